"""The one command line: ``clawrl <command>``. Each command loads Settings once and calls the library."""

# each module registers its commands; `clawrl --help` lists them in this order
from clawrl.cli import serving, data, training, adapters, demo, bench  # noqa: F401, I001
from clawrl.cli.common import app

__all__ = ["app"]
