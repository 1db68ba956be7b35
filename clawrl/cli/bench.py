"""`clawrl bench engine|lora|isolation|gateway|judge|train|load|long-prompt|tools`: measure, print, and rewrite a
section of docs/benchmarks.md."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from clawrl.cli.common import ConfigOpt, bench_app, console, fail, settings_or_exit

OutOpt = Annotated[Path, typer.Option(help="Markdown file whose section of this benchmark is rewritten.")]
ModelsOpt = Annotated[str, typer.Option(help="Comma-separated model names.")]
DeviceOpt = Annotated[Optional[Literal["cpu", "cuda"]], typer.Option(
    help="Where the models run (default: cuda if available, else cpu); bfloat16 on cuda, float32 on cpu.")]
REPORT = Path("docs/benchmarks.md")


def _split(text: str, cast=str) -> tuple:
    """'1, 4,16' -> (1, 4, 16): a comma-separated option, blanks dropped."""
    return tuple(cast(x.strip()) for x in text.split(",") if x.strip())


def _sizes(text: str) -> str:
    """Check a comma-separated option of sizes (each an integer >= 1; '' = none) as typer parses it."""
    for x in _split(text):
        if not x.isdigit() or int(x) < 1:
            raise typer.BadParameter(f"{x!r} is not a whole number >= 1 (expected e.g. 1,4,16)")
    return text


def _some_sizes(text: str) -> str:
    """:func:`_sizes`, at least one."""
    if not _split(_sizes(text)):
        raise typer.BadParameter("expected at least one whole number >= 1, e.g. 1,16")
    return text


def _device(device: str | None) -> str:
    """``--device``, or cuda when torch sees a GPU, else cpu."""
    import torch

    return device or ("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def _status(what: str):
    """A spinner line; yields the ``progress(label)`` callback a bench calls as it goes."""
    with console.status(what) as status:
        yield lambda label: status.update(f"{what}: {label}")


def _write(name: str, section: str, out: Path) -> None:
    """Print the section and put it in its place in ``out``."""
    from clawrl.bench.common import write_section

    typer.echo(section)
    write_section(name, section, out)
    console.print(f"wrote {out}", markup=False)


@bench_app.command("engine")
def bench_engine(
    models: ModelsOpt = "tiny,smollm2-135m",
    concurrency: Annotated[str, typer.Option(
        callback=_some_sizes, help="Comma-separated engine concurrencies.")] = "1,4,16",
    hf_batch: Annotated[str, typer.Option(
        callback=_sizes, help="Comma-separated HF generate batch sizes ('' = skip).")] = "1,16",
    new_tokens: Annotated[int, typer.Option(min=1, help="Tokens per request (greedy, ignore_eos).")] = 32,
    repeats: Annotated[int, typer.Option(min=1, help="Interleaved passes; each row keeps its best.")] = 3,
    device: DeviceOpt = None,
    out: OutOpt = REPORT,
    config: ConfigOpt = None,
) -> None:
    """Embedded-engine tokens/s at several concurrencies vs HF generate; writes docs/benchmarks.md (CUDA: its
    own section, with the engine's eager steps and HF's compiled static-cache generate beside)."""
    from clawrl.bench.engine import format_engine_section, run_engine_bench

    s = settings_or_exit(config)
    with _status("engine bench") as progress:
        rows = run_engine_bench(_split(models), _split(concurrency, int), new_tokens, cache_dir=s.storage.models_dir,
                                hf_batch_sizes=_split(hf_batch, int), repeats=repeats, device=_device(device),
                                progress=progress)
    _write("engine" if rows[0]["device"] == "cpu" else "engine-cuda", format_engine_section(rows), out)


@bench_app.command("lora")
def bench_lora(
    model: Annotated[str, typer.Option(help="Model name (qwen3-0.6b-random on a GPU).")] = "smollm2-135m",
    adapters: Annotated[int, typer.Option(min=1, help="Distinct adapters in flight.")] = 8,
    concurrency: Annotated[int, typer.Option(min=1, help="Requests in flight.")] = 16,
    rank: Annotated[int, typer.Option(min=1, help="LoRA rank (all seven projections).")] = 16,
    new_tokens: Annotated[int, typer.Option(min=1, help="Tokens per throughput request.")] = 32,
    repeats: Annotated[int, typer.Option(min=1, help="Interleaved passes; the best is kept.")] = 3,
    registered: Annotated[int, typer.Option(min=0, help="Adapters registered for the many-users part (0: skip).")] = 1000,
    held: Annotated[int, typer.Option(min=1, help="max_loaded_loras of the many-users part.")] = 32,
    cold_requests: Annotated[int, typer.Option(min=1, help="Requests of the many-users part.")] = 300,
    sync: Annotated[bool, typer.Option(help="Time an adapter sync against a full-weight sync.")] = True,
    device: DeviceOpt = None,
    out: OutOpt = REPORT,
    config: ConfigOpt = None,
) -> None:
    """Tokens/s with many LoRA adapters in flight vs the base alone (and the bound), the latency a cold adapter adds
    with many registered, and an adapter sync vs a full-weight sync."""
    from clawrl.bench.lora import format_lora_section, run_lora_bench

    s = settings_or_exit(config)
    with _status("lora bench") as progress:
        result = run_lora_bench(model, cache_dir=s.storage.models_dir, adapters=adapters, rank=rank,
                                concurrency=concurrency, new_tokens=new_tokens, repeats=repeats, registered=registered,
                                held=held, cold_requests=cold_requests, sync=sync, device=_device(device),
                                progress=progress)
    _write("lora" if result["device"] == "cpu" else "lora-cuda", format_lora_section(result), out)


@bench_app.command("isolation")
def bench_isolation(
    model: Annotated[str, typer.Option(help="Model name.")] = "smollm2-135m",
    rank: Annotated[int, typer.Option(min=1, help="LoRA rank of A's and B's adapters (all seven projections).")] = 16,
    lr: Annotated[float, typer.Option(min=0.0, help="Learning rate of A's PPO step (a LoRA lr).")] = 1e-4,
    new_tokens: Annotated[int, typer.Option(min=1, help="Tokens per greedy or seeded answer.")] = 16,
    device: DeviceOpt = None,
    out: OutOpt = REPORT,
    config: ConfigOpt = None,
) -> None:
    """Whether training user A's adapter and loading A's new version into the running engine leaves what it
    serves user B (own adapter) and user C (base) bytes-identical, greedy, seeded and echo, with A's requests
    in the same batches; writes the isolation part of the LoRA section of docs/benchmarks.md. The engine runs with
    [engine] deterministic on (batch-invariant decode): bytes-identical is what that setting promises."""
    from clawrl.bench.isolation import format_isolation_section, run_isolation_bench

    s = settings_or_exit(config)
    with _status("isolation bench") as progress:
        result = run_isolation_bench(model, cache_dir=s.storage.models_dir, rank=rank, lr=lr, new_tokens=new_tokens,
                                     device=_device(device), progress=progress)
    _write("lora-isolation" if result["device"] == "cpu" else "lora-isolation-cuda", format_isolation_section(result),
           out)


@bench_app.command("gateway")
def bench_gateway(
    requests: Annotated[int, typer.Option(
        min=1, help="Requests per path at concurrency <= 4 (p99 of 2,000 = the 20th "
                    "worst); concurrency c > 4 takes c/4 times as many.")] = 2000,
    concurrency: Annotated[str, typer.Option(callback=_some_sizes, help="Comma-separated concurrencies.")] = "1,16",
    append_turns: Annotated[int, typer.Option(min=1, help="Turns for the session-log append rate.")] = 200_000,
    model: Annotated[Optional[str], typer.Option(help="Model the engine serves (default: smollm2-135m on cuda, the "
                                                      "real model the target is read on; tiny on cpu, whose short "
                                                      "engine call gives the gateway its largest share).")] = None,
    device: DeviceOpt = None,
    out: OutOpt = REPORT,
    config: ConfigOpt = None,
) -> None:
    """Gateway latency added over a direct engine call (p50/p99) and the session-log append rate."""
    from clawrl.bench.gateway import format_gateway_section, run_gateway_bench

    s = settings_or_exit(config)
    device = _device(device)
    model = model or ("smollm2-135m" if device == "cuda" else "tiny")
    with _status("gateway bench") as progress:
        result = run_gateway_bench(model_cache=s.storage.models_dir, concurrencies=_split(concurrency, int),
                                   n=requests, append_turns=append_turns, device=device, model=model,
                                   progress=progress)
    _write("gateway", format_gateway_section(result), out)
    console.print(f"servers' logs and session log: {Path(result['data_root']).parent}", markup=False)


@bench_app.command("long-prompt")
def bench_long_prompt(
    model: Annotated[str, typer.Option(help="Model name.")] = "smollm2-135m",
    context: Annotated[int, typer.Option(min=1, help="max_context_len of the engine.")] = 8192,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="Tokens of the long prompt.")] = 7500,
    chunks: Annotated[str, typer.Option(
        callback=_some_sizes, help="Comma-separated chunked_prefill_size values.")] = "8192,2048,512",
    prefixes: Annotated[str, typer.Option(
        callback=_sizes, help="Comma-separated shared-prefix lengths of the conversation with and without the "
                              "prefix cache ('' = skip).")] = "2000,6000",
    device: DeviceOpt = None,
    out: OutOpt = REPORT,
    config: ConfigOpt = None,
) -> None:
    """A long prompt's cost to running requests, abort latency and memory at several prefill chunk sizes."""
    from clawrl.bench.longprompt import format_long_prompt_section, run_long_prompt_bench

    s = settings_or_exit(config)
    with _status("long-prompt bench") as progress:
        rows = run_long_prompt_bench(model, cache_dir=s.storage.models_dir, context=context, prompt_tokens=prompt_tokens,
                                     chunks=_split(chunks, int), prefixes=_split(prefixes, int),
                                     device=_device(device), progress=progress)
    _write("long-prompt", format_long_prompt_section(rows, _device(device)), out)


