"""DuckDB over the Parquet tables: views for ad-hoc SQL and the queries the flows and ``clawrl status`` need.

Each call opens an in-memory DuckDB. A ``.duckdb`` file would let only one process open it
(ref/stack.md section 4); Parquet plus in-memory DuckDB lets any number of readers run next to
the writers. Readers only ever see complete files (storage/writer.py).

Views (every one exists on an empty data root: empty, with the columns below). Each also has
``date`` (DATE), the UTC date of ``created_at`` taken from the hive directory ``date=YYYY-MM-DD``;
filtering on it skips whole directories. Times are TIMESTAMP WITH TIME ZONE (UTC), id lists
INTEGER[], log-prob lists DOUBLE[] (exact engine values), ``*_json`` columns below are JSON text.

``turns`` -- one served assistant turn, exactly as generated (``TurnRecord``):
    turn_id, session_id, turn_index (0-based within the session), turn_type ('main' trainable /
    'side' never trained), namespace (API-key namespace, 'open' without keys), model (served name),
    weight_version (policy that produced it), request_messages (JSON messages the client sent),
    request_tools (JSON or NULL), request_params (JSON sampling parameters used), prompt_ids
    (rendered prompt), output_ids (sampled ids, EOS included), rollout_logprobs (engine log-prob
    of each output id, same length), text (content returned), tool_calls (JSON or NULL),
    finish_reason (stop | length | tool_calls | abort), created_at (request received),
    completed_at (response complete), latency_ms, weight_versions (JSON spans when the weights
    changed mid-turn, '[]' otherwise).
``next_states`` -- the evidence for a turn (``NextStateRecord``):
    turn_id, session_id, turn_index, has_next_state (false: none will come), messages (JSON
    messages added after the turn: user reply or tool results; NULL without one), reason
    (next_request | session_done | idle_timeout | evicted | shutdown), created_at.
``judgments`` -- the judge's verdict per turn and judge configuration (``JudgeVerdict``, stored
    as table ``verdicts``): turn_id, judge_config_hash, judge_backend, score (-1/0/+1 after the
    vote), score_reason (majority | tie | all_failed | rule:<rule>), votes (INTEGER[], NULL =
    unparseable vote), raw_outputs (JSON list of every raw judge reply), hint (selected hindsight
    hint or NULL), hint_raw_outputs (JSON or NULL), error (judge backend failure or NULL),
    created_at. One row per (turn_id, judge_config_hash): the newest verdict, i.e. the one of the
    attempt that wrote the fate (an attempt killed before its fate is judged again).
``judgment_attempts`` -- every verdict ever written, superseded attempts included (same columns).
``samples`` -- one trainable sample (``SampleRecord``), one row per sample_id (the newest write):
    sample_id, turn_id, session_id, judge_config_hash, method (grpo | on_policy_distillation |
    combine), prompt_ids, output_ids, rollout_logprobs, reward (judge score, 0.0 if the method uses none), has_teacher,
    teacher_logprobs (DOUBLE[] over output_ids, NULL without a teacher), weight_version (policy
    that sampled output_ids), created_at.
``turn_fate`` -- what became of each turn under one judge configuration (``FateRecord``):
    turn_id, session_id, judge_config_hash, fate (sample | side_turn | no_next_state |
    score_zero | no_hint | judge_error | too_stale), detail (why, free text), created_at.
``batches`` -- the samples one PPO step consumed, written before the step (``BatchRecord``):
    batch_id, step, sample_ids (VARCHAR[]), session_ids (VARCHAR[]), method, config_hash,
    parent_version (weights the step starts from), created_at.
``checkpoints`` -- saved policy versions and what produced them (``CheckpointRecord``):
    weight_version, step, batch_id, parent_version, path, sha256 (of the safetensors bytes),
    mlflow_run_id (or NULL), created_at.
``syncs`` -- one row per attempt to push a version into a serving engine (``SyncRecord``):
    sync_id, weight_version (pushed), target (engine URL or 'in-process'), ok, skipped (the
    engine already served it), error (why not, NULL when ok), serving_version (what the engine
    reported afterwards; NULL when it did not answer), checkpoint_path, mlflow_run_id (the run of
    the step that made the version), started_at, seconds, created_at (when the attempt ended).

A view is bound to the files at query time, so a long-lived connection sees new files, except
that a table with no file at all when the connection was opened stays an empty view until
``refresh_views`` (DuckDB cannot glob a pattern that matches nothing). ``run_query`` and the
helpers below open a fresh connection per call, so this only concerns callers of ``open_catalog``.
"""

