"""What every command shares: the Typer apps, the consoles, loading the settings, failing with a message."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NoReturn, Optional

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


def fail(message: str, code: int = 2) -> NoReturn:
    """``message`` on stderr as plain text (never markup, never wrapped: scripts grep it), then exit ``code``."""
    err.print(message, markup=False, highlight=False, style="red", soft_wrap=True)
    raise typer.Exit(code)


def settings_or_exit(config: Path | None, overrides: dict | None = None) -> Settings:
    """The settings of ``config`` and ``overrides`` (dotted keys; a None value: an option not given)."""
    try:
        return load_settings(config, overrides={k: v for k, v in (overrides or {}).items() if v is not None})
    except ConfigError as e:
        fail(f"config error: {e}")


@config_app.command("show")
def config_show(
    config: ConfigOpt = None,
    defaults: Annotated[bool, typer.Option("--defaults", help="The defaults, each key under its description "
                                                              "(conf/default.toml is this output).")] = False,
) -> None:
    """Print the effective configuration (defaults + --config + CLAWRL__SECTION__KEY env)."""
    typer.echo(dump_defaults() if defaults else dump_toml(settings_or_exit(config)), nl=False)