@bench_app.command("judge")
def bench_judge(
    models: ModelsOpt = "tiny,smollm2-135m",
    turns: Annotated[int, typer.Option(min=1, help="Turns judged per concurrency.")] = 32,
    judge_samples: Annotated[int, typer.Option(min=1, help="PRM votes per turn.")] = 1,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens per vote.")] = 32,
    repeats: Annotated[int, typer.Option(min=1, help="Passes of the judge and of the engine each (best kept).")] = 2,
    device: DeviceOpt = None,
    out: OutOpt = REPORT,
    config: ConfigOpt = None,
) -> None:
    """Turns judged per second with the embedded engine as judge, concurrency 1 vs 16."""
    from clawrl.bench.judge import format_judge_section, run_judge_bench

    s = settings_or_exit(config)
    with _status("judge bench"):
        rows = run_judge_bench(_split(models), cache_dir=s.storage.models_dir, n_turns=turns,
                               judge_samples=judge_samples, max_tokens=max_tokens, device=_device(device),
                               repeats=repeats)
    _write("judge", format_judge_section(rows), out)


@bench_app.command("load")
def bench_load(
    sessions: Annotated[int, typer.Option(min=1, help="Concurrent simulated users (a session at a time each).")] = 64,
    duration: Annotated[float, typer.Option(min=1.0, help="Seconds of load (the window syncs are counted in).")] = 60.0,
    rollout_batch_size: Annotated[int, typer.Option(
        min=1, help="Samples per PPO step (small: steps happen in the window).")] = 8,
    max_tokens: Annotated[int, typer.Option(min=1, help="New tokens per turn.")] = 16,
    turns: Annotated[int, typer.Option(min=1, help="Main turns per session.")] = 3,
    model: Annotated[str, typer.Option(help="The served and trained model (e.g. qwen3-0.6b-random on a GPU).")] = "tiny",
    min_syncs: Annotated[int, typer.Option(
        min=0, help="Keep the load on past --duration until this many weight syncs "
                    "were served (at most 4x --duration + 240 s).")] = 1,
    engines: Annotated[str, typer.Option(help="Comma-separated counts of `clawrl engine` processes behind the "
                                               "gateway, one run each (e.g. 1,2); default: its embedded engine.")] = "",
    up: Annotated[bool, typer.Option("--up", help="Run the whole system as `clawrl up` (Prefect server, MLflow, "
                                                  "trainer service, gateway, judge and evaluation engines, flow "
                                                  "server) and only drive the users.")] = False,
    device: DeviceOpt = None,
    out: OutOpt = REPORT,
    config: ConfigOpt = None,
) -> None:
    """Concurrent sessions against `clawrl serve` while the judge and train flows run and sync weights
    (with --up: against `clawrl up`, whose flow server runs them)."""
    from clawrl.bench.load import run_load_bench
    from clawrl.bench.load_report import format_engines_section, format_load_section
    from clawrl.config import use_prefect_home

    if up and engines:
        fail("--up runs `clawrl up`, whose gateway serves from its embedded engine: --engines cannot go with it")
    s = settings_or_exit(config)
    use_prefect_home(s.storage.data_root / "prefect")  # flow runs of the bench show in that Prefect UI
    with _status("load bench") as label:
        def progress(p: dict) -> None:
            label(f"{p['elapsed_s']:.0f}/{p['duration_s']:g} s, {p['requests']} requests, {p['errors']} errors, "
                  f"syncs {p['syncs']}, versions served {','.join(p['versions']) or '-'}")

        results = [run_load_bench(model_cache=s.storage.models_dir, sessions=sessions, duration_s=duration,
                                  rollout_batch_size=rollout_batch_size, max_tokens=max_tokens,
                                  turns_per_session=turns, min_syncs=min_syncs, device=_device(device), model=model,
                                  engines=n, up=up, progress=progress) for n in _counts(engines)]
    if engines:
        _write("load-engines", format_engines_section(results), out)
    else:
        _write("load-up" if up else "load", format_load_section(results[0]), out)
    for result in results:
        console.print(f"run data: {result['data_root']}", markup=False)
        if not (result["errors"] == 0 and result["sent_not_logged"] == 0
                and result["main_turns_sent"] == result["main_turns_logged"] and result["syncs_during_run"] >= 1):
            fail(f"load bench FAILED its checks: errors {result['errors']} {result['error_samples']}, sent "
                 f"{result['main_turns_sent']} vs logged {result['main_turns_logged']}, syncs in the window "
                 f"{result['syncs_during_run']} {result['failed_syncs']}", code=1)


