"""What per-namespace training reads (``[ppo] adapters = "namespace"``): each namespace's trainable samples
with the adapter version that served their turn, its adapter versions, its unfinished batch, and when it
was last forgotten.

A namespace's samples are measured against that namespace's adapter only: a sample's version is the one
of the adapter that served its turn (``turns.adapter``; the base alone is version 0), and samples of
turns served before the namespace was forgotten are never trained on again.
"""

from __future__ import annotations

from typing import Any

import duckdb

from clawrl.records import OPEN_NAMESPACE, adapter_version
from clawrl.storage.queries import _columns, _rows, batch_manifest, trainable_samples


def _adapter_of_turn(con: duckdb.DuckDBPyConnection) -> str:
    """The adapter column of ``turns`` (NULL where every file predates it)."""
    return "any_value(adapter)" if "adapter" in _columns(con, "turns") else "NULL::VARCHAR"


def forgotten_at(con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    """namespace -> when it was last forgotten (its samples from before then never train)."""
    return dict(con.execute("SELECT namespace, max(created_at) FROM adapter_serving WHERE action = 'forget' AND ok "
                            "GROUP BY namespace").fetchall())


def namespace_samples(con: duckdb.DuckDBPyConnection, judge_config_hash: str,
                      namespace: str | None = None) -> list[dict[str, Any]]:
    """The trainable samples (``trainable_samples``, oldest first) of ``namespace`` (None: of every one),
    each with ``adapter_version``: the version of its namespace's adapter that served its turn (0: the
    base; also for a sample without a turn). Samples of turns from before their namespace was last
    forgotten are left out."""
    rows = [r for r in trainable_samples(con, judge_config_hash).to_pylist()
            if namespace is None or (r["namespace"] or OPEN_NAMESPACE) == namespace]
    if not rows:
        return []
    turns = {tid: (adapter, at) for tid, adapter, at in con.execute(
        f"SELECT turn_id, {_adapter_of_turn(con)}, min(created_at) FROM turns WHERE list_contains($ids, turn_id) "
        "GROUP BY turn_id", {"ids": sorted({r["turn_id"] for r in rows})}).fetchall()}
    forgotten, kept = forgotten_at(con), []
    for r in rows:
        adapter, at = turns.get(r["turn_id"], (None, r["created_at"]))
        ns = r["namespace"] or OPEN_NAMESPACE
        if ns in forgotten and at <= forgotten[ns]:
            continue
        kept.append({**r, "namespace": ns, "adapter_version": adapter_version(adapter)})
    return kept


def full_batch_namespaces(con: duckdb.DuckDBPyConnection, judge_config_hash: str, batch_size: int) -> list[str]:
    """The namespaces with at least ``batch_size`` trainable samples waiting (before staleness), sorted, and
    those with a batch claimed but not trained: what a train run would find work for."""
    counts: dict[str, int] = {}
    for r in namespace_samples(con, judge_config_hash):
        counts[r["namespace"]] = counts.get(r["namespace"], 0) + 1
    return sorted({ns for ns, n in counts.items() if n >= batch_size} | set(open_namespaces(con)))


def open_namespaces(con: duckdb.DuckDBPyConnection) -> list[str]:
    """The namespaces with a claimed batch whose adapter version was never recorded."""
    if "namespace" not in _columns(con, "batches"):
        return []
    return [r[0] for r in con.execute("SELECT DISTINCT namespace FROM batches b WHERE namespace IS NOT NULL AND NOT "
                                      "EXISTS (SELECT 1 FROM adapters a WHERE a.batch_id = b.batch_id) "
                                      "ORDER BY 1").fetchall()]


def open_adapter_batch(con: duckdb.DuckDBPyConnection, namespace: str) -> dict[str, Any] | None:
    """The newest batch of ``namespace`` whose adapter version was never recorded (claimed, not trained), or None."""
    if "namespace" not in _columns(con, "batches"):
        return None
    rows = _rows(con, """
        SELECT * EXCLUDE (date) FROM batches b
        WHERE namespace = $ns AND NOT EXISTS (SELECT 1 FROM adapters a WHERE a.batch_id = b.batch_id)
        ORDER BY created_at DESC LIMIT 1
    """, ns=namespace)
    return rows[0] if rows else None


def latest_adapter_version(con: duckdb.DuckDBPyConnection, namespace: str) -> int:
    """The newest version of ``namespace``'s adapter ever recorded (0 before its first step); a forgotten
    namespace's versions count too (its ``forget`` row's ``last_version``): its next one gets a name never
    used."""
    value = con.execute("SELECT max(version) FROM adapters WHERE namespace = $ns", {"ns": namespace}).fetchall()[0][0]
    forgot = None
    if "last_version" in _columns(con, "adapter_serving"):
        forgot = con.execute("SELECT max(last_version) FROM adapter_serving WHERE namespace = $ns AND action = "
                             "'forget'", {"ns": namespace}).fetchall()[0][0]
    return max(int(value or 0), int(forgot or 0))


def adapter_recorded(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    return con.execute("SELECT count(*) FROM adapters WHERE name = $n", {"n": name}).fetchall()[0][0] > 0


def find_adapter(con: duckdb.DuckDBPyConnection, name: str) -> dict[str, Any] | None:
    """The ``adapters`` row of the adapter named ``name``, or None."""
    rows = _rows(con, "SELECT * EXCLUDE (date) FROM adapters WHERE name = $n ORDER BY created_at LIMIT 1", n=name)
    return rows[0] if rows else None


def batch_namespace(con: duckdb.DuckDBPyConnection, batch_id: str) -> tuple[str, int] | None:
    """(the namespace whose adapter batch ``batch_id`` trains, the version it makes), or None for a batch of
    the shared policy."""
    if "namespace" not in _columns(con, "batches"):
        return None
    rows = con.execute("SELECT namespace, step FROM batches WHERE batch_id = $b ORDER BY created_at LIMIT 1",
                       {"b": batch_id}).fetchall()
    return (rows[0][0], int(rows[0][1])) if rows and rows[0][0] is not None else None


def serving_changes(con: duckdb.DuckDBPyConnection, namespace: str) -> list[dict[str, Any]]:
    """``namespace``'s ``adapter_serving`` rows (syncs and forgets), newest first: action, adapter, ok, error,
    created_at."""
    return _rows(con, "SELECT action, adapter, ok, error, created_at FROM adapter_serving WHERE namespace = $ns "
                      "ORDER BY created_at DESC", ns=namespace)


def adapter_chain(con: duckdb.DuckDBPyConnection, namespace: str, version: int) -> list[dict[str, Any]]:
    """What trained version ``version`` of ``namespace``'s adapter: its ``adapters`` row and each one it was
    trained from (``parent``), newest first, back to the fresh adapter; each with its batch's method, config
    hash, sample ids, sessions ([namespace, session_id] pairs) and turn ids. Empty when the version is not
    recorded."""
    rows = {r["name"]: r for r in _rows(con, """
        SELECT a.* EXCLUDE (date), b.method, b.config_hash, b.sample_ids FROM adapters a
        JOIN (SELECT * FROM batches QUALIFY row_number() OVER (PARTITION BY batch_id ORDER BY created_at) = 1) b
        USING (batch_id) WHERE a.namespace = $ns
        QUALIFY row_number() OVER (PARTITION BY a.name ORDER BY a.created_at) = 1""", ns=namespace)}
    chain, name = [], f"{namespace}@v{int(version)}"
    while name in rows:
        r = rows[name]
        manifest = batch_manifest(con, r["batch_id"])
        chain.append({**r, "turn_ids": [t["turn_id"] for t in manifest],
                      "sessions": sorted(map(list, {(t["namespace"], t["session_id"]) for t in manifest}))})
        name = r["parent"]
    return chain


def namespaces(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """Every namespace of the data root (its turns, or its adapter versions), busiest first: namespace,
    turns, adapter versions, the newest one."""
    return _rows(con, """
        WITH t AS (SELECT namespace, count(DISTINCT turn_id) AS turns FROM turns GROUP BY namespace),
        a AS (SELECT namespace, count(DISTINCT name) AS versions, max(version) AS newest FROM adapters GROUP BY namespace)
        SELECT namespace, coalesce(t.turns, 0) AS turns, coalesce(a.versions, 0) AS versions, a.newest
        FROM t FULL JOIN a USING (namespace) WHERE namespace IS NOT NULL ORDER BY turns DESC, namespace""")
