"""The one command line: ``clawrl <command>``. Each command loads Settings once and calls the library."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from clawrl.config import ConfigError, Settings, apply_offline_env, dump_toml, load_settings

apply_offline_env()

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, help="Online RL for live agent conversations.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect the effective configuration.")
app.add_typer(config_app, name="config")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks; results go to docs/benchmarks.md.")
app.add_typer(bench_app, name="bench")

console = Console()
err = Console(stderr=True)

ConfigOpt = Annotated[
    Optional[Path], typer.Option("--config", "-c", help="TOML overlay on conf/default.toml.")
]


def settings_or_exit(config: Path | None, overrides: dict | None = None) -> Settings:
    try:
        return load_settings(config, overrides=overrides)
    except ConfigError as e:
        err.print(f"config error: {e}", markup=False, highlight=False, style="red", soft_wrap=True)
        raise typer.Exit(2) from None


@config_app.command("show")
def config_show(config: ConfigOpt = None) -> None:
    """Print the effective configuration (defaults + --config + CLAWRL__SECTION__KEY env)."""
    typer.echo(dump_toml(settings_or_exit(config)))


@app.command("serve")
def serve(
    config: ConfigOpt = None,
    host: Annotated[Optional[str], typer.Option(help="Bind address (default [server] host).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port (default [server] api_port).")] = None,
) -> None:
    """Start the OpenAI-compatible gateway in front of the engine named in [engine]."""
    import uvicorn

    from clawrl.gateway.routes import create_app

    overrides = {k: v for k, v in {"server.host": host, "server.api_port": port}.items() if v is not None}
    settings = settings_or_exit(config, overrides)
    from clawrl.storage.writer import DataRootError

    try:
        app = create_app(settings)
    except ConfigError as e:
        err.print(f"config error: {e}", markup=False, style="red")
        raise typer.Exit(2) from None
    except DataRootError as e:  # checked before any model loads or any port is bound
        err.print(f"storage error: {e}", markup=False, highlight=False, style="red", soft_wrap=True)
        raise typer.Exit(2) from None
    console.print(f"gateway on http://{settings.server.host}:{settings.server.api_port}/v1 "
                  f"(engine: {settings.engine.kind}, model: {settings.model.name}, "
                  f"data: {settings.storage.data_root})", markup=False)
    from clawrl.serving import freeze_startup_heap

    freeze_startup_heap()  # the model and modules are loaded: keep them out of full GC passes
    uvicorn.run(app, host=settings.server.host, port=settings.server.api_port, log_level="warning")


@app.command("engine")
def engine(
    model: Annotated[Optional[str], typer.Option(help="Model name or HF directory (default: model.name).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port (default: engine.port).")] = None,
    host: Annotated[Optional[str], typer.Option(help="Bind address (default: server.host).")] = None,
    config: ConfigOpt = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Start from the checkpoint of the last successful weight sync recorded under the data "
                         "root (its sha256 checked), not the base model: a restarted engine serves the last good "
                         "version, never one whose load it died in.")] = False,
) -> None:
    """Serve the embedded engine over SGLang's native HTTP API (weight_version starts at "0", or with
    --resume at the last version synced successfully)."""
    from clawrl.config import resolve_device
    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.engine.server import serve_engine
    from clawrl.models import ModelNotFoundError, resolve_model_dir

    overrides = {k: v for k, v in {"model.name": model, "engine.port": port, "server.host": host}.items()
                 if v is not None}
    s = settings_or_exit(config, overrides)
    device, device_reason = resolve_device(s.model.device)
    try:
        model_dir = resolve_model_dir(s.model.name, s.storage.models_dir, seed=s.model.seed)
    except ModelNotFoundError as e:
        err.print(f"model error: {e}", markup=False, style="red", soft_wrap=True)
        raise typer.Exit(2) from None
    version = "0"
    if resume:
        from clawrl.checkpoint import CheckpointError, verify_checkpoint
        from clawrl.storage.catalog import last_synced_checkpoint, open_catalog

        con = open_catalog(s.storage.data_root)
        try:
            last = last_synced_checkpoint(con)
        finally:
            con.close()
        try:
            if last is not None:
                verify_checkpoint(last["path"], last["sha256"])
                model_dir, version = Path(last["path"]), str(last["weight_version"])
        except CheckpointError as e:
            err.print(f"not resuming version {last['weight_version']}: {e}; serving the base model (version 0)",
                      markup=False, style="red", soft_wrap=True)
    try:
        eng = EmbeddedEngine(model_dir, dtype=s.model.dtype, device=device, max_batch_size=s.engine.max_batch_size,
                             max_context_len=s.engine.max_context_len, weight_version=version,
                             served_model_name=s.server.served_model_name, worker_cpus=s.engine.worker_cpus)
    except ConfigError as e:
        err.print(f"config error: {e}", markup=False, style="red")
        raise typer.Exit(2) from None
    console.print(f"engine on http://{s.server.host}:{s.engine.port} (SGLang API; model: {model_dir}, "
                  f"weight_version {version}, device: {device} [{device_reason}], dtype: {s.model.dtype})",
                  markup=False, soft_wrap=True)
    from clawrl.serving import freeze_startup_heap

    freeze_startup_heap()  # model loaded: keep it out of full GC passes
    serve_engine(eng, s.server.host, s.engine.port, model_path=str(model_dir),
                 served_model_name=s.server.served_model_name, max_context_len=s.engine.max_context_len,
                 max_running_requests=s.engine.max_batch_size, log_level="warning")


class SqlFormat(str, Enum):
    TABLE = "table"
    CSV = "csv"
    JSON = "json"
    PARQUET = "parquet"


@app.command("sql")
def sql(
    query: Annotated[str, typer.Argument(help="SQL over the views turns, next_states, judgments, samples, "
                                               "turn_fate, batches, checkpoints, syncs, judgment_attempts "
                                               "(storage/catalog.py).")],
    fmt: Annotated[SqlFormat, typer.Option("--format", "-f", help="parquet needs --out.")] = SqlFormat.TABLE,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the result to this file.")] = None,
    config: ConfigOpt = None,
) -> None:
    """Query the recorded data with DuckDB, read-only: queries only, no file access outside the tables."""
    import duckdb
    from rich.table import Table
    from rich.text import Text

    from clawrl.storage.catalog import ReadOnlyQueryError, export_table, format_cell, run_query

    if fmt is SqlFormat.PARQUET and out is None:
        err.print("--format parquet needs --out FILE", markup=False)
        raise typer.Exit(2)
    data_root = settings_or_exit(config).storage.data_root
    try:
        result = run_query(data_root, query, read_only=True)  # --out is written below, by clawrl
    except (duckdb.Error, ReadOnlyQueryError) as e:
        err.print(str(e), markup=False, highlight=False, style="red", soft_wrap=True)
        raise typer.Exit(2) from None
    if fmt is not SqlFormat.TABLE:
        text = export_table(result, fmt.value, out)
        if text is not None:
            typer.echo(text, nl=False)
        return
    view = Table(caption=f"{result.num_rows} rows")
    for name in result.column_names:
        view.add_column(Text(name))
    for row in result.to_pylist():
        # Token and log-prob lists are long: cut cells so the table stays readable. Text, not
        # markup: a "[red]" inside recorded text must print as is.
        view.add_row(*(Text(_cut(format_cell(v), 80)) for v in row.values()))
    if out is None:
        console.print(view)
    else:
        with out.open("w") as f:
            Console(file=f, width=200).print(view)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


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
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from clawrl.bench.engine import count_bench_runs, format_engine_rows, run_engine_bench, write_engine_results_markdown

    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split(",") if x.strip())

    names = tuple(m.strip() for m in models.split(",") if m.strip())
    conc, hf = ints(concurrency), ints(hf_batch)
    s = settings_or_exit(config)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as bar:
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
    out: Annotated[Path, typer.Option(help="Markdown report to update.")] = Path("docs/benchmarks.md"),
    config: ConfigOpt = None,
) -> None:
    """Gateway latency added over a direct engine call (p50/p99) and the session-log append rate."""
    from clawrl.bench.gateway import format_gateway_section, run_gateway_bench
    from clawrl.bench.report import machine_line, write_section

    s = settings_or_exit(config)
    conc = tuple(int(x) for x in concurrency.split(",") if x.strip())
    with console.status("gateway bench: engine + gateway processes, then the append rate") as status:
        result = run_gateway_bench(model_cache=s.storage.models_dir, concurrencies=conc, n=requests,
                                   append_turns=append_turns,
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
    out: Annotated[Path, typer.Option(help="Markdown report to update.")] = Path("docs/benchmarks.md"),
    config: ConfigOpt = None,
) -> None:
    """Turns judged per second with the embedded engine as judge, concurrency 1 vs 16."""
    from clawrl.bench.judge import format_judge_section, run_judge_bench
    from clawrl.bench.report import machine_line, write_section

    s = settings_or_exit(config)
    names = tuple(m.strip() for m in models.split(",") if m.strip())
    with console.status("judge bench"):
        rows = run_judge_bench(names, cache_dir=s.storage.models_dir, n_turns=turns, judge_samples=judge_samples,
                               max_tokens=max_tokens)
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
    out: Annotated[Path, typer.Option(help="Markdown report to update.")] = Path("docs/benchmarks.md"),
    config: ConfigOpt = None,
) -> None:
    """Concurrent sessions against `clawrl serve` while the judge and train flows run and sync weights."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from clawrl.bench.load import format_load_section, run_load_bench
    from clawrl.bench.report import machine_line, write_section
    from clawrl.config import use_prefect_home

    s = settings_or_exit(config)
    use_prefect_home(s.storage.data_root / "prefect")  # flow runs of the bench show in that Prefect UI
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[line]}"),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("load (warming up)", total=duration, line="")

        def progress(p: dict) -> None:
            bar.update(task, completed=p["elapsed_s"], description="load", line=(
                f"{p['requests']} requests, {p['errors']} errors, syncs {p['syncs']}, "
                f"versions served {','.join(p['versions']) or '-'}"))

        result = run_load_bench(model_cache=s.storage.models_dir, sessions=sessions, duration_s=duration,
                                rollout_batch_size=rollout_batch_size, max_tokens=max_tokens,
                                turns_per_session=turns, progress=progress)
    section = format_load_section(result, machine_line(result["machine"]))
    typer.echo(section)
    write_section("load", section, out)
    console.print(f"wrote {out} (run data: {result['data_root']})", markup=False)
    ok = (result["errors"] == 0 and result["sent_not_logged"] == 0 and result["main_turns_sent"] == result["main_turns_logged"]
          and result["syncs_during_run"] >= 1)
    if not ok:
        err.print(f"load bench FAILED its checks: errors {result['errors']} {result['error_samples']}, sent "
                  f"{result['main_turns_sent']} vs logged {result['main_turns_logged']}, syncs in the window "
                  f"{result['syncs_during_run']} {result['failed_syncs']}", markup=False, style="red", soft_wrap=True)
        raise typer.Exit(1)


