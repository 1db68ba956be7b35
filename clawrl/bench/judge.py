"""Judge throughput: turns judged per second with a model judge (the embedded engine) at turn
concurrency 1 vs 16, beside the engine's own batching gain measured in the same run.

Each turn gets ``judge_samples`` PRM votes of at most ``max_tokens`` tokens from an ``EngineJudge``
over the embedded engine (the judge path of ``[prm] backend = "engine"``). The engine's gain is the
same engine given exactly the requests that judge pass sent it - each turn's own rendered PRM prompt
with the vote's sampling parameters and seed, so it generates the same tokens - at request
concurrency 1 vs 16: the same work without the judge around it. The prefix cache is emptied before every pass, so neither
finds the other's prompts cached. The judge's and the engine's passes alternate, and each rate keeps its best
pass: on a shared VM whose speed drifts, one pass each would compare two moments as well as two systems.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from clawrl.bench.common import bench_dtype, gather_bounded, load_average, machine_line, markdown_table
from clawrl.config import load_settings
from clawrl.engine.types import GenerateRequest
from clawrl.judge.runner import build_judge
from clawrl.records import NextStateRecord, TurnRecord, utcnow


def build_judge_turns(tokenizer, n: int) -> list[tuple[TurnRecord, NextStateRecord]]:
    """n synthetic (turn, next_state) pairs with realistic short conversations."""
    out = []
    answer = "How about Whiskers? It is a classic name."
    ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    for i in range(n):
        msgs = [{"role": "user", "content": f"Question {i}: what is a good name for a cat?"}]
        prompt = list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
        now = utcnow()
        turn = TurnRecord(turn_id=f"bench{i}", session_id=f"bench-{i}", turn_index=0, turn_type="main",
                          namespace="open", model="bench", weight_version="0", request_messages=json.dumps(msgs),
                          request_tools=None, request_params="{}", prompt_ids=prompt, output_ids=ids,
                          rollout_logprobs=[-1.0] * len(ids), text=answer, tool_calls=None, finish_reason="stop",
                          created_at=now, completed_at=now, latency_ms=1.0)
        reply = "thanks, that's great!" if i % 2 else "no, give me a shorter name"
        out.append((turn, NextStateRecord(turn.turn_id, turn.session_id, 0, True,
                                          json.dumps([{"role": "user", "content": reply}]), "next_request")))
    return out


async def _rate(concurrency: int, aws) -> float:
    """Awaitables completed per second, at most ``concurrency`` in flight."""
    aws = list(aws)
    t0 = time.perf_counter()
    await gather_bounded(concurrency, aws)
    return len(aws) / (time.perf_counter() - t0)


class _Recorder:
    """The engine, keeping each request the judge sends it with the number of tokens it produced."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    async def generate(self, req: GenerateRequest):
        res = await self.engine.generate(req)
        self.calls.append((req, len(res.output_ids)))
        return res


async def _measure(engine, pairs, concurrencies, judge_samples: int, max_tokens: int,
                   repeats: int) -> dict[int, tuple[float, float, float]]:
    """{concurrency: (turns judged per second, engine requests per second on the same requests, their mean
    output tokens)}, each rate the best of ``repeats`` passes, the judge's and the engine's alternating."""
    s = load_settings(env={}, overrides={"prm.backend": "engine", "ppo.advantage_estimator": "grpo",
                                         "prm.judge_samples": judge_samples, "prm.max_new_tokens": max_tokens})
    recorder = _Recorder(engine)
    timed = build_judge(s, frozen=lambda _: recorder)  # what `[prm] backend = "engine"` builds, over this engine
    warm = dataclasses.replace(timed, max_tokens=4)

    await _rate(4, (warm.judge(*p) for p in pairs[:4]))
    out = {}
    for c in concurrencies:
        turns_s = gen_s = 0.0
        calls: list = []
        for _ in range(repeats):
            await engine.flush_cache()
            recorder.calls.clear()
            turns_s = max(turns_s, await _rate(c, (timed.judge(*p) for p in pairs)))
            calls = calls or list(recorder.calls)  # every pass sends the same requests (seeded votes)
            await engine.flush_cache()
            gen_s = max(gen_s, await _rate(c * judge_samples, (engine.generate(req) for req, _ in calls)))
        out[c] = (turns_s, gen_s, sum(n for _, n in calls) / len(calls))
    return out


def run_judge_bench(model_names=("tiny", "smollm2-135m"), *, cache_dir: Path, n_turns: int = 32,
                    judge_samples: int = 1, max_tokens: int = 32, concurrencies=(1, 16),
                    device: str = "cpu", repeats: int = 2) -> list[dict[str, Any]]:
    """One row per (model, concurrency), the judge's engine on ``device`` (module docstring)."""
    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.models import resolve_model_dir

    rows, dtype = [], bench_dtype(device)
    for name in model_names:
        engine = EmbeddedEngine(resolve_model_dir(name, cache_dir), dtype=dtype, device=device, max_batch_size=16,
                                max_context_len=2048)

        async def measure():
            async with engine:
                return await _measure(engine, build_judge_turns(engine.tokenizer, n_turns), concurrencies,
                                      judge_samples, max_tokens, repeats)

        res = asyncio.run(measure())
        base_turns, base_gen, _ = res[concurrencies[0]]
        rows += [{"model": name, "concurrency": c, "judge_samples": judge_samples, "turns": n_turns,
                  "turns_per_s": turns_s, "judge_gain": turns_s / base_turns, "engine_requests_per_s": gen_s,
                  "engine_gain": gen_s / base_gen, "vote_tokens": tokens, "max_tokens": max_tokens, "device": device,
                  "repeats": repeats,
                  "dtype": dtype, "load_1m": load_average()} for c, (turns_s, gen_s, tokens) in res.items()]
    return rows


def format_judge_section(rows: list[dict[str, Any]]) -> str:
    cols = ["model", "concurrency", "judge_samples", "turns", "vote_tokens", "turns_per_s", "judge_gain",
            "engine_requests_per_s", "engine_gain", "load_1m"]
    lines = ["## Judge throughput", "", machine_line(rows[0]["device"], rows[0]["dtype"]),
             f"`EngineJudge` over the embedded engine, {rows[0]['max_tokens']}-token votes, `concurrency` turns in "
             "flight; `engine_gain`: the same engine's requests/s at that concurrency vs 1,",
             "on the requests the judge pass sent (prefix cache emptied before each pass). Each rate is the best of "
             f"{rows[0]['repeats']} passes, judge and engine alternating; target: judge_gain at 16 >= engine_gain.",
             "",
             markdown_table(rows, cols)]
    return "\n".join(lines)
