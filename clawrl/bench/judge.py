"""Judge throughput: turns judged per second with a model judge (the embedded engine) at turn
concurrency 1 vs 16, beside the engine's own batching gain measured in the same run.

Each turn gets ``judge_samples`` PRM votes of ``max_tokens`` tokens from an ``EngineJudge`` over
the embedded engine (the judge path of ``[prm] backend = "engine"``); ``ignore_eos`` is not
available through the judge, so vote lengths vary - the tokens generated are counted and reported.
The engine's gain is the same engine generating the same number of tokens per request at request
concurrency 1 vs 16. With one vote per turn the two gains compare like with like.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from clawrl.bench.report import load_average


def build_judge_turns(tokenizer, n: int) -> list[tuple[Any, Any]]:
    """n synthetic (turn, next_state) pairs with realistic short conversations."""
    import json

    from clawrl.records import NextStateRecord, TurnRecord, utcnow

    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Question {i}: what is a good name for a cat?"}]
        prompt = list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
        answer = "How about Whiskers? It is a classic name."
        ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        now = utcnow()
        turn = TurnRecord(turn_id=f"bench{i}", session_id=f"bench-{i}", turn_index=0, turn_type="main",
                          namespace="open", model="bench", weight_version="0", request_messages=json.dumps(msgs),
                          request_tools=None, request_params="{}", prompt_ids=prompt, output_ids=ids,
                          rollout_logprobs=[-1.0] * len(ids), text=answer, tool_calls=None, finish_reason="stop",
                          created_at=now, completed_at=now, latency_ms=1.0)
        reply = "thanks, that's great!" if i % 2 else "no, give me a shorter name"
        ns = NextStateRecord(turn.turn_id, turn.session_id, 0, True, json.dumps([{"role": "user", "content": reply}]),
                             "next_request")
        out.append((turn, ns))
    return out


async def _judge_all(engine, tokenizer, pairs, concurrency: int, judge_samples: int, max_tokens: int) -> float:
    from clawrl.records import Method
    from clawrl.judge.backends import EngineJudge
    from clawrl.judge.pipeline import judge_turn

    judge = EngineJudge(engine, tokenizer)
    sem = asyncio.Semaphore(concurrency)

    async def one(turn, ns):
        async with sem:
            return await judge_turn(turn, ns, judge=judge, method=Method.GRPO, judge_samples=judge_samples,
                                    hint_samples=1, temperature=0.6, max_tokens=max_tokens, budget_chars=2000,
                                    hint_policy="longest", teacher=None, teacher_tokenizer=None,
                                    hint_placement="append_last_user", judge_config_hash="bench",
                                    judge_backend_name="engine")

    t0 = time.perf_counter()
    await asyncio.gather(*(one(t, n) for t, n in pairs))
    return time.perf_counter() - t0


def _rendered_prm_prompt(tokenizer, turn, next_state) -> list[int]:
    """The ids of the PRM prompt the judge sends for this turn: the engine-gain comparison uses
    prompts of the judge's own length (a long prompt is prefill-bound and batches less)."""
    from clawrl.judge.context import build_judge_context
    from clawrl.judge.prompts import build_prm_messages

    msgs = build_prm_messages(build_judge_context(turn, next_state), 2000)
    return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))


async def _engine_gain(engine, prompt: list[int], concurrency: int, n: int, max_tokens: int) -> float:
    from clawrl.engine.types import GenerateRequest, SamplingParams

    sem = asyncio.Semaphore(concurrency)

    async def one(i):
        async with sem:
            await engine.generate(GenerateRequest(input_ids=prompt, sampling_params=SamplingParams(
                max_new_tokens=max_tokens, temperature=0.6, ignore_eos=True, sampling_seed=i)))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n / (time.perf_counter() - t0)


def run_judge_bench(model_names=("tiny", "smollm2-135m"), *, cache_dir: Path, n_turns: int = 32,
                    judge_samples: int = 1, max_tokens: int = 32, concurrencies=(1, 16)) -> list[dict[str, Any]]:
    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.models import resolve_model_dir

    rows = []
    for name in model_names:
        model_dir = resolve_model_dir(name, cache_dir)
        engine = EmbeddedEngine(model_dir, max_batch_size=16, max_context_len=2048)

        async def measure():
            await engine.start()
            try:
                pairs = build_judge_turns(engine.tokenizer, n_turns)
                judge_prompt = _rendered_prm_prompt(engine.tokenizer, *pairs[0])
                await _judge_all(engine, engine.tokenizer, pairs[:4], 4, judge_samples, 4)  # warm up
                out = {}
                for c in concurrencies:
                    secs = await _judge_all(engine, engine.tokenizer, pairs, c, judge_samples, max_tokens)
                    gen = await _engine_gain(engine, judge_prompt, c * judge_samples, n_turns * judge_samples,
                                             max_tokens)
                    out[c] = (n_turns / secs, gen)
                return out
            finally:
                await engine.close()

        res = asyncio.run(measure())
        base_turns, base_gen = res[concurrencies[0]]
        for c in concurrencies:
            turns_s, gen_s = res[c]
            rows.append({"model": name, "concurrency": c, "judge_samples": judge_samples, "turns": n_turns,
                         "turns_per_s": turns_s, "judge_gain": turns_s / base_turns,
                         "engine_requests_per_s": gen_s, "engine_gain": gen_s / base_gen, "load_1m": load_average()})
    return rows


def format_judge_section(rows: list[dict[str, Any]], machine_line: str, max_tokens: int) -> str:
    from clawrl.bench.report import markdown_table

    cols = ["model", "concurrency", "judge_samples", "turns", "turns_per_s", "judge_gain", "engine_requests_per_s",
            "engine_gain", "load_1m"]
    lines = ["## Judge throughput", "", machine_line,
             f"`EngineJudge` over the embedded engine, {max_tokens}-token votes, turns in flight = `concurrency`;",
             "`engine_gain` is the same engine's requests/s at the same request concurrency vs 1, on the judge's",
             "own rendered PRM prompt (ignore_eos, same token budget). Target: the judge's gain at 16 at least",
             "matches the engine's batching gain.", "",
             markdown_table(rows, cols)]
    return "\n".join(lines)
