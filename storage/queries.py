"""The queries the flows, the gateway and ``clawrl status`` run on a catalog connection (storage/catalog.py).

A record written twice (a retried append, a turn re-linked after a restart) counts once: these
queries take the first write of each key (``_first``), except where a view keeps the newest.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from clawrl.records import OPEN_NAMESPACE, Fate, TurnType
from clawrl.storage.catalog import sql_str
from clawrl.storage.promotions import unserved_versions
from clawrl.storage.selection import parse_version

_MAIN, _SIDE, _SAMPLE = TurnType.MAIN.value, TurnType.SIDE.value, Fate.SAMPLE.value


def _rows(con: duckdb.DuckDBPyConnection, sql: str, **params: Any) -> list[dict[str, Any]]:
    return con.sql(sql, params=params).to_arrow_table().to_pylist()


def _columns(con: duckdb.DuckDBPyConnection, view: str) -> set[str]:
    """The columns of ``view`` (a table whose files all predate a column lacks it)."""
    return {r[0] for r in con.execute(f"DESCRIBE {view}").fetchall()}


def _namespaced(con: duckdb.DuckDBPyConnection, alias: str, exclude: Sequence[str] = ()) -> str:
    """The columns of samples ``alias`` with ``namespace`` resolved: the sample's own, else its turn's
    (``turn_namespace`` of a joined ``_TURN_NAMESPACE``), else "open" (a sample with no turn)."""
    turn = f"coalesce(turn_namespace, '{OPEN_NAMESPACE}')"
    if "namespace" in _columns(con, "samples"):
        dropped = ", ".join([*exclude, "namespace"])
        return f"{alias}.* EXCLUDE ({dropped}), coalesce({alias}.namespace, {turn}) AS namespace"
    return f"{alias}.*{' EXCLUDE (' + ', '.join(exclude) + ')' if exclude else ''}, {turn} AS namespace"


# one row per turn id with its API-key namespace, to join to samples
_TURN_NAMESPACE = ("SELECT turn_id, any_value(namespace) AS turn_namespace, min(created_at) AS turn_at, "
                   "min(turn_index) AS turn_index FROM turns GROUP BY turn_id")


def _first(view: str, key: str, *, where: str = "", columns: str = "* EXCLUDE (date)",
           order: str = "created_at") -> str:
    """SQL for one row per `key` of `view`: the first by `order`."""
    return f"SELECT {columns} FROM {view} {where} QUALIFY row_number() OVER (PARTITION BY {key} ORDER BY {order}) = 1"


def turns_to_judge(
    con: duckdb.DuckDBPyConnection, judge_config_hash: str, *, limit: int | None = None,
    judge_calls: int | None = None, turn_ids: Sequence[str] | None = None,
) -> pa.Table:
    """Every turn the judge flow can decide now, oldest first, with no fate under this config:
    main turns whose next state arrived (``next_has_state`` true; its first such next state), main
    turns told that none will come (false), and side turns (NULL next-state columns). Main turns
    still waiting are left out.

    Columns: every ``turns`` column plus next_has_state, next_messages, next_reason, next_state_at,
    and ``judge_call``: whether the judge is called for the turn (a main turn whose next state arrived;
    the others are only marked, side_turn or no_next_state). ``limit`` caps the turns, ``judge_calls``
    only those the judge is called for: up to the ``judge_calls``-th of them, with every turn only
    marked before the next one. ``turn_ids`` restricts the answer to those turns.
    """
    only = "" if turn_ids is None else "WHERE list_contains($turn_ids, turn_id)"
    params = {"hash": judge_config_hash} | ({} if turn_ids is None else {"turn_ids": list(turn_ids)})
    next_state = _first("next_states", "turn_id", where=only, order="has_next_state DESC, created_at",
                        columns="turn_id, has_next_state AS next_has_state, messages AS next_messages, "
                                "reason AS next_reason, created_at AS next_state_at")
    judge_call = f"coalesce(t.turn_type = '{_MAIN}' AND ns.next_has_state, false)"
    # the judge calls up to and including this turn (the turn ids break created_at ties: one order)
    calls_so_far = f"count(*) FILTER (WHERE {judge_call}) OVER (ORDER BY t.created_at, t.turn_id)"
    sql = f"""
        WITH t AS ({_first("turns", "turn_id", where=only)}), ns AS ({next_state})
        SELECT t.*, ns.next_has_state, ns.next_messages, ns.next_reason, ns.next_state_at,
               {judge_call} AS judge_call
        FROM t LEFT JOIN ns USING (turn_id)
        WHERE (t.turn_type = '{_SIDE}' OR ns.turn_id IS NOT NULL)
          AND NOT EXISTS (
            SELECT 1 FROM turn_fate f WHERE f.turn_id = t.turn_id AND f.judge_config_hash = $hash)
        {'' if judge_calls is None else f'QUALIFY {calls_so_far} <= {int(judge_calls)}'}
        ORDER BY t.created_at, t.turn_id {'' if limit is None else f'LIMIT {int(limit)}'}
    """
    return con.sql(sql, params=params).to_arrow_table()


_CONSUMED = "SELECT DISTINCT unnest(sample_ids) AS sample_id FROM batches"

# Samples under $hash a step may take (one row per sample id, the newest write): not when the turn
# has a fate other than 'sample' under this config (too_stale, or a re-judge after a crash that
# decided otherwise), and not while the turn's judge attempt is uncommitted (a verdict without a
# fate: being judged now, or killed before its fate and to be judged again). Samples without any
# verdict (a [hooks] sample_source, hand-written) are usable.
_USABLE_SAMPLES = f"""
    SELECT * EXCLUDE (date) FROM samples s
    WHERE s.judge_config_hash = $hash
      AND NOT EXISTS (SELECT 1 FROM turn_fate f WHERE f.turn_id = s.turn_id AND f.judge_config_hash = $hash
                      AND f.fate <> '{_SAMPLE}')
      AND NOT (EXISTS (SELECT 1 FROM verdict_attempts j WHERE j.turn_id = s.turn_id
                       AND j.judge_config_hash = $hash)
               AND NOT EXISTS (SELECT 1 FROM turn_fate f WHERE f.turn_id = s.turn_id
                               AND f.judge_config_hash = $hash))
