"""What every command shares: the Typer apps, the consoles, loading the settings, failing with a message."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional

import typer
from rich.console import Console

from clawrl.config import ConfigError, Settings, apply_offline_env, dump_toml, load_settings
from clawrl.config_defaults import dump_defaults

apply_offline_env()

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, help="Online RL for live agent conversations.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect the effective configuration.")
app.add_typer(config_app, name="config")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks; results go to docs/benchmarks.md.")
app.add_typer(bench_app, name="bench")

console = Console()
err = Console(stderr=True)

ConfigOpt = Annotated[
    Optional[Path], typer.Option("--config", "-c", help="TOML overlay on the defaults (`clawrl config show --defaults`).")
]
RUN_CONFIG = "config.toml"  # in a data root: the settings of the run that wrote it (`clawrl demo` writes one)


def run_config(config: Path | None) -> Path | None:
    """``config`` when given; else the run's own settings in the data root that the defaults and the
    environment name (``<data_root>/config.toml``) when it holds them: read with other settings, the
    data would be counted under another judge config and model. None: the defaults."""
    if config is not None:
        return config
    found = settings_or_exit(None).storage.data_root / RUN_CONFIG
    return found if found.is_file() else None


# the commands that read or act on a data root's records: without -c they read the run's own settings
RunConfigOpt = Annotated[
    Optional[Path], typer.Option("--config", "-c", callback=run_config, help=(
        "TOML overlay on the defaults (`clawrl config show --defaults`); default: the data root's own config.toml "
        "when it has one (a demo's run)."))
]


def fail(message: str, code: int = 2) -> NoReturn:
    """``message`` on stderr as plain text (never markup, never wrapped: scripts grep it), then exit ``code``."""
    err.print(message, markup=False, highlight=False, style="red", soft_wrap=True)
    raise typer.Exit(code)


def warn(message: str, style: str = "bold yellow") -> None:
    """``message`` on stderr in ``style``, plain text and never wrapped (scripts grep it)."""
    err.print(message, markup=False, highlight=False, style=style, soft_wrap=True)


def sync_command(config: Path | None, version: str, engine_url: str | None = None) -> str:
    """The `clawrl sync` command line that serves ``version``."""
    return " ".join(["clawrl sync", str(version), *(["-c", str(config)] if config else []),
                     *(["--engine-url", engine_url] if engine_url else [])])


def gateway_engine_url(s: Settings) -> str:
    """The embedded engine of the gateway `clawrl serve` starts with these settings."""
    from clawrl.ports import client_url

    return f"{client_url(s.server.host, s.server.api_port)}/engine"


def settings_or_exit(config: Path | None, overrides: dict | None = None) -> Settings:
    """The settings of ``config`` and ``overrides`` (dotted keys; a None value: an option not given)."""
    try:
        return load_settings(config, overrides={k: v for k, v in (overrides or {}).items() if v is not None})
    except ConfigError as e:
        fail(f"config error: {e}")


def data_root_line(s: Settings, config: Path | None) -> str:
    """'data root /x (from env CLAWRL__STORAGE__DATA_ROOT)': the first line of every command that reads
    the recorded data, so that reading another data root than meant (the default one) shows at once."""
    from clawrl.config import setting_origin

    origin = setting_origin(config, "storage", "data_root")
    where = ("the default; -c CONFIG or CLAWRL__STORAGE__DATA_ROOT reads another" if origin == "defaults" else
             f"from {origin}")
    own = s.storage.data_root / RUN_CONFIG
    if config is not None and Path(config).expanduser().resolve() == own and origin != str(own):
        where += f"; settings from its {RUN_CONFIG}"
    return f"data root {s.storage.data_root} ({where})"


def require_data_root(s: Settings, config: Path | None) -> None:
    """Exit with one line when the data root a reading command would read does not exist (a mistyped
    path, the default where the run wrote elsewhere): its counts would all be zeros."""
    if not Path(s.storage.data_root).is_dir():
        fail(f"{data_root_line(s, config)} does not exist: nothing was recorded there")


def use_data_root_prefect(s: Settings) -> str:
    """Point this command's Prefect flows at the data root's Prefect, before Prefect is imported:
    the API of a `clawrl up` running on this data root when it answers (no server of this command's
    own), else a temporary server on the data root's Prefect home (``<data_root>/prefect``, the
    database `clawrl up` and `clawrl demo` use too). A ``PREFECT_API_URL`` already set wins.
    Returns the API or home used, for the user."""
    import os

    from clawrl.config import use_prefect_home

    root = Path(s.storage.data_root)
    use_prefect_home(root / "prefect")
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    if api := up_prefect_api(root):
        os.environ["PREFECT_API_URL"] = api
        return api
    return str(root / "prefect")  # no `clawrl up` here, or it is gone: this command's own temporary server


def up_prefect_api(data_root: Path) -> str | None:
    """The Prefect API of the `clawrl up` running on ``data_root`` (its ``up.pids.json``), when it answers."""
    import json

    import httpx

    try:
        api = json.loads((Path(data_root) / "up.pids.json").read_text())["prefect_api_url"]
        return api if httpx.get(f"{api}/health", timeout=2).status_code == 200 else None
    except (OSError, ValueError, KeyError, TypeError, httpx.HTTPError):
        return None


def run_in_up(s: Settings, deployment: str, parameters: dict) -> Any | None:
    """When a `clawrl up` runs on the data root (and ``PREFECT_API_URL`` names no other server): a run of its
    ``deployment`` (``clawrl.flows.slots``) with ``parameters`` on top of the deployment's, which `up`'s
    flow server executes with the models it holds; waited for, where to watch it printed first. Returns
    the finished flow run; None when no `clawrl up` answers (the caller runs the flow itself)."""
    import os

    api, other = up_prefect_api(Path(s.storage.data_root)), os.environ.get("PREFECT_API_URL")
    if api is None or (other and other.rstrip("/") != api.rstrip("/")):
        return None
    use_data_root_prefect(s)  # PREFECT_API_URL: up's
    import time

    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    run = run_deployment(deployment, parameters=parameters, timeout=0)  # created; waited for below
    console.print(f"submitted a run of {deployment} to the `clawrl up` running on {s.storage.data_root}, with its "
                  f"settings ({run.parameters.get('config_path')}); watch it at "
                  f"{api.removesuffix('/api')}/runs/flow-run/{run.id}", markup=False, highlight=False, soft_wrap=True)
    with err.status(f"waiting for the {deployment} run"), get_client(sync_client=True) as client:
        while not (run := client.read_flow_run(run.id)).state.is_final():
            time.sleep(UP_POLL_S)
    return run


UP_POLL_S = 1.0  # how often a command waiting for a run in `clawrl up` asks how it stands


@contextlib.contextmanager
def data_root_prefect(s: Settings) -> Iterator[str]:
    """:func:`use_data_root_prefect` for the span of a command's flows; where it finds no API to use,
    a Prefect server of the command's own on the data root's Prefect home, started in a session of its
    own (``clawrl.supervisor.own_prefect_server``), so a Ctrl-C stops the flows and not their server.
    Yields the Prefect API URL the flows report to."""
    import os

    from clawrl.storage.writer import DataRootError, check_data_root

    try:  # a data root that cannot be made or written: one line, not a traceback from Prefect's home
        check_data_root(s.storage.data_root)
    except DataRootError as e:
        fail(f"storage error: {e}")
    where = use_data_root_prefect(s)
    with contextlib.ExitStack() as stack:
        if not os.environ.get("PREFECT_API_URL"):
            from clawrl.supervisor import own_prefect_server

            with err.status("starting a Prefect server on the data root"):
                stack.enter_context(own_prefect_server(Path(where)))
            where = os.environ["PREFECT_API_URL"]
        stack.enter_context(chatter_to_log(Path(s.storage.data_root) / "logs" / FLOW_LOG))
        yield where


FLOW_LOG = "flows.log"  # under <data_root>/logs: every log line of the flows a command runs in its process
# Prefect's own lines about each run that went well: in the log file, not in the terminal (a run that crashed
# or failed is said there)
_CHATTER = ("Beginning ", "View at ", "Finished in state Completed", "Created task run", "Executing ")


class _UserFacing(logging.Filter):
    """What the terminal shows of the flows: warnings and errors, and the lines of the runs' own code
    (the demo's step lines, a judge run's counts), not Prefect's lines about starting and finishing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or (
            record.name.startswith("prefect.flow_runs") and not record.getMessage().startswith(_CHATTER))


