"""`clawrl bench load`, short: 16 concurrent simulated users for 15 s against `clawrl serve` (its own
process, the tiny engine) while the judge and train flows run and sync weights through /engine.
Zero errors, every acknowledged main turn in the log (turn by turn), at least one weight sync inside
the window (held open until one happened: ``min_syncs``), and clients served the new version after it.
The same load against the whole `clawrl up` (``up=True``): the steps its flow server made read back from
the data root and its Prefect API."""

from __future__ import annotations

import pytest

from clawrl.bench.load import run_load_bench
from clawrl.bench.load_report import format_load_section
from tests.utils.waiting import HANG_S

pytestmark = [pytest.mark.reliability, pytest.mark.bench]


@pytest.mark.timeout(HANG_S)
def test_load_with_training_and_sync_has_no_errors_and_logs_every_turn(prefect_harness, model_cache, tmp_path):
    seen: list[dict] = []
    r = run_load_bench(model_cache=model_cache, sessions=16, duration_s=15, rollout_batch_size=4, max_tokens=8,
                       turns_per_session=3, data_root=tmp_path / "load", min_syncs=1, progress=seen.append)
    print(format_load_section(r))
    assert r["errors"] == 0, r["error_samples"]
    assert r["requests"] == r["main_turns_sent"] >= 32
    assert r["main_turns_logged"] == r["main_turns_sent"] and r["sent_not_logged"] == r["logged_not_sent"] == 0
    assert r["syncs_during_run"] >= 1 and r["failed_syncs"] == [], r["steps"]
    assert r["window_s"] >= 15
    assert len(r["weight_versions_seen"]) >= 2 and "0" in r["weight_versions_seen"], r["weight_versions_seen"]
    assert 0 < r["p50_ms"] <= r["p99_ms"]
    assert r["sessions_completed"] >= 1 and r["turns_judged"] >= 4
    assert seen and seen[-1]["requests"] == r["requests"] and seen[-1]["errors"] == 0
    # loop latency: a served step's version reached a client after its batch's last next state, and
    # at least the step's own training and sync time later
    served = [st for st in r["steps"] if st["loop_s"] is not None]
    assert served and all(st["loop_s"] >= st["train_s"] + st["sync_s"] > 0 for st in served), r["steps"]
    parts = ("judged_s", "queued_s", "read_s", "train_s", "state_s", "checkpoint_s", "eval_s", "sync_s",
             "orchestration_s", "served_s")
    assert all(st["loop_s"] == pytest.approx(sum(st[k] for k in parts)) for st in served), served  # the parts add up
    assert all(min(st[k] for k in parts) >= 0 and st["eval_s"] > 0 for st in served), [  # the gate is on
        {k: st[k] for k in parts} for st in served]
    assert all(st["checkpoint_s"] > 0 and st["read_s"] > 0 for st in served), served  # timed by the trainer
    text = format_load_section(r)
    assert ("| version | loop_s | judged_s | queued_s | read_s | train_s | state_s | checkpoint_s | eval_s "
            "| sync_s | orchestration_s | served_s |") in text
    assert "The promotion gate's evaluation (an evaluation engine on the same device) took" in text
    assert _gate_actions(tmp_path / "load") == {"promote"}  # evaluated, then served whatever its score
    # each step's tasks, in the order they ran, the path to the sync first
    order = ["claim_batch", "run_step", "start_lineage", "record_checkpoint", "gate_checkpoint", "sync_weights",
             "log_lineage", "link_step", "log_doctor_report"]
    assert all(list(st["tasks_s"]) == order and all(v > 0 for v in st["tasks_s"].values()) for st in r["steps"])
    assert "| version | " + " | ".join(order) + " |" in text


@pytest.mark.timeout(HANG_S)
def test_load_under_clawrl_up_has_no_errors_and_reads_back_its_steps(model_cache, tmp_path):
    r = run_load_bench(model_cache=model_cache, sessions=8, duration_s=20, rollout_batch_size=4, max_tokens=8,
                       data_root=tmp_path / "load-up", min_syncs=1, up=True)
    text = format_load_section(r)
    print(text)
    assert r["mode"] == "up" and "Mode `up`" in text
    assert r["errors"] == 0, r["error_samples"]
    assert r["main_turns_sent"] == r["main_turns_logged"] > 0 and r["sent_not_logged"] == 0
    # a step up's flow server made, synced and served, with its loop latency and its train run's tasks
    served = [st for st in r["steps"] if st["synced"] and isinstance(st["orchestration_s"], float)
              and {"claim_batch", "gate_checkpoint", "sync_weights"} <= set(st["tasks_s"])]
    assert _gate_actions(tmp_path / "load-up") == {"promote"}
    assert served, [{k: st.get(k) for k in ("weight_version", "synced", "sync_message", "at_s", "first_served_s",
                                             "orchestration_s")} | {"tasks": sorted(st["tasks_s"])}
                    for st in r["steps"]]


def _gate_actions(root) -> set[str]:
    from clawrl.storage.catalog import run_query

    return {r["action"] for r in run_query(root, "select action from promotions where source = 'gate'").to_pylist()}
