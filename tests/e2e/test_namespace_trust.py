"""Trust per namespace, with the tiny model and the embedded engine serving adapters by name: two keys, A and B,
talk to one gateway; A's first step is helpful and its second harmful (the reward's sign flipped for its `harm-`
sessions), B's one step helpful. One run of serve -> judge -> train is shared by the tests, which run in order:

* the gate decides per namespace: A@v1 and B@v1 are promoted against their base alone, A@v2 is refused against
  A@v1 and never served to A, while B goes on being served B@v1 (its log-probs bit-identical);
* lineage, status and doctor per namespace name that namespace's batches, sessions and gate only, and each
  namespace's MLflow runs live in an experiment of its own;
* a replay of A's adapter rebuilds both versions byte for byte;
* promote and rollback by hand move A alone;
* forgetting A leaves no byte of its sessions anywhere under the data root, and B's rows, adapter and runs as
  they were.
"""

from __future__ import annotations

import re
from pathlib import Path
from unittest import mock

import pytest
from openai import OpenAI
from typer.testing import CliRunner

from clawrl.config import dump_toml, load_settings
from clawrl.ids import namespace_for_key
from clawrl.storage.catalog import run_query
from tests.utils import gate_eval
from tests.utils.samples import two_turn_session

KEYS = ("trust-key-alpha", "trust-key-beta")
A, B = (namespace_for_key(k) for k in KEYS)
TEXT = "The capital of France is Paris, and the capital of Italy is Rome."
# session ids that appear nowhere else: forgetting A is checked by looking for their bytes in every file
A_SESSIONS = ("alpha-7f3a-capital", "alpha-7f3a-color", "harm-alpha-7f3a-bees", "harm-alpha-7f3a-sky")
B_SESSIONS = ("beta-91c2-capital", "beta-91c2-color")


def fixed_text_logprobs(client: OpenAI) -> list[float]:
    """The served model's log-probs of TEXT's tokens (the first has none), as the caller's key is served it."""
    r = client.completions.create(model="clawrl-policy", prompt=TEXT, max_tokens=1, temperature=0, echo=True,
                                  logprobs=0)
    return r.choices[0].logprobs.token_logprobs[1:-1]


class Run:
    """The shared run: settings, the config file, the gateway and its clients, what each step returned."""

    def __init__(self, settings, conf: Path, gw, clients: dict[str, OpenAI], store):
        self.s, self.conf, self.gw, self.clients, self.store = settings, conf, gw, clients, store
        self.root = settings.storage.data_root
        self.steps: dict[str, dict] = {}
        self.logprobs: dict[str, list[float]] = {}

    def cli(self, *args: str, code: int = 0) -> str:
        """What `clawrl ARGS -c CONF` printed (stderr, for a command expected to fail with ``code``)."""
        from clawrl.cli import app
        from clawrl.cli.common import console, err

        # 300 columns, also where an earlier test of this process made the consoles with COLUMNS set (a rich
        # Console reads COLUMNS when it is made, if it is set then, and keeps that width)
        with mock.patch.object(console, "_width", 300), mock.patch.object(err, "_width", 300):
            out = CliRunner().invoke(app, [*args, "-c", str(self.conf)], env={"COLUMNS": "300"})
        assert out.exit_code == code, out.output
        return out.output if code == 0 else out.stderr

    def step(self, key: str, sessions: tuple[str, ...]) -> list[dict]:
        from clawrl.flows.judge import judge_flow
        from clawrl.flows.train import train_flow

        for sid, question in zip(sessions, gate_eval.QUESTIONS):
            two_turn_session(self.clients[key], sid, question, "thanks!")
        self.store.flush()
        judge_flow(config_path=str(self.conf))
        return train_flow(config_path=str(self.conf))["steps"]