@bench_app.command("train")
def bench_train(
    models: Annotated[str, typer.Option(help="Comma-separated model names.")] = "tiny,smollm2-135m",
    repeats: Annotated[int, typer.Option(help="Timed repeats (best is reported, median beside it).")] = 3,
    out: Annotated[Path, typer.Option(help="Markdown report to update.")] = Path("docs/benchmarks.md"),
    config: ConfigOpt = None,
) -> None:
    """(a) PPO step tokens/s vs a plain HF step; (b) weight-sync time vs its bound (CPU)."""
    from clawrl.bench.report import machine_line, markdown_table, write_section
    from clawrl.bench.sync import run_sync_bench
    from clawrl.bench.train import run_train_bench

    s = settings_or_exit(config)
    names = tuple(m.strip() for m in models.split(",") if m.strip())
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


@app.command("judge")
def judge(
    config: ConfigOpt = None,
    limit: Annotated[Optional[int], typer.Option(help="Most turns to judge (default [prm] batch_limit).")] = None,
) -> None:
    """Judge every ready turn now (the Prefect flow `judge`, run directly), then print the status."""
    settings_or_exit(config)
    from clawrl.flows.judge import judge_flow

    out = judge_flow(config_path=str(config) if config else None, limit=limit)
    console.print(f"judged {out['judged']} turns: {out['fates']}", markup=False)
    _print_status(out["status"], out["judge_config_hash"])