"""


def pending_counts(
    con: duckdb.DuckDBPyConnection, judge_config_hash: str, rollout_batch_size: int, namespace: str | None = None
) -> dict[str, Any]:
    """Where every turn stands under one judge config, for ``clawrl status``.

    Keys: turns (distinct turn ids), main_turns, side_turns; awaiting_next_state (main, no next
    state row and no fate yet); pending_judgment (main, next state arrived, no fate);
    pending_no_next_state (main, told no next state will come, no fate yet: the judge flow's next
    'no_next_state' fates); side_unmarked (side, no fate yet: the judge flow's next 'side_turn'
    fates); judged (turns with a fate): every turn is in one of these five; fates ({fate: turns} for every Fate, 0
    when none); excluded (judged turns whose fate is not 'sample'); samples (distinct usable
    sample ids under this config, as ``trainable_samples`` counts them); consumed (of those, listed
    in some batch); trainable (not consumed); batches (rows of ``batches``); rollout_batch_size;
    full_batches (trainable // rollout_batch_size); samples_needed (more samples before the next
    step can start). ``namespace``: the turns of that API-key namespace only, with their samples, and the
    batches of its adapter (``[ppo] adapters = "namespace"``).
    """
    if rollout_batch_size < 1:
        raise ValueError("rollout_batch_size must be >= 1")
    waiting = f"FROM t JOIN ns USING (turn_id) ANTI JOIN f USING (turn_id) WHERE t.turn_type = '{_MAIN}' AND"
    mine = "" if namespace is None else " AND turn_id IN (SELECT turn_id FROM t)"
    params = {"hash": judge_config_hash} | ({} if namespace is None else {"ns": namespace})
    (counts,) = _rows(con, f"""
        WITH t AS (SELECT turn_id, any_value(turn_type) AS turn_type FROM turns
                   {'' if namespace is None else 'WHERE namespace = $ns'} GROUP BY turn_id),
        ns AS (SELECT turn_id, bool_or(has_next_state) AS has_next FROM next_states GROUP BY turn_id),
        f AS (SELECT DISTINCT turn_id FROM turn_fate WHERE judge_config_hash = $hash{mine}),
        s AS (SELECT DISTINCT sample_id FROM ({_USABLE_SAMPLES}){mine.replace(' AND', ' WHERE', 1)}),
        used AS ({_CONSUMED})
        SELECT
            (SELECT count(*) FROM t) AS turns,
            (SELECT count(*) FROM t WHERE turn_type = '{_MAIN}') AS main_turns,
            (SELECT count(*) FROM t WHERE turn_type = '{_SIDE}') AS side_turns,
            (SELECT count(*) FROM t LEFT JOIN ns USING (turn_id) ANTI JOIN f USING (turn_id)
              WHERE t.turn_type = '{_MAIN}' AND ns.turn_id IS NULL) AS awaiting_next_state,
            (SELECT count(*) {waiting} ns.has_next) AS pending_judgment,
            (SELECT count(*) {waiting} NOT ns.has_next) AS pending_no_next_state,
            (SELECT count(*) FROM t ANTI JOIN f USING (turn_id) WHERE t.turn_type = '{_SIDE}') AS side_unmarked,
            (SELECT count(*) FROM f) AS judged,
            (SELECT count(*) FROM s) AS samples,
            (SELECT count(*) FROM s SEMI JOIN used USING (sample_id)) AS consumed,
            (SELECT count(*) FROM batches {'' if namespace is None else 'WHERE namespace = $ns'}) AS batches
    """, **params)
    fates = {fate.value: 0 for fate in Fate}
    latest_fate = _first("turn_fate", "turn_id", where="WHERE judge_config_hash = $hash", order="created_at DESC")
    if namespace is not None:
        latest_fate = (f"SELECT * FROM ({latest_fate}) WHERE turn_id IN (SELECT DISTINCT turn_id FROM turns "
                       "WHERE namespace = $ns)")
    for fate, n in con.sql(f"SELECT fate, count(*) FROM ({latest_fate}) GROUP BY fate", params=params).fetchall():
        fates[fate] = int(n)
    trainable = counts["samples"] - counts["consumed"]
    counts.update(
        fates=fates,
        excluded=sum(n for fate, n in fates.items() if fate != _SAMPLE),
        trainable=trainable,
        rollout_batch_size=rollout_batch_size,
        full_batches=trainable // rollout_batch_size,
        samples_needed=max(0, rollout_batch_size - trainable),
    )
    return counts


def trainable_samples(con: duckdb.DuckDBPyConnection, judge_config_hash: str) -> pa.Table:
    """Usable samples under this judge config (see ``_USABLE_SAMPLES``) not yet consumed by a batch,
    oldest turn first (ties by sample id), each with ``take_order``: the order a batch takes them in
    (``clawrl.storage.selection.select_batch``). Ordered by the turn's time, not the sample's: the
    judge's finishing order must not matter (its turns run concurrently, and a turn re-judged after a
    crash gets a later sample row). ``take_order`` does not depend on time at all: the oldest weight
    version first, then an order fixed by the turn itself (a hash of its namespace, session, index and
    version; a turn's own sample and the demonstration of it by their tokens; samples with no turn row
    first, by their time as before). Which samples a batch takes must not depend on the order the
    gateway happened to complete concurrent turns in either (the tools demo's users send their second
    turn as soon as their first is answered, and a round yields more samples than a batch takes): the
    same turns give the same batches. Within a version
    staleness is equal; the hash takes an unbiased share when more wait than a batch takes, with the
    version in it so that no session always comes last."""
    sql = f"""
        WITH u AS ({_USABLE_SAMPLES}), t AS ({_TURN_NAMESPACE})
        SELECT {_namespaced(con, "u")}, row_number() OVER (ORDER BY
                   coalesce(TRY_CAST(u.weight_version AS BIGINT), 0), t.turn_at IS NOT NULL,
                   CASE WHEN t.turn_at IS NULL THEN u.created_at END, CASE WHEN t.turn_at IS NULL THEN u.sample_id END,
                   md5(concat_ws('|', t.turn_namespace, u.session_id, t.turn_index, u.weight_version)),
                   u.output_ids, u.sample_id) AS take_order
        FROM u LEFT JOIN t USING (turn_id)
        WHERE u.sample_id NOT IN ({_CONSUMED})
        ORDER BY coalesce(t.turn_at, u.created_at), u.sample_id
    """
    return con.sql(sql, params={"hash": judge_config_hash}).to_arrow_table()


def custom_samples(con: duckdb.DuckDBPyConnection, records: list, store) -> list[dict[str, Any]]:
    """Samples from a ``[hooks] sample_source``: store the ones not stored yet, drop consumed ones,
    and return them as rows (oldest first, as the hook gave them)."""
    ids = {"ids": [r.sample_id for r in records]}
    known = {r[0] for r in con.execute(
        "SELECT DISTINCT sample_id FROM samples WHERE list_contains($ids, sample_id)", ids).fetchall()}
    used = {r[0] for r in con.execute(
        f"SELECT sample_id FROM ({_CONSUMED}) WHERE list_contains($ids, sample_id)", ids).fetchall()}
    new = [r for r in records if r.sample_id not in known]
    if new:
        store.append(new)
        store.flush()
    return [asdict(r) for r in records if r.sample_id not in used]


def open_batch(con: duckdb.DuckDBPyConnection) -> dict[str, Any] | None:
    """The newest batch of the shared policy with no checkpoint yet (a step that was claimed but not
    finished), or None. A namespace's adapter batch is not one (``clawrl.storage.adapters``)."""
    shared = "AND b.namespace IS NULL" if "namespace" in _columns(con, "batches") else ""
    rows = _rows(con, f"""
        SELECT * EXCLUDE (date) FROM batches b
        WHERE NOT EXISTS (SELECT 1 FROM checkpoints c WHERE c.batch_id = b.batch_id) {shared}
        ORDER BY created_at DESC LIMIT 1
    """)
    return rows[0] if rows else None