from __future__ import annotations

import csv
import io
import os
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import duckdb
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from clawrl.records import Fate, TurnType
from clawrl.storage.schemas import TABLES, duckdb_type

# view name -> table directory under <data_root>/tables/
VIEWS: dict[str, str] = {
    "turns": "turns",
    "next_states": "next_states",
    "judgments": "verdicts",
    "samples": "samples",
    "turn_fate": "turn_fate",
    "batches": "batches",
    "checkpoints": "checkpoints",
    "syncs": "syncs",
    "judgment_attempts": "verdicts",
}

# Views that show one row per key, the newest write: a judge attempt cut short by a crash before
# its fate was written is re-run, and the re-run's verdict and sample supersede the first ones
# (the fate, written last, belongs to the newest). The superseded rows stay in the files
# (``judgment_attempts`` lists every verdict written).
LATEST_BY: dict[str, str] = {
    "judgments": "turn_id, judge_config_hash",
    "samples": "sample_id",
}

EXPORT_FORMATS = ("csv", "json", "parquet")


def tables_dir(data_root: str | os.PathLike) -> Path:
    return Path(data_root) / "tables"


def open_catalog(data_root: str | os.PathLike) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the views above over ``<data_root>/tables/``."""
    # No progress bar: it would be drawn into `clawrl sql --format csv` output.
    con = duckdb.connect(":memory:")
    con.execute("SET enable_progress_bar = false")
    refresh_views(con, data_root)
    return con


def refresh_views(con: duckdb.DuckDBPyConnection, data_root: str | os.PathLike) -> None:
    """(Re)define every view; a table that has gained its first file since the last call now shows it."""
    root = tables_dir(data_root)
    for view, table in VIEWS.items():
        table_dir = root / table
        if any(table_dir.glob("date=*/*.parquet")):
            pattern = _sql_str(str(table_dir / "date=*" / "*.parquet"))
            # union_by_name: files written before a column was added read it as NULL.
            latest = (f" QUALIFY row_number() OVER (PARTITION BY {LATEST_BY[view]} ORDER BY created_at DESC) = 1"
                      if view in LATEST_BY else "")
            con.execute(
                f"CREATE OR REPLACE VIEW {view} AS SELECT * FROM read_parquet({pattern}, "
                "hive_partitioning = true, hive_types = {'date': DATE}, union_by_name = true)" + latest
            )
        else:
            # Typed NULLs, not a registered Arrow table: con.register imports pandas (~2 s).
            columns = [f"NULL::{duckdb_type(f.type)} AS {f.name}" for f in TABLES[table].schema]
            con.execute(f"CREATE OR REPLACE VIEW {view} AS SELECT {', '.join(columns)}, NULL::DATE AS date WHERE false")


class ReadOnlyQueryError(ValueError):
    """A statement other than a query was sent to a read-only catalog."""


def open_readonly_catalog(data_root: str | os.PathLike) -> duckdb.DuckDBPyConnection:
    """The views of ``open_catalog`` on a connection that cannot touch any file but the tables' Parquet.

    After the views are defined: DuckDB may only open paths under ``<data_root>/tables/``
    (``allowed_directories`` + ``enable_external_access = false``: no reading /etc/passwd, no
    ATTACH, no INSTALL/LOAD of extensions), never spills to a temp directory, and the configuration
    is locked so a ``SET`` cannot undo any of it. DuckDB cannot tell reads from writes inside an
    allowed directory, so the statements themselves are checked too (``check_read_only``).
    """
    con = duckdb.connect(":memory:", config={"temp_directory": "", "autoinstall_known_extensions": False,
                                             "autoload_known_extensions": False})
    con.execute("SET enable_progress_bar = false")
    refresh_views(con, data_root)
    con.execute(f"SET allowed_directories = [{_sql_str(str(tables_dir(data_root)) + os.sep)}]")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


_EXPLAIN = re.compile(r"^\s*explain\s+(?:analy[sz]e\s+)?(?:\([^)]*\)\s*)?(.*)$", re.IGNORECASE | re.DOTALL)


def check_read_only(sql: str) -> None:
    """Raise ``ReadOnlyQueryError`` unless every statement in ``sql`` is a query (SELECT, WITH,
    FROM, VALUES, DESCRIBE, SHOW, SUMMARIZE, or EXPLAIN of one). COPY, EXPORT, CREATE, INSERT,
    ATTACH, INSTALL, LOAD, SET, PRAGMA and CALL are refused; so is EXPLAIN ANALYZE COPY, which would
    run the COPY. A statement DuckDB cannot parse passes, so DuckDB reports the syntax error itself."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error:
        return
    for st in statements:
        kind = st.type
        if kind == duckdb.StatementType.EXPLAIN:
            m = _EXPLAIN.match(st.query.strip().rstrip(";"))
            try:
                inner = duckdb.extract_statements(m.group(1)) if m else []
            except duckdb.Error:
                inner = []
            if inner and all(s.type == duckdb.StatementType.SELECT for s in inner):
                continue
        elif kind == duckdb.StatementType.SELECT:
            continue
        name = (st.query.split() or [kind.name])[0].upper()  # INSTALL, not DuckDB's LOAD_STATEMENT
        raise ReadOnlyQueryError(f"the catalog is read-only: {name} statements are not allowed, only queries "
                                 "(SELECT ...); to save a result use --format csv|json|parquet --out FILE")