@pytest.fixture(scope="module")
def run(prefect_harness, tmp_path_factory, model_cache, tiny_dir):
    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.flows.common import attach_policy_engine
    from clawrl.gateway.routes import create_app
    from clawrl.storage.writer import DataStore
    from tests.utils.gateway_server import running_gateway

    tmp = tmp_path_factory.mktemp("trust")
    gate_eval.fill_reference(tiny_dir)
    s = load_settings(env={}, overrides={
        "storage.data_root": str(tmp / "data"), "storage.model_cache": str(model_cache), "model.name": "tiny",
        "ppo.adapters": "namespace", "ppo.rollout_batch_size": 2, "ppo.advantage_estimator": "grpo",
        "ppo.temperature": 0.0, "ppo.lr": 1e-2, "ppo.kl_coef": 0.0, "ppo.max_new_tokens": 8, "prm.backend": "rule",
        "hooks.reward": "tests.utils.gate_eval:session_reward", "gate.evaluator": gate_eval.EVALUATOR, "gate.size": 4,
        "gate.tolerance": 0.05, "gate.alpha": 0.05, "engine.max_context_len": 1024})
    conf = tmp / "clawrl.toml"
    conf.write_text(dump_toml(s))
    engine = EmbeddedEngine(tiny_dir, max_batch_size=16, max_context_len=1024)
    attach_policy_engine(engine)  # what the train flow syncs adapters into
    store = DataStore(s.storage.data_root)
    app = create_app(s, engine=engine, tokenizer=engine.tokenizer, store=store, api_keys=list(KEYS))
    try:
        with running_gateway(app) as gw:
            clients = {ns: OpenAI(base_url=gw.base_url, api_key=k, max_retries=0) for ns, k in zip((A, B), KEYS)}
            r = Run(s, conf, gw, clients, store)
            r.logprobs["base"] = fixed_text_logprobs(clients[B])
            [r.steps["A1"]] = r.step(A, A_SESSIONS[:2])
            [r.steps["B1"]] = r.step(B, B_SESSIONS)
            r.logprobs["A1"], r.logprobs["B1"] = fixed_text_logprobs(clients[A]), fixed_text_logprobs(clients[B])
            [r.steps["A2"]] = r.step(A, A_SESSIONS[2:])
            r.logprobs["A after A2"], r.logprobs["B after A2"] = (fixed_text_logprobs(clients[A]),
                                                                  fixed_text_logprobs(clients[B]))
            store.flush()
            yield r
    finally:
        attach_policy_engine(None)
        store.close()


def test_the_gate_decides_per_namespace_and_a_refused_adapter_is_never_served(run):
    from clawrl.adapters import complete_adapters, read_served

    a1, b1, a2 = run.steps["A1"], run.steps["B1"], run.steps["A2"]
    assert [(st["weight_version"], st["gate"]["decision"], st["gate"]["champion_version"]) for st in (a1, b1, a2)] == [
        (f"{A}@v1", "promote", f"{A}@v0"), (f"{B}@v1", "promote", f"{B}@v0"), (f"{A}@v2", "refuse", f"{A}@v1")]
    assert a2["gate"]["reason"].startswith(("worse by more than the tolerance", "significantly worse")), a2["gate"]
    assert a2["gate"]["champion_mean"] == 1.0 and a2["gate"]["candidate_mean"] < 1.0 and a2["gate"]["n"] == 4
    assert a2["gate"]["serve_version"] == f"{A}@v1" and a2["sync"]["skipped"]  # nothing loaded, nothing switched
    checkpoints = run.root / "checkpoints"
    assert read_served(checkpoints, A).name == f"{A}@v1" and read_served(checkpoints, B).name == f"{B}@v1"
    assert [v for v, _ in complete_adapters(checkpoints, A)] == [2, 1]  # the refused version stays on disk
    # what each key is served: A's refused step changed nothing anyone gets
    assert run.logprobs["A after A2"] == run.logprobs["A1"] != run.logprobs["base"]
    assert run.logprobs["B after A2"] == run.logprobs["B1"] != run.logprobs["base"]
    rows = run_query(run.root, "SELECT namespace, action, weight_version, champion_version, source, eval_set "
                               "FROM promotions ORDER BY created_at").to_pylist()
    assert [tuple(r.values()) for r in rows] == [
        (A, "promote", f"{A}@v1", f"{A}@v0", "gate", "validation"),
        (B, "promote", f"{B}@v1", f"{B}@v0", "gate", "validation"),
        (A, "refuse", f"{A}@v2", f"{A}@v1", "gate", "validation")]
    evaluated = run_query(run.root, "SELECT namespace, weight_version FROM evaluations ORDER BY created_at").to_pylist()
    assert [tuple(r.values()) for r in evaluated] == [(A, f"{A}@v0"), (A, f"{A}@v1"), (B, f"{B}@v0"), (B, f"{B}@v1"),
                                                      (A, f"{A}@v2")]  # the champion's scores are reused
    served = run_query(run.root, "SELECT namespace, adapter FROM turns WHERE request_params LIKE '%completions%' "
                                 "ORDER BY created_at").to_pylist()
    assert [(r["namespace"], r["adapter"]) for r in served] == [
        (B, None), (A, f"{A}@v1"), (B, f"{B}@v1"), (A, f"{A}@v1"), (B, f"{B}@v1")]