def _counts(engines: str) -> list[int]:
    """--engines "1,2" -> [1, 2]; "" -> [0] (the gateway's embedded engine)."""
    try:
        counts = [int(x) for x in engines.split(",") if x.strip()] or [0]
    except ValueError:
        fail(f"--engines: expected comma-separated engine counts such as 1,2, got {engines!r}")
    if any(n < 0 for n in counts):
        fail(f"--engines: counts must be >= 0 (0: the gateway's embedded engine), got {engines!r}")
    return counts


@bench_app.command("train")
def bench_train(
    models: ModelsOpt = "tiny,smollm2-135m",
    repeats: Annotated[int, typer.Option(min=1, help="Timed repeats (best is reported, median beside it).")] = 3,
    backend: Annotated[Literal["torch", "megatron"], typer.Option(help="The trainer backend whose PPO step is timed.")]
    = "torch",
    batch_size: Annotated[int, typer.Option(min=1, help="Sequences per step.")] = 8,
    seq_len: Annotated[int, typer.Option(min=4, help="Tokens per sequence (half prompt, half output).")] = 256,
    parts: Annotated[str, typer.Option(help="Which parts to time: 'step', 'sync' or both ('step,sync'); a 4B "
                                            "model's step measures three trainers at once, its sync one.")]
    = "step,sync",
    device: DeviceOpt = None,
    out: OutOpt = REPORT,
    config: ConfigOpt = None,
) -> None:
    """(a) PPO step tokens/s (and MFU on a GPU) vs a plain HF step; (b) weight-sync time vs its bound."""
    from clawrl.bench.sync import run_sync_bench
    from clawrl.bench.train import format_train_section, run_train_bench

    s = settings_or_exit(config)
    chosen = set(_split(parts))
    if not chosen or chosen - {"step", "sync"}:
        fail(f"--parts {parts!r}: name 'step', 'sync' or both, comma-separated")
    kw = dict(cache_dir=s.storage.models_dir, repeats=repeats, device=_device(device))
    with _status("train bench") as progress:
        train_rows = run_train_bench(_split(models), progress=progress, backend=backend, batch_size=batch_size,
                                     seq_len=seq_len, **kw) if "step" in chosen else []
        sync_rows = run_sync_bench(_split(models), progress=progress, **kw) if "sync" in chosen else []
    _write("train", format_train_section(train_rows, sync_rows), out)