@app.command("status")
def status(config: ConfigOpt = None) -> None:
    """Turns pending judgment, judged, trainable samples vs rollout_batch_size, exclusion reasons."""
    s = settings_or_exit(config)
    from clawrl.judge.runner import build_judge_config_hash
    from clawrl.storage.catalog import open_catalog, pending_counts, sync_state

    chash = build_judge_config_hash(s)
    con = open_catalog(s.storage.data_root)
    try:
        counts = pending_counts(con, chash, s.ppo.rollout_batch_size)
        versions = con.sql("SELECT weight_version, step FROM checkpoints ORDER BY step DESC LIMIT 1").fetchall()
        syncs = sync_state(con)
    finally:
        con.close()
    _print_status(counts, chash, versions[0] if versions else None)
    _print_sync_status(syncs)


def _print_sync_status(st: dict) -> None:
    """One line on weight sync, e.g. 'last sync: FAILED at <time> (version 4 -> URL): <reason>;
    serving version 3; checkpoint 4 waiting'. Plain text, never wrapped: scripts grep it."""
    last = st["last"]
    if last is None:
        console.print("last sync: none recorded", markup=False, highlight=False)
        return
    when = last["created_at"].strftime("%Y-%m-%d %H:%M:%S UTC")
    head = (f"last sync: ok at {when} (version {last['weight_version']} -> {last['target']})" if last["ok"] else
            f"last sync: FAILED at {when} (version {last['weight_version']} -> {last['target']}): {last['error']}")
    serving = st["serving"] if st["serving"] is not None else (
        f"unknown (the engine did not answer; last seen serving {st['last_seen_serving']})")
    parts = [head, f"serving version {serving}"]
    if st["waiting"]:
        parts.append(f"checkpoint{'s' if len(st['waiting']) > 1 else ''} {', '.join(st['waiting'])} waiting")
    parts.append(f"{st['attempts']} sync attempts, {st['failures']} failed")
    console.print("; ".join(parts), markup=False, highlight=False, soft_wrap=True)