def run_query(data_root: str | os.PathLike, sql: str, *, read_only: bool = False) -> pa.Table:
    """Run SQL over the views in a fresh in-memory DuckDB and return the result.

    ``read_only`` (what ``clawrl sql`` uses): queries only, on ``open_readonly_catalog``; anything
    else raises ``ReadOnlyQueryError`` before it runs. Otherwise nothing here writes the data root,
    though DuckDB's own COPY/EXPORT are not blocked. Raises ``duckdb.Error`` with DuckDB's message
    for a bad query. A statement with no result (SET, CREATE ...) returns an empty table.
    """
    if read_only:
        check_read_only(sql)
    con = open_readonly_catalog(data_root) if read_only else open_catalog(data_root)
    try:
        rel = con.sql(sql)
        return rel.to_arrow_table() if rel is not None else pa.table({})
    finally:
        con.close()


# ------------------------------------------------------------------------------ flow queries

_FIRST_NEXT_STATE = """
    SELECT turn_id, messages AS next_messages, reason AS next_reason, created_at AS next_state_at
    FROM next_states WHERE has_next_state
    QUALIFY row_number() OVER (PARTITION BY turn_id ORDER BY created_at) = 1
"""

_MAIN_TURNS = f"""
    SELECT * EXCLUDE (date) FROM turns WHERE turn_type = '{TurnType.MAIN.value}'
    QUALIFY row_number() OVER (PARTITION BY turn_id ORDER BY created_at) = 1
"""


def ready_turns(
    con: duckdb.DuckDBPyConnection, judge_config_hash: str, *, limit: int | None = None
) -> pa.Table:
    """Main turns whose next state has arrived and that have no fate under this judge config.

    Columns: every ``turns`` column (prompt_ids, output_ids, rollout_logprobs, request_messages,
    ...) plus next_messages, next_reason and next_state_at from the turn's first next state.
    Oldest first. A turn written twice (same turn_id) appears once.
    """
    sql = f"""
        WITH t AS ({_MAIN_TURNS}), ns AS ({_FIRST_NEXT_STATE})
        SELECT t.*, ns.next_messages, ns.next_reason, ns.next_state_at
        FROM t JOIN ns USING (turn_id)
        WHERE NOT EXISTS (
            SELECT 1 FROM turn_fate f WHERE f.turn_id = t.turn_id AND f.judge_config_hash = $hash)
        ORDER BY t.created_at, t.turn_id
        {'' if limit is None else f'LIMIT {int(limit)}'}
    """
    return con.sql(sql, params={"hash": judge_config_hash}).to_arrow_table()


