"""Claiming a namespace's adapter batch ([ppo] adapters = "namespace") over real Parquet and DuckDB: only that
namespace's samples, staleness against that namespace's adapter, an unfinished batch resumed, never seen as the
shared policy's open batch, and nothing of a forgotten namespace's past trained again."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from clawrl.adapters import ServedAdapter, write_served
from clawrl.records import AdapterRecord, AdapterServeRecord, Fate, SampleRecord, make_turn_id
from clawrl.storage.adapters import full_batch_namespaces, namespace_samples
from clawrl.storage.catalog import open_catalog
from clawrl.storage.queries import open_batch
from clawrl.storage.writer import DataStore
from clawrl.trainer_service import claim_adapter_batch
from tests.utils.turns import T0, build_turn

A, B = "key-aaaa", "key-bbbb"


def turn_and_sample(namespace: str, i: int, adapter: str | None = None, minutes: int = 0):
    turn = dataclasses.replace(build_turn([{"role": "user", "content": "hi"}], session_id=f"s{i}"),
                               turn_id=make_turn_id(namespace, f"s{i}", 0), namespace=namespace, adapter=adapter,
                               created_at=T0 + timedelta(minutes=minutes + i))
    sample = SampleRecord(sample_id=f"smp-{turn.turn_id}", turn_id=turn.turn_id, session_id=turn.session_id,
                          judge_config_hash="h", method="grpo", prompt_ids=[1, 2, 3], output_ids=[11, 12],
                          rollout_logprobs=[-1.0, -1.0], reward=1.0, has_teacher=False, teacher_logprobs=None,
                          weight_version="0", namespace=namespace)
    return [turn, sample]


def claim(store, root, namespace, max_staleness=4):
    return claim_adapter_batch(store, root, namespace, judge_config_hash="h", batch_size=2,
                               max_staleness=max_staleness, method="grpo", config_hash="c", config_toml="")


def batch_row(root, batch_id):
    with open_catalog(root) as con:
        return con.sql(f"SELECT * FROM batches WHERE batch_id = '{batch_id}'").to_arrow_table().to_pylist()[0]


def test_a_namespace_claims_only_its_own_samples_and_resumes_its_unfinished_batch(tmp_path):
    with DataStore(tmp_path) as store:
        store.append([r for i in range(3) for r in turn_and_sample(A, i)] + turn_and_sample(B, 0))
        batch_id, note = claim(store, tmp_path, A)
        row = batch_row(tmp_path, batch_id)
        assert (row["namespace"], row["step"], row["parent_version"], row["session_namespaces"]) == (
            A, 1, f"{A}@v0", [A, A])
        assert note == f"claimed {A}'s batch {batch_id} (2 samples) for {A}@v1"
        taken = set(row["sample_ids"])
        assert taken < {f"smp-{make_turn_id(A, f's{i}', 0)}" for i in range(3)}  # two of A's three
        with open_catalog(tmp_path) as con:
            assert open_batch(con) is None  # not the shared policy's unfinished batch
            assert full_batch_namespaces(con, "h", 2) == [A]  # A's batch waits to be trained; B has one sample
        assert claim(store, tmp_path, A) == (batch_id, f"resuming {A}'s batch {batch_id} (claimed, not trained)")
        assert claim(store, tmp_path, B) == (None, f"1 fresh samples of {B} wait; rollout_batch_size is 2")
        store.append(AdapterRecord(A, 1, f"{A}@v1", batch_id, f"{A}@v0", "0", "/p", "sha"))
        store.flush()
        assert claim(store, tmp_path, A)[0] is None  # one of A's samples left: no full batch
        with open_catalog(tmp_path) as con:
            [left] = namespace_samples(con, "h", A)
        assert left["sample_id"] not in taken and left["namespace"] == A and left["adapter_version"] == 0


def test_staleness_is_against_the_namespaces_own_adapter_and_the_one_serving_it_is_fresh(tmp_path):
    with DataStore(tmp_path) as store:
        store.append([AdapterRecord(A, v, f"{A}@v{v}", f"b{v}", f"{A}@v{v - 1}", "0", "/p", "sha") for v in (1, 2)])
        store.append([r for i in range(2) for r in turn_and_sample(A, i)]  # served by the base
                     + [r for i in (2, 3) for r in turn_and_sample(A, i, adapter=f"{A}@v1")]
                     + [r for i in range(2) for r in turn_and_sample(B, i)])  # B has no adapter: v0 is its newest
        store.flush()
        with open_catalog(tmp_path) as con:
            assert sorted(r["adapter_version"] for r in namespace_samples(con, "h", A)) == [0, 0, 1, 1]
        write_served(tmp_path / "checkpoints", ServedAdapter(A, f"{A}@v1", 1, "/p", "sha"))
        batch_id, note = claim(store, tmp_path, A, max_staleness=0)
        # A's adapter is at v2: base samples are 2 behind (too stale); v1's serve A now, so they are fresh
        assert note.startswith(f"2 of {A}'s samples too stale for its adapter v2; claimed")
        assert batch_row(tmp_path, batch_id)["step"] == 3
        with open_catalog(tmp_path) as con:
            fates = con.sql("SELECT fate, detail FROM turn_fate ORDER BY detail").fetchall()
        assert fates == [(Fate.TOO_STALE.value, f"sampled by {A}@v0, its adapter is at v2 (max_staleness 0)")] * 2
        assert claim(store, tmp_path, B, max_staleness=0)[0] is not None  # B's base samples are fresh for B


def test_a_forgotten_namespaces_earlier_samples_never_train_again(tmp_path):
    with DataStore(tmp_path) as store:
        store.append([r for i in range(2) for r in turn_and_sample(A, i)])
        store.append(AdapterServeRecord(A, "forget", None, f"{A}@v1", True, None, None, 0.0, "asked",
                                        created_at=T0 + timedelta(minutes=30)))
        store.append([r for i in (2, 3) for r in turn_and_sample(A, i, minutes=60)])
        store.flush()
        with open_catalog(tmp_path) as con:
            kept = namespace_samples(con, "h", A)
        assert sorted(r["session_id"] for r in kept) == ["s2", "s3"]  # only the turns after the forget
