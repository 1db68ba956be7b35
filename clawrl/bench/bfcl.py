"""`clawrl bench bfcl`: two models on BFCL, the Berkeley Function Calling Leaderboard, scored by BFCL itself.

Each side (the config's model, then ``--versus``: a checkpoint or any HF model directory) is served by
a gateway of its own (embedded engine, a throwaway data root); BFCL's own ``generate`` then asks it every
prompt of the chosen categories through ``/v1/chat/completions`` with ``tools`` (its function-calling
mode, clawrl's registry entry: ``clawrl/sim/bfcl_plugin.py``), and BFCL's own ``evaluate`` scores the
answers, both in BFCL's environment (`make bfcl`) as subprocesses, with ``BFCL_PROJECT_ROOT`` a folder
of ours that keeps the answers and scores. Per category: each side's accuracy with its Wilson 95%
interval, and whether the second is worse by the promotion gate's rule (:func:`clawrl.gate.decide_promotion`
on the per-prompt 0/1 verdicts, paired by prompt).
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clawrl.bench.common import gateway_on
from clawrl.gate import decide_promotion
from clawrl.sim.bfcl import BFCL_VERSION, PLUGIN, REGISTRY_NAME, bfcl_env, bfcl_python, worker

# BFCL's single-turn categories that need no executable backend and no network (its "AST" categories)
OFFLINE_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance", "live_simple",
                      "live_multiple", "live_parallel", "live_irrelevance")
Z95 = 1.959964  # the standard normal's 97.5% quantile


# a request waits for the engine's first token this long: BFCL keeps max_batch_size requests in flight, and a
# batch of 256-token answers to long prompts takes minutes on a busy 2-core CPU (the gateway's default, 120 s,
# turned them into 504s, which BFCL scores as answers without a call: right on irrelevance)
STALL_TIMEOUT_S = 1800.0
TEMPERATURE = 0.001  # BFCL's own default for every model; with the handler's fixed seed, near-greedy answers


def choose_ids(categories: tuple[str, ...], per_category: int, seed: int) -> dict[str, list[str]]:
    """The entry ids to ask per category (BFCL's ``test_case_ids_to_generate.json``): all of them
    (``per_category`` 0), else that many drawn with ``seed``."""
    return {c: [e["id"] for e in worker().sample({c: per_category}, seed)] for c in categories}


def pinned() -> str:
    """What the scores depend on besides the weights, in words: BFCL's handler and its pins, and the
    prompt the gateway wraps the tools in."""
    import hashlib

    from clawrl.chat import _tools_block

    h = worker().describe()
    block = hashlib.sha256(_tools_block([], None).encode()).hexdigest()[:12]
    return (f"registry entry `{REGISTRY_NAME}` ({h['model_name']}), handler {h['handler']}, {h['mode']} mode: "
            f"`tools` through /v1/chat/completions, temperature {TEMPERATURE:g}, seed {h['seed']}, max_tokens "
            f"{h['max_tokens']}; no system prompt from BFCL, the tools rendered into the system message by "
            f"clawrl's chat adapter (tool block sha256 {block})")


def wilson(k: int, n: int) -> tuple[float, float]:
    """Wilson's 95% interval of a proportion k/n."""
    if n == 0:
        return math.nan, math.nan
    p, z2 = k / n, Z95 * Z95
    mid, half = (p + z2 / (2 * n)) / (1 + z2 / n), Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, mid - half), min(1.0, mid + half)


def _bfcl(root: Path, log: Path, *args: str, base_url: str | None = None) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([str(bfcl_python()), str(PLUGIN), *args], cwd=root, stdout=out, stderr=subprocess.STDOUT,
                                env=bfcl_env(**({"base_url": base_url} if base_url else {}), BFCL_PROJECT_ROOT=str(root)))


def _answered(results: Path) -> int:
    return sum(sum(1 for _ in f.open()) for f in results.rglob("*_result.json"))


def run_side(settings, model_dir: Path, root: Path, label: str, ids: dict[str, list[str]], *,
             progress: Callable[[int], None] = lambda n: None) -> dict[str, dict[str, bool]]:
    """BFCL's verdict on each prompt of ``ids`` answered by ``model_dir``: ``{category: {id: valid}}``;
    the answers and scores stay in ``root / label`` and ``root / f"score_{label}"``. A side already done
    there on the same prompts (``done.json``) is read again, not run again."""
    done = root / label / "done.json"
    if done.exists() and json.loads(done.read_text()) == {"model": str(model_dir), "ids": ids}:
        return read_verdicts(root / label, root / f"score_{label}", list(ids))
    (root / "test_case_ids_to_generate.json").write_text(json.dumps(ids))
    log = root / f"{label}.log"
    # the model's whole context (live_multiple's longest prompts need ~4k tokens): a prompt beyond it is an error
    context = json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]
    with gateway_on(settings, model_dir, max_context_len=context, stall_timeout_s=STALL_TIMEOUT_S) as url:
        proc = _bfcl(root, log, "generate", "--model", REGISTRY_NAME, "--run-ids", "--result-dir", label,
                     "--temperature", str(TEMPERATURE), "--num-threads", str(settings.engine.max_batch_size),
                     "--allow-overwrite", base_url=url + "/v1")
        while proc.poll() is None:
            progress(_answered(root / label))
            time.sleep(1.0)
    if proc.returncode:
        raise RuntimeError(f"BFCL generate failed (exit {proc.returncode}); its log: {log}")
    progress(_answered(root / label))
    ev = _bfcl(root, log, "evaluate", "--model", REGISTRY_NAME, "--test-category", ",".join(ids), "--result-dir", label,
               "--score-dir", f"score_{label}", "--partial-eval")
    if ev.wait():
        raise RuntimeError(f"BFCL evaluate failed (exit {ev.returncode}); its log: {log}")
    verdicts = read_verdicts(root / label, root / f"score_{label}", list(ids))
    done.write_text(json.dumps({"model": str(model_dir), "ids": ids}))
    return verdicts