@app.command("train")
def train(
    config: ConfigOpt = None,
    steps: Annotated[int, typer.Option(help="Most PPO steps to run (one per full batch).")] = 1,
    trainer_url: Annotated[Optional[str], typer.Option(help="A `clawrl trainer` service (default: train here).")] = None,
    engine_url: Annotated[Optional[str], typer.Option(help="Engine to sync (default: [engine] url when kind=http).")] = None,
) -> None:
    """Run the Prefect flow `train` directly: claim a full batch, step, checkpoint, log lineage, sync."""
    settings_or_exit(config)
    from clawrl.flows.train import train_flow

    out = train_flow(config_path=str(config) if config else None, max_steps=steps, trainer_url=trainer_url,
                     engine_url=engine_url)
    if not out["steps"]:
        console.print("no full batch of trainable samples yet (see `clawrl status`)")
    for st in out["steps"]:
        m = st["metrics"]
        console.print(f"step {st['step']}: weight_version {st['weight_version']}, loss {m.get('loss', float('nan')):.4f}, "
                      f"{int(m.get('num_seqs', 0))} samples, checkpoint {st['path']}, sync: {st['sync']['message'] or 'ok'}",
                      markup=False)


@app.command("sync")
def sync(
    version: Annotated[str, typer.Argument(help="Weight version to push (default: the latest checkpoint).")] = "latest",
    config: ConfigOpt = None,
    engine_url: Annotated[Optional[str], typer.Option(help="SGLang server or `clawrl engine` URL.")] = None,
) -> None:
    """Push a checkpoint to an HTTP engine: pause -> update_weights_from_disk -> continue."""
    s = settings_or_exit(config)
    url = engine_url or (s.engine.url if s.engine.kind == "http" else None)
    if not url:
        err.print("no engine URL: pass --engine-url or set engine.kind = 'http' and engine.url", style="red")
        raise typer.Exit(2)
    from clawrl import runtime
    from clawrl.config import read_admin_key
    from clawrl.flows.common import record_sync
    from clawrl.sync import sync_checkpoint
    from clawrl.storage.catalog import open_catalog

    con = open_catalog(s.storage.data_root)
    try:
        where = "ORDER BY step DESC LIMIT 1" if version == "latest" else "WHERE weight_version = $v LIMIT 1"
        rows = con.sql(f"SELECT weight_version, path, sha256, mlflow_run_id FROM checkpoints {where}",
                       params={} if version == "latest" else {"v": version}).fetchall()
    finally:
        con.close()
    if not rows:
        err.print(f"no checkpoint for version {version!r} in {s.storage.data_root}", style="red", markup=False)
        raise typer.Exit(2)
    v, path, sha256, run_id = rows[0]
    rep = runtime.run(sync_checkpoint(v, path, sha256, url=url, admin_key=read_admin_key(s.server.admin_keys_env),
                                      timeout_s=s.engine.request_timeout_s))
    # recorded like the train flow's attempts (flushed: `clawrl status` and MLflow show it at once)
    record_sync(s, rep, weight_version=v, target=rep.target, checkpoint_path=rep.checkpoint_path, run_id=run_id,
                started_at=rep.started_at)
    console.print(f"{'synced' if rep.success else 'FAILED'}: engine serves version {rep.weight_version} "
                  f"({rep.message}, {rep.seconds:.2f} s)", markup=False)
    raise typer.Exit(0 if rep.success else 1)


