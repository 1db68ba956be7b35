"""The train flow with [ppo] adapters = "namespace", on a real Prefect server: each namespace with a full batch
trains its own adapter and gets it synced (loaded beside the old one, switched to, the old one unloaded) while
another namespace's slot being taken stops only that namespace; train runs are created one per namespace; a
failed sync leaves the namespace on its previous adapter; forgetting removes every version and unloads it. The
serving engine is a fake with SGLang's LoRA API (the real multi-LoRA engine is another part)."""

from __future__ import annotations

import pytest

from clawrl.adapters import complete_adapters, read_served
from clawrl.config import dump_toml
from clawrl.engine.types import UpdateResult
from clawrl.flows.common import attach_policy_engine
from clawrl.records import SampleRecord
from clawrl.storage.catalog import run_query
from clawrl.storage.writer import DataStore
from tests.utils.fake_engine import LoraFakeEngine

A, B = "key-aaaa", "key-bbbb"


def write_namespace_samples(settings, namespace: str, n: int, first: int = 0) -> None:
    """``n`` GRPO samples of ``namespace`` (random ids, rewards alternating -1, +1), under the settings' judge hash."""
    import random

    from clawrl.judge.runner import build_judge_config_hash

    rng, chash = random.Random(hash(namespace) % 1000 + first), build_judge_config_hash(settings)
    recs = [SampleRecord(sample_id=f"{namespace}-{i}", turn_id=f"{namespace}-t{i}", session_id=f"s{i}",
                         judge_config_hash=chash, method="grpo",
                         prompt_ids=[1] + [rng.randrange(3, 40000) for _ in range(5)],
                         output_ids=[rng.randrange(3, 40000) for _ in range(4)] + [2], rollout_logprobs=[-10.0] * 5,
                         reward=1.0 if i % 2 else -1.0, has_teacher=False, teacher_logprobs=None, weight_version="0",
                         namespace=namespace) for i in range(first, first + n)]
    with DataStore(settings.storage.data_root) as store:
        store.append(recs)


@pytest.fixture
def adapter_settings(make_settings, tmp_path):
    s = make_settings({"server.open_mode": True, "ppo.adapters": "namespace", "ppo.lora_rank": 4,
                       "ppo.rollout_batch_size": 2, "ppo.advantage_estimator": "grpo", "ppo.kl_coef": 0.0,
                       "ppo.lr": 1e-3, "gate.enabled": False})
    conf = tmp_path / "adapters.toml"
    conf.write_text(dump_toml(s))
    return s, conf


@pytest.fixture
def engine():
    engine = LoraFakeEngine(49152)
    attach_policy_engine(engine)  # the serving engine of this process: what the flow syncs
    yield engine
    attach_policy_engine(None)


