"""Isolation of per-user adapters in one running engine: training user A's adapter and loading A's new
version leaves what the engine serves user B (on an adapter of B's own) and user C (on the base model)
bytes-identical, while A's requests share their batches.

The engine serves three users at once (every request of a phase in flight together, so they share
prefill and decode batches): for B and C, on each probe question, a greedy answer (its tokens and their
log-probs), an answer sampled with a fixed ``sampling_seed`` (likewise) and the echo log-probs of a
fixed text (``max_new_tokens`` 0, every prompt position scored); A asks its own questions beside them.
B's adapter is trained first, one PPO step through :class:`clawrl.train.adapters.NamespaceTrainer` on
answers B was served. Phase *before*: A has no adapter yet (A is served the base). Then A's adapter is
trained for real, one PPO step on the answers A was served in that phase (rewards +1 / -1 in turn: any
signal moves A; which one does not matter here), and loaded into the same running engine by the adapter
sync path (:func:`clawrl.sync.sync_adapter`: digest check, ``load_lora_adapter``). Phase *after*: the same
requests again, A's now on A's new version. Per user and kind: whether the two phases' tokens and
log-probs are bytes-identical and the largest |difference| of a log-prob; for A, the mean |difference| of
its echo log-probs, to show that A did change.

The engine runs with ``[engine] deterministic`` on (batch-invariant CPU decode, clawrl/engine/modeling.py):
bytes-identical is what it promises. Off, a row's last bits move with how many rows share its decode step
(A's answers ending at other steps), and the bench would measure that instead of the adapters' isolation.
"""

from __future__ import annotations

import asyncio
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

from clawrl.bench.common import bench_dtype, load_average

KINDS = ("greedy", "seeded", "echo", "greedy_fixed", "seeded_fixed")  # *_fixed: every answer its full length
SEED = 1234  # sampling_seed of a probe's sampled answer (probe i: SEED + i)
QUESTIONS = {  # each user's probe questions; A's answers are A's training samples
    "A": ("What is the capital of France?", "Name a primary color.", "How many legs does a spider have?",
          "What do bees make?"),
    "B": ("Which planet is the largest?", "What is water made of?", "Who wrote Hamlet?", "What is 12 times 12?"),
    "C": ("Why is the sky blue?", "What is the boiling point of water?", "Name a mammal that flies."),
}
ECHO = {"A": "The capital of France is Paris, and the capital of Italy is Rome.",
        "B": "Jupiter is the largest planet of the solar system.",
        "C": "Light of short wavelengths is scattered the most."}


def bits(values: list[float | None]) -> bytes:
    """The values as float64 bytes (None as NaN): equal bytes mean bit-identical floats, -0.0 and 0.0 apart."""
    return struct.pack(f"<{len(values)}d", *(float("nan") if v is None else v for v in values))


def compare_answers(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    """Two phases' answers to the same requests (``{"ids": [...], "logprobs": [...]}`` each): whether all
    are bytes-identical, how many differ in their tokens, and the largest and mean |difference| of a
    log-prob over the positions before the first one where the tokens part (from there on a log-prob is
    of another token, or of the same token after another context: not the same quantity)."""
    if len(before) != len(after):
        raise ValueError(f"{len(before)} answers before, {len(after)} after: the phases asked different requests")
    diffs: list[float] = []
    identical, token_changes = True, 0
    for b, a in zip(before, after):
        same_ids = b["ids"] == a["ids"]
        token_changes += not same_ids
        identical &= same_ids and bits(b["logprobs"]) == bits(a["logprobs"])
        for i, (x, y) in enumerate(zip(b["logprobs"], a["logprobs"])):
            if b["ids"][i] != a["ids"][i]:
                break
            if x is not None and y is not None:
                diffs.append(abs(x - y))
    return {"identical": identical, "answers": len(before), "token_changes": token_changes,
            "max_abs_diff": max(diffs, default=0.0), "mean_abs_diff": sum(diffs) / len(diffs) if diffs else 0.0}


def isolation_verdict(result: dict[str, Any]) -> tuple[bool, str]:
    """Isolation holds when every kind of B's and C's answers is bytes-identical and A's echo log-probs
    moved; the reason in words."""
    broken = [f"{u} {k}" for u in ("B", "C") for k in KINDS if not result["users"][u][k]["identical"]]
    moved = result["users"]["A"]["echo"]["mean_abs_diff"] > 0
    if broken:
        fixed = all(result["users"][u][k]["identical"] for u in ("B", "C") for k in KINDS if k.endswith("_fixed"))
        return False, "not bytes-identical: " + ", ".join(broken) + ("; at fixed length every kind is" if fixed else "")
    if not moved:
        return False, "A's log-probs did not move: training A showed nothing"
    return True, "B and C bytes-identical in every kind; A moved"


def _requests(tokenizer, users: dict[str, str | None], new_tokens: int, fixed: bool) -> list[tuple[str, str, Any]]:
    """(user, kind, GenerateRequest) of one pass; ``users``: each user's adapter name (None: the base).
    ``fixed``: greedy and seeded answers only, each ``new_tokens`` long (``ignore_eos``), so that every
    decode step's batch holds the same rows whatever the answers say."""
    from clawrl.engine.types import GenerateRequest, SamplingParams

    out, suffix = [], "_fixed" if fixed else ""
    for user, adapter in users.items():
        for i, q in enumerate(QUESTIONS[user]):
            prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                                    add_generation_prompt=True), add_special_tokens=False)
            for kind, sp in (("greedy", SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=fixed)),
                             ("seeded", SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=fixed,
                                                       sampling_seed=SEED + i))):
                out.append((user, kind + suffix, GenerateRequest(input_ids=prompt, sampling_params=sp,
                                                                 return_logprob=True, lora_path=adapter)))
        if not fixed:
            out.append((user, "echo", GenerateRequest(input_ids=tokenizer.encode(ECHO[user]), return_logprob=True,
                                                      logprob_start_len=0, lora_path=adapter,
                                                      sampling_params=SamplingParams(max_new_tokens=0))))
    return out


