"""The judge and sync benchmarks at toy sizes, and `clawrl bench judge` writing its section: rows, ratios
and the device they ran on (speed is reported in docs/benchmarks.md, never asserted here)."""

from __future__ import annotations

import pytest

from clawrl.bench import cpu_model
from clawrl.bench.judge import run_judge_bench
from clawrl.bench.sync import run_sync_bench

pytestmark = [pytest.mark.bench]


def test_judge_bench_rows_and_gains(model_cache):
    rows = run_judge_bench(("tiny",), cache_dir=model_cache, n_turns=4, max_tokens=4, concurrencies=(1, 2),
                           repeats=1)
    assert [(r["model"], r["concurrency"], r["turns"], r["judge_samples"], r["repeats"]) for r in rows] == [
        ("tiny", 1, 4, 1, 1), ("tiny", 2, 4, 1, 1)]
    assert rows[0]["judge_gain"] == rows[0]["engine_gain"] == 1.0
    for r in rows:
        assert r["turns_per_s"] > 0 and r["engine_requests_per_s"] > 0
        assert r["judge_gain"] == pytest.approx(r["turns_per_s"] / rows[0]["turns_per_s"])
        assert (r["device"], r["dtype"], r["max_tokens"]) == ("cpu", "float32", 4)
        assert 1 <= r["vote_tokens"] <= 4  # the engine rows generate what the votes did: at most the budget


def test_the_engine_rows_replay_exactly_the_requests_the_judge_sent(tiny_dir):
    """Each PRM request the judge sends is kept with its own prompt and output length, for the engine rows."""
    import asyncio

    from clawrl.bench.judge import _Recorder, build_judge_turns
    from clawrl.config import load_settings
    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.judge.runner import build_judge

    engine = EmbeddedEngine(tiny_dir, max_batch_size=4, max_context_len=2048)
    recorder = _Recorder(engine)
    s = load_settings(env={}, overrides={"prm.backend": "engine", "ppo.advantage_estimator": "grpo",
                                         "prm.judge_samples": 1, "prm.max_new_tokens": 5})
    judge = build_judge(s, frozen=lambda _: recorder)
    pairs = build_judge_turns(engine.tokenizer, 3)

    async def go():
        async with engine:
            return [await judge.judge(*p) for p in pairs]

    outcomes = asyncio.run(go())
    assert len(recorder.calls) == 3 and all(o.verdict is not None for o in outcomes)
    prompts = [list(req.input_ids) for req, _ in recorder.calls]
    assert len({tuple(p) for p in prompts}) == 3  # each turn's own PRM prompt, not one repeated
    assert all(f"Question {i}" in engine.tokenizer.decode(p) for i, p in enumerate(prompts))
    assert all(1 <= n <= 5 for _, n in recorder.calls)


def test_sync_bench_times_both_paths_against_their_bounds(model_cache, tiny_dir):
    from clawrl.models import load_causal_lm

    rows = run_sync_bench(("tiny",), cache_dir=model_cache, repeats=1)
    assert [r["path"] for r in rows] == ["in_process", "disk_sync"]
    state = load_causal_lm(tiny_dir).state_dict()  # float32, as the trainer holds it
    for r in rows:
        assert r["bytes"] == sum(t.numel() * 4 for t in state.values())
        assert r["seconds"] <= r["seconds_median"] and r["bound_seconds"] > 0
        assert r["vs_bound"] == pytest.approx(r["seconds"] / r["bound_seconds"])
        assert (r["device"], r["dtype"]) == ("cpu", "float32")


def test_cli_writes_the_judge_section_naming_the_device(model_cache, tmp_path):
    from typer.testing import CliRunner

    from clawrl.cli import app

    out = tmp_path / "benchmarks.md"
    res = CliRunner().invoke(app, ["bench", "judge", "--models", "tiny", "--turns", "2", "--max-tokens", "2",
                                   "--repeats", "2", "--device", "cpu", "--out", str(out)],
                             env={"CLAWRL__STORAGE__MODEL_CACHE": str(model_cache)})
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert text.count("<!-- judge-bench:start -->") == 1 and "## Judge throughput" in text
    assert f"; device cpu ({cpu_model()}), float32; " in text and "2-token votes" in text
    assert "the best of 2 passes" in text


def test_train_bench_times_only_the_parts_asked_for(model_cache, tmp_path):
    from typer.testing import CliRunner

    from clawrl.cli import app

    out = tmp_path / "benchmarks.md"
    env = {"CLAWRL__STORAGE__MODEL_CACHE": str(model_cache)}
    res = CliRunner().invoke(app, ["bench", "train", "--models", "tiny", "--parts", "sync", "--repeats", "1",
                                   "--device", "cpu", "--out", str(out)], env=env)
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert "(b) Weight sync" in text and "(a) One PPO step" not in text
    assert "| tiny | in_process |" in text and "| tiny | disk_sync |" in text
    bad = CliRunner().invoke(app, ["bench", "train", "--parts", "step,evaluation", "--out", str(out)], env=env)
    assert bad.exit_code == 2 and "--parts 'step,evaluation'" in bad.output