def batch_samples(con: duckdb.DuckDBPyConnection, batch_id: str) -> pa.Table:
    """The samples a batch lists, in the batch's order (each sample's newest write, as the view keeps
    it), each with its session's API-key namespace."""
    sql = f"""
        WITH one AS (SELECT sample_ids FROM batches WHERE batch_id = $batch_id ORDER BY created_at LIMIT 1),
        b AS (SELECT unnest(sample_ids) AS sample_id, generate_subscripts(sample_ids, 1) AS pos FROM one),
        t AS ({_TURN_NAMESPACE})
        SELECT {_namespaced(con, "s", ["date"])} FROM b JOIN samples s USING (sample_id) LEFT JOIN t USING (turn_id)
        ORDER BY b.pos
    """
    return con.sql(sql, params={"batch_id": batch_id}).to_arrow_table()


def batch_manifest(con: duckdb.DuckDBPyConnection, batch_id: str) -> list[dict[str, Any]]:
    """One row per sample of a batch (lineage): sample_id, namespace, session_id, turn_id, reward,
    has_teacher, weight_version."""
    cols = ["sample_id", "namespace", "session_id", "turn_id", "reward", "has_teacher", "weight_version"]
    return batch_samples(con, batch_id).select(cols).to_pylist()


def checkpoint_exists(con: duckdb.DuckDBPyConnection, weight_version: str) -> bool:
    return con.execute("SELECT count(*) FROM checkpoints WHERE weight_version = $v",
                       {"v": str(weight_version)}).fetchall()[0][0] > 0