def _model_dir_or_fail(path: Path) -> None:
    """``--versus`` must hold a model: an HF config and its weights (training prunes the weights of
    older checkpoints; their trainer.json stays)."""
    if not (path / "config.json").is_file():
        fail(f"--versus {path}: not an HF model directory (no config.json)")
    if not any(path.glob("*.safetensors")) and not (path / "pytorch_model.bin").is_file():
        fail(f"--versus {path}: no weights in it (no *.safetensors): the trainer keeps the weights of the newest 3 "
             f"checkpoints and of those the promotion gate serves or may roll back to; older ones keep only trainer.json")


@bench_app.command("tools")
def bench_tools(
    versus: Annotated[Path, typer.Option(help="The checkpoint (an HF directory, e.g. <run>/checkpoints/v000016) "
                                              "compared with the config's model.")],
    samples: Annotated[int, typer.Option(min=1, help="Answers to each held-out task, per version.")] = 8,
    heldout: Annotated[int, typer.Option(min=2, help="Held-out tasks: half tool tasks, half plain questions.")] = 24,
    unseen: Annotated[int, typer.Option(
        min=0, help="Plain questions the scenario never asks (28 in all), also "
                    "answered: plain_quality_unseen; 0: none.")] = 28,
    seed: Annotated[int, typer.Option(help="The demo's seed: which tasks are held out.")] = 0,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens per answer.")] = 64,
    out: OutOpt = REPORT,
    config: ConfigOpt = None,
) -> None:
    """The tools scenario's held-out split answered by the config's model and by VERSUS, many answers
    each, compared per task (use the run's config, e.g. -c conf/demo-tools.toml)."""
    from clawrl.bench.common import machine_line
    from clawrl.bench.tools_eval import answer_rows, compare, format_section
    from clawrl.models import resolve_device, resolve_dtype, resolve_model_dir

    s = settings_or_exit(config)
    _model_dir_or_fail(versus)
    base = resolve_model_dir(s.model.name, s.storage.models_dir, s.model.seed)
    answers = []
    with _status("tools comparison") as progress:
        for label, model_dir in (("base", base), ("versus", versus)):
            answers.append(answer_rows(s, model_dir, samples=samples, heldout=heldout, seed=seed,
                                       max_tokens=max_tokens, unseen=unseen))
            progress(f"{label}: {len(answers[-1])} answers")
    device, _ = resolve_device(s.model.device)
    rows = compare(*answers, tolerance=s.gate.tolerance, alpha=s.gate.alpha)
    section = format_section(rows, (s.model.name, versus.name), samples=samples,
                             machine=machine_line(device, resolve_dtype(s.model.dtype, device)))
    _write("tools-eval", section, out)