@app.command("lineage")
def lineage(
    version: Annotated[str, typer.Argument(help="A weight version, e.g. 3.")],
    config: ConfigOpt = None,
) -> None:
    """What trained a version: its batches -> sessions -> turns, with MLflow runs and checkpoint hashes."""
    s = settings_or_exit(config)
    from rich.tree import Tree

    from clawrl.storage.catalog import lineage_chain, open_catalog

    con = open_catalog(s.storage.data_root)
    try:
        chain = lineage_chain(con, version)
    finally:
        con.close()
    if not chain:
        err.print(f"no checkpoint with weight_version {version!r} in {s.storage.data_root}", style="red",
                  markup=False)
        raise typer.Exit(2)
    tree = Tree(f"weight_version {version} (from version 0 = {s.model.name})")
    for c in chain:
        node = tree.add(f"v{c['weight_version']} <- v{c['parent_version']}: batch {c['batch_id']} "
                        f"({len(c['sample_ids'])} samples, {c['method']}), mlflow run {c['mlflow_run_id']}, "
                        f"sha256 {c['sha256'][:12]}")
        for sid in c["session_ids"]:
            node.add(f"session {sid}")
        node.add(f"turns: {', '.join(t[:8] for t in c['turn_ids'])}")
    console.print(tree, markup=False)