def waiting_step(con: duckdb.DuckDBPyConnection, judge_config_hash: str, rollout_batch_size: int) -> int | None:
    """The step (= the weight version it makes) a train run would take next, when a batch waits for it: one
    claimed and not yet checkpointed, or a full batch of trainable samples (staler ones counted: the claim sets
    them aside); None when none waits."""
    pending = open_batch(con)
    if pending is not None:
        return int(pending["step"])
    if pending_counts(con, judge_config_hash, rollout_batch_size)["full_batches"] < 1:
        return None
    return latest_version(con) + 1


def latest_version(con: duckdb.DuckDBPyConnection) -> int:
    """The newest trained weight version recorded in ``checkpoints`` (0 before any step)."""
    value = con.execute("SELECT max(step) FROM checkpoints").fetchall()[0][0]
    return 0 if value is None else int(value)


def find_checkpoint(con: duckdb.DuckDBPyConnection, weight_version: str = "latest") -> dict[str, Any] | None:
    """The ``checkpoints`` row of ``weight_version`` ("latest": the newest step's), or None."""
    rows = _rows(con, "SELECT * EXCLUDE (date) FROM checkpoints WHERE $v IN ('latest', weight_version) "
                 "ORDER BY step DESC LIMIT 1", v=str(weight_version))
    return rows[0] if rows else None


