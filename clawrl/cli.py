"""The one command line: ``clawrl <command>``. Each command loads Settings once and calls the library."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from clawrl.config import ConfigError, Settings, apply_offline_env, dump_toml, load_settings

apply_offline_env()

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Online RL for live agent conversations.")
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


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
