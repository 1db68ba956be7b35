"""Judge throughput: turns judged per second with a model judge (the embedded engine) at turn
concurrency 1 vs 16, beside the engine's own batching gain measured in the same run.

Each turn gets ``judge_samples`` PRM votes of ``max_tokens`` tokens from an ``EngineJudge`` over
the embedded engine (the judge path of ``[prm] backend = "engine"``); ``ignore_eos`` is not
available through the judge, so vote lengths vary. The engine's gain is the same engine generating
``max_tokens`` tokens on the judge's own rendered PRM prompt (a long prompt is prefill-bound and
batches less) at request concurrency 1 vs 16. With one vote per turn the two gains compare like with like.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from clawrl.bench.report import load_average, markdown_table
from clawrl.engine.types import GenerateRequest, SamplingParams
from clawrl.judge.backends import EngineJudge
from clawrl.judge.context import build_judge_context
from clawrl.judge.pipeline import Judge
from clawrl.judge.prompts import build_prm_messages
from clawrl.records import Method, NextStateRecord, TurnRecord, utcnow

BUDGET_CHARS = 2000


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


async def _rate(n: int, concurrency: int, one) -> float:
    """``n`` calls of ``one(i)``, at most ``concurrency`` in flight: calls per second."""
    sem = asyncio.Semaphore(concurrency)

    async def bounded(i: int) -> None:
        async with sem:
            await one(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(bounded(i) for i in range(n)))
    return n / (time.perf_counter() - t0)


async def _measure(engine, pairs, concurrencies, judge_samples: int, max_tokens: int) -> dict[int, tuple[float, float]]:
    """{concurrency: (turns judged per second, engine requests per second)}."""
    def judge(tokens: int) -> Judge:
        return Judge(backend=EngineJudge(engine, engine.tokenizer), method=Method.GRPO, judge_samples=judge_samples,
                     hint_samples=1, temperature=0.6, max_tokens=tokens, budget_chars=BUDGET_CHARS,
                     hint_policy="longest", hint_placement="append_last_user", teacher=None, teacher_tokenizer=None,
                     config_hash="bench", backend_name="engine")

    msgs = build_prm_messages(build_judge_context(*pairs[0]), BUDGET_CHARS)
    prompt = list(engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))

    async def generate(i: int) -> None:
        await engine.generate(GenerateRequest(input_ids=prompt, sampling_params=SamplingParams(
            max_new_tokens=max_tokens, temperature=0.6, ignore_eos=True, sampling_seed=i)))

    warm, timed = judge(4), judge(max_tokens)
    await _rate(4, 4, lambda i: warm.judge(*pairs[i]))
    return {c: (await _rate(len(pairs), c, lambda i: timed.judge(*pairs[i])),
                await _rate(len(pairs) * judge_samples, c * judge_samples, generate)) for c in concurrencies}


def run_judge_bench(model_names=("tiny", "smollm2-135m"), *, cache_dir: Path, n_turns: int = 32,
                    judge_samples: int = 1, max_tokens: int = 32, concurrencies=(1, 16)) -> list[dict[str, Any]]:
    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.models import resolve_model_dir

    rows = []
    for name in model_names:
        engine = EmbeddedEngine(resolve_model_dir(name, cache_dir), max_batch_size=16, max_context_len=2048)

        async def measure():
            async with engine:
                return await _measure(engine, build_judge_turns(engine.tokenizer, n_turns), concurrencies,
                                      judge_samples, max_tokens)

        res = asyncio.run(measure())
        base_turns, base_gen = res[concurrencies[0]]
        rows += [{"model": name, "concurrency": c, "judge_samples": judge_samples, "turns": n_turns,
                  "turns_per_s": turns_s, "judge_gain": turns_s / base_turns, "engine_requests_per_s": gen_s,
                  "engine_gain": gen_s / base_gen, "load_1m": load_average()} for c, (turns_s, gen_s) in res.items()]
    return rows


def format_judge_section(rows: list[dict[str, Any]], machine_line: str, max_tokens: int) -> str:
    cols = ["model", "concurrency", "judge_samples", "turns", "turns_per_s", "judge_gain", "engine_requests_per_s",
            "engine_gain", "load_1m"]
    lines = ["## Judge throughput", "", machine_line,
             f"`EngineJudge` over the embedded engine, {max_tokens}-token votes, turns in flight = `concurrency`;",
             "`engine_gain` is the same engine's requests/s at the same request concurrency vs 1, on the judge's",
             "own rendered PRM prompt (ignore_eos, same token budget). Target: the judge's gain at 16 at least",
             "matches the engine's batching gain.", "",
             markdown_table(rows, cols)]
    return "\n".join(lines)