def test_lineage_status_doctor_and_mlflow_show_a_namespace_its_own(run):
    out = run.cli("lineage", "latest", "--namespace", A)
    assert f"adapter {A}@v2 over weight version 0 of tiny: refused by the gate" in out
    assert f"{A}@v2 <- {A}@v1: batch {run.steps['A2']['batch_id']}" in out and f"{A}@v1 <- {A}@v0" in out
    assert all(f"session {A}:{sid}" in out for sid in A_SESSIONS) and B not in out and "beta-91c2" not in out
    status = run.cli("status")
    assert re.search(rf"{A}\s+\d+\s+0\s+2\s+v1\s+refuse v2", status), status
    assert re.search(rf"{B}\s+\d+\s+0\s+1\s+v1\s+promote v1", status), status
    mine = run.cli("status", "--namespace", A)
    for label, value in (("samples consumed by batches", "4 in 2 batches"), ("newest adapter version", f"{A}@v2"),
                         ("served", f"{A}@v1"), ("trainable samples waiting", "0 / rollout_batch_size 2")):
        assert re.search(rf"{label}\s+│\s+{re.escape(value)} │", mine), (label, mine)
    assert f"promotion: champion version {A}@v1; candidate {A}@v2 refused on the validation set (worse" in mine
    assert f"last sync: ok at " in mine and f"(sync {A}@v1)" in mine and B not in mine
    doctor = run.cli("doctor", "--namespace", A)
    assert f"clawrl doctor of {A}" in doctor and f"ok   serving: served {A}@v1; 0 of 1 syncs failed" in doctor
    # MLflow: an experiment and a model per namespace, no run holding another namespace's sessions
    from clawrl.lineage import client, namespace_experiment, namespace_model

    c = client(run.root)
    for ns, others in ((A, B_SESSIONS), (B, A_SESSIONS)):
        exp = c.get_experiment_by_name(namespace_experiment(ns))
        runs = c.search_runs([exp.experiment_id])
        steps = [r for r in runs if r.data.tags.get("batch_id")]
        assert {r.data.tags["namespace"] for r in steps} == {ns} and len(steps) == (2 if ns == A else 1)
        for r in steps:
            manifest = Path(r.info.artifact_uri.removeprefix("file://"), "batch_manifest.json").read_text()
            assert ns in manifest and not any(sid in manifest for sid in others)
        versions = c.search_model_versions(f"name = '{namespace_model(ns)}'")
        assert sorted(v.tags["weight_version"] for v in versions) == [f"{ns}@v{i}" for i in
                                                                     range(1, 3 if ns == A else 2)]
    assert c.get_model_version_by_alias(namespace_model(A), "champion").tags["weight_version"] == f"{A}@v1"


def test_a_replay_of_a_namespace_adapter_rebuilds_its_bytes(run, monkeypatch):
    from prefect.settings import PREFECT_API_URL

    monkeypatch.setenv("PREFECT_API_URL", str(PREFECT_API_URL.value()))  # the session's Prefect, not one of its own
    monkeypatch.setenv("PREFECT_HOME", str(run.root / "prefect"))
    out = run.cli("replay", "latest", "--namespace", A)
    assert "checkpoints byte-identical: yes" in out, out
    [replay_id] = re.findall(r"--replay (\S+) --namespace", out)
    replayed = run_query(run.root / "replays" / replay_id, "SELECT name, sha256 FROM adapters ORDER BY version")
    recorded = run_query(run.root, f"SELECT name, sha256 FROM adapters WHERE namespace = '{A}' ORDER BY version")
    assert replayed.to_pylist() == recorded.to_pylist() and len(recorded) == 2
    # without one of its sessions: v2 is trained on the other one alone, and the replay names it nowhere
    out = run.cli("replay", "2", "--namespace", A, "--exclude-session", f"{A}:{A_SESSIONS[2]}", "--reason", "asked")
    assert f"excluded: {A}:{A_SESSIONS[2]}" in out
    [replay_id] = re.findall(r"--replay (\S+) --namespace", out)
    lineage = run.cli("lineage", "2", "--namespace", A, "--replay", replay_id)
    assert f"session {A}:{A_SESSIONS[3]}" in lineage and A_SESSIONS[2] not in lineage
    from clawrl.lineage import client, namespace_experiment

    c = client(run.root)
    replays = c.search_runs([c.get_experiment_by_name(namespace_experiment(A)).experiment_id],
                            filter_string="tags.kind = 'unlearning'")
    assert [r.data.tags["excluded_sessions"] for r in replays] == [f"{A}:{A_SESSIONS[2]}"]
    refused = run.cli("replay", "2", "--namespace", A, "--exclude-session", f"{B}:{B_SESSIONS[0]}", code=2)
    assert refused == (f"replay failed: {B}:{B_SESSIONS[0]} is not a session of {A}: an adapter replay leaves out "
                       "sessions of its own namespace only\n")


