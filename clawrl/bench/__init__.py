"""Benchmarks: each returns a dict of measured numbers; the CLI and docs/benchmarks.md report them."""


def cpu_model() -> str:
    """The CPU's model name, for result rows (here, not in clawrl.bench.common: the standalone
    clawrl.bench.mfu imports no other clawrl module)."""
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
