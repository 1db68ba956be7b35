"""What the promotion gate reads: the champion, the line of champions, stored evaluations, the best promoted score.

The champion is the version of the newest ``promote`` or ``rollback`` row of ``promotions``; before
any, the initial weights (version "0"). Evaluations are reused only under the same ``eval_key``
(same evaluator, prompts, samples, seeds, budget and temperature), so paired scores stay paired.

With ``[ppo] adapters = "namespace"`` each namespace has a line of its own: the rows of that
``namespace``, whose versions are adapter names, starting from ``<namespace>@v0``, the base alone
(:func:`base_of`). ``namespace=None`` reads the shared policy's rows only.
"""

from __future__ import annotations

from typing import Any

import duckdb

from clawrl.records import PromotionAction, adapter_name

BASE_VERSION = "0"


def base_of(namespace: str | None) -> str:
    """What serves before any promotion: the initial weights "0", or for a namespace its base alone."""
    return BASE_VERSION if namespace is None else adapter_name(namespace, 0)


def _rows(con: duckdb.DuckDBPyConnection, sql: str, **params: Any) -> list[dict[str, Any]]:
    return con.sql(sql, params=params).to_arrow_table().to_pylist()


def whose(con: duckdb.DuckDBPyConnection, view: str, namespace: str | None) -> str:
    """A WHERE clause for the rows of ``view`` about ``namespace``'s adapter ($ns), or about the shared
    policy (None): the rows without a namespace, every row where no file has the column yet."""
    if "namespace" not in {r[0] for r in con.execute(f"DESCRIBE {view}").fetchall()}:
        return "WHERE true" if namespace is None else "WHERE false"
    return "WHERE namespace IS NULL" if namespace is None else "WHERE namespace = $ns"


def promotion_log(con: duckdb.DuckDBPyConnection, namespace: str | None = None) -> list[dict[str, Any]]:
    """Every ``promotions`` row of the shared policy (of ``namespace``'s adapter), oldest first."""
    return _rows(con, f"SELECT * EXCLUDE (date) FROM promotions {whose(con, 'promotions', namespace)} "
                      "ORDER BY created_at, promotion_id", **({} if namespace is None else {"ns": namespace}))


def _walk_line(log: list[dict[str, Any]], base: str = BASE_VERSION) -> tuple[list[str], set[str]]:
    """(the line of champions, the versions kept from serving on purpose) after the rows of ``log``.

    A promotion pushes its version (not again when it is already the champion: a rollback must reach
    the previous distinct champion); a rollback to a version pops back to it (pushes it when it was not
    on the line). Kept from serving: versions the gate refused or a rollback took off the line, until
    promoted again."""
    stack, unserved = [base], set()
    for r in log:
        v = str(r["weight_version"])
        if r["action"] == PromotionAction.REFUSE.value:
            unserved.add(v)
            continue
        unserved.discard(v)
        if r["action"] == PromotionAction.PROMOTE.value:
            if stack[-1] != v:
                stack.append(v)
        elif r["action"] == PromotionAction.ROLLBACK.value:
            if v in stack:
                unserved.update(stack[stack.index(v) + 1:])
                del stack[stack.index(v) + 1:]
            else:
                unserved.add(stack[-1])
                stack.append(v)
    return stack, unserved


def champion_stack(con: duckdb.DuckDBPyConnection, namespace: str | None = None) -> list[str]:
    """The line of champions a rollback walks back (``_walk_line``). The last one is the champion."""
    return _walk_line(promotion_log(con, namespace), base_of(namespace))[0]


def current_champion(con: duckdb.DuckDBPyConnection, namespace: str | None = None) -> str:
    return champion_stack(con, namespace)[-1]


def previous_champion(con: duckdb.DuckDBPyConnection, namespace: str | None = None) -> str | None:
    """The champion before the current one on the line (what `clawrl rollback` serves again), or None
    when the initial weights (the namespace's base alone) are the champion."""
    stack = champion_stack(con, namespace)
    return stack[-2] if len(stack) > 1 else None


def consecutive_refusals(con: duckdb.DuckDBPyConnection, namespace: str | None = None) -> int:
    """Candidates refused since the last promote or rollback."""
    n = 0
    for r in reversed(promotion_log(con, namespace)):
        if r["action"] != PromotionAction.REFUSE.value:
            break
        n += 1
    return n


