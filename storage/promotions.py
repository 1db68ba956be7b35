"""What the promotion gate reads: the champion, its history, stored evaluations, the best promoted score.

The champion is the version of the newest ``promote`` or ``rollback`` row of ``promotions``; before
any, the initial weights (version "0"). Evaluations are reused only under the same ``eval_key``
(same evaluator, prompts, samples, seeds, budget and temperature), so paired scores stay paired.
"""

from __future__ import annotations

from typing import Any

import duckdb

from clawrl.records import PromotionAction

BASE_VERSION = "0"
_SERVING = (PromotionAction.PROMOTE.value, PromotionAction.ROLLBACK.value)


def _rows(con: duckdb.DuckDBPyConnection, sql: str, **params: Any) -> list[dict[str, Any]]:
    return con.sql(sql, params=params).to_arrow_table().to_pylist()


def promotion_log(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """Every ``promotions`` row, oldest first."""
    return _rows(con, "SELECT * EXCLUDE (date) FROM promotions ORDER BY created_at, promotion_id")


def champion_history(con: duckdb.DuckDBPyConnection) -> list[str]:
    """The versions that served as champion, oldest first, starting with the initial weights ("0")."""
    rows = con.execute("SELECT weight_version FROM promotions WHERE action IN (?, ?) ORDER BY created_at, "
                       "promotion_id", list(_SERVING)).fetchall()
    return [BASE_VERSION] + [str(r[0]) for r in rows]


def current_champion(con: duckdb.DuckDBPyConnection) -> str:
    return champion_history(con)[-1]


def previous_champion(con: duckdb.DuckDBPyConnection) -> str | None:
    """The champion before the current one (what `clawrl rollback` serves again), or None when the
    initial weights are the only champion there ever was."""
    history = champion_history(con)
    current = history[-1]
    earlier = [v for v in history[:-1] if v != current]
    return earlier[-1] if earlier else None


def consecutive_refusals(con: duckdb.DuckDBPyConnection) -> int:
    """Candidates refused since the last promote or rollback."""
    n = 0
    for r in reversed(promotion_log(con)):
        if r["action"] != PromotionAction.REFUSE.value:
            break
        n += 1
    return n


def stored_evaluation(con: duckdb.DuckDBPyConnection, weight_version: str, eval_key: str) -> dict[str, Any] | None:
    """The newest ``evaluations`` row of ``weight_version`` under ``eval_key``, or None."""
    rows = _rows(con, "SELECT * EXCLUDE (date) FROM evaluations WHERE weight_version = $v AND eval_key = $k "
                 "ORDER BY created_at DESC LIMIT 1", v=str(weight_version), k=eval_key)
    return rows[0] if rows else None


def best_promoted_mean(con: duckdb.DuckDBPyConnection, eval_key: str) -> float | None:
    """The best mean score any champion (the initial weights included) had under ``eval_key``."""
    champions = champion_history(con)
    value = con.execute("SELECT max(mean) FROM evaluations WHERE eval_key = ? AND list_contains(?, weight_version)",
                        [eval_key, champions]).fetchall()[0][0]
    return None if value is None else float(value)


def refused_versions(con: duckdb.DuckDBPyConnection) -> set[str]:
    """Versions the gate refused and nobody promoted since: unserved on purpose, not waiting."""
    out: set[str] = set()
    for r in promotion_log(con):
        if r["action"] == PromotionAction.REFUSE.value:
            out.add(str(r["weight_version"]))
        else:
            out.discard(str(r["weight_version"]))
    return out
