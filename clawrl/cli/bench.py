"""`clawrl bench engine|gateway|judge|train|load`: measure, print, and rewrite a section of docs/benchmarks.md."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from clawrl.cli.common import ConfigOpt, bench_app, console, fail, settings_or_exit

OutOpt = Annotated[Path, typer.Option(help="Markdown report to update.")]


def _split(text: str, cast=str) -> tuple:
    """'1, 4,16' -> (1, 4, 16): a comma-separated option, blanks dropped."""
    return tuple(cast(x.strip()) for x in text.split(",") if x.strip())


def _progress_bar(*columns):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn(*columns), TimeElapsedColumn(),
                    console=console)


@bench_app.command("engine")
def bench_engine(
    models: Annotated[str, typer.Option(help="Comma-separated model names.")] = "tiny,smollm2-135m",
    concurrency: Annotated[str, typer.Option(help="Comma-separated engine concurrencies.")] = "1,4,16",
    hf_batch: Annotated[str, typer.Option(help="Comma-separated HF generate batch sizes ('' = skip).")] = "1,16",
    new_tokens: Annotated[int, typer.Option(help="Tokens per request (greedy, ignore_eos).")] = 32,
    repeats: Annotated[int, typer.Option(help="Interleaved passes; each row keeps its best.")] = 3,
    out: Annotated[Path, typer.Option(help="Markdown file whose engine section is rewritten.")] = Path("docs/benchmarks.md"),
    config: ConfigOpt = None,
) -> None:
    """Embedded-engine tokens/s at several concurrencies vs HF generate; writes docs/benchmarks.md."""
    from clawrl.bench.engine import count_bench_runs, format_engine_rows, run_engine_bench, write_engine_results_markdown

    names, conc, hf = _split(models), _split(concurrency, int), _split(hf_batch, int)
    s = settings_or_exit(config)
    with _progress_bar("{task.completed}/{task.total}") as bar:
        task = bar.add_task("engine bench", total=count_bench_runs(names, conc, hf, repeats))
        rows = run_engine_bench(names, conc, new_tokens, cache_dir=s.storage.models_dir, hf_batch_sizes=hf,
                                repeats=repeats, progress=lambda label: bar.update(task, advance=1, description=label))
    typer.echo(format_engine_rows(rows))
    write_engine_results_markdown(rows, out)
    console.print(f"wrote {out}", markup=False)


@bench_app.command("gateway")
def bench_gateway(
    requests: Annotated[int, typer.Option(help="Requests per path at concurrency <= 4 (p99 of 2,000 = the 20th "
                                                "worst); concurrency c > 4 takes c/4 times as many.")] = 2000,
    concurrency: Annotated[str, typer.Option(help="Comma-separated concurrencies.")] = "1,16",
    append_turns: Annotated[int, typer.Option(help="Turns for the session-log append rate.")] = 200_000,
    out: OutOpt = Path("docs/benchmarks.md"),
    config: ConfigOpt = None,
) -> None:
    """Gateway latency added over a direct engine call (p50/p99) and the session-log append rate."""
    from clawrl.bench.gateway import format_gateway_section, run_gateway_bench
    from clawrl.bench.report import machine_line, write_section

    s = settings_or_exit(config)
    with console.status("gateway bench: engine + gateway processes, then the append rate") as status:
        result = run_gateway_bench(model_cache=s.storage.models_dir, concurrencies=_split(concurrency, int),
                                   n=requests, append_turns=append_turns,
                                   progress=lambda what: status.update(f"gateway bench: {what}"))
    section = format_gateway_section(result, machine_line())
    typer.echo(section)
    write_section("gateway", section, out)
    console.print(f"wrote {out}", markup=False)


@bench_app.command("judge")
def bench_judge(
    models: Annotated[str, typer.Option(help="Comma-separated model names.")] = "tiny,smollm2-135m",
    turns: Annotated[int, typer.Option(help="Turns judged per concurrency.")] = 32,
    judge_samples: Annotated[int, typer.Option(help="PRM votes per turn.")] = 1,
    max_tokens: Annotated[int, typer.Option(help="Tokens per vote.")] = 32,
    out: OutOpt = Path("docs/benchmarks.md"),
    config: ConfigOpt = None,
) -> None:
    """Turns judged per second with the embedded engine as judge, concurrency 1 vs 16."""
    from clawrl.bench.judge import format_judge_section, run_judge_bench
    from clawrl.bench.report import machine_line, write_section

    s = settings_or_exit(config)
    with console.status("judge bench"):
        rows = run_judge_bench(_split(models), cache_dir=s.storage.models_dir, n_turns=turns,
                               judge_samples=judge_samples, max_tokens=max_tokens)
    section = format_judge_section(rows, machine_line(), max_tokens)
    typer.echo(section)
    write_section("judge", section, out)


@bench_app.command("load")
def bench_load(
    sessions: Annotated[int, typer.Option(help="Concurrent simulated users (one session at a time each).")] = 64,
    duration: Annotated[float, typer.Option(help="Seconds of load (the window syncs are counted in).")] = 60.0,
    rollout_batch_size: Annotated[int, typer.Option(help="Samples per PPO step (small: steps happen in the window).")] = 8,
    max_tokens: Annotated[int, typer.Option(help="New tokens per turn.")] = 16,
    turns: Annotated[int, typer.Option(help="Main turns per session.")] = 3,
    min_syncs: Annotated[int, typer.Option(help="Keep the load on past --duration until this many weight syncs "
                                                 "were served (at most 4x --duration + 240 s).")] = 1,
    out: OutOpt = Path("docs/benchmarks.md"),
    config: ConfigOpt = None,
) -> None:
    """Concurrent sessions against `clawrl serve` while the judge and train flows run and sync weights."""
    from clawrl.bench.load import format_load_section, run_load_bench
    from clawrl.bench.report import machine_line, write_section
    from clawrl.config import use_prefect_home

    s = settings_or_exit(config)
    use_prefect_home(s.storage.data_root / "prefect")  # flow runs of the bench show in that Prefect UI
    with _progress_bar("{task.fields[line]}") as bar:
        task = bar.add_task("load (warming up)", total=duration, line="")

        def progress(p: dict) -> None:
            bar.update(task, completed=p["elapsed_s"], description="load", line=(
                f"{p['requests']} requests, {p['errors']} errors, syncs {p['syncs']}, "
                f"versions served {','.join(p['versions']) or '-'}"))

        result = run_load_bench(model_cache=s.storage.models_dir, sessions=sessions, duration_s=duration,
                                rollout_batch_size=rollout_batch_size, max_tokens=max_tokens,
                                turns_per_session=turns, min_syncs=min_syncs, progress=progress)
    section = format_load_section(result, machine_line(result["machine"]))
    typer.echo(section)
    write_section("load", section, out)
    console.print(f"wrote {out} (run data: {result['data_root']})", markup=False)
    ok = (result["errors"] == 0 and result["sent_not_logged"] == 0 and result["main_turns_sent"] == result["main_turns_logged"]
          and result["syncs_during_run"] >= 1)
    if not ok:
        fail(f"load bench FAILED its checks: errors {result['errors']} {result['error_samples']}, sent "
             f"{result['main_turns_sent']} vs logged {result['main_turns_logged']}, syncs in the window "
             f"{result['syncs_during_run']} {result['failed_syncs']}", code=1)


@bench_app.command("train")
def bench_train(
    models: Annotated[str, typer.Option(help="Comma-separated model names.")] = "tiny,smollm2-135m",
    repeats: Annotated[int, typer.Option(help="Timed repeats (best is reported, median beside it).")] = 3,
    out: OutOpt = Path("docs/benchmarks.md"),
    config: ConfigOpt = None,
) -> None:
    """(a) PPO step tokens/s vs a plain HF step; (b) weight-sync time vs its bound (CPU)."""
    from clawrl.bench.report import machine_line, markdown_table, write_section
    from clawrl.bench.sync import run_sync_bench
    from clawrl.bench.train import run_train_bench

    s = settings_or_exit(config)
    names = _split(models)
    with console.status("train bench: PPO step vs plain HF step"):
        train_rows = run_train_bench(names, cache_dir=s.storage.models_dir, repeats=repeats)
    with console.status("sync bench: in-process copy and safetensors save+load vs their bounds"):
        sync_rows = run_sync_bench(names, cache_dir=s.storage.models_dir, repeats=repeats)
    section = "\n".join([
        "## Training step and weight sync (CPU)", "", machine_line(),
        "(a) One PPO step (`TorchBackend.train_step`, 8 x 256 tokens, one micro-batch) vs a plain HF",
        "forward + backward + AdamW step of the same batch (the bound). `ppo_step` includes the KL",
        "reference forward (kl_coef > 0, the default); `ppo_step_no_ref` is the step without it.",
        "Target: vs_bound >= 0.8.", "",
        markdown_table(train_rows, ["model", "what", "threads", "seconds", "seconds_median", "tokens_per_s", "vs_bound"]),
        "", "(b) Weight sync into an idle embedded engine vs its bound (target <= 1.5x): `in_process` =",
        "pause -> state-dict copy -> continue vs copying the same tensors; `disk_sync` = checkpoint save +",
        "`update_weights_from_disk` vs safetensors save_file + load_file of the same state dict.", "",
        markdown_table(sync_rows, ["model", "path", "bytes", "seconds", "seconds_median", "bound_seconds", "vs_bound",
                                   "load_1m"]),
    ])
    typer.echo(section)
    write_section("train", section, out)