def test_promote_and_rollback_by_hand_move_one_namespace(run):
    out = run.cli("promote", "2", "--namespace", A, "--reason", "try it")
    assert f"promoted {A}@v2: {A} is served it" in out
    assert fixed_text_logprobs(run.clients[A]) not in (run.logprobs["A1"], run.logprobs["base"])
    assert fixed_text_logprobs(run.clients[B]) == run.logprobs["B1"]
    out = run.cli("rollback", "--namespace", A)
    assert f"rolled back from {A}@v2 to {A}@v1" in out
    assert fixed_text_logprobs(run.clients[A]) == run.logprobs["A1"]
    assert fixed_text_logprobs(run.clients[B]) == run.logprobs["B1"]


def test_forgetting_a_namespace_leaves_none_of_its_bytes_and_the_other_as_it_was(run):
    from clawrl.adapters import complete_adapters, read_served

    run.store.flush()
    tables = ("turns", "next_states", "verdicts", "samples", "turn_fate", "batches", "evaluations", "promotions",
              "adapters", "adapter_serving")

    def b_rows() -> dict:
        """Every row of B in each table, in one order (a rewritten file may list its rows elsewhere)."""
        by_turn = f"turn_id IN (SELECT turn_id FROM turns WHERE namespace = '{B}')"
        return {t: sorted(map(repr, run_query(run.root, f"SELECT * EXCLUDE (date) FROM {t} WHERE " + (
            by_turn if t in ("next_states", "verdicts", "turn_fate") else f"namespace = '{B}'")).to_pylist()))
                for t in tables}

    def holders(sessions) -> set[str]:
        """The files under the data root (relative paths) that hold one of ``sessions``' ids, as bytes."""
        return {str(p.relative_to(run.root)) for p in run.root.rglob("*")
                if p.is_file() and any(sid.encode() in p.read_bytes() for sid in sessions)}

    from clawrl.lineage import client, namespace_experiment

    c = client(run.root)
    b_runs = sorted(r.info.run_id for r in c.search_runs([c.get_experiment_by_name(namespace_experiment(B))
                                                          .experiment_id]))
    before, held = b_rows(), holders(A_SESSIONS)
    assert all(before[t] for t in tables if t not in ("adapter_serving",))
    assert {p.split("/")[1] for p in held if p.startswith("tables/")} >= {"turns", "next_states", "samples",
                                                                          "turn_fate", "batches"}, held
    assert any(h.startswith("mlflow/") for h in held) and any(h.startswith("replays/") for h in held), held
    out = run.cli("forget", A, "--reason", "asked to be forgotten")
    assert f"forgot {A}: adapter versions removed: {A}@v1, {A}@v2; unloaded {A}@v1" in out
    assert holders(A_SESSIONS) == set()  # no file anywhere under the data root holds one of A's session ids
    assert holders(B_SESSIONS)  # B's are where they were
    assert b_rows() == before  # B's rows, every value as it was
    assert sorted(r.info.run_id for r in c.search_runs([c.get_experiment_by_name(namespace_experiment(B))
                                                         .experiment_id])) == b_runs
    assert complete_adapters(run.root / "checkpoints", A) == [] and read_served(run.root / "checkpoints", A) is None
    assert read_served(run.root / "checkpoints", B).name == f"{B}@v1"
    assert fixed_text_logprobs(run.clients[B]) == run.logprobs["B1"]
    assert fixed_text_logprobs(run.clients[A]) == run.logprobs["base"]  # A gets the base from its next request
    assert c.get_experiment_by_name(namespace_experiment(A)) is None
    assert c.get_experiment_by_name(namespace_experiment(B)) is not None
    [forgot] = run_query(run.root, f"SELECT * FROM adapter_serving WHERE namespace = '{A}'").to_pylist()
    assert (forgot["action"], forgot["last_version"], forgot["reason"]) == ("forget", 2, "asked to be forgotten")