@contextlib.contextmanager
def chatter_to_log(path: Path) -> Iterator[Path]:
    """For the span of a command's flows: every log line (Prefect's, MLflow's, Python warnings) also
    goes to ``path``; the terminal keeps only what ``_UserFacing`` lets through."""
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import PrefectConsoleHandler

    ensure_logging_setup()  # Prefect's handlers, once per process (importing prefect does it too)
    path.parent.mkdir(parents=True, exist_ok=True)
    root, quiet = logging.getLogger(), [logging.getLogger(n) for n in ("mlflow", "py.warnings")]
    consoles = [h for h in root.handlers if isinstance(h, PrefectConsoleHandler)]
    to_file = logging.FileHandler(path)
    to_file.setFormatter(consoles[0].formatter if consoles else logging.Formatter(logging.BASIC_FORMAT))
    saved = [(q, q.handlers[:], q.propagate) for q in quiet]
    for q in quiet:  # their own stderr handlers (MLflow's) give way to the file
        q.handlers, q.propagate = [to_file], False
    for h in consoles:
        h.addFilter(_UserFacing())
    root.addHandler(to_file)
    logging.captureWarnings(True)
    try:
        yield path
    finally:
        logging.captureWarnings(False)
        root.removeHandler(to_file)
        for h in consoles:
            h.filters = [f for f in h.filters if not isinstance(f, _UserFacing)]
        for q, handlers, propagate in saved:
            q.handlers, q.propagate = handlers, propagate
        to_file.close()