def turns_to_judge(
    con: duckdb.DuckDBPyConnection, judge_config_hash: str, *, limit: int | None = None,
    turn_id: str | None = None,
) -> pa.Table:
    """Every turn the judge flow can decide now, oldest first, with no fate under this config:
    main turns whose next state arrived (``next_has_state`` true), main turns told that none will
    come (false), and side turns (NULL next-state columns). Main turns still waiting are left out.

    Columns: every ``turns`` column plus next_has_state, next_messages, next_reason, next_state_at.
    ``turn_id`` restricts the answer to that one turn.
    """
    only = "" if turn_id is None else "WHERE turn_id = $turn_id"
    params = {"hash": judge_config_hash} | ({} if turn_id is None else {"turn_id": turn_id})
    sql = f"""
        WITH t AS (
            SELECT * EXCLUDE (date) FROM turns {only}
            QUALIFY row_number() OVER (PARTITION BY turn_id ORDER BY created_at) = 1),
        ns AS (
            SELECT turn_id, has_next_state AS next_has_state, messages AS next_messages,
                   reason AS next_reason, created_at AS next_state_at
            FROM next_states {only}
            QUALIFY row_number() OVER (PARTITION BY turn_id ORDER BY has_next_state DESC, created_at) = 1)
        SELECT t.*, ns.next_has_state, ns.next_messages, ns.next_reason, ns.next_state_at
        FROM t LEFT JOIN ns USING (turn_id)
        WHERE (t.turn_type = '{TurnType.SIDE.value}' OR ns.turn_id IS NOT NULL)
          AND NOT EXISTS (
            SELECT 1 FROM turn_fate f WHERE f.turn_id = t.turn_id AND f.judge_config_hash = $hash)
        ORDER BY t.created_at, t.turn_id
        {'' if limit is None else f'LIMIT {int(limit)}'}
    """
    return con.sql(sql, params=params).to_arrow_table()


_LATEST_FATE = """
    SELECT turn_id, fate FROM turn_fate WHERE judge_config_hash = $hash
    QUALIFY row_number() OVER (PARTITION BY turn_id ORDER BY created_at DESC) = 1
"""

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
                      AND f.fate <> '{Fate.SAMPLE.value}')
      AND NOT (EXISTS (SELECT 1 FROM judgment_attempts j WHERE j.turn_id = s.turn_id
                       AND j.judge_config_hash = $hash)
               AND NOT EXISTS (SELECT 1 FROM turn_fate f WHERE f.turn_id = s.turn_id
                               AND f.judge_config_hash = $hash))
"""


def trainable_samples(con: duckdb.DuckDBPyConnection, judge_config_hash: str) -> pa.Table:
    """Usable samples under this judge config (see ``_USABLE_SAMPLES``) not yet consumed by a batch,
    oldest turn first (ties by sample id). Ordered by the turn's time, not the sample's: which
    samples share a batch must not depend on the order the judge happened to finish them in (its
    turns run concurrently, and a turn re-judged after a crash gets a later sample row), or a run
    with a crash would train other batches than one without."""
    sql = f"""
        WITH u AS ({_USABLE_SAMPLES}),
        t AS (SELECT turn_id, min(created_at) AS turn_at FROM turns GROUP BY turn_id)
        SELECT u.* FROM u LEFT JOIN t USING (turn_id)
        WHERE u.sample_id NOT IN ({_CONSUMED})
        ORDER BY coalesce(t.turn_at, u.created_at), u.sample_id
    """
    return con.sql(sql, params={"hash": judge_config_hash}).to_arrow_table()


def custom_samples(con: duckdb.DuckDBPyConnection, records: list, store) -> list[dict[str, Any]]:
    """Samples from a ``[hooks] sample_source``: store the ones not stored yet, drop consumed ones,
    and return them as rows (oldest first, as the hook gave them)."""
    from dataclasses import asdict

    ids = [r.sample_id for r in records]
    known = {r[0] for r in con.execute("SELECT DISTINCT sample_id FROM samples WHERE list_contains($ids, sample_id)",
                                       {"ids": ids}).fetchall()}
    used = {r[0] for r in con.execute(f"SELECT sample_id FROM ({_CONSUMED}) WHERE list_contains($ids, sample_id)",
                                      {"ids": ids}).fetchall()}
    new = [r for r in records if r.sample_id not in known]
    if new:
        store.append(new)
        store.flush()
    return [asdict(r) for r in records if r.sample_id not in used]


def open_batch(con: duckdb.DuckDBPyConnection) -> dict[str, Any] | None:
    """The newest batch with no checkpoint yet (a step that was claimed but not finished), or None."""
    rows = con.sql("""
        SELECT * EXCLUDE (date) FROM batches b
        WHERE NOT EXISTS (SELECT 1 FROM checkpoints c WHERE c.batch_id = b.batch_id)
        ORDER BY created_at DESC LIMIT 1
    """).to_arrow_table().to_pylist()
    return rows[0] if rows else None


def batch_samples(con: duckdb.DuckDBPyConnection, batch_id: str) -> pa.Table:
    """The samples a batch lists, in the batch's order."""
    sql = """
        WITH one AS (SELECT sample_ids FROM batches WHERE batch_id = $batch_id ORDER BY created_at LIMIT 1),
        b AS (SELECT unnest(sample_ids) AS sample_id, generate_subscripts(sample_ids, 1) AS pos FROM one),
        s AS (SELECT * EXCLUDE (date) FROM samples
              QUALIFY row_number() OVER (PARTITION BY sample_id ORDER BY created_at DESC) = 1)
        SELECT s.* FROM b JOIN s USING (sample_id) ORDER BY b.pos
    """
    return con.sql(sql, params={"batch_id": batch_id}).to_arrow_table()