@bench_app.command("bfcl")
def bench_bfcl(
    versus: Annotated[list[Path], typer.Option(help="A checkpoint (an HF directory, e.g. <run>/checkpoints/v000016) or "
                                                    "model directory compared with the config's model; repeat it to "
                                                    "compare several.")],
    categories: Annotated[str, typer.Option(help="Comma-separated BFCL categories (default: every offline one).")] = "",
    per_category: Annotated[int, typer.Option(min=0, help="Prompts per category, drawn with --seed; 0: all.")] = 0,
    seed: Annotated[int, typer.Option(help="Which prompts --per-category draws.")] = 0,
    root: Annotated[Optional[Path], typer.Option(help="Folder for BFCL's answers and scores (default: a new one under "
                                                      "the data root); a model already answered there on the same "
                                                      "prompts is read again, not asked again.")] = None,
    out: OutOpt = REPORT,
    config: ConfigOpt = None,
) -> None:
    """The config's model and each VERSUS on BFCL's offline categories, generated and scored by BFCL
    itself in its own environment (`make bfcl`); per category each one's accuracy and whether it is
    worse than the config's model by the promotion gate's rule."""
    import datetime as dt

    from rich.progress import Progress

    from clawrl.bench.bfcl import OFFLINE_CATEGORIES, compare, format_section, format_table, pinned, run_bfcl_bench
    from clawrl.bench.common import machine_line
    from clawrl.models import resolve_device, resolve_dtype, resolve_model_dir
    from clawrl.sim.bfcl import BfclMissing, bfcl_python

    s = settings_or_exit(config)
    try:
        bfcl_python()
    except BfclMissing as e:
        fail(str(e))
    for v in versus:
        _model_dir_or_fail(v)
    chosen = _split(categories) or OFFLINE_CATEGORIES
    if unknown := [c for c in chosen if c not in OFFLINE_CATEGORIES]:
        fail(f"--categories: {', '.join(unknown)} not among BFCL's offline categories ({', '.join(OFFLINE_CATEGORIES)})")
    names = {"base": s.model.name, **{f"versus{i}": _version_name(v) for i, v in enumerate(versus, 1)}}
    sides = [("base", resolve_model_dir(s.model.name, s.storage.models_dir, s.model.seed)),
             *((f"versus{i}", v.resolve()) for i, v in enumerate(versus, 1))]
    root = root or s.storage.data_root / "bench" / dt.datetime.now().strftime("bfcl-%Y%m%d-%H%M%S")
    with Progress(console=console) as bar:
        tasks = {label: bar.add_task(f"BFCL {names[label]}", total=None) for label, _ in sides}
        got = run_bfcl_bench(s, sides, root, categories=chosen, per_category=per_category, seed=seed,
                             progress=lambda label, n, total: bar.update(tasks[label], completed=n, total=total))
    kw = dict(tolerance=s.gate.tolerance, alpha=s.gate.alpha)
    tables = [format_table(compare(got["verdicts"]["base"], got["verdicts"][label], **kw), (names["base"], names[label]),
                           {c: (got["errors"]["base"][c], got["errors"][label][c]) for c in got["ids"]})
              for label, _ in sides[1:]]
    device, _ = resolve_device(s.model.device)
    _write("bfcl", format_section(tables, machine=machine_line(device, resolve_dtype(s.model.dtype, device)),
                                  pins=pinned(), per_category=per_category, seed=seed, **kw), out)
    console.print(f"BFCL's answers and scores: {root}", markup=False)


def _version_name(model_dir: Path) -> str:
    """How a table names a model directory: ``<run>/v000016`` for a checkpoint of a run, else its name."""
    d = model_dir.resolve()
    return f"{d.parent.parent.name}/{d.name}" if d.parent.name == "checkpoints" else d.name