async def _phase(engine, users: dict[str, str | None], new_tokens: int) -> dict[str, dict[str, list[dict]]]:
    """Two passes, every request of a pass in flight at once (answers ending when they end, then of fixed
    length): ``{user: {kind: [{"ids", "logprobs", "prompt_ids"}]}}``."""
    out: dict[str, dict[str, list[dict]]] = {u: {k: [] for k in KINDS} for u in users}
    for fixed in (False, True):
        reqs = _requests(engine.tokenizer, users, new_tokens, fixed)
        results = await asyncio.gather(*(engine.generate(r) for _, _, r in reqs))
        out = _collect(out, reqs, results)
    return out


def _collect(out: dict[str, dict[str, list[dict]]], reqs: list[tuple[str, str, Any]], results: list) -> dict:
    for (user, kind, req), res in zip(reqs, results):
        if kind == "echo":
            out[user][kind].append({"ids": list(req.input_ids), "logprobs": list(res.input_logprobs or [])})
        else:
            out[user][kind].append({"ids": list(res.output_ids), "logprobs": list(res.output_logprobs or []),
                                    "prompt_ids": list(req.input_ids)})
    return out


def _samples(namespace: str, answers: list[dict], tag: str):
    from clawrl.records import SampleRecord

    return [SampleRecord(sample_id=f"{tag}-{i}", turn_id=f"{tag}-t{i}", session_id=f"{tag}-s{i}",
                         judge_config_hash="isolation", method="grpo", prompt_ids=a["prompt_ids"],
                         output_ids=a["ids"], rollout_logprobs=a["logprobs"], reward=1.0 if i % 2 == 0 else -1.0,
                         has_teacher=False, teacher_logprobs=None, weight_version="0", namespace=namespace)
            for i, a in enumerate(answers)]