def batch_manifest(con: duckdb.DuckDBPyConnection, batch_id: str) -> list[dict[str, Any]]:
    """One row per sample of a batch (lineage): sample_id, session_id, turn_id, reward, has_teacher,
    weight_version."""
    cols = ["sample_id", "session_id", "turn_id", "reward", "has_teacher", "weight_version"]
    return batch_samples(con, batch_id).select(cols).to_pylist()


def checkpoint_exists(con: duckdb.DuckDBPyConnection, weight_version: str) -> bool:
    return con.execute("SELECT count(*) FROM checkpoints WHERE weight_version = $v",
                       {"v": str(weight_version)}).fetchall()[0][0] > 0


def lineage_chain(con: duckdb.DuckDBPyConnection, weight_version: str) -> list[dict[str, Any]]:
    """What trained ``weight_version``: that checkpoint and every ancestor back to version 1, each with
    its batch, sessions and turns (newest first). Empty when the version is unknown."""
    rows = con.sql("""
        WITH c AS (SELECT * EXCLUDE (date) FROM checkpoints
                   QUALIFY row_number() OVER (PARTITION BY weight_version ORDER BY created_at) = 1),
        b AS (SELECT * EXCLUDE (date) FROM batches
              QUALIFY row_number() OVER (PARTITION BY batch_id ORDER BY created_at) = 1)
        SELECT c.weight_version, c.step, c.parent_version, c.batch_id, c.sha256, c.mlflow_run_id, c.path,
               b.sample_ids, b.session_ids, b.method
        FROM c JOIN b USING (batch_id)
        WHERE c.step <= (SELECT max(step) FROM c WHERE weight_version = $v)
        ORDER BY c.step DESC
    """, params={"v": str(weight_version)}).to_arrow_table().to_pylist()
    for r in rows:
        r["turn_ids"] = [t["turn_id"] for t in batch_manifest(con, r["batch_id"])]
    return rows


def session_turns(con: duckdb.DuckDBPyConnection, session_pattern: str) -> list[dict[str, Any]]:
    """Turns of the sessions whose id matches a SQL LIKE pattern, oldest first (one row per turn)."""
    return con.sql("""
        SELECT * EXCLUDE (date) FROM turns WHERE session_id LIKE $p
        QUALIFY row_number() OVER (PARTITION BY turn_id ORDER BY created_at) = 1
        ORDER BY session_id, turn_index
    """, params={"p": session_pattern}).to_arrow_table().to_pylist()


