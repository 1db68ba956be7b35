"""Forgetting a namespace in the tables: every file that holds a row of it is written again without that row.

A row is the namespace's when it names the namespace (turns, samples, batches, evaluations, promotions,
adapters; ``adapter_serving`` too, except the ``forget`` rows, the record that it was forgotten) or one of
its turns (next_states, verdicts, turn_fate, samples without a namespace). Rows of others that list its
ids keep their other entries: a shared batch's samples and sessions, a promotion's replayed turns. Every
other row is written back with the same values, in the same order, under the file's own schema.

A file is rewritten as storage/convert.py publishes one: under a temporary name the readers' glob
(``date=*/*.parquet``) does not match, then ``os.replace``d over the old one, so a reader sees the old
file or the new one, never a partial one; a file left with no row is removed. Rows still in another
process's write-ahead log cannot be rewritten: the segments that exist when forgetting starts are waited
for (their writers convert them within a second), up to ``wal.SETTLE_S``. ``_rejected/`` files (rows that
never fit their table) lose the namespace's lines too. A replay's data root (``replays/<id>/``) is treated
the same way, and a replay of the namespace's own adapter is removed whole.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from clawrl.storage.catalog import open_catalog
from clawrl.storage.convert import REJECTED_DIR
from clawrl.storage.queries import _columns
from clawrl.storage.schemas import TABLES
from clawrl.storage.wal import wait_converted

REPLAY_FILE = "replay.json"  # a replay's report, naming the namespace whose adapter it re-trained


def _ids(con, namespace: str) -> tuple[set[str], set[str]]:
    """(the turn ids, the sample ids) of ``namespace``."""
    turns = {r[0] for r in con.execute("SELECT DISTINCT turn_id FROM turns WHERE namespace = $ns",
                                       {"ns": namespace}).fetchall()}
    has_ns = "namespace" in _columns(con, "samples")
    samples = {r[0] for r in con.execute(
        "SELECT DISTINCT sample_id FROM samples WHERE list_contains($t, turn_id)"
        + (" OR namespace = $ns" if has_ns else ""), {"t": sorted(turns), **({"ns": namespace} if has_ns else {})}
    ).fetchall()}
    return turns, samples


def _is(table: pa.Table, column: str, values: set[str] | str) -> pa.ChunkedArray | pa.Array:
    """Row mask: ``column`` equals ``values`` (a str) or is one of them (a set); false where it is missing."""
    if column not in table.column_names:
        return pa.array([False] * table.num_rows)
    if isinstance(values, str):
        return pc.fill_null(pc.equal(table[column], values), False)
    return pc.fill_null(pc.is_in(table[column], value_set=pa.array(sorted(values), pa.string())), False)


def _row_rules(namespace: str, turns: set[str], samples: set[str]) -> dict[str, Callable[[pa.Table], pa.Array]]:
    """table -> the mask of the rows of the namespace in one of its files."""
    def own(t: pa.Table) -> pa.Array:
        return _is(t, "namespace", namespace)

    def by_turn(t: pa.Table) -> pa.Array:
        return _is(t, "turn_id", turns)

    def sample(t: pa.Table) -> pa.Array:  # named, or of one of its turns (a sample written without a namespace)
        return pc.or_(own(t), pc.or_(by_turn(t), _is(t, "sample_id", samples)))

    def serving(t: pa.Table) -> pa.Array:  # the record that it was forgotten stays
        return pc.and_(own(t), pc.invert(_is(t, "action", "forget")))

    return {"turns": own, "next_states": by_turn, "verdicts": by_turn, "turn_fate": by_turn, "samples": sample,
            "batches": own, "evaluations": own, "promotions": own, "adapters": own, "adapter_serving": serving}


def _strip_lists(name: str, rows: list[dict], namespace: str, turns: set[str], samples: set[str]) -> bool:
    """Take the namespace's entries out of the id lists of others' rows (in place); whether any went."""
    changed = False
    for r in rows:
        if name == "batches" and r.get("session_namespaces") and namespace in r["session_namespaces"]:
            pairs = [(ns, sid) for ns, sid in zip(r["session_namespaces"], r["session_ids"]) if ns != namespace]
            r["session_namespaces"], r["session_ids"] = [p[0] for p in pairs], [p[1] for p in pairs]
            r["sample_ids"] = [x for x in r["sample_ids"] if x not in samples]
            changed = True
        elif name == "promotions" and r.get("eval_turn_ids") and set(r["eval_turn_ids"]) & turns:
            r["eval_turn_ids"] = [x for x in r["eval_turn_ids"] if x not in turns]
            changed = True
    return changed


def _publish(path: Path, table: pa.Table) -> None:
    """``table`` in place of the file at ``path`` (temp + rename), or no file when it has no row."""
    if table.num_rows == 0:
        path.unlink()
        return
    tmp = path.with_name(f".{path.name}.forget-{os.getpid()}.tmp")
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)


def _rewrite_file(path: Path, name: str, mask_of: Callable[[pa.Table], pa.Array], namespace: str,
                  turns: set[str], samples: set[str]) -> int:
    """Rewrite one Parquet file of table ``name`` without the namespace's rows (and, in others' rows, without its
    entries); the rows removed. A file with nothing of the namespace is left as it is."""
    table = pq.ParquetFile(path).read()
    mask = mask_of(table)
    dropped = pc.sum(pc.cast(mask, pa.int64())).as_py() or 0
    kept = table.filter(pc.invert(mask))
    stripped = False
    if name in ("batches", "promotions") and kept.num_rows:
        rows = kept.to_pylist()
        if stripped := _strip_lists(name, rows, namespace, turns, samples):
            kept = pa.Table.from_pylist(rows, schema=table.schema)
    if dropped or stripped:
        _publish(path, kept)
    return dropped


def _rewrite_rejected(table_dir: Path, namespace: str, turns: set[str]) -> int:
    """Lines of the namespace (its name or one of its turn ids in the raw row) out of ``_rejected/`` files."""
    marks = [f'"namespace":"{namespace}"', *turns]
    dropped = 0
    for path in sorted((table_dir / REJECTED_DIR).glob("*.jsonl")):
        lines = path.read_bytes().splitlines(keepends=True)
        kept = [x for x in lines if not any(m in json.loads(x).get("line", "") for m in marks)]
        if len(kept) != len(lines):
            dropped += len(lines) - len(kept)
            tmp = path.with_name(f".{path.name}.forget-{os.getpid()}.tmp")
            tmp.write_bytes(b"".join(kept))
            os.replace(tmp, path)
    return dropped


def forget_rows(data_root: str | os.PathLike, namespace: str) -> dict[str, int]:
    """Rewrite every table of ``data_root`` (and of each replay under it) without ``namespace``'s rows (module
    docstring). Returns the rows removed per table, with ``wal_segments_left``: segments another process
    had not converted within ``SETTLE_S`` (their rows of the namespace, if any, stay)."""
    root = Path(data_root)
    tables = root / "tables"
    left = wait_converted(tables) if tables.is_dir() else []
    with open_catalog(root, private=True) as con:
        turns, samples = _ids(con, namespace)
    rules = _row_rules(namespace, turns, samples)
    removed: dict[str, int] = {}
    for name in TABLES:
        n = sum(_rewrite_file(p, name, rules[name], namespace, turns, samples)
                for p in sorted((tables / name).glob("date=*/*.parquet"))) if name in rules else 0
        n += _rewrite_rejected(tables / name, namespace, turns)
        if n:
            removed[name] = n
    for replay in sorted((root / "replays").glob("*")) if (root / "replays").is_dir() else []:
        report = replay / REPLAY_FILE
        if report.is_file() and json.loads(report.read_text()).get("namespace") == namespace:
            shutil.rmtree(replay)  # a replay of its own adapter: all of it is the namespace's
            removed["replays"] = removed.get("replays", 0) + 1
        elif (replay / "tables").is_dir():
            for table, n in forget_rows(replay, namespace).items():
                if table != "wal_segments_left":
                    removed[table] = removed.get(table, 0) + n
    return {**removed, "wal_segments_left": len(left)}
