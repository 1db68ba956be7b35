"""Shared by every benchmark: the machine description, markdown tables, and replacing one section of
``docs/benchmarks.md`` while leaving the others alone (each benchmark owns the text between its own
``<!-- NAME-bench:start -->`` / ``<!-- NAME-bench:end -->`` markers)."""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
from pathlib import Path
from typing import Any

DEFAULT_REPORT = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def describe_machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or "unknown"
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
        cpu = m.group(1).strip() if m else cpu
    except OSError:
        pass
    return {"cores": os.cpu_count(), "cpu": cpu, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def machine_line(m: dict[str, Any] | None = None) -> str:
    m = m or describe_machine()
    return f"Machine: {m['cores']} cores, {m['cpu']}; torch {m['torch']} ({m['threads']} threads); {m['date']}."


def load_average() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return float("nan")


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_section(name: str, body: str, path: Path = DEFAULT_REPORT) -> Path:
    """Replace (or append) the section ``name`` of the report with ``body``."""
    start, end = f"<!-- {name}-bench:start -->", f"<!-- {name}-bench:end -->"
    section = f"{start}\n{body.rstrip()}\n{end}"
    path = Path(path)
    text = path.read_text() if path.exists() else "# Benchmarks\n\nWritten by `clawrl bench ...`; each section is replaced by its own command.\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