def session_log(con: duckdb.DuckDBPyConnection, namespace: str, session_id: str) -> list[dict[str, Any]]:
    """One session of one API-key namespace, by turn index: turn_index, turn_type, text,
    weight_version, finish_reason, created_at, has_next_state (true / false: none will come / NULL:
    still waiting) and next_state_reason. Another namespace's session of the same id is not part of it."""
    return con.sql("""
        WITH t AS (SELECT * EXCLUDE (date) FROM turns WHERE namespace = $ns AND session_id = $sid
                   QUALIFY row_number() OVER (PARTITION BY turn_id ORDER BY created_at) = 1),
        ns AS (SELECT turn_id, has_next_state, reason FROM next_states WHERE session_id = $sid
               QUALIFY row_number() OVER (PARTITION BY turn_id ORDER BY has_next_state DESC, created_at) = 1)
        SELECT t.turn_index, t.turn_type, t.text, t.weight_version, t.finish_reason, t.created_at,
               ns.has_next_state, ns.reason AS next_state_reason
        FROM t LEFT JOIN ns USING (turn_id) ORDER BY t.turn_index, t.created_at
    """, params={"ns": namespace, "sid": session_id}).to_arrow_table().to_pylist()


def version_for_run(con: duckdb.DuckDBPyConnection, mlflow_run_id: str) -> str | None:
    """The weight version the MLflow run ``mlflow_run_id`` trained, or None."""
    rows = con.execute("SELECT weight_version FROM checkpoints WHERE mlflow_run_id = $r ORDER BY created_at LIMIT 1",
                       {"r": mlflow_run_id}).fetchall()
    return str(rows[0][0]) if rows else None


def session_states(con: duckdb.DuckDBPyConnection, limit: int) -> list[dict[str, Any]]:
    """What a restarted gateway needs to continue its sessions: one row per (namespace, session_id)
    of the ``limit`` most recently active, newest first.

    Columns: namespace, session_id, next_index (1 + the highest turn index stored, so a returning
    session never reuses an index), age_s (seconds since its last turn completed), and, when its
    last main turn has no next-state row yet (the session waits for the user's reply),
    pending_turn_id, pending_turn_index and pending_message_count (messages in that turn's
    request); else those three are NULL.
    """
    rows = con.sql(f"""
        WITH t AS (
            SELECT namespace, session_id, turn_id, turn_index, turn_type, completed_at
            FROM turns QUALIFY row_number() OVER (PARTITION BY turn_id ORDER BY created_at) = 1),
        s AS (
            SELECT namespace, session_id, max(turn_index) + 1 AS next_index, max(completed_at) AS last_at
            FROM t GROUP BY namespace, session_id ORDER BY last_at DESC, session_id LIMIT {int(limit)}),
        m AS (
            SELECT namespace, session_id, turn_id, turn_index FROM t WHERE turn_type = '{TurnType.MAIN.value}'
            QUALIFY row_number() OVER (PARTITION BY namespace, session_id
                                       ORDER BY turn_index DESC, completed_at DESC) = 1)
        SELECT s.namespace, s.session_id, s.next_index,
               greatest(date_diff('millisecond', s.last_at, now()), 0) / 1000.0 AS age_s,
               m.turn_id AS pending_turn_id, m.turn_index AS pending_turn_index
        FROM s LEFT JOIN m ON m.namespace = s.namespace AND m.session_id = s.session_id
               AND m.turn_id NOT IN (SELECT turn_id FROM next_states)
        ORDER BY s.last_at DESC, s.session_id
    """).to_arrow_table().to_pylist()
    # Message counts in a second pass, for the pending turns only: request_messages holds whole
    # conversations, and a constant IN list lets the scan skip the rows it does not need.
    pending = [r["pending_turn_id"] for r in rows if r["pending_turn_id"] is not None]
    counts: dict[str, int] = {}
    for i in range(0, len(pending), 1000):
        ids = ", ".join(_sql_str(t) for t in pending[i : i + 1000])
        counts.update(con.sql(f"SELECT turn_id, json_array_length(request_messages) FROM turns "
                              f"WHERE turn_id IN ({ids})").fetchall())
    for r in rows:
        r["pending_message_count"] = counts.get(r["pending_turn_id"]) if r["pending_turn_id"] else None
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