def test_each_namespace_with_a_full_batch_trains_and_serves_its_own_adapter(prefect_harness, adapter_settings, engine):
    from clawrl.flows.adapters import forget_namespace
    from clawrl.flows.slots import leased_slot, trainer_limit
    from clawrl.flows.train import train_flow

    s, conf = adapter_settings
    checkpoints = s.storage.data_root / "checkpoints"
    write_namespace_samples(s, A, 4)
    write_namespace_samples(s, B, 1)  # not a full batch

    steps = train_flow(config_path=str(conf), max_steps=3)["steps"]
    assert [(st["namespace"], st["weight_version"], st["sync"]["success"]) for st in steps] == [
        (A, f"{A}@v1", True), (A, f"{A}@v2", True)]
    assert engine.loads == [(f"{A}@v1", str(checkpoints / "adapters" / A / "v000001")),
                            (f"{A}@v2", str(checkpoints / "adapters" / A / "v000002"))]
    assert sorted(engine.adapters) == [f"{A}@v2"]  # v1 unloaded once A was switched to v2
    assert read_served(checkpoints, A).name == f"{A}@v2" and read_served(checkpoints, B) is None
    root = s.storage.data_root
    assert run_query(root, "SELECT name, parent, base_version FROM adapters ORDER BY version").to_pylist() == [
        {"name": f"{A}@v1", "parent": f"{A}@v0", "base_version": "0"},
        {"name": f"{A}@v2", "parent": f"{A}@v1", "base_version": "0"}]
    assert run_query(root, "SELECT action, adapter, previous, ok, target FROM adapter_serving ORDER BY created_at"
                     ).to_pylist() == [
        {"action": "sync", "adapter": f"{A}@v1", "previous": None, "ok": True, "target": "in-process"},
        {"action": "sync", "adapter": f"{A}@v2", "previous": f"{A}@v1", "ok": True, "target": "in-process"}]
    assert run_query(root, "SELECT count(*) AS n FROM checkpoints").to_pylist() == [{"n": 0}]  # the base never trained

    # one namespace's step at a time, the others go on: with A's slot taken, B trains and A is skipped
    write_namespace_samples(s, A, 2, first=10)
    write_namespace_samples(s, B, 1, first=10)
    with leased_slot(trainer_limit(A)) as held:
        assert held
        out = train_flow(config_path=str(conf), exclusive=True)
    assert [st["weight_version"] for st in out["steps"]] == [f"{B}@v1"] and out["skipped"] == f"other runs train {A}"
    assert [st["weight_version"] for st in train_flow(config_path=str(conf), namespace=A)["steps"]] == [f"{A}@v3"]

    # forgetting A: every version gone, its adapter unloaded, B untouched
    gone = forget_namespace(s, A, reason="asked to be forgotten")
    rows = gone.pop("rows")
    assert gone == {"namespace": A, "removed": [f"{A}@v1", f"{A}@v2", f"{A}@v3"], "unloaded": f"{A}@v3",
                    "message": f"{A}@v3 unloaded", "mlflow_runs": 4}  # 3 steps and the curves' run
    # 6 samples, 3 batches and adapter versions, 3 ungated promotions, 3 syncs: all of them A's
    assert rows == {"samples": 6, "batches": 3, "adapters": 3, "promotions": 3, "adapter_serving": 3,
                    "wal_segments_left": 0}
    assert complete_adapters(checkpoints, A) == [] and read_served(checkpoints, A) is None
    assert sorted(engine.adapters) == [f"{B}@v1"]
    [row] = run_query(root, "SELECT * FROM adapter_serving WHERE action = 'forget'").to_pylist()
    assert (row["namespace"], row["previous"], row["ok"], row["reason"]) == (A, f"{A}@v3", True,
                                                                            "asked to be forgotten")


def test_a_sync_an_engine_refuses_leaves_the_namespace_on_its_previous_adapter(prefect_harness, adapter_settings,
                                                                                engine):
    from clawrl.flows.train import train_flow

    s, conf = adapter_settings
    write_namespace_samples(s, A, 4)
    [first] = train_flow(config_path=str(conf))["steps"]
    assert first["sync"]["success"]

    async def refuse(name, path):
        return UpdateResult(False, "out of adapter slots")

    engine.load_lora_adapter = refuse
    [second] = train_flow(config_path=str(conf))["steps"]
    assert (second["weight_version"], second["sync"]["success"]) == (f"{A}@v2", False)
    assert second["sync"]["message"] == f"in-process did not load {A}@v2: out of adapter slots"
    assert read_served(s.storage.data_root / "checkpoints", A).name == f"{A}@v1"  # still served v1
    assert sorted(engine.adapters) == [f"{A}@v1"]
    [row] = run_query(s.storage.data_root,
                      "SELECT ok, error FROM adapter_serving WHERE adapter LIKE '%@v2'").to_pylist()
    assert row == {"ok": False, "error": second["sync"]["message"]}


def test_train_runs_are_created_one_per_namespace_with_a_batch(prefect_harness, adapter_settings):
    from prefect.client.orchestration import get_client

    from clawrl.flows.adapters import start_train_runs
    from clawrl.flows.serve import build_deployments, deploy_to_pool

    s, conf = adapter_settings
    write_namespace_samples(s, A, 2)
    write_namespace_samples(s, B, 3)
    write_namespace_samples(s, "open", 1)
    deploy_to_pool(build_deployments(str(conf), None, None), "clawrl-adapter-pool")
    created = start_train_runs(str(conf))
    try:
        with get_client(sync_client=True) as pc:
            runs = [pc.read_flow_run(i) for i in created]
        assert sorted((r.parameters["namespace"], r.tags) for r in runs) == [
            (A, [f"namespace:{A}"]), (B, [f"namespace:{B}"])]  # "open" has no full batch
        assert all(r.parameters["exclusive"] and r.state.is_scheduled() for r in runs)
        assert start_train_runs(str(conf)) == []  # one run of a namespace at a time
    finally:
        with get_client(sync_client=True) as pc:  # no worker here: leave nothing waiting for another test
            for i in created:
                pc.delete_flow_run(i)
