"""``clawrl doctor``: why a run is (not) learning, in words, from the tables.

:func:`diagnose` reads the DuckDB views of a data root and the trainer's checkpoint markers and
returns :class:`Finding` s, one per thing that can stop learning, in the order data flows: turns
arrive (main, not side) -> they get a next state -> the judge scores them (parseable votes, no
backend errors, not all 0) -> hints (OPD, combine) -> samples are fresh enough -> batches carry
a signal (not every reward equal) -> training steps stay sane (KL) -> new weights are served. A
finding that fails names its cause and the fix, and the SQL over a view that shows it, so the
user can look for themselves. :func:`learning_by_version` is the judged score of live turns by the
weight version that served them (the ``learning_by_version`` view): learning as users see it, with
no simulator.

Thresholds are shares of the turns concerned, stated in each finding's text; a finding on too few
rows to say anything (under ``MIN_ROWS``) passes with a note.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import duckdb

from clawrl.checkpoint import complete_checkpoints, read_step_result
from clawrl.records import Fate, Method

MIN_ROWS = 5  # fewer judged turns than this: too few to blame anything


@dataclass
class Finding:
    name: str
    ok: bool
    summary: str  # what was measured
    cause: str = ""  # why it stops learning (when not ok)
    fix: str = ""
    sql: str = ""  # a query over the views that shows it

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _one(con: duckdb.DuckDBPyConnection, sql: str, **params: Any) -> dict[str, Any]:
    return con.sql(sql, params=params).to_arrow_table().to_pylist()[0]


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def diagnose(con: duckdb.DuckDBPyConnection, judge_config_hash: str, *, method: str,
             checkpoints: Path | None = None, group_by_prompt: bool = False, judge_timeout_s: float | None = None,
             placeholder_keys: Sequence[str] = ()) -> list[Finding]:
    """Every finding for the turns judged under ``judge_config_hash`` with advantage ``method``. From the
    settings (:func:`settings_checks`): ``group_by_prompt`` (rewards centred on their prompt's group),
    ``judge_timeout_s`` (what bounds a judge call; None: the judge calls nothing that can hang) and
    ``placeholder_keys`` (key variables holding a placeholder)."""
    fates = _fate_counts(con, judge_config_hash)
    return [_traffic(con), judge_config_finding(con, judge_config_hash), _next_states(con, judge_config_hash, fates),
            *_judge(con, judge_config_hash, fates), _judge_timeout(judge_timeout_s), _keys(placeholder_keys),
            _hints(con, judge_config_hash, method), _staleness(fates), _signal(con, method),
            _groups(con, method, group_by_prompt), _training(checkpoints), _serving(con), _promotion(con)]


def settings_checks(s: Any) -> dict[str, Any]:
    """What :func:`diagnose` reads from the settings ``s``, as plain values."""
    from clawrl.config import placeholder_keys

    method = Method(s.ppo.advantage_estimator)
    calls_out = bool(s.hooks.reward) or s.prm.backend == "provider" or bool(
        s.prm.backend == "engine" and s.prm.engine_url)
    return {"group_by_prompt": s.ppo.group_by == "prompt" and method in (Method.GRPO, Method.COMBINE),
            "judge_timeout_s": s.engine.stall_timeout_s if calls_out else None,
            "placeholder_keys": placeholder_keys(s.server.api_keys_env, s.server.admin_keys_env,
                                                 *([s.provider.api_key_env] if s.prm.backend == "provider" else []))}


def _keys(placeholders: Sequence[str]) -> Finding:
    if not placeholders:
        return Finding("api_keys", True, "no API key variable holds a placeholder")
    return Finding("api_keys", False, f"{', '.join(placeholders)} hold{'s' if len(placeholders) == 1 else ''} a "
                   "placeholder, not a key", "a placeholder copied from an example is no key: a provider judge "
                   "sends it and every call is refused (HTTP 401, each turn a judge_error), and a gateway given it "
                   "refuses to start", "put the real key in the variable, or unset it",
                   "SELECT detail, count(*) FROM turn_outcomes WHERE fate = 'judge_error' GROUP BY detail")


def _judge_timeout(timeout_s: float | None) -> Finding:
    if timeout_s is None:
        return Finding("judge_timeout", True, "the judge calls nothing that can hang (the rule judge, or an "
                       "engine in this process)")
    if 0 < timeout_s < math.inf:
        return Finding("judge_timeout", True, f"every judge call (a model over HTTP, a reward hook) times out after "
                       f"{timeout_s:g} s ([engine] stall_timeout_s) and counts as a failed vote")
    return Finding("judge_timeout", False, f"judge calls have no timeout ([engine] stall_timeout_s = {timeout_s:g})",
                   "a judge model or reward hook that never answers holds its turns, the judge run and the "
                   "training that waits for their samples, for good", "set [engine] stall_timeout_s to a "
                   "finite number of seconds", "clawrl status (turns pending judgment)")


def _groups(con: duckdb.DuckDBPyConnection, method: str, group_by_prompt: bool) -> Finding:
    """A sample alone with its prompt in its batch gets reward - its own mean = 0 (std 0 after centering)."""
    if not group_by_prompt:
        return Finding("groups", True, "rewards are not centred on their prompt's group ([ppo] group_by)")
    sql = ("SELECT batch_id, prompt_ids, count(*) AS n FROM batches b, unnest(b.sample_ids) AS u(sample_id) "
           "JOIN samples s USING (sample_id) GROUP BY batch_id, prompt_ids")
    c = _one(con, f"SELECT coalesce(sum(n), 0) AS samples, coalesce(sum(n) FILTER (WHERE n = 1), 0) AS alone "
                  f"FROM ({sql})")
    summary = f"{c['alone']} of {c['samples']} trained samples were alone with their prompt in their batch"
    if c["samples"] >= MIN_ROWS and _share(c["alone"], c["samples"]) >= 0.5:
        return Finding("groups", False, summary,
                       "[ppo] group_by = 'prompt' centres each judge reward on the mean of its prompt's group: "
                       "a group of one sample has std 0 after centering, its advantage is 0, and its "
                       "judge score teaches nothing" + (" (grpo: the sample trains on nothing)"
                                                         if method == Method.GRPO.value else ""),
                       "[ppo] group_by = 'batch' (a baseline over the batch: live traffic rarely repeats a prompt) "
                       "or 'none', or several answers per prompt (n > 1)", sql)
    return Finding("groups", True, summary)


def _fate_counts(con: duckdb.DuckDBPyConnection, chash: str) -> dict[str, int]:
    counts = dict.fromkeys((f.value for f in Fate), 0)
    for fate, n in con.sql("SELECT fate, count(*) FROM turn_outcomes WHERE judge_config_hash = $h GROUP BY fate",
                           params={"h": chash}).fetchall():
        counts[fate] = int(n)
    return counts


def _traffic(con: duckdb.DuckDBPyConnection) -> Finding:
    c = _one(con, """SELECT count(*) AS turns, count(*) FILTER (WHERE turn_type = 'main') AS main,
                     count(DISTINCT session_id) AS sessions
                     FROM (SELECT DISTINCT turn_id, turn_type, session_id FROM turns)""")
    summary = f"{c['turns']} turns logged, {c['main']} main, {c['turns'] - c['main']} side, in {c['sessions']} sessions"
    sql = "SELECT turn_type, count(*) FROM turns GROUP BY turn_type"
    if c["turns"] == 0:
        return Finding("traffic", False, summary, "nothing reached the gateway's chat completions",
                       "point the agent's OpenAI base_url at the gateway (`clawrl serve`, /v1)", sql)
    if c["main"] == 0:  # side turns beside main ones are normal: heartbeats, an agent's maintenance calls
        return Finding("traffic", False, summary,
                       "every turn is a side turn, which is served and logged but never trained on: the "
                       "client marks them (X-Turn-Type: side), they look like an agent's maintenance calls (its "
                       "compaction summariser), or they add no new user or tool message",
                       "send X-Turn-Type: main for the turns to learn from",
                       sql)
    return Finding("traffic", True, summary)


def judge_config_finding(con: duckdb.DuckDBPyConnection, chash: str) -> Finding:
    """Whether the turns were judged under the judge config read (``chash``): data judged under another
    one only (a run's own config not read, a judge setting changed since) counts as never judged here."""
    judged = dict(con.execute("SELECT judge_config_hash, count(DISTINCT turn_id) AS n FROM turn_fate "
                              "GROUP BY ALL ORDER BY n DESC, judge_config_hash").fetchall())
    mine = judged.pop(chash, 0)
    others = ", ".join(f"{h} ({n} turns)" for h, n in judged.items())
    summary = f"{mine} turns judged under this judge config {chash}" + (f"; under others: {others}" if others else "")
    if not judged or mine:
        return Finding("judge_config", True, summary)
    return Finding("judge_config", False, summary,
                   "the turns were judged under other judge settings than the ones read ([prm], [opd], [ppo] "
                   "advantage_estimator or the model): every count here is for this config's judge, which judged "
                   "none",
                   "read with the config the run used (-c FILE; a demo's is <data_root>/config.toml), or judge "
                   "the turns again under this one (`clawrl judge`)",
                   "SELECT judge_config_hash, count(DISTINCT turn_id) FROM turn_fate GROUP BY 1")


def _next_states(con: duckdb.DuckDBPyConnection, chash: str, fates: dict[str, int]) -> Finding:
    """The last turn of a conversation never gets a next state (no reply follows the last answer):
    only a session of one turn each, or a turn followed by more of its session without one, is wrong."""
    c = _one(con, """WITH o AS (SELECT *, max(turn_index) OVER (PARTITION BY session_id) AS last_index
                                FROM turn_outcomes WHERE judge_config_hash = $h AND turn_type = 'main')
                     SELECT count(*) AS judged, count(*) FILTER (WHERE fate = 'no_next_state') AS missing,
                            count(*) FILTER (WHERE fate = 'no_next_state' AND turn_index < last_index) AS inner_missing,
                            count(*) FILTER (WHERE turn_index < last_index) AS inner,
                            count(DISTINCT session_id) AS sessions,
                            count(DISTINCT session_id) FILTER (WHERE last_index = 0) AS single FROM o""", h=chash)
    summary = (f"{c['missing']} of {c['judged']} judged main turns got no next state, {c['inner_missing']} of them "
               f"before the last turn of their session; {c['single']} of {c['sessions']} sessions have one turn")
    sql = (f"SELECT session_id, count(*) AS turns, count(*) FILTER (WHERE fate = 'no_next_state') AS no_next_state "
           f"FROM turn_outcomes WHERE judge_config_hash = '{chash}' AND turn_type = 'main' GROUP BY session_id")
    one_turn = _share(c["single"], c["sessions"]) >= 0.8
    if c["judged"] >= MIN_ROWS and one_turn and _share(c["missing"], c["judged"]) >= 0.5:
        return Finding("next_states", False, summary,
                       "every request starts a new session, so no turn ever sees the user's next message: the "
                       "client sends no session id and its requests do not continue a logged conversation",
                       "send a stable session id (X-Session-Id, the body's session_id, prompt_cache_key or user), "
                       "or send the conversation's history with each request so the gateway links it", sql)
    if c["inner"] >= MIN_ROWS and _share(c["inner_missing"], c["inner"]) >= 0.3:
        return Finding("next_states", False, summary,
                       "turns that the conversation went on after were closed without their next message: the "
                       "user's replies came more than 15 minutes after the answers (a session idle that long is "
                       "closed), or the gateway restarted",
                       "reply within 15 minutes, or close a finished conversation with session_done", sql)
    return Finding("next_states", True, summary)


def _judge(con: duckdb.DuckDBPyConnection, chash: str, fates: dict[str, int]) -> list[Finding]:
    v = _one(con, """SELECT count(*) AS verdicts, coalesce(sum(len(votes)), 0) AS votes,
                     coalesce(sum(len(list_filter(votes, lambda x: x IS NULL))), 0) AS unparsed,
                     count(*) FILTER (WHERE score = 0) AS zero FROM verdicts WHERE judge_config_hash = $h""", h=chash)
    sql = f"SELECT score, score_reason, votes, raw_outputs FROM verdicts WHERE judge_config_hash = '{chash}'"
    out = []
    unparsed = _share(v["unparsed"], v["votes"])
    summary = f"{v['unparsed']} of {v['votes']} judge votes unparseable ({unparsed:.0%}) over {v['verdicts']} verdicts"
    if v["verdicts"] >= MIN_ROWS and unparsed >= 0.3:
        out.append(Finding("judge_votes", False, summary + "; most common outputs: " + _top_outputs(con, chash),
                           "the judge's outputs carry no score in \\boxed{1}, \\boxed{0} or \\boxed{-1}, so its "
                           "votes count for nothing and the turns end as score 0 or judge errors",
                           "use a judge that follows the PRM prompt: a larger model ([prm] backend = sglang or "
                           "provider), or the rule judge; more tokens ([prm] max_new_tokens) if outputs are cut", sql))
    else:
        out.append(Finding("judge_votes", True, summary))
    errors, judged = fates[Fate.JUDGE_ERROR.value], sum(fates.values()) - fates[Fate.SIDE_TURN.value]
    if judged >= MIN_ROWS and _share(errors, judged) >= 0.1:
        top = _one(con, "SELECT detail, count(*) AS n FROM turn_outcomes WHERE judge_config_hash = $h AND fate = "
                        "'judge_error' GROUP BY detail ORDER BY n DESC LIMIT 1", h=chash)
        out.append(Finding("judge_errors", False, f"{errors} of {judged} judged turns failed in the judge",
                           f"the judge backend fails: {(top['detail'] or '')[:200]}",
                           "check [prm] backend, its engine_url, and [provider] base_url and api_key_env",
                           sql.replace("SELECT score", "SELECT error, score")))
    zero = fates[Fate.SCORE_ZERO.value]
    if judged >= MIN_ROWS and _share(zero, judged) >= 0.5:
        out.append(Finding("judge_zero", False, f"{zero} of {judged} judged turns scored 0 and were dropped",
                           "the judge's votes tie or it answers 0: no reward signal",
                           "more votes ([prm] judge_samples), a better judge model, or a reward hook", sql))
    return out


def _top_outputs(con: duckdb.DuckDBPyConnection, chash: str, k: int = 2) -> str:
    outputs = Counter()
    for (raw,) in con.sql("SELECT raw_outputs FROM verdicts WHERE judge_config_hash = $h LIMIT 200",
                          params={"h": chash}).fetchall():
        outputs.update(str(o).strip()[:60] for o in json.loads(raw or "[]"))
    return "; ".join(f"{text!r} x{n}" for text, n in outputs.most_common(k)) or "(none recorded)"


def _hints(con: duckdb.DuckDBPyConnection, chash: str, method: str) -> Finding:
    h = _one(con, """SELECT count(*) FILTER (WHERE hint_asked) AS asked,
                            count(*) FILTER (WHERE hint_asked AND has_hint) AS usable
                     FROM turn_outcomes WHERE judge_config_hash = $h""", h=chash)
    summary = f"{h['usable']} usable hints of {h['asked']} asked"
    if method == Method.GRPO.value:
        return Finding("hints", True, summary + " (grpo uses none)")
    sql = f"SELECT fate, has_hint, score, detail FROM turn_outcomes WHERE judge_config_hash = '{chash}' AND hint_asked"
    # OPD trains only on hinted turns; combine learns from the score too, so only no hints at all is a fault
    floor = 0.2 if method == Method.OPD.value else 1e-9
    if h["asked"] >= MIN_ROWS and _share(h["usable"], h["asked"]) < floor:
        return Finding("hints", False, summary + f" ({_share(h['usable'], h['asked']):.0%} accepted)",
                       "the hint model writes no usable hindsight hint, so on-policy distillation gets no "
                       "teacher signal"
                       + (" and its turns are dropped (no_hint)" if method == Method.OPD.value else ""),
                       "a stronger hint model (the judge's, [prm] backend), or "
                       + ("advantage_estimator = grpo / combine, which learn from the score alone"
                          if method == Method.OPD.value else "advantage_estimator = grpo, which needs no hints"), sql)
    return Finding("hints", True, summary)


def _staleness(fates: dict[str, int]) -> Finding:
    stale, judged = fates[Fate.TOO_STALE.value], sum(fates.values())
    summary = f"{stale} of {judged} judged turns too stale to train on"
    if judged >= MIN_ROWS and _share(stale, judged) >= 0.2:
        return Finding("staleness", False, summary, "samples wait so long that the policy moved on by more than "
                       "[ppo] max_staleness versions", "raise [ppo] max_staleness, or a smaller rollout_batch_size "
                       "so steps come sooner", "SELECT * FROM turn_outcomes WHERE fate = 'too_stale'")
    return Finding("staleness", True, summary)


def _signal(con: duckdb.DuckDBPyConnection, method: str) -> Finding:
    rows = con.sql("""SELECT b.batch_id, count(DISTINCT s.reward) AS rewards, bool_or(s.has_teacher) AS teacher
                      FROM batches b, unnest(b.sample_ids) AS u(sample_id) JOIN samples s USING (sample_id)
                      GROUP BY b.batch_id""").fetchall()
    flat = [b for b, rewards, teacher in rows if rewards <= 1 and not teacher]
    summary = f"{len(flat)} of {len(rows)} batches had one reward for every sample and no teacher term"
    if rows and _share(len(flat), len(rows)) >= 0.5:
        return Finding("signal", False, summary,
                       "when every reward in a batch is the same and no teacher term is present, the advantage "
                       "is constant" + (" (zero after the group baseline)" if method == Method.GRPO.value else "")
                       + ": the step pushes every token the same way and learns nothing about which answer was better",
                       "a judge that tells answers apart, bigger batches, or "
                       + ("combine / on_policy_distillation" if method == Method.GRPO.value else
                          "usable hints (the teacher term needs them: see the hints finding)"),
                       "SELECT b.batch_id, list(DISTINCT s.reward) FROM batches b, unnest(b.sample_ids) AS "
                       "u(sample_id) JOIN samples s USING (sample_id) GROUP BY b.batch_id")
    return Finding("signal", True, summary)


def _training(checkpoints: Path | None) -> Finding:
    steps = [read_step_result(d).metrics for _, d in reversed(complete_checkpoints(checkpoints))] \
        if checkpoints is not None and Path(checkpoints).is_dir() else []
    kls = [m["kl"] for m in steps if "kl" in m]
    summary = f"{len(steps)} training steps" + (f", KL to the reference {kls[0]:.3g} -> {kls[-1]:.3g}" if kls else "")
    if len(kls) >= 3 and (kls[-1] > 1.0 or kls[-1] > 10 * max(statistics.median(kls), 1e-3)):
        return Finding("training", False, summary, "the policy is running away from its reference: the KL grew "
                       "more than tenfold (or past 1 nat a token)", "lower [ppo] lr or raise [ppo] kl_coef",
                       "clawrl lineage VERSION (each step's metrics), or the MLflow runs of experiment clawrl")
    return Finding("training", True, summary)


def _serving(con: duckdb.DuckDBPyConnection) -> Finding:
    from clawrl.storage.queries import sync_state

    st = sync_state(con)
    serving = st["last_seen_serving"] or "the initial weights"
    summary = (f"newest checkpoint v{st['latest_checkpoint']}, serving {serving}; "
               f"{st['failures']} of {st['attempts']} syncs failed")
    sql = "SELECT weight_version, ok, error, serving_version, created_at FROM syncs ORDER BY created_at DESC"
    if st["latest_checkpoint"] and not st["attempts"]:
        return Finding("serving", False, summary, "checkpoints were trained but never pushed to the engine: users "
                       "are still served the initial weights", "`clawrl sync`, or run training through the "
                       "train flow (`clawrl up` / `clawrl train`), which syncs after each step", sql)
    if st["failures"]:
        failed, recovered = st["last_failed"], st["last"]["ok"]
        waiting = f"; versions {', '.join(st['waiting'])} not served" if st["waiting"] else ""
        what = (f"({failed['created_at']:%Y-%m-%d %H:%M:%S} UTC, version {failed['weight_version']} -> "
                f"{failed['target']}): {(failed['error'] or '')[:200]}")
        if recovered:
            return Finding("serving", False, summary + waiting, f"the newest failed sync {what}; the syncs after it "
                           "went through", "nothing waits for a sync now; if failures recur, check the engine (is it "
                           "up, can it read the checkpoint path?) before one leaves a checkpoint unserved", sql)
        return Finding("serving", False, summary + waiting, f"the last sync failed {what}",
                       "fix the engine side (is it up, can it read the checkpoint path?), then `clawrl sync`", sql)
    return Finding("serving", True, summary)


GATE_STALL = 3  # refused candidates in a row that make the gate a finding


def _promotion(con: duckdb.DuckDBPyConnection, namespace: str | None = None) -> Finding:
    """The gate's decisions on the shared policy (on ``namespace``'s adapter, whose versions are named)."""
    from clawrl.gate import NO_GAIN
    from clawrl.storage.promotions import consecutive_refusals, current_champion, promotion_log

    log = promotion_log(con, namespace)
    champion, refused = current_champion(con, namespace), consecutive_refusals(con, namespace)
    if namespace is None:
        champion = f"v{champion}"
    summary = f"champion {champion}; {sum(r['action'] == 'refuse' for r in log)} of " \
              f"{sum(r['source'] == 'gate' for r in log)} gated candidates refused, {refused} in a row"
    sql = ("SELECT action, weight_version, champion_version, reason, created_at FROM promotions "
           + ("" if namespace is None else f"WHERE namespace = '{namespace}' ") + "ORDER BY created_at DESC")
    if refused >= GATE_STALL and all(r["reason"].startswith(NO_GAIN) for r in log[-refused:]):
        return Finding("promotion", True, summary + f"; none of the last {refused} beat the champion by more than "
                       "[gate] min_gain: a plateau, not a fault")
    means = [r["candidate_mean"] for r in log[-refused:]]
    if refused >= GATE_STALL and None not in means and all(b < a for a, b in zip(means, means[1:])):
        return Finding("promotion", False, summary + "; candidates falling: " + " -> ".join(f"{m:.3f}" for m in means),
                       f"the last {refused} checkpoints scored lower each time while users kept getting "
                       f"{champion}: the policy trains on {champion}'s answers, not its own, so its own mistakes "
                       "are never served and never get a reward to unlearn them (e.g. a policy taught a tool call "
                       "by demonstrations learns to call everywhere)",
                       "let the policy's own answers be scored: serve it to a share of sessions ([gate] "
                       "canary_share, e.g. 0.25) or to everyone for a while (`clawrl promote VERSION`, or "
                       "[gate] enabled = false) and gate again once it recovers; check that hints and "
                       "demonstrations teach when not to act as well as when to; a reward with the wrong sign "
                       "shows the same way", sql)
    if refused >= GATE_STALL:
        return Finding("promotion", False, summary + f"; last: {log[-1]['reason']}",
                       f"training goes on but the last {refused} checkpoints scored worse than the champion "
                       f"{champion} on the evaluation set, so users keep getting {champion}",
                       "look at what changed since the champion (a reward with the wrong sign, a learning rate too "
                       "high, a judge config change); if the evaluation set no longer fits the traffic, point "
                       "[gate] evaluator at one that does; `clawrl promote VERSION"
                       + ("" if namespace is None else f" --namespace {namespace}") + "` serves one by hand", sql)
    return Finding("promotion", True, summary)


def namespace_findings(con: duckdb.DuckDBPyConnection, chash: str, namespace: str, batch_size: int,
                       served: str | None) -> list[Finding]:
    """``clawrl doctor --namespace``: from the namespace's turns to the adapter it is served (``served``: its
    name, None for the base alone), each finding over that namespace's rows only."""
    from clawrl.storage.adapters import namespace_samples
    from clawrl.storage.queries import pending_counts

    c = pending_counts(con, chash, batch_size, namespace)
    waiting = len(namespace_samples(con, chash, namespace))
    where = f"namespace = '{namespace}'"
    traffic = Finding("traffic", c["main_turns"] > 0, f"{c['turns']} turns logged, {c['main_turns']} main",
                      "no main turn of this namespace reached the gateway: its key sends none, or only side turns",
                      "send the agent's turns with this key (X-Turn-Type: main)",
                      f"SELECT turn_type, count(*) FROM turns WHERE {where} GROUP BY 1")
    kept = c["fates"].get(Fate.SAMPLE.value, 0)
    judged = Finding("judged", c["judged"] < MIN_ROWS or kept > 0,
                     f"{c['judged']} of {c['turns']} turns judged, {kept} became samples, {c['excluded']} excluded",
                     "every judged turn of the namespace was excluded: it gives its adapter nothing to learn from",
                     "see why with the query below (clawrl doctor without --namespace explains each fate)",
                     f"SELECT fate, count(*) FROM turn_outcomes JOIN (SELECT DISTINCT turn_id FROM turns WHERE {where}) "
                     "USING (turn_id) GROUP BY 1")
    samples = Finding("samples", True, f"{waiting} trainable samples wait; its adapter trains at rollout_batch_size "
                      f"{batch_size}" + (f" ({batch_size - waiting} more)" if waiting < batch_size else " (a full batch)"))
    return [traffic, judged, samples, _adapter_serving(con, namespace, served), _promotion(con, namespace)]


def _adapter_serving(con: duckdb.DuckDBPyConnection, namespace: str, served: str | None) -> Finding:
    from clawrl.storage.adapters import serving_changes

    rows = [r for r in serving_changes(con, namespace) if r["action"] == "sync"]
    failed = [r for r in rows if not r["ok"]]
    summary = f"served {served or 'the base alone'}; {len(failed)} of {len(rows)} syncs failed"
    sql = f"SELECT action, adapter, ok, error, created_at FROM adapter_serving WHERE namespace = '{namespace}'"
    if rows and not rows[0]["ok"]:
        return Finding("serving", False, summary, f"the last sync ({rows[0]['adapter']}) failed: {rows[0]['error']}",
                       "check the engine serves LoRA adapters and can read the adapter's directory, then "
                       f"`clawrl promote {rows[0]['adapter']} --namespace {namespace}`", sql)
    return Finding("serving", True, summary)


def report(con: duckdb.DuckDBPyConnection, judge_config_hash: str, *, method: str,
           checkpoints: Path | None = None, **checks: Any) -> dict[str, Any]:
    """The whole diagnosis as JSON values (``clawrl doctor --json``, the train flow's ``doctor.json``):
    the findings, the per-version scores and the one-sentence verdict on them. ``checks``: those of
    :func:`settings_checks`."""
    findings = diagnose(con, judge_config_hash, method=method, checkpoints=checkpoints, **checks)
    versions = learning_by_version(con, judge_config_hash)
    out = {"judge_config_hash": judge_config_hash, "findings": [f.as_dict() for f in findings],
           "learning_by_version": versions, "learning": learning_verdict(versions)}
    return json.loads(json.dumps(out, default=str))


def learning_by_version(con: duckdb.DuckDBPyConnection, chash: str) -> list[dict[str, Any]]:
    """The ``learning_by_version`` rows of one judge config, oldest version first."""
    return con.sql("SELECT * EXCLUDE (judge_config_hash) FROM learning_by_version WHERE judge_config_hash = $h",
                   params={"h": chash}).to_arrow_table().to_pylist()


def learning_verdict(rows: list[dict[str, Any]]) -> str:
    """One sentence on the per-version scores: the first and the newest version with enough turns."""
    enough = [r for r in rows if r["n"] >= MIN_ROWS]
    if len(enough) < 2:
        return "not enough judged live turns on two weight versions to tell whether the served model improves"
    a, b = enough[0], enough[-1]
    change = "improved" if b["ci_low"] > a["ci_high"] else ("got worse" if b["ci_high"] < a["ci_low"] else
                                                          "changed within the noise")
    return (f"the judged score of live turns {change}: {a['mean_score']:+.2f} on version {a['weight_version']} "
            f"(n={a['n']}) -> {b['mean_score']:+.2f} on version {b['weight_version']} (n={b['n']})")


def plot_learning_by_version(rows: list[dict[str, Any]], out: Path) -> Path:
    """The ``learning_by_version`` rows as a PNG: the mean judged score per weight version with its
    95% interval, and the number of judged turns under it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(rows)))
    fig, (ax, ax_n) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    mean = [r["mean_score"] for r in rows]
    ax.errorbar(x, mean, yerr=[[m - r["ci_low"] for m, r in zip(mean, rows)],
                               [r["ci_high"] - m for m, r in zip(mean, rows)]], fmt="o-", capsize=3)
    ax.axhline(0, color="gray", linewidth=1)
    ax.set_ylim(-1.05, 1.05)
    ax.set_ylabel("judged score of live turns")
    ax.set_title("learning by weight version (mean, 95% interval)")
    ax.grid(alpha=0.3)
    ax_n.bar(x, [r["n"] for r in rows], color="tab:gray")
    ax_n.set_ylabel("judged turns")
    ax_n.set_xticks(x, [str(r["weight_version"]) for r in rows])
    ax_n.set_xlabel("weight version that served the turn")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
