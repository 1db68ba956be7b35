"""The links from MLflow back to Prefect: every run a flow made names its flow run, links its page in the
Prefect UI by the UI's own route, and carries that link in its description, where the MLflow UI renders it
as a link (tags are shown as text, cut short). `clawrl up` points them at the Prefect it runs, quietly."""

from __future__ import annotations

import logging

from clawrl.config import dump_toml
from clawrl.lineage import ML_VIEW


class _Records(logging.Handler):
    """The records of one logger (pytest's caplog sits on the root logger, which Prefect reconfigures)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_up_relinks_each_run_to_prefects_flow_run_page_with_a_link_in_its_description(
        prefect_harness, make_settings, tmp_path):
    from prefect.settings import PREFECT_UI_URL

    from clawrl.flows.serve import relink_uis
    from clawrl.lineage import client as mlflow_client, experiment_id

    s = make_settings()
    conf = tmp_path / "run.toml"
    conf.write_text(dump_toml(s))
    ml = mlflow_client(s.storage.data_root)
    exp = experiment_id(ml, s.storage.data_root)
    flow_run_id = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    old = ml.create_run(exp, run_name="step-0001", tags={  # as a demo wrote it, on its own Prefect's port
        "prefect.flow_run_id": flow_run_id,
        "prefect.flow_run_url": f"http://127.0.0.1:8123/flow-runs/flow-run/{flow_run_id}"}).info.run_id
    unlinked = ml.create_run(exp, run_name="policy").info.run_id
    from prefect.artifacts import create_markdown_artifact

    key = f"train-v{int(tmp_path.stat().st_ino) % 10**6}"  # this test's own among the session's train-v* artifacts
    create_markdown_artifact(key=key, markdown=f"- [MLflow run](http://127.0.0.1:5123/#/experiments/{exp}/runs/{old})")

    log, said = logging.getLogger("clawrl.flows.serve"), _Records()
    log.addHandler(said)
    level = log.level
    log.setLevel(logging.INFO)  # as the flow server sets it
    try:
        relink_uis(str(conf))
        relinked = list(said.records)
        said.records.clear()
        relink_uis(str(conf))  # nothing left to change: nothing said
    finally:
        log.removeHandler(said)
        log.setLevel(level)
    url = f"{PREFECT_UI_URL.value()}/runs/flow-run/{flow_run_id}"  # the Prefect UI's route; flow-runs/... redirects
    tags = ml.get_run(old).data.tags
    assert tags["prefect.flow_run_url"] == url
    assert tags["mlflow.note.content"] == f"Made by the Prefect flow run [{flow_run_id}]({url})."
    assert "mlflow.note.content" not in ml.get_run(unlinked).data.tags
    [line] = relinked  # routine: INFO, not WARNING
    assert line.levelno == logging.INFO
    assert line.getMessage().startswith("links updated to the UIs now running: 1 MLflow runs -> Prefect")
    assert said.records == []
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as pc:
        [art] = pc.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    assert art.data == f"- [MLflow run](http://127.0.0.1:5000/#/experiments/{exp}/runs/{old}?{ML_VIEW})"


def test_the_installed_mlflow_ui_takes_its_view_from_the_query_clawrls_links_carry():
    """MLflow 3.17's UI shows the GenAI view (training runs under "Evaluation", no model registry) unless its
    sidebar switch says otherwise or the page's query names the view: the query clawrl's links carry must be
    the one the installed UI reads, with a value it knows."""
    from pathlib import Path

    import mlflow

    [bundle] = (Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js").glob("main.*.js")
    key, value = ML_VIEW.split("=")
    js = bundle.read_text()
    assert f'.get("{key}")' in js and f'MACHINE_LEARNING="{value}"' in js