def recorded_checkpoints(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """Every ``checkpoints`` row (the first of each weight version), oldest step first."""
    return _rows(con, f"SELECT * FROM ({_first('checkpoints', 'weight_version')}) ORDER BY step")


def version_for_run(con: duckdb.DuckDBPyConnection, mlflow_run_id: str) -> str | None:
    """The weight version the MLflow run ``mlflow_run_id`` trained, or None."""
    rows = con.execute("SELECT weight_version FROM checkpoints WHERE mlflow_run_id = $r ORDER BY created_at LIMIT 1",
                       {"r": mlflow_run_id}).fetchall()
    return str(rows[0][0]) if rows else None


def _chain(con: duckdb.DuckDBPyConnection) -> str:
    """SQL: every checkpoint with the batch that trained it (the first write of each)."""
    have = _columns(con, "batches")
    newer = ", ".join(f"b.{c}" if c in have else f"NULL::{t} AS {c}"
                      for c, t in (("session_namespaces", "VARCHAR[]"), ("source_batch_id", "VARCHAR")))
    return f"""
        WITH c AS ({_first("checkpoints", "weight_version")}), b AS ({_first("batches", "batch_id")})
        SELECT c.step, c.weight_version, c.parent_version, c.batch_id, c.sha256, c.mlflow_run_id, c.path,
               b.config_hash, b.sample_ids, b.session_ids, b.method, {newer}
        FROM c JOIN b USING (batch_id)
    """


def lineage_chain(con: duckdb.DuckDBPyConnection, weight_version: str) -> list[dict[str, Any]]:
    """What trained ``weight_version``: that checkpoint and every ancestor back to version 1, each with
    its batch, sessions (``sessions``: sorted [namespace, session_id] pairs) and turns (newest first).
    Empty when the version is unknown."""
    rows = _rows(con, _chain(con) + "WHERE c.step <= (SELECT max(step) FROM c WHERE weight_version = $v) "
                 "ORDER BY c.step DESC", v=str(weight_version))
    for r in rows:
        manifest = batch_manifest(con, r["batch_id"])
        r["turn_ids"] = [t["turn_id"] for t in manifest]
        if r["session_namespaces"] is not None:
            r["sessions"] = sorted(map(list, zip(r["session_namespaces"], r["session_ids"])))
        else:  # a batch written before namespaces were recorded: its samples' namespaces
            r["sessions"] = sorted(map(list, {(t["namespace"], t["session_id"]) for t in manifest}))
    return rows


def session_namespaces(con: duckdb.DuckDBPyConnection, session_ids: Sequence[str]) -> dict[str, list[str]]:
    """The API-key namespaces holding a session of each id in ``session_ids`` (its turns or its
    samples), sorted; an id no namespace holds is left out."""
    sql = f"""
        WITH t AS ({_TURN_NAMESPACE}),
        sm AS (SELECT {_namespaced(con, "s", ["date"])} FROM samples s LEFT JOIN t USING (turn_id)
               WHERE list_contains($ids, s.session_id))
        SELECT DISTINCT session_id, namespace FROM turns WHERE list_contains($ids, session_id)
        UNION SELECT session_id, namespace FROM sm ORDER BY ALL
    """
    found: dict[str, list[str]] = {}
    for sid, ns in con.execute(sql, {"ids": list(session_ids)}).fetchall():
        found.setdefault(sid, []).append(ns)
    return found


def replay_plan(con: duckdb.DuckDBPyConnection, weight_version: str) -> list[dict[str, Any]]:
    """The batches that produced versions 1..``weight_version`` in training order, each with its
    original checkpoint hash and config hash. Raises when a version in the chain is missing."""
    rows = _rows(con, _chain(con) + "WHERE c.step <= $v ORDER BY c.step", v=int(weight_version))
    steps = [r["step"] for r in rows]
    if steps != list(range(1, int(weight_version) + 1)):
        have = ("none" if not steps else f"{steps[0]}..{steps[-1]}" if steps == list(range(steps[0], steps[-1] + 1))
                else ", ".join(map(str, steps[:12])) + (", ..." if len(steps) > 12 else ""))
        newest = latest_version(con)
        raise ValueError(f"cannot replay to version {weight_version}: the recorded steps up to it are {have}"
                         + (f" (the newest version is {newest})" if newest else " (no version trained yet)"))
    return rows


def config_snapshot_path(data_root: str | os.PathLike, config_hash: str) -> Path:
    return Path(data_root) / "configs" / f"{config_hash}.toml"


def write_config_snapshot(data_root: str | os.PathLike, config_hash: str, toml_text: str) -> Path:
    """The full effective config a batch was trained with, kept by hash for replay (written once,
    atomically)."""
    path = config_snapshot_path(data_root, config_hash)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(toml_text)
        os.replace(tmp, path)
    return path


def session_turns(con: duckdb.DuckDBPyConnection, session_pattern: str) -> list[dict[str, Any]]:
    """Turns of the sessions whose id matches a SQL LIKE pattern, oldest first (one row per turn)."""
    sql = _first("turns", "turn_id", where="WHERE session_id LIKE $p") + " ORDER BY session_id, turn_index"
    return _rows(con, sql, p=session_pattern)


def session_log(con: duckdb.DuckDBPyConnection, namespace: str, session_id: str) -> list[dict[str, Any]]:
    """One session of one API-key namespace, by turn index: turn_index, turn_type, text,
    weight_version, finish_reason, created_at, has_next_state (true / false: none will come / NULL:
    still waiting) and next_state_reason. Another namespace's session of the same id is not part of it."""
    turns = _first("turns", "turn_id", where="WHERE namespace = $ns AND session_id = $sid")
    next_state = _first("next_states", "turn_id", where="WHERE session_id = $sid",
                        columns="turn_id, has_next_state, reason", order="has_next_state DESC, created_at")
    return _rows(con, f"""
        WITH t AS ({turns}), ns AS ({next_state})
        SELECT t.turn_index, t.turn_type, t.text, t.weight_version, t.finish_reason, t.created_at,
               ns.has_next_state, ns.reason AS next_state_reason
        FROM t LEFT JOIN ns USING (turn_id) ORDER BY t.turn_index, t.created_at
    """, ns=namespace, sid=session_id)


def turn_by_id(con: duckdb.DuckDBPyConnection, namespace: str, turn_id: str) -> dict[str, Any] | None:
    """One turn of one API-key namespace (session_id, request_messages, request_tools, request_params,
    text), or None: what a Responses request's previous_response_id continues."""
    rows = _rows(con, _first("turns", "turn_id", where="WHERE namespace = $ns AND turn_id = $tid", columns=(
        "session_id, request_messages, request_tools, request_params, text, created_at")), ns=namespace, tid=turn_id)
    return rows[0] if rows else None


def session_states(con: duckdb.DuckDBPyConnection, limit: int) -> list[dict[str, Any]]:
    """What a restarted gateway needs to continue its sessions: one row per (namespace, session_id)
    of the ``limit`` most recently active, newest first.

    Columns: namespace, session_id, next_index (1 + the highest turn index stored, so a returning
    session never reuses an index), age_s (seconds since its last turn completed), and, when its
    last main turn has no next-state row yet (the session waits for the user's reply),
    pending_turn_id, pending_turn_index, pending_message_count (messages in that turn's
    request) and pending_n (the choices its request asked for); else those are NULL.
    """
    turns = _first("turns", "turn_id", columns="namespace, session_id, turn_id, turn_index, turn_type, completed_at")
    rows = _rows(con, f"""
        WITH t AS ({turns}),
        s AS (
            SELECT namespace, session_id, max(turn_index) + 1 AS next_index, max(completed_at) AS last_at
            FROM t GROUP BY namespace, session_id ORDER BY last_at DESC, session_id LIMIT {int(limit)}),
        m AS (
            SELECT namespace, session_id, turn_id, turn_index FROM t WHERE turn_type = '{_MAIN}'
            QUALIFY row_number() OVER (PARTITION BY namespace, session_id
                                       ORDER BY turn_index DESC, completed_at DESC) = 1)
        SELECT s.namespace, s.session_id, s.next_index,
               greatest(date_diff('millisecond', s.last_at, now()), 0) / 1000.0 AS age_s,
               m.turn_id AS pending_turn_id, m.turn_index AS pending_turn_index
        FROM s LEFT JOIN m ON m.namespace = s.namespace AND m.session_id = s.session_id
               AND m.turn_id NOT IN (SELECT turn_id FROM next_states)
        ORDER BY s.last_at DESC, s.session_id
    """)
    # Message counts in a second pass, for the pending turns only: request_messages holds whole
    # conversations, and a constant IN list lets the scan skip the rows it does not need.
    pending = [r["pending_turn_id"] for r in rows if r["pending_turn_id"] is not None]
    counts: dict[str, tuple[int, int]] = {}
    for i in range(0, len(pending), 1000):
        ids = ", ".join(sql_str(t) for t in pending[i : i + 1000])
        counts.update((t, (m, n)) for t, m, n in con.sql(
            f"SELECT turn_id, json_array_length(request_messages), "
            f"coalesce(try_cast(json_extract(request_params, '$.n') AS INTEGER), 1) FROM turns "
            f"WHERE turn_id IN ({ids})").fetchall())
    for r in rows:
        r["pending_message_count"], r["pending_n"] = counts.get(r["pending_turn_id"], (None, None))
    return rows


def choice_turns(con: duckdb.DuckDBPyConnection, namespace: str, session_id: str, first_index: int,
                 n: int) -> list[dict[str, Any]]:
    """The n turns one request with ``n`` choices made (choice i at turn index ``first_index + i``):
    turn_index, text and request_tools, in index order (a restarted gateway tells its choices apart)."""
    turns = _first("turns", "turn_id", columns="namespace, session_id, turn_index, text, request_tools, created_at")
    return _rows(con, f"""
        SELECT turn_index, text, request_tools FROM ({turns})
        WHERE namespace = {sql_str(namespace)} AND session_id = {sql_str(session_id)}
          AND turn_index BETWEEN {int(first_index)} AND {int(first_index) + int(n) - 1}
        ORDER BY turn_index""")


def sync_state(con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    """Where weight sync stands, for ``clawrl status``.

    Keys: attempts, failures (rows of ``syncs``); last (the newest attempt as a ``syncs`` row, or
    None); last_ok (the newest successful attempt, or None); last_failed (the newest failed attempt,
    or None); serving (the version the engine
    reported after the newest attempt; None when it did not answer); last_seen_serving (the newest
    version any attempt saw served); latest_checkpoint (newest trained version, 0 before any step);
    waiting (trained versions newer than ``last_seen_serving``; every trained version when no sync
    ever saw one served: the engine still serves the initial weights), except candidates the
    promotion gate refused and versions a rollback served away from.
    """
    rows = _rows(con, "SELECT * EXCLUDE (date) FROM syncs ORDER BY created_at DESC")
    last = rows[0] if rows else None
    last_ok = next((r for r in rows if r["ok"]), None)
    seen = next((r["serving_version"] for r in rows if r["serving_version"] is not None), None)
    latest = latest_version(con)
    unserved = unserved_versions(con)  # refused, or rolled back from: not waiting for a sync
    waiting = [str(v) for v in range((0 if seen is None else parse_version(seen)) + 1, latest + 1)
               if str(v) not in unserved]
    return {"attempts": len(rows), "failures": sum(not r["ok"] for r in rows), "last": last, "last_ok": last_ok,
            "last_failed": next((r for r in rows if not r["ok"]), None),
            "serving": None if last is None else last["serving_version"], "last_seen_serving": seen,
            "latest_checkpoint": latest, "waiting": waiting}


def last_synced_checkpoint(con: duckdb.DuckDBPyConnection) -> dict[str, Any] | None:
    """The checkpoint of the newest successful sync (weight_version, path, sha256), or None: what a
    restarted engine should serve again. A version whose load killed the engine never counts."""
    rows = _rows(con, """
        SELECT c.weight_version, c.path, c.sha256 FROM syncs s JOIN checkpoints c USING (weight_version)
        WHERE s.ok ORDER BY s.created_at DESC LIMIT 1
    """)
    return rows[0] if rows else None