def read_verdicts(results: Path, scores: Path, categories: list[str]) -> dict[str, dict[str, bool]]:
    """Per category, each answered id and whether BFCL's score file leaves it out of its failures
    (the first line of a score file is the summary, each further line one failed entry)."""
    out = {}
    for c in categories:
        (result,) = results.rglob(f"BFCL_v4_{c}_result.json")
        (score,) = scores.rglob(f"BFCL_v4_{c}_score.json")
        lines = [json.loads(line) for line in score.open()]
        failed = {e["id"] for e in lines[1:]}
        answered = [json.loads(line)["id"] for line in result.open()]
        if len(answered) != lines[0]["total_count"]:
            raise ValueError(f"{score}: {lines[0]['total_count']} scored, {len(answered)} answered in {result}")
        out[c] = {i: i not in failed for i in answered}
    return out


def errors_in(results: Path, category: str) -> int:
    """Answers BFCL recorded as an inference error (a request refused or timed out)."""
    (result,) = results.rglob(f"BFCL_v4_{category}_result.json")
    return sum(str(json.loads(line)["result"]).startswith("Error during inference") for line in result.open())


def compare(first: dict[str, dict[str, bool]], second: dict[str, dict[str, bool]], *, tolerance: float,
            alpha: float) -> list[dict[str, Any]]:
    """One row per category: n, each side's accuracy and Wilson interval, and the gate's rule on the
    paired per-prompt verdicts (``worse``: the rule would refuse the second as a candidate)."""
    rows = []
    for c, a in first.items():
        b = second[c]
        ids = [i for i in a if i in b]
        xa, xb = [float(a[i]) for i in ids], [float(b[i]) for i in ids]
        d = decide_promotion(xb, xa, tolerance=tolerance, alpha=alpha)
        rows.append({"category": c, "n": len(ids), "first": d.champion_mean, "first_ci": wilson(int(sum(xa)), len(ids)),
                     "second": d.candidate_mean, "second_ci": wilson(int(sum(xb)), len(ids)), "diff": d.mean_diff,
                     "p": d.p_value, "worse": not d.promoted})
    return rows


def format_table(rows: list[dict[str, Any]], labels: tuple[str, str], errors: dict[str, tuple[int, int]]) -> str:
    """One comparison as a markdown table; ``errors``: per category, each side's inference errors."""
    head = [f"| category | n | {labels[0]} | {labels[1]} | diff | p | worse | errors |", "|---" * 8 + "|"]
    for r in rows:
        e = errors.get(r["category"], (0, 0))
        head.append(f"| {r['category']} | {r['n']} | {r['first']:.3f} ({r['first_ci'][0]:.2f}-{r['first_ci'][1]:.2f}) "
                    f"| {r['second']:.3f} ({r['second_ci'][0]:.2f}-{r['second_ci'][1]:.2f}) | {r['diff']:+.3f} "
                    f"| {r['p']:.3g} | {'**yes**' if r['worse'] else 'no'} | {e[0]} / {e[1]} |")
    return "\n".join(head)


def format_section(tables: list[str], *, machine: str, pins: str, per_category: int, seed: int, tolerance: float,
                   alpha: float) -> str:
    """The markdown section ``clawrl bench bfcl`` writes: ``tables`` (:func:`format_table`) under what they used."""
    sample = "every prompt" if per_category == 0 else f"{per_category} prompts per category drawn with seed {seed}"
    head = ["## BFCL: the base model and trained versions on the Berkeley Function Calling Leaderboard", "", machine,
            f"`clawrl bench bfcl`: bfcl-eval {BFCL_VERSION}, {sample}; {pins}. Every version answers the same prompts; "
            "accuracy with its Wilson 95% interval; `worse`: the promotion gate's rule on the paired per-prompt "
            f"verdicts (tolerance {tolerance:g}, alpha {alpha:g}; `p`: one-sided, of a drop); `errors`: requests that got "
            "no answer, refused or timed out (BFCL scores them as answers without a call)."]
    return "\n".join(head + [x for t in tables for x in ("", t)])


def run_bfcl_bench(settings, sides: list[tuple[str, Path]], root: Path, *, categories: tuple[str, ...],
                   per_category: int, seed: int, progress: Callable[[str, int, int], None]) -> dict[str, Any]:
    """Every side on the same prompts: ``{"ids", "verdicts": {label: ...}, "errors": {label: {category: n}}}``."""
    root.mkdir(parents=True, exist_ok=True)
    ids = choose_ids(categories, per_category, seed)
    total = sum(map(len, ids.values()))
    verdicts = {label: run_side(settings, model_dir, root, label, ids, progress=lambda n, lb=label: progress(lb, n, total))
                for label, model_dir in sides}
    errors = {label: {c: errors_in(root / label, c) for c in ids} for label, _ in sides}
    return {"ids": ids, "verdicts": verdicts, "errors": errors}