def stored_evaluation(con: duckdb.DuckDBPyConnection, weight_version: str, eval_key: str) -> dict[str, Any] | None:
    """The newest ``evaluations`` row of ``weight_version`` under ``eval_key``, or None."""
    rows = _rows(con, "SELECT * EXCLUDE (date) FROM evaluations WHERE weight_version = $v AND eval_key = $k "
                 "ORDER BY created_at DESC LIMIT 1", v=str(weight_version), k=eval_key)
    return rows[0] if rows else None


def best_promoted_mean(con: duckdb.DuckDBPyConnection, eval_key: str, namespace: str | None = None) -> float | None:
    """The best mean score under ``eval_key`` of a champion on the line (the initial weights included;
    a version rolled back from no longer counts)."""
    champions = champion_stack(con, namespace)
    value = con.execute("SELECT max(mean) FROM evaluations WHERE eval_key = ? AND list_contains(?, weight_version)",
                        [eval_key, champions]).fetchall()[0][0]
    return None if value is None else float(value)


def unserved_versions(con: duckdb.DuckDBPyConnection, namespace: str | None = None) -> set[str]:
    """Versions the gate refused or a rollback served away from, and nobody promoted since: unserved on
    purpose, not waiting for a sync."""
    return _walk_line(promotion_log(con, namespace), base_of(namespace))[1]


def live_scores(con: duckdb.DuckDBPyConnection, judge_config_hash: str, weight_version: str) -> list[float]:
    """The judged scores of the live main turns ``weight_version`` served (``learning_by_version``'s rows)."""
    rows = con.execute("SELECT score FROM turn_outcomes WHERE judge_config_hash = ? AND weight_version = ? AND "
                       "turn_type = 'main' AND score IS NOT NULL AND judge_error IS NULL",
                       [judge_config_hash, str(weight_version)]).fetchall()
    return [float(r[0]) for r in rows]


def batch_claimed_at(con: duckdb.DuckDBPyConnection, batch_id: str) -> Any:
    """When batch ``batch_id`` was claimed (its ``batches`` row was written), or None."""
    return con.execute("SELECT min(created_at) FROM batches WHERE batch_id = ?", [batch_id]).fetchall()[0][0]


def replay_turns(con: duckdb.DuckDBPyConnection, judge_config_hash: str, size: int,
                 judged_by: Any = None, namespace: str | None = None) -> list[dict[str, Any]]:
    """The prompts of the gate's replay evaluation: up to ``size`` main turns judged under
    ``judge_config_hash`` without a judge error (a fate and a verdict stored, the first fate at or before
    ``judged_by`` when given), newest session first: the newest turn of each (namespace, session), newest
    first, then the sessions' second-newest turns, and so on; ties by turn id. ``namespace``: its turns
    only (a namespace's adapter is evaluated on its own sessions). Rows: turn_id, session_id,
    request_messages, request_tools."""
    cut = " AND f.judged_at <= $cut" if judged_by is not None else ""
    cut += " AND t.namespace = $ns" if namespace is not None else ""
    params: dict[str, Any] = ({"h": judge_config_hash, "n": int(size)} | ({"cut": judged_by} if judged_by is not None
                              else {}) | ({"ns": namespace} if namespace is not None else {}))
    return _rows(con, f"""
        WITH f AS (SELECT turn_id, min(created_at) AS judged_at FROM turn_fate WHERE judge_config_hash = $h
                   GROUP BY turn_id),
        t AS (SELECT * EXCLUDE (date) FROM turns
              QUALIFY row_number() OVER (PARTITION BY turn_id ORDER BY created_at) = 1),
        ranked AS (
            SELECT t.turn_id, t.session_id, t.request_messages, t.request_tools, t.created_at,
                   row_number() OVER (PARTITION BY t.namespace, t.session_id
                                      ORDER BY t.created_at DESC, t.turn_id DESC) AS k
            FROM t JOIN f USING (turn_id) JOIN verdicts j ON j.turn_id = t.turn_id AND j.judge_config_hash = $h
            WHERE t.turn_type = 'main' AND j.error IS NULL{cut})
        SELECT turn_id, session_id, request_messages, request_tools FROM ranked
        ORDER BY k, created_at DESC, turn_id DESC LIMIT $n""", **params)