def replay_plan(con: duckdb.DuckDBPyConnection, weight_version: str) -> list[dict[str, Any]]:
    """The batches that produced versions 1..``weight_version`` in training order, each with its
    original checkpoint hash and config hash. Raises when a version in the chain is missing."""
    rows = con.sql("""
        WITH c AS (SELECT * EXCLUDE (date) FROM checkpoints
                   QUALIFY row_number() OVER (PARTITION BY weight_version ORDER BY created_at) = 1),
        b AS (SELECT * EXCLUDE (date) FROM batches
              QUALIFY row_number() OVER (PARTITION BY batch_id ORDER BY created_at) = 1)
        SELECT c.step, c.weight_version, c.batch_id, c.sha256, c.mlflow_run_id, c.path, b.config_hash, b.sample_ids,
               b.session_ids, b.method
        FROM c JOIN b USING (batch_id)
        WHERE c.step <= $v ORDER BY c.step
    """, params={"v": int(weight_version)}).to_arrow_table().to_pylist()
    steps = [r["step"] for r in rows]
    if steps != list(range(1, int(weight_version) + 1)):
        raise ValueError(f"cannot replay to version {weight_version}: recorded steps are {steps}")
    return rows


def latest_version(con: duckdb.DuckDBPyConnection) -> int:
    """The newest trained weight version recorded in ``checkpoints`` (0 before any step)."""
    value = con.execute("SELECT max(step) FROM checkpoints").fetchall()[0][0]
    return 0 if value is None else int(value)