@app.command("trainer")
def trainer_service(
    config: ConfigOpt = None,
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 30020,
) -> None:
    """Run the long-lived trainer service (model + optimizer stay in memory between flow runs)."""
    s = settings_or_exit(config)
    import uvicorn

    from clawrl.train.trainer import trainer_from_settings
    from clawrl.trainer_service import create_trainer_app

    tr = trainer_from_settings(s)
    console.print(f"trainer at http://{host}:{port} (weight_version {tr.weight_version}, backend {s.ppo.backend})",
                  markup=False)
    uvicorn.run(create_trainer_app(tr, s.storage.data_root), host=host, port=port, log_level="warning")


@app.command("up")
def up(
    config: ConfigOpt = None,
    prefect_port: Annotated[int, typer.Option(help="Prefect UI/API port.")] = 4200,
    mlflow_port: Annotated[int, typer.Option(help="MLflow UI port.")] = 5000,
    trainer_port: Annotated[int, typer.Option(help="Trainer service port.")] = 30020,
    judge_every: Annotated[float, typer.Option(help="Judge deployment interval, seconds (editable in the UI).")] = 20.0,
    train_every: Annotated[float, typer.Option(help="Train deployment safety-net interval, seconds.")] = 120.0,
) -> None:
    """Everything at once: gateway + engine, Prefect server and deployments, trainer, MLflow UI."""
    from clawrl.supervisor import run_up

    from clawrl.storage.writer import DataRootError, check_data_root

    s = settings_or_exit(config)
    try:  # before any service starts: a clear line, not a traceback from a child process
        check_data_root(s.storage.data_root)
    except DataRootError as e:
        err.print(f"storage error: {e}", markup=False, style="red", soft_wrap=True)
        raise typer.Exit(2) from None
    conf = config.resolve() if config else None
    if conf is None:  # the child processes read the same effective config from a file
        conf = s.storage.data_root / "up-config.toml"
        conf.write_text(dump_toml(s))
    try:
        run_up(s, conf, prefect_port=prefect_port, mlflow_port=mlflow_port, trainer_port=trainer_port,
               judge_every_s=judge_every, train_every_s=train_every, echo=lambda m: console.print(m, markup=False))
    except RuntimeError as e:
        err.print(str(e), markup=False, style="red")
        raise typer.Exit(1) from None


@app.command("replay")
def replay_cmd(
    version: Annotated[str, typer.Argument(help="Weight version to rebuild (1..N), 'latest', or an MLflow run id.")],
    config: ConfigOpt = None,
    exclude_session: Annotated[Optional[list[str]], typer.Option("--exclude-session", help="Leave this session's samples out (repeatable).")] = None,
    reason: Annotated[str, typer.Option(help="Why sessions are excluded (kept in the lineage).")] = "",
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Counterfactual SECTION.KEY=VALUE (repeatable).")] = None,
) -> None:
    """Re-run training from the logged samples, recorded config and seeds; compare checkpoint hashes."""
    from rich.table import Table

    s = settings_or_exit(config)
    if len(version) == 32 and not version.isdigit():  # an MLflow run id: the version it trained
        from clawrl.lineage import client

        try:
            version = client(s.storage.data_root).get_run(version).data.tags["weight_version"]
        except Exception as e:
            err.print(f"MLflow run {version!r}: {e}", markup=False, style="red")
            raise typer.Exit(2) from None
    for item in set_ or []:
        try:
            from clawrl.config import parse_override

            parse_override(item)
        except ConfigError as e:
            err.print(str(e), markup=False, style="red")
            raise typer.Exit(2) from None
    from clawrl.flows.replay import replay_flow

    try:
        report = replay_flow(config_path=str(config) if config else None, version=version,
                             exclude_sessions=exclude_session or [], reason=reason, set_overrides=set_ or [])
    except (ValueError, FileNotFoundError, ConfigError) as e:
        err.print(f"replay failed: {e}", markup=False, style="red")
        raise typer.Exit(2) from None
    t = Table(title=f"replay {report['replay_id']} of version {report['source_version']}")
    for col in ("step", "batch", "samples", "excluded", "original sha256", "replayed sha256", "identical"):
        t.add_column(col)
    for st in report["steps"]:
        t.add_row(str(st["step"]), st["batch_id"], str(st["samples"]), str(st["excluded_samples"]),
                  st["original_sha256"][:16], (st["replay_sha256"] or "-")[:16], str(st["identical"]))
    console.print(t)
    if report["identical"] is not None:
        console.print("checkpoints byte-identical: " + ("yes" if report["identical"] else "NO"), markup=False)
    console.print(f"replayed checkpoint: {report['final_path']} (MLflow run {report['mlflow_run_id']} in "
                  f"experiment clawrl-replays)", markup=False)
    raise typer.Exit(0 if report["identical"] is not False else 1)


