"""The long-running services: the gateway, the engine alone, the trainer, and all of them at once (`up`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from clawrl.cli.common import ConfigOpt, app, console, err, fail, settings_or_exit
from clawrl.config import ConfigError, dump_toml
from clawrl.gateway.agents import Agent
from clawrl.ports import SERVER_KEEPALIVE_S


@app.command("serve")
def serve(
    config: ConfigOpt = None,
    host: Annotated[Optional[str], typer.Option(help="Bind address (default [server] host).")] = None,
    port: Annotated[Optional[int], typer.Option(min=1, max=65535, help="Port (default [server] api_port).")] = None,
    print_config: Annotated[Optional[Agent], typer.Option(
        "--print-config", help="Print the client config for AGENT (openclaw, codex, openai: any openai-SDK program) with this "
             "gateway's URL, model name and context window, and exit (docs/<agent>.md).")] = None,
) -> None:
    """Start the OpenAI-compatible gateway in front of the engine named in [engine]."""
    import uvicorn

    from clawrl.gateway.routes import create_app
    from clawrl.ports import client_url, listen_problem
    from clawrl.serving import freeze_startup_heap, record_where_it_serves
    from clawrl.storage.writer import DataRootError

    settings = settings_or_exit(config, {"server.host": host, "server.api_port": port})
    if print_config:
        from clawrl.gateway.agents import AGENT_CONFIGS

        s = settings
        print(AGENT_CONFIGS[print_config.value](client_url(s.server.host, s.server.api_port), s.server.served_model_name,
                                                served_context_len(s), s.ppo.max_new_tokens))
        return
    if problem := listen_problem(settings.server.host, settings.server.api_port):
        fail(f"{problem}: choose another with --port / [server] api_port, or --host / [server] host")
    try:
        app = create_app(settings)
    except ConfigError as e:
        fail(f"config error: {e}")
    except DataRootError as e:  # checked before any model loads or any port is bound
        fail(f"storage error: {e}")
    console.print(f"gateway on http://{settings.server.host}:{settings.server.api_port}/v1 "
                  f"(engine: {settings.engine.kind}{' at ' + settings.engine.url if settings.engine.url else ''}, "
                  f"model: {settings.model.name}, "
                  f"data: {settings.storage.data_root})", markup=False)
    console.print(limits_line(settings, app.state.engine), markup=False, soft_wrap=True)
    freeze_startup_heap()  # the model and modules are loaded: keep them out of full GC passes
    # where this gateway and its engine answer, for `clawrl train`, `sync` and `status` on this data root
    gateway = client_url(settings.server.host, settings.server.api_port)
    # an HTTP engine (or SGLang's router in front of several) is synced directly, the embedded one through /engine
    engine_url = settings.engine.url if settings.engine.kind == "http" else f"{gateway}/engine"
    record_where_it_serves(app, settings.storage.data_root, gateway, engine_url, settings.engine.kind)
    uvicorn.run(app, host=settings.server.host, port=settings.server.api_port, log_level="warning",
                timeout_keep_alive=SERVER_KEEPALIVE_S)


def served_context_len(s) -> int:
    """The context the gateway serves with settings ``s``, as its engine resolves it: [engine]
    max_context_len, or 0 for the model's own limit (the embedded engine; read from the model's
    config, nothing loaded); an HTTP engine's own, asked (it must be running). A client told less
    compacts early; told more, it sends what the gateway refuses."""
    if s.engine.kind == "http":
        import asyncio

        from clawrl.engine.router import RoutedEngines
        from clawrl.engine.types import EngineError

        async def ask() -> int | None:
            engines = RoutedEngines(s.engine.url, timeout_s=10.0)
            try:
                await engines.workers()  # unreachable: its reason, in one line
                return await engines.learn_context_len()
            except EngineError as e:
                fail(f"no context to print: {e}; start the engine, then print the config again")
            finally:
                await engines.close()

        if (context := asyncio.run(ask())) is None:
            fail(f"the engine at {s.engine.url} did not say its context (/server_info): start it, then print the "
                 "config again")
        return context
    from clawrl.models import ModelNotFoundError, resolve_context_len, resolve_model_dir

    try:
        return resolve_context_len(resolve_model_dir(s.model.name, s.storage.models_dir, s.model.seed),
                                   s.engine.max_context_len)
    except (ModelNotFoundError, ConfigError) as e:
        fail(f"config error: {e}")


def limits_line(s, engine) -> str:
    """What a request may fill and what the engine may hold, said at start: clients (OpenClaw's
    contextWindow) take the context from here."""
    engine = getattr(engine, "main", engine)  # behind a canary router: the served engine
    if not hasattr(engine, "describe_memory"):
        return "context and KV memory: the HTTP engine's own (its /server_info says them)"
    why = "the model's limit" if s.engine.max_context_len == 0 else "[engine] max_context_len"
    return f"context {engine.max_context_len} tokens ({why}); {engine.describe_memory()}"


@app.command("engine")
def engine(
    model: Annotated[Optional[str], typer.Option(help="Model name or HF directory (default: model.name).")] = None,
    port: Annotated[Optional[int], typer.Option(min=1, max=65535, help="Port (default: [server] api_port + 10).")] = None,
    host: Annotated[Optional[str], typer.Option(help="Bind address (default: server.host).")] = None,
    config: ConfigOpt = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Start from the checkpoint of the last successful weight sync recorded under the data "
                         "root (its sha256 checked), not the base model: a restarted engine serves the last good "
                         "version, never one whose load it died in.")] = False,
) -> None:
    """Serve the embedded engine over SGLang's native HTTP API (weight_version starts at "0", or with
    --resume at the last version synced successfully)."""
    from clawrl.models import resolve_device, resolve_dtype
    from clawrl.engine.embedded import ENGINE_KEYS, EmbeddedEngine
    from clawrl.engine.server import serve_engine
    from clawrl.models import ModelNotFoundError, resolve_model_dir
    from clawrl.ports import listen_problem
    from clawrl.serving import freeze_startup_heap

    s = settings_or_exit(config, {"model.name": model, "server.host": host})
    port = port or s.port("engine")
    if problem := listen_problem(s.server.host, port):
        fail(f"{problem}: choose another with --port, or --host / [server] host")
    device, device_reason = resolve_device(s.model.device)
    try:
        model_dir = resolve_model_dir(s.model.name, s.storage.models_dir, seed=s.model.seed)
    except ModelNotFoundError as e:
        fail(f"model error: {e}")
    version = "0"
    if resume:
        from clawrl.storage.catalog import open_catalog
        from clawrl.storage.queries import last_synced_checkpoint
        from clawrl.checkpoint import CheckpointError, verify_checkpoint

        with open_catalog(s.storage.data_root) as con:
            last = last_synced_checkpoint(con)
        try:
            if last is not None:
                verify_checkpoint(last["path"], last["sha256"])
                model_dir, version = Path(last["path"]), str(last["weight_version"])
        except CheckpointError as e:
            err.print(f"not resuming version {last['weight_version']}: {e}; serving the base model (version 0)",
                      markup=False, style="red", soft_wrap=True)
    dtype = resolve_dtype(s.model.dtype, device)
    try:
        eng = EmbeddedEngine(model_dir, dtype=dtype, device=device, weight_version=version,
                             served_model_name=s.server.served_model_name, **s.engine.model_dump(include=ENGINE_KEYS))
    except ConfigError as e:
        fail(f"config error: {e}")
    console.print(f"engine on http://{s.server.host}:{port} (SGLang API; model: {model_dir}, "
                  f"weight_version {version}, device: {device} [{device_reason}], dtype: {dtype} [{s.model.dtype}])",
                  markup=False, soft_wrap=True)
    console.print(limits_line(s, eng), markup=False, soft_wrap=True)
    freeze_startup_heap()  # model loaded: keep it out of full GC passes
    serve_engine(eng, s.server.host, port, model_path=str(model_dir),
                 served_model_name=s.server.served_model_name, max_context_len=eng.max_context_len,
                 max_running_requests=s.engine.max_batch_size, log_level="warning")


@app.command("trainer")
def trainer_service(
    config: ConfigOpt = None,
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port.")] = 30020,
) -> None:
    """Run the long-lived trainer service (model + optimizer stay in memory between flow runs); under
    torchrun, one process per rank of [model] tensor_parallel x data_parallel."""
    s = settings_or_exit(config)
    from clawrl.trainer_service import serve_trainer

    try:
        serve_trainer(s, host, port, echo=lambda m: console.print(m, markup=False))
    except ValueError as e:
        fail(f"config error: {e}")


@app.command("up")
def up(
    config: ConfigOpt = None,
    api_port: Annotated[Optional[int], typer.Option(
        min=1, max=65535, help="The gateway's OpenAI API port (default [server] api_port, 30000); the engines' "
                               "ports follow it (+10, +21, +22, +23).")] = None,
    prefect_port: Annotated[int, typer.Option(min=1, max=65535, help="Prefect UI/API port.")] = 4200,
    mlflow_port: Annotated[int, typer.Option(min=1, max=65535, help="MLflow UI port.")] = 5000,
    trainer_port: Annotated[int, typer.Option(min=1, max=65535, help="Trainer service port.")] = 30020,
    judge_every: Annotated[float, typer.Option(
        min=1.0, help="Seconds between judge runs while turns wait (a run starts only "
                      "while none is going; after a run that took a full bite, the "
                      "next starts at once).")] = 20.0,
    train_every: Annotated[float, typer.Option(
        min=1.0, help="Seconds between train ticks, a safety net: a judge run that "
                      "leaves a full batch starts a train run at once (either only "
                      "while none is going).")] = 120.0,
    work_pool: Annotated[Optional[str], typer.Option(help="Register the flows on this Prefect process work pool "
                                                          "(created if missing): `prefect worker start --pool NAME` "
                                                          "processes, here or on other machines, run them.")] = None,
    local_worker: Annotated[bool, typer.Option(help="With --work-pool, also start one worker here.")] = True,
    host: Annotated[str, typer.Option(help="Address Prefect, MLflow, the trainer and the judge engine bind and "
                                           "the flows reach them at: this machine's address on a private network "
                                           "when Prefect workers on other machines run the flows.")] = "127.0.0.1",
    engines: Annotated[int, typer.Option(min=0, help="`clawrl engine` processes serving the policy (several: behind "
                                                     "SGLang's router on [server] api_port + 10); 0: the gateway's "
                                                     "embedded engine.")] = 0,
    judge_engines: Annotated[int, typer.Option(min=1, help="`clawrl engine` processes holding the initial weights for "
                                                           "the judge and teacher (several: behind SGLang's router on "
                                                           "[server] api_port + 21), when they use them.")] = 1,
) -> None:
    """Everything at once: gateway + engine, Prefect server and deployments, trainer, MLflow UI."""
    from clawrl.storage.writer import DataRootError, check_data_root
    from clawrl.supervisor import host_problem, run_up

    s = settings_or_exit(config, {"server.api_port": api_port})
    if problem := host_problem(s, host):
        fail(problem)
    if not (host.startswith("127.") or host in ("localhost", "::1")):
        console.print(f"[bold yellow]the trainer API, Prefect and MLflow answer anyone who reaches {host}, without "
                      "authentication: keep that address on a private network[/]")
    try:  # before any service starts: a clear line, not a traceback from a child process
        check_data_root(s.storage.data_root)
    except DataRootError as e:
        fail(f"storage error: {e}")
    conf = s.storage.data_root / "up-config.toml"  # every child process reads this effective config
    conf.write_text(dump_toml(s))
    try:
        run_up(s, conf, prefect_port=prefect_port, mlflow_port=mlflow_port, trainer_port=trainer_port,
               judge_every_s=judge_every, train_every_s=train_every, work_pool=work_pool, local_worker=local_worker,
               host=host, engines=engines, judge_engines=judge_engines, echo=lambda m: console.print(m, markup=False))
    except RuntimeError as e:
        fail(str(e), code=1)