def sync_state(con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    """Where weight sync stands, for ``clawrl status``.

    Keys: attempts, failures (rows of ``syncs``); last (the newest attempt as a ``syncs`` row, or
    None); last_ok (the newest successful attempt, or None); serving (the version the engine
    reported after the newest attempt; None when it did not answer); last_seen_serving (the newest
    version any attempt saw served); latest_checkpoint (newest trained version, 0 before any step);
    waiting (trained versions newer than ``last_seen_serving``).
    """
    rows = con.sql("SELECT * EXCLUDE (date) FROM syncs ORDER BY created_at DESC").to_arrow_table().to_pylist()
    last = rows[0] if rows else None
    last_ok = next((r for r in rows if r["ok"]), None)
    seen = next((r["serving_version"] for r in rows if r["serving_version"] is not None), None)
    latest = latest_version(con)
    from clawrl.storage.selection import parse_version

    waiting = [] if seen is None else [str(v) for v in range(parse_version(seen) + 1, latest + 1)]
    return {"attempts": len(rows), "failures": sum(not r["ok"] for r in rows), "last": last, "last_ok": last_ok,
            "serving": None if last is None else last["serving_version"], "last_seen_serving": seen,
            "latest_checkpoint": latest, "waiting": waiting}


def last_synced_checkpoint(con: duckdb.DuckDBPyConnection) -> dict[str, Any] | None:
    """The checkpoint of the newest successful sync (weight_version, path, sha256), or None: what a
    restarted engine should serve again. A version whose load killed the engine never counts."""
    rows = con.sql("""
        SELECT c.weight_version, c.path, c.sha256 FROM syncs s JOIN checkpoints c USING (weight_version)
        WHERE s.ok ORDER BY s.created_at DESC LIMIT 1
    """).to_arrow_table().to_pylist()
    return rows[0] if rows else None


def pending_counts(
    con: duckdb.DuckDBPyConnection, judge_config_hash: str, rollout_batch_size: int
) -> dict[str, Any]:
    """Where every turn stands under one judge config, for ``clawrl status``.

    Keys: turns (distinct turn ids), main_turns, side_turns; awaiting_next_state (main, no next
    state row and no fate yet); pending_judgment (main, next state arrived, no fate: what
    ``ready_turns`` returns); pending_no_next_state (main, told no next state will come, no fate
    yet: the judge flow's next 'no_next_state' fates); judged (turns with a fate); fates ({fate: turns} for every Fate,
    0 when none); excluded (judged turns whose fate is not 'sample'); samples (distinct usable
    sample ids under this config, as ``trainable_samples`` counts them); consumed (of those, listed
    in some batch); trainable (not consumed);
    batches (rows of ``batches``); rollout_batch_size; full_batches (trainable //
    rollout_batch_size); samples_needed (more samples before the next step can start).
    """
    if rollout_batch_size < 1:
        raise ValueError("rollout_batch_size must be >= 1")
    row = con.sql(
        f"""
        WITH t AS (
            SELECT turn_id, any_value(turn_type) AS turn_type FROM turns GROUP BY turn_id),
        ns AS (
            SELECT turn_id, bool_or(has_next_state) AS has_next FROM next_states GROUP BY turn_id),
        f AS (
            SELECT DISTINCT turn_id FROM turn_fate WHERE judge_config_hash = $hash),
        s AS (
            SELECT DISTINCT sample_id FROM ({_USABLE_SAMPLES})),
        used AS (
            SELECT DISTINCT unnest(sample_ids) AS sample_id FROM batches)
        SELECT
            (SELECT count(*) FROM t) AS turns,
            (SELECT count(*) FROM t WHERE turn_type = '{TurnType.MAIN.value}') AS main_turns,
            (SELECT count(*) FROM t WHERE turn_type = '{TurnType.SIDE.value}') AS side_turns,
            (SELECT count(*) FROM t LEFT JOIN ns USING (turn_id) ANTI JOIN f USING (turn_id)
              WHERE t.turn_type = '{TurnType.MAIN.value}' AND ns.turn_id IS NULL) AS awaiting_next_state,
            (SELECT count(*) FROM t JOIN ns USING (turn_id) ANTI JOIN f USING (turn_id)
              WHERE t.turn_type = '{TurnType.MAIN.value}' AND ns.has_next) AS pending_judgment,
            (SELECT count(*) FROM t JOIN ns USING (turn_id) ANTI JOIN f USING (turn_id)
              WHERE t.turn_type = '{TurnType.MAIN.value}' AND NOT ns.has_next) AS pending_no_next_state,
            (SELECT count(*) FROM f) AS judged,
            (SELECT count(*) FROM s) AS samples,
            (SELECT count(*) FROM s SEMI JOIN used USING (sample_id)) AS consumed,
            (SELECT count(*) FROM batches) AS batches
        """,
        params={"hash": judge_config_hash},
    ).fetchall()[0]
    names = ["turns", "main_turns", "side_turns", "awaiting_next_state", "pending_judgment",
             "pending_no_next_state", "judged", "samples", "consumed", "batches"]
    counts: dict[str, Any] = dict(zip(names, (int(v) for v in row)))
    fates = {fate.value: 0 for fate in Fate}
    for fate, n in con.sql(
        f"SELECT fate, count(*) FROM ({_LATEST_FATE}) GROUP BY fate", params={"hash": judge_config_hash}
    ).fetchall():
        fates[fate] = int(n)
    trainable = counts["samples"] - counts["consumed"]
    counts.update(
        fates=fates,
        excluded=sum(n for fate, n in fates.items() if fate != Fate.SAMPLE.value),
        trainable=trainable,
        rollout_batch_size=rollout_batch_size,
        full_batches=trainable // rollout_batch_size,
        samples_needed=max(0, rollout_batch_size - trainable),
    )
    return counts


# ------------------------------------------------------------------------------ export


def export_table(table: pa.Table, fmt: str, out: str | os.PathLike | None = None) -> str | None:
    """Write a query result as csv / json / parquet to `out`, or return csv / json text.

    csv: one header row; lists as JSON arrays, timestamps ISO 8601. json: one array of row
    objects. parquet: needs `out`.
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid: {', '.join(EXPORT_FORMATS)}")
    if fmt == "parquet":
        if out is None:
            raise ValueError("parquet output needs a file")
        pq.write_table(table, out)
        return None
    rows = table.to_pylist()
    if fmt == "json":
        data = orjson.dumps(rows, default=_json_default, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)
        text = data.decode()
    else:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(table.column_names)
        for row in rows:
            writer.writerow([_csv_cell(v) for v in row.values()])
        text = buf.getvalue()
    if out is None:
        return text
    Path(out).write_text(text)
    return None


def format_cell(value: Any) -> str:
    """One value as plain text: lists and dicts as JSON, None as NULL."""
    if value is None:
        return "NULL"
    if isinstance(value, (list, dict)):
        return orjson.dumps(value, default=_json_default).decode()
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def _csv_cell(value: Any) -> str:
    return "" if value is None else format_cell(value)


def _json_default(value: Any) -> Any:
    if isinstance(value, Decimal):  # DuckDB's sum() of integers is a HUGEINT -> decimal128
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _sql_str(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"