@app.command("demo")
def demo(
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="Overlay (default conf/demo.toml).")] = None,
    steps: Annotated[int, typer.Option(help="Training steps (weight versions).")] = 16,
    users: Annotated[int, typer.Option(help="Simulated users per step.")] = 16,
    persona: Annotated[str, typer.Option(help="concise | signoff | lowercase | bullets | french")] = "concise",
    max_tokens: Annotated[int, typer.Option(help="Answer budget per turn.")] = 48,
    run_dir: Annotated[Optional[Path], typer.Option(help="Data root of this run (default: a new one).")] = None,
    model: Annotated[Optional[str], typer.Option(help="Model (default from the config).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the simulated users and evaluation.")] = 0,
    heldout: Annotated[int, typer.Option(help="Held-out questions scored after every step.")] = 24,
    eval_samples: Annotated[int, typer.Option(min=1, help="Answers scored per held-out question (distinct seeds).")] = 2,
    group_size: Annotated[int, typer.Option(min=1, help="Users per step asking the same question (for ppo.group_by = 'prompt').")] = 1,
) -> None:
    """The closed loop on CPU: simulated users -> gateway -> judge -> train -> sync, with a learning curve."""
    import datetime as dt

    from clawrl.config import REPO_CONF_DIR, use_prefect_home

    conf = config or REPO_CONF_DIR / "demo.toml"
    base = settings_or_exit(conf)
    root = run_dir or base.storage.data_root / "runs" / dt.datetime.now().strftime("demo-%Y%m%d-%H%M%S")
    overrides = {"storage.data_root": str(root), "storage.model_cache": str(base.storage.models_dir)}
    if model:
        overrides["model.name"] = model
    s = settings_or_exit(conf, overrides)
    root.mkdir(parents=True, exist_ok=True)
    run_conf = root / "config.toml"  # the flows read this; replay re-reads it
    run_conf.write_text(dump_toml(s))
    use_prefect_home(base.storage.data_root / "prefect")
    from clawrl import runtime
    from clawrl.config import resolve_device
    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.gateway.routes import create_app
    from clawrl.judge.runner import POLICY_ENGINE
    from clawrl.models import resolve_model_dir
    from clawrl.serving import serve_in_thread
    from clawrl.flows.common import data_store
    from clawrl.flows.loop import learning_loop

    with console.status(f"preparing {s.model.name} (first run converts the GGUF once)"):
        model_dir = resolve_model_dir(s.model.name, s.storage.models_dir, s.model.seed)
    device, _ = resolve_device(s.model.device)
    engine = EmbeddedEngine(model_dir, dtype=s.model.dtype, device=device, max_batch_size=s.engine.max_batch_size,
                            max_context_len=s.engine.max_context_len, served_model_name=s.server.served_model_name,
                            worker_cpus=s.engine.worker_cpus)
    runtime.register(POLICY_ENGINE, engine)  # the train flow syncs this engine in-process
    # the flows and the gateway share one store; settings are cached by config path in flows.common
    from clawrl.flows.common import load_flow_settings

    store = data_store(load_flow_settings(str(run_conf)))
    gw = serve_in_thread(create_app(s, engine=engine, tokenizer=engine.tokenizer, store=store))
    console.print(f"gateway (OpenAI API) on {gw.url}/v1, run data in {root}", markup=False)
    try:
        out = learning_loop(config_path=str(run_conf), gateway_url=gw.url, steps=steps, users=users,
                            persona=persona, max_tokens=max_tokens, seed=seed, heldout=heldout,
                            eval_samples=eval_samples, group_size=group_size)
    finally:
        gw.stop()
        runtime.unregister(POLICY_ENGINE)
        store.flush()
    rows = out["rows"]
    from rich.table import Table

    t = Table(title=f"held-out score per step (persona {persona})")
    for col in ("step", "score", "on-topic", "persona", "KL", "words"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["step"]), f"{r['score']:.3f}", f"{r['on_topic_rate']:.3f}", f"{r['persona_rate']:.3f}",
                  f"{r['kl']:.4f}", f"{r['mean_words']:.1f}")
    console.print(t)
    console.print(f"base score {rows[0]['score']:.3f} -> {rows[-1]['score']:.3f} after {len(rows) - 1} steps "
                  f"(best {max(r['score'] for r in rows):.3f}); on-topic {rows[0]['on_topic_rate']:.3f} -> "
                  f"{rows[-1]['on_topic_rate']:.3f}", markup=False)
    console.print(f"learning curve: {out['png']} (also in MLflow run {out['mlflow_run_id']})", markup=False)
    from clawrl.judge.runner import build_judge_config_hash
    from clawrl.storage.catalog import open_catalog, pending_counts

    con = open_catalog(s.storage.data_root)
    try:
        chash = build_judge_config_hash(s)
        _print_status(pending_counts(con, chash, s.ppo.rollout_batch_size), chash,
                      con.sql("SELECT weight_version, step FROM checkpoints ORDER BY step DESC LIMIT 1").fetchall()[0])
    finally:
        con.close()
    console.print("\nwhere to look:", markup=False)
    console.print(f"  clawrl status  -c {run_conf}\n  clawrl sql \"select * from turn_fate\" -c {run_conf}\n"
                  f"  clawrl lineage {len(rows) - 1} -c {run_conf}\n"
                  f"  Prefect UI: PREFECT_HOME={base.storage.data_root / 'prefect'} .venv/bin/prefect server start"
                  f"  -> http://127.0.0.1:4200 (flow runs 'learning-loop', 'judge', 'train')\n"
                  f"  MLflow UI:  .venv/bin/mlflow ui --backend-store-uri sqlite:///{root}/mlflow/mlflow.db"
                  f"  -> http://127.0.0.1:5000 (experiment 'clawrl', model 'clawrl-policy')\n"
                  f"  or `clawrl up -c {run_conf}` to bring up the gateway and both UIs on this run's data", markup=False)


def _print_status(c: dict, chash: str, latest: tuple | None = None) -> None:
    from rich.table import Table

    t = Table(title=f"clawrl status (judge config {chash})", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(justify="right")
    rows = [
        ("turns (main / side)", f"{c['turns']} ({c['main_turns']} / {c['side_turns']})"),
        ("awaiting next state", c["awaiting_next_state"]),
        ("pending judgment", c["pending_judgment"] + c["pending_no_next_state"]),
        ("judged", c["judged"]),
        ("trainable samples waiting", f"{c['trainable']} / rollout_batch_size {c['rollout_batch_size']}"),
        ("samples consumed by batches", f"{c['consumed']} in {c['batches']} batches"),
    ]
    if c["samples_needed"]:
        rows.append(("next training step needs", f"{c['samples_needed']} more samples"))
    if latest:
        rows.append(("latest checkpoint", f"weight_version {latest[0]} (step {latest[1]})"))
    for k, v in rows:
        t.add_row(k, str(v))
    for fate, n in sorted(c["fates"].items()):
        if fate != "sample":
            t.add_row(f"  excluded: {fate}", str(n))
    console.print(t)


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
