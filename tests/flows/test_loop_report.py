"""The learning loop's report: the curve rows in MLflow (a learning-loop run over loop steps, points of the
policy run over weight versions) and the PNG, with the served and the candidate's held-out scores apart."""

from __future__ import annotations

import json

import pytest

from clawrl.config import dump_toml


def _rows() -> list[dict]:
    """The base model, a promoted v1, then a refused v2 (v1 keeps serving) as the last step."""
    return [
        {"step": 0, "weight_version": "0", "served_score": 0.25, "on_topic_rate": 0.5, "persona_rate": 0.5,
         "candidate_score": 0.25, "kl": 0.0, "mean_words": 30.0},
        {"step": 1, "weight_version": "1", "candidate_version": "1", "gate": "promote", "served_score": 0.5,
         "on_topic_rate": 0.75, "persona_rate": 0.625, "candidate_score": 0.5, "kl": 0.01, "mean_words": 24.0},
        {"step": 2, "weight_version": "1", "candidate_version": "2", "gate": "refuse", "served_score": 0.5,
         "on_topic_rate": 0.75, "persona_rate": 0.625, "candidate_score": 0.375, "kl": 0.01, "mean_words": 24.0},
    ]


def test_the_last_refused_step_reaches_every_curve_and_the_two_scores_have_two_names(make_settings, tmp_path):
    from clawrl.flows.loop import CURVES, report_curve
    from clawrl.lineage import client as mlflow_client, log_policy_point

    s = make_settings()
    conf = tmp_path / "run.toml"
    conf.write_text(dump_toml(s))
    out = report_curve.fn(str(conf), _rows(), "persona 'concise'", {"steps": 2}, "persona")
    ml = mlflow_client(s.storage.data_root)

    def history(run_id: str, key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in ml.get_metric_history(run_id, key)]

    policy = log_policy_point(s.storage.data_root, 0, {})
    for key, values in {"served_on_topic_rate": [0.5, 0.75, 0.75], "served_persona_rate": [0.5, 0.625, 0.625],
                        "served_kl": [0.0, 0.01, 0.01], "served_mean_words": [30.0, 24.0, 24.0],
                        "served_score": [0.25, 0.5, 0.5], "candidate_score": [0.25, 0.5, 0.375]}.items():
        assert history(policy, key) == [(v, pytest.approx(x)) for v, x in zip((0, 1, 2), values)], key
    loop = ml.get_run(out["mlflow_run_id"])
    assert {"served_score", "candidate_score"} <= set(loop.data.metrics) and "score" not in loop.data.metrics
    assert history(loop.info.run_id, "candidate_score") == [(0, 0.25), (1, 0.5), (2, 0.375)]
    assert [label for _, label in CURVES["persona"]][::3] == ["served score (persona AND on topic)",
                                                              "candidate score (served only if promoted)"]
    assert json.loads((s.storage.data_root / "reports" / "learning_curve.json").read_text()) == _rows()
    assert (s.storage.data_root / "reports" / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"