def run_isolation_bench(model: str, *, cache_dir: Path, rank: int = 16, lr: float = 1e-4, new_tokens: int = 16,
                        device: str = "cpu", progress=None) -> dict[str, Any]:
    """The module docstring's measurement: one row per user and kind, A's training and sync timed."""
    from clawrl.config import PPOSettings
    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.models import resolve_model_dir
    from clawrl.sync import sync_adapter
    from clawrl.train.adapters import NamespaceTrainer
    from clawrl.train.base import PPOHyperParams

    say = progress or (lambda label: None)
    model_dir, dtype = resolve_model_dir(model, Path(cache_dir)), bench_dtype(device)
    hp = PPOHyperParams.from_settings(PPOSettings(advantage_estimator="grpo", lr=lr, kl_coef=0.0, group_by="batch"),
                                      seed=0)
    n_requests = sum(2 * len(q) + 1 for q in QUESTIONS.values())  # the first pass's; the second has no echo
    engine = EmbeddedEngine(model_dir, dtype=dtype, device=device, max_batch_size=n_requests, max_context_len=512,
                            max_loaded_loras=4, deterministic=True)
    tok = engine.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with tempfile.TemporaryDirectory() as tmp:
        trainer = NamespaceTrainer(base_model_dir=model_dir, checkpoints=Path(tmp), hp=hp, pad_id=pad_id, rank=rank,
                                   dtype=dtype, device=device)

        async def train_and_sync(user: str, answers: list[dict]) -> tuple[str, float, float]:
            t0 = time.perf_counter()
            step = await asyncio.to_thread(trainer.run, f"{user}-batch", _samples(user, answers, user), version=1)
            report = await sync_adapter(step.weight_version, step.path, step.sha256, engine=engine)
            if not report.success:
                raise RuntimeError(f"adapter sync of {step.weight_version} failed: {report.message}")
            return step.weight_version, time.perf_counter() - t0 - report.seconds, report.seconds

        async def go() -> dict[str, Any]:
            async with engine:
                say("B's answers on the base, for B's adapter")
                warm = await _phase(engine, {"B": None}, new_tokens)
                say("training B's adapter (one PPO step)")
                b_name, _, _ = await train_and_sync("B", warm["B"]["seeded"])
                users = {"A": None, "B": b_name, "C": None}
                say("phase before: A on the base, B on its adapter, C on the base")
                engine.reset_stats()
                before = await _phase(engine, users, new_tokens)
                batch_before = engine.stats["max_batch_seen"]
                say("training A's adapter (one PPO step) and loading it")
                a_name, step_s, sync_s = await train_and_sync("A", before["A"]["seeded"] + before["A"]["greedy"])
                say("phase after: A on its new version")
                engine.reset_stats()
                after = await _phase(engine, {**users, "A": a_name}, new_tokens)
                return {"before": before, "after": after, "a_adapter": a_name, "b_adapter": b_name,
                        "a_step_s": round(step_s, 2), "sync_s": round(sync_s, 3),
                        "max_batch_seen": min(batch_before, engine.stats["max_batch_seen"])}

        got = asyncio.run(go())
    users = {u: {k: compare_answers(got["before"][u][k], got["after"][u][k]) for k in KINDS} for u in QUESTIONS}
    decoding = sum(2 * len(q) for q in QUESTIONS.values())
    return {"model": model, "device": device, "dtype": dtype, "rank": rank, "lr": lr, "new_tokens": new_tokens,
            "requests": n_requests, "decoding": decoding, "max_batch_seen": got["max_batch_seen"],
            "a_adapter": got["a_adapter"], "b_adapter": got["b_adapter"], "a_samples": 2 * len(QUESTIONS["A"]),
            "a_step_s": got["a_step_s"], "sync_s": got["sync_s"], "users": users, "load_1m": load_average()}


def _cell(r: dict[str, Any]) -> str:
    if r["identical"]:
        return "yes"
    tokens = f"{r['token_changes']} of {r['answers']} answers' tokens changed" if r["token_changes"] else "same tokens"
    return f"**no**: {tokens}, max {r['max_abs_diff']:.3g}"


def format_isolation_section(result: dict[str, Any]) -> str:
    """The results page's section: the verdict and A's change, then one row for B and one for C, a column per kind."""
    from clawrl.bench.common import machine_line

    ok, why = isolation_verdict(result)
    invariant = "batch-invariant decode steps" if result["device"] == "cpu" else "which covers the CPU's decode only"
    served = {"B": f"`{result['b_adapter']}`", "C": "base"}
    rows = ["| user | served by | greedy | seeded | echo | greedy, fixed length | seeded, fixed length |",
            "|---|---|---|---|---|---|---|"]
    rows += [f"| {u} | {served[u]} | " + " | ".join(_cell(result["users"][u][k]) for k in KINDS) + " |"
             for u in ("B", "C")]
    a, changed = result["users"]["A"]["echo"], result["users"]["A"]["greedy"]
    return "\n".join([
        "**Isolation: does training A's adapter leave B and C bytes-identical?** "
        f"{machine_line(result['device'], result['dtype'])} `clawrl bench isolation`: `{result['model']}`, its engine "
        f"with `[engine] deterministic` on ({invariant}); a pass "
        f"holds every user's requests in flight together (decode batches of up to {result['max_batch_seen']} rows): "
        f"greedy and seeded answers of up to {result['new_tokens']} tokens and echo log-probs of a fixed text, then "
        f"the answers again at their full length (`ignore_eos`: the same rows in every decode step). Between the "
        f"phases A's rank-{result['rank']} adapter trains one PPO step (lr {result['lr']:g}, {result['a_samples']} of "
        f"A's answers, {result['a_step_s']:g} s) and `{result['a_adapter']}` is synced into the running engine "
        f"({1000 * result['sync_s']:.0f} ms); A's echo log-probs moved by {a['mean_abs_diff']:.3g} on average (max "
        f"{a['max_abs_diff']:.3g}), {changed['token_changes']} of its {changed['answers']} greedy answers changed. "
        f"Cells: bytes-identical before and after (else the largest |difference| of a log-prob where the tokens "
        f"agree). Target: B and C bytes-identical: {'MET' if ok else 'NOT MET'} ({why}).", "", *rows])
