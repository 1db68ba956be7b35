"""Benchmarks: each returns a dict of measured numbers; the CLI and docs/benchmarks.md report them."""

import re
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name, for result rows (here, not in clawrl.bench.common: the standalone
    clawrl.bench.mfu imports no other clawrl module)."""
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    except OSError:
        m = None
    return m.group(1).strip() if m else "unknown"