@config_app.command("show")
def config_show(
    config: RunConfigOpt = None,
    defaults: Annotated[bool, typer.Option("--defaults", help="The defaults, each key with the first sentence "
                                                              "of its description.")] = False,
    full: Annotated[bool, typer.Option("--full", help="With --defaults: each key under its whole description "
                                                      "(conf/default.toml is this output).")] = False,
) -> None:
    """Print the effective configuration (defaults + --config + CLAWRL__SECTION__KEY env)."""
    typer.echo(dump_defaults(full) if defaults else dump_toml(settings_or_exit(config)), nl=False)


def promotion_line(log: list[dict], consecutive: int) -> str:
    """One line on what serves and why, e.g. 'promotion: champion version 3; candidate 5 refused (worse by
    more than the tolerance 0.05: ...); 2 refused in a row'. Plain text: scripts grep it."""
    champions = [r["weight_version"] for r in log if r["action"] in ("promote", "rollback")]
    champion = champions[-1] if champions else "0"
    head = f"promotion: champion version {champion}" + ("" if champions else " (the initial weights)")
    if not log:
        return head + "; no candidate decided yet"
    last = log[-1]
    on = f" on the {last['eval_set']} set" if last.get("eval_set") else ""  # [gate] eval_set of the evidence
    if last["action"] == "refuse":
        return (f"{head}; candidate {last['weight_version']} refused{on} ({last['reason']}); "
                f"{consecutive} refused in a row")
    verb = "promoted" if last["action"] == "promote" else f"rolled back from version {last['champion_version']}"
    return f"{head}, {verb} {DECIDED_BY.get(last['source'], 'by ' + last['source'])}{on} ({last['reason']})"


def promotion_note(log: list[dict], line: list[str], unserved: set[str], version: str) -> str:
    """What the gate and the promotions (``log``, the champion ``line``, the ``unserved`` versions) made
    of ``version``, e.g. 'refused by the gate (worse by more than the tolerance 0.05), not served; the
    champion is version 3'."""
    rows = [r for r in log if str(r["weight_version"]) == version]
    if version == line[-1]:
        done = {"promote": "promoted", "rollback": "rolled back to"}
        how = f" ({done[rows[-1]['action']]} {DECIDED_BY.get(rows[-1]['source'], 'by ' + rows[-1]['source'])})" \
            if rows and rows[-1]["action"] in done else ""
        return f"the champion{how}"
    champion = f"the champion is version {line[-1]}"
    if rows and rows[-1]["action"] == "refuse" and version in unserved:
        return f"refused by the gate ({rows[-1]['reason'].split(':')[0]}), not served; {champion}"
    if version in unserved:
        return f"rolled back from, not served; {champion}"
    if not rows:
        return f"no promotion decision recorded yet, not served; {champion}"
    return f"served as champion before; {champion}"


# a promotions row's source, as the status line says who decided
DECIDED_BY = {"gate": "by the gate", "manual": "by hand", "live": "by the live check",
              "ungated": "without the gate"}


def print_findings(title: str, findings: list[dict]) -> None:
    """`clawrl doctor`'s report: how many problems, then each finding, with the cause, fix and SQL of a problem."""
    problems = [f for f in findings if not f["ok"]]
    console.print(f"{title}: {len(problems) or 'no'} problem{'s' if len(problems) != 1 else ''} found", markup=False)
    for f in findings:
        console.print(f"{'ok  ' if f['ok'] else 'FAIL'} {f['name']}: {f['summary']}", markup=False, highlight=False,
                      soft_wrap=True)
        for label in ("cause", "fix", "sql") if not f["ok"] else ():
            console.print(f"       {'see' if label == 'sql' else label}: {f[label]}", markup=False, highlight=False,
                          soft_wrap=True)
