"""`clawrl doctor` on runs broken in the ways users meet, written as the tables those runs leave (the
records the gateway, the judge flow, the trainer and sync write), and on a healthy one."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone

import pytest

from clawrl.doctor import diagnose, learning_by_version, learning_verdict
from clawrl.records import (
    BatchRecord,
    CheckpointRecord,
    FateRecord,
    JudgeVerdict,
    NextStateRecord,
    SampleRecord,
    SyncRecord,
    TurnRecord,
)
from clawrl.storage.catalog import open_catalog
from clawrl.storage.writer import DataStore

H = "judgehash"
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)


def turn(i: int, session: str, index: int, version: str = "0", turn_type: str = "main") -> TurnRecord:
    at = T0 + timedelta(seconds=i)
    return TurnRecord(turn_id=f"t{i}", session_id=session, turn_index=index, turn_type=turn_type, namespace="open",
                      model="m", weight_version=version, request_messages="[]", request_tools=None,
                      request_params="{}", prompt_ids=[1, 2], output_ids=[3], rollout_logprobs=[-0.5], text="ok",
                      tool_calls=None, finish_reason="stop", created_at=at, completed_at=at, latency_ms=1.0)


def verdict(i: int, score: int, votes, raw, *, hint: str | None = None, hint_raw: str | None = None) -> JudgeVerdict:
    return JudgeVerdict(f"t{i}", H, "engine", score, "majority" if any(v is not None for v in votes) else "all_failed",
                        list(votes), json.dumps(raw), hint=hint, hint_raw_outputs=hint_raw)


def write(root, records) -> None:
    with DataStore(root, background=False) as store:
        store.append(records)
        store.flush()


def findings(root, method: str = "grpo", checkpoints=None) -> dict:
    with open_catalog(root) as con:
        return {f.name: f for f in diagnose(con, H, method=method, checkpoints=checkpoints)}


def failing(found: dict) -> list[str]:
    return [name for name, f in found.items() if not f.ok]


def test_a_client_that_starts_a_new_session_with_every_request(tmp_path):
    """No session id and no history: every turn is alone in its session and never gets a next state."""
    recs = []
    for i in range(12):
        recs += [turn(i, f"derived-{i}", 0), NextStateRecord(f"t{i}", f"derived-{i}", 0, False, None, "idle_timeout"),
                 FateRecord(f"t{i}", f"derived-{i}", H, "no_next_state", "idle_timeout")]
    write(tmp_path, recs)
    found = findings(tmp_path)
    assert failing(found) == ["next_states"]
    f = found["next_states"]
    assert f.summary == ("12 of 12 judged main turns got no next state, 0 of them before the last turn of their "
                         "session; 12 of 12 sessions have one turn")
    assert "every request starts a new session" in f.cause
    assert "X-Session-Id" in f.fix and "prompt_cache_key" in f.fix and "turn_outcomes" in f.sql
    with open_catalog(tmp_path) as con:  # the query it points to runs and shows the 12 lonely sessions
        assert len(con.sql(f.sql).fetchall()) == 12


def test_a_judge_that_never_writes_a_boxed_score(tmp_path):
    recs = []
    for i in range(10):
        s = f"s{i // 2}"
        recs += [turn(i, s, i % 2), NextStateRecord(f"t{i}", s, i % 2, True, "[]", "next_request"),
                 verdict(i, 0, [None, None, None], ["The reply is helpful and friendly."] * 2 + ["Score: good"]),
                 FateRecord(f"t{i}", s, H, "score_zero", "score 0 (all_failed)")]
    write(tmp_path, recs)
    found = findings(tmp_path)
    assert failing(found) == ["judge_votes", "judge_zero"]
    votes = found["judge_votes"]
    assert votes.summary.startswith("30 of 30 judge votes unparseable (100%) over 10 verdicts; most common outputs: "
                                    "'The reply is helpful and friendly.' x20; 'Score: good' x10")
    assert "\\boxed{1}" in votes.cause and "[prm] backend" in votes.fix
    assert found["judge_zero"].summary == "10 of 10 judged turns scored 0 and were dropped"


def test_a_judge_backend_that_cannot_be_reached(tmp_path):
    """Every judge attempt raised (what the judge flow writes then: a verdict with the error, fate judge_error)."""
    err = "ConnectError: [Errno 111] Connection refused (http://127.0.0.1:30001/generate)"
    recs = []
    for i in range(10):
        s = f"s{i // 2}"
        bad = i < 8
        recs += [turn(i, s, i % 2), NextStateRecord(f"t{i}", s, i % 2, True, "[]", "next_request"),
                 JudgeVerdict(f"t{i}", H, "engine", 0 if bad else 1, "all_failed" if bad else "majority",
                              [] if bad else [1, 1, 1], "[]" if bad else json.dumps(["\\boxed{1}"] * 3),
                              error=err if bad else None),
                 FateRecord(f"t{i}", s, H, "judge_error" if bad else "sample", err if bad else "")]
    write(tmp_path, recs)
    found = findings(tmp_path)
    assert failing(found) == ["judge_errors"]
    f = found["judge_errors"]
    assert f.summary == "8 of 10 judged turns failed in the judge"
    assert f.cause == "the judge backend fails: " + err
    assert "[prm] backend" in f.fix and "api_key_env" in f.fix
    with open_catalog(tmp_path) as con:  # the query it points to shows each verdict with its error
        rows = con.sql(f.sql).fetchall()
    assert len(rows) == 10 and sum(r[0] == err for r in rows) == 8


@pytest.mark.parametrize("method,fate", [("on_policy_distillation", "no_hint"), ("combine", "sample")])
def test_a_model_that_never_writes_a_usable_hint(tmp_path, method, fate):
    recs = []
    for i in range(8):
        s = f"s{i // 2}"
        recs += [turn(i, s, i % 2), NextStateRecord(f"t{i}", s, i % 2, True, "[]", "next_request"),
                 verdict(i, -1, [-1, -1, -1], ["\\boxed{-1}"] * 3, hint_raw=json.dumps(["I cannot help."])),
                 FateRecord(f"t{i}", s, H, fate, "")]
    write(tmp_path, recs)
    found = findings(tmp_path, method)
    assert failing(found) == ["hints"]
    assert found["hints"].summary == "0 usable hints of 8 asked (0% accepted)"
    assert "no usable hindsight hint" in found["hints"].cause
    assert ("dropped (no_hint)" in found["hints"].cause) == (method == "on_policy_distillation")


def test_trained_but_never_synced_and_a_failing_sync_are_stale_serving(tmp_path):
    write(tmp_path, [turn(0, "s", 0), CheckpointRecord("1", 1, "b1", "0", "/c/v000001", "ab", None),
                     CheckpointRecord("2", 2, "b2", "1", "/c/v000002", "cd", None)])
    serving = findings(tmp_path)["serving"]
    assert not serving.ok and "never pushed to the engine" in serving.cause
    write(tmp_path, [SyncRecord("y1", "1", "http://e", True, False, None, "1", "/c/v000001", None, T0, 0.5,
                                created_at=T0 + timedelta(seconds=1)),
                     SyncRecord("y2", "2", "http://e", False, False, "engine refused: out of memory", "1",
                                "/c/v000002", None, T0 + timedelta(seconds=5), 0.5,
                                created_at=T0 + timedelta(seconds=6))])
    serving = findings(tmp_path)["serving"]
    assert not serving.ok and serving.summary.endswith("versions 2 not served")
    assert serving.cause == "the last sync failed (2026-12-01 12:00:06 UTC, version 2 -> http://e): engine refused: " \
                            "out of memory"


def test_failed_syncs_stay_a_finding_after_a_later_sync_went_through(tmp_path):
    """A failed attempt (a rollback to pruned weights, an engine that was down) is not 'no problems'
    once the next sync serves: the doctor says how many failed and the newest one's reason."""
    sync = lambda i, v, ok, error, serving: SyncRecord(  # noqa: E731
        f"y{i}", v, "http://e", ok, False, error, serving, f"/c/v{int(v):06d}", None, T0, 0.5,
        created_at=T0 + timedelta(seconds=i))
    write(tmp_path, [turn(0, "s", 0), CheckpointRecord("1", 1, "b1", "0", "/c/v000001", "ab", None),
                     CheckpointRecord("2", 2, "b2", "1", "/c/v000002", "cd", None),
                     sync(1, "1", True, None, "1"), sync(2, "2", False, "engine stopped answering", "1"),
                     sync(3, "2", True, None, "2")])
    serving = findings(tmp_path)["serving"]
    assert not serving.ok and serving.summary == "newest checkpoint v2, serving 2; 1 of 3 syncs failed"
    assert serving.cause == ("the newest failed sync (2026-12-01 12:00:02 UTC, version 2 -> http://e): engine stopped "
                             "answering; the syncs after it went through")
    assert "nothing waits for a sync now" in serving.fix


def test_batches_whose_rewards_are_all_equal_carry_no_signal(tmp_path):
    recs = []
    for b in range(2):
        ids = [f"x{b}{k}" for k in range(4)]
        recs += [SampleRecord(sid, "t", "s", H, "grpo", [1], [2], [-0.5], 1.0, False, None, "0") for sid in ids]
        recs.append(BatchRecord(f"b{b}", b, ids, ["s"], "grpo", "c", str(b)))
    write(tmp_path, recs)
    signal = findings(tmp_path)["signal"]
    assert not signal.ok and signal.summary == "2 of 2 batches had one reward for every sample and no teacher term"


def test_samples_that_wait_past_max_staleness(tmp_path):
    recs = []
    for i in range(10):
        s = f"s{i // 2}"
        stale = i < 3
        recs += [turn(i, s, i % 2), NextStateRecord(f"t{i}", s, i % 2, True, "[]", "next_request"),
                 verdict(i, 1, [1, 1, 1], ["\\boxed{1}"] * 3),
                 FateRecord(f"t{i}", s, H, "too_stale" if stale else "sample", "")]
    write(tmp_path, recs)
    found = findings(tmp_path)
    assert failing(found) == ["staleness"]
    f = found["staleness"]
    assert f.summary == "3 of 10 judged turns too stale to train on"
    assert "max_staleness" in f.cause and "max_staleness" in f.fix
    with open_catalog(tmp_path) as con:
        assert sorted(r[0] for r in con.sql(f"SELECT turn_id FROM ({f.sql})").fetchall()) == ["t0", "t1", "t2"]


def _checkpoints_with_kl(root, kls) -> None:
    from clawrl.checkpoint import StepResult, write_step_result

    for step, kl in enumerate(kls, start=1):
        d = root / f"v{step:06d}"
        d.mkdir(parents=True)
        write_step_result(d, StepResult(f"b{step}", step, str(step), str(step - 1), str(d), "ab", {"kl": kl}))


@pytest.mark.parametrize("kls,ok", [([0.01, 0.02, 0.015, 0.4], False), ([0.2, 0.5, 0.9, 1.5], False),
                                    ([0.01, 0.02, 0.015, 0.12], True), ([0.5, 2.0], True)])
def test_a_policy_that_runs_away_from_its_reference(tmp_path, kls, ok):
    """KL of the last step over 10x the median of all steps (0.4 > 10 x 0.0175), or past 1 nat; fewer
    than 3 steps say nothing."""
    _checkpoints_with_kl(tmp_path / "ckpt", kls)
    f = findings(tmp_path / "data", checkpoints=tmp_path / "ckpt")["training"]
    assert f.ok == ok
    assert f.summary == f"{len(kls)} training steps, KL to the reference {kls[0]:.3g} -> {kls[-1]:.3g}"
    if not ok:
        assert "running away" in f.cause and "kl_coef" in f.fix


def test_a_healthy_run_reports_learning_per_version(tmp_path):
    """Two sessions a version, the first version judged mostly -1, the third mostly +1."""
    recs, i = [], 0
    for version, scores in (("0", [-1, -1, -1, 1, -1, -1]), ("1", [-1, 1, 1, -1, 1, -1]), ("2", [1, 1, 1, 1, -1, 1])):
        for k, score in enumerate(scores):
            s = f"s{version}-{k // 3}"
            recs += [turn(i, s, k % 3, version), NextStateRecord(f"t{i}", s, k % 3, True, "[]", "next_request"),
                     verdict(i, score, [score] * 3, [f"\\boxed{{{score}}}"] * 3),
                     FateRecord(f"t{i}", s, H, "sample", f"reward {score:+d}")]
            i += 1
    write(tmp_path, recs)
    assert failing(findings(tmp_path)) == []
    with open_catalog(tmp_path) as con:
        rows = learning_by_version(con, H)
    assert [(r["weight_version"], r["n"]) for r in rows] == [("0", 6), ("1", 6), ("2", 6)]
    first, last = rows[0], rows[-1]
    assert first["mean_score"] == pytest.approx(-4 / 6) and last["mean_score"] == pytest.approx(4 / 6)
    # five -1 and one +1: squared deviations 5 * (1/3)^2 + (5/3)^2 = 10/3, sample variance 2/3,
    # std 0.8165; half-width 1.96 * 0.8165 / sqrt(6) = 0.6533
    assert first["ci_high"] == pytest.approx(-4 / 6 + 0.6533, abs=1e-4)
    assert learning_verdict(rows) == ("the judged score of live turns improved: -0.67 on version 0 (n=6) -> "
                                      "+0.67 on version 2 (n=6)")
    assert learning_verdict(rows[:1]).startswith("not enough judged live turns")
    assert rows[2]["ci_high"] == 1.0  # five +1 and one -1: the interval is clipped to the scores' range
    from clawrl.doctor import plot_learning_by_version

    png = plot_learning_by_version(rows, tmp_path / "plot" / "lbv.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_doctor_command_prints_the_cause_and_fix_and_json(tmp_path):
    from typer.testing import CliRunner

    from clawrl.cli import app

    recs = []
    for i in range(6):
        recs += [turn(i, f"d{i}", 0), FateRecord(f"t{i}", f"d{i}", H, "no_next_state", "idle_timeout")]
    env = {"CLAWRL__STORAGE__DATA_ROOT": str(tmp_path)}
    from clawrl.config import load_settings
    from clawrl.judge.runner import build_judge_config_hash

    chash = build_judge_config_hash(load_settings(env=env))
    write(tmp_path, [r if not isinstance(r, FateRecord) else FateRecord(r.turn_id, r.session_id, chash, r.fate,
                                                                        r.detail) for r in recs])
    out = CliRunner().invoke(app, ["doctor"], env=env)
    assert out.exit_code == 0, out.output
    assert f"clawrl doctor (judge config {chash}): 1 problem found" in out.output
    assert "FAIL next_states:" in out.output and "fix: send a stable session id" in out.output
    report = json.loads(CliRunner().invoke(app, ["doctor", "--json"], env=env).output)
    assert [f["name"] for f in report["findings"] if not f["ok"]] == ["next_states"]
    assert report["learning_by_version"] == [] and report["learning"].startswith("not enough")


def test_traffic_fails_on_no_turns_and_on_side_turns_only(tmp_path):
    assert findings(tmp_path / "empty")["traffic"].cause == "nothing reached the gateway's chat completions"
    write(tmp_path, [turn(i, "s", i, turn_type="side") for i in range(4)])
    traffic = findings(tmp_path)["traffic"]
    assert not traffic.ok and traffic.summary == "4 turns logged, 0 main, 4 side, in 1 sessions"
    assert "X-Turn-Type: main" in traffic.fix
    write(tmp_path, [turn(9, "s", 9)])  # one main turn beside them: side turns are normal
    assert findings(tmp_path)["traffic"].ok


def _status(root) -> str:
    """`clawrl status` on ``root`` (the environment names it), the table's cells on one line."""
    from typer.testing import CliRunner

    from clawrl.cli import app

    out = CliRunner().invoke(app, ["status"], env={"CLAWRL__STORAGE__DATA_ROOT": str(root)})
    assert out.exit_code == 0, out.output
    return re.sub(r"[│\s]+", " ", out.output)  # the table wraps to the console's width


def _default_hash(root) -> str:
    from clawrl.config import load_settings
    from clawrl.judge.runner import build_judge_config_hash

    return build_judge_config_hash(load_settings(env={"CLAWRL__STORAGE__DATA_ROOT": str(root)}))


def test_status_shows_the_live_score_of_the_first_and_the_last_versions(tmp_path):
    chash = _default_hash(tmp_path)
    recs = []
    for i, (version, score) in enumerate([("0", -1), ("0", 1), ("1", 1), ("2", 1), ("3", -1), ("3", 1)]):
        recs += [turn(i, f"s{i}", 0, version),
                 JudgeVerdict(f"t{i}", chash, "rule", score, "majority", [score], "[]"),
                 FateRecord(f"t{i}", f"s{i}", chash, "sample", "")]
    write(tmp_path, recs)
    assert "live judged score by version v0 +0.00 (n=2), v1 +1.00 (n=1), v2 +1.00 (n=1), v3 +0.00 (n=2)" in \
        _status(tmp_path)
    write(tmp_path, [turn(9, "s9", 0, "4"), JudgeVerdict("t9", chash, "rule", -1, "majority", [-1], "[]"),
                     FateRecord("t9", "s9", chash, "sample", "")])
    # five versions: the first (where learning started) and the newest three
    assert "by version v0 +0.00 (n=2), ..., v2 +1.00 (n=1), v3 +0.00 (n=2), v4 -1.00 (n=1)" in _status(tmp_path)


def test_status_counts_every_turn_in_one_row(tmp_path):
    """judged + awaiting next state + pending judgment + side turns not yet marked = the turns logged."""
    chash = _default_hash(tmp_path)
    nxt = lambda i, has: NextStateRecord(f"t{i}", f"s{i}", 0, has, "[]" if has else None,  # noqa: E731
                                         "next_request" if has else "session_done")
    write(tmp_path, [turn(0, "s0", 0), FateRecord("t0", "s0", chash, "sample", ""),  # judged
                     turn(1, "s1", 0, turn_type="side"), FateRecord("t1", "s1", chash, "side_turn", ""),  # judged
                     turn(2, "s2", 0),  # no next state yet
                     turn(3, "s3", 0), nxt(3, True), turn(4, "s4", 0), nxt(4, False),  # ready for the judge
                     turn(5, "s5", 0, turn_type="side"), turn(6, "s6", 0, turn_type="side")])  # side, not yet marked
    assert ("turns (main / side) 7 (4 / 3) judged 2 main, awaiting next state 1 main, pending judgment 2 side, not "
            "yet marked by the judge 2 ") in _status(tmp_path)


def test_status_shows_checkpoints_that_no_sync_ever_served_as_waiting(tmp_path):
    from typer.testing import CliRunner

    from clawrl.cli import app

    write(tmp_path, [CheckpointRecord("1", 1, "b1", "0", "/c/v000001", "ab", None),
                     CheckpointRecord("2", 2, "b2", "1", "/c/v000002", "cd", None)])
    out = CliRunner().invoke(app, ["status"], env={"CLAWRL__STORAGE__DATA_ROOT": str(tmp_path)})
    assert out.exit_code == 0, out.output
    assert "last sync: none recorded; checkpoints 1, 2 waiting: nothing serves them (`clawrl sync`)" in out.output


def test_a_gate_that_keeps_refusing_is_a_finding_with_the_last_reason(tmp_path):
    from clawrl.records import PromotionRecord

    def row(i: int, action: str, version: str, reason: str) -> PromotionRecord:
        return PromotionRecord(f"p{i}", action, version, "1" if i else "0", "gate", reason, "k", 16, None, None, None,
                               None, None, None, 0.05, 0.05, None, created_at=T0 + timedelta(seconds=i))

    write(tmp_path, [row(0, "promote", "1", "ok"), row(1, "refuse", "2", "worse A"), row(2, "refuse", "3", "worse B")])
    f = findings(tmp_path)["promotion"]
    assert f.ok and f.summary == "champion v1; 2 of 3 gated candidates refused, 2 in a row"
    write(tmp_path, [row(3, "refuse", "4", "worse by more than the tolerance 0.05: candidate 0.500 vs ...")])
    f = findings(tmp_path)["promotion"]
    assert not f.ok and "the last 3 checkpoints scored worse than the champion v1" in f.cause
    assert f.summary.endswith("; last: worse by more than the tolerance 0.05: candidate 0.500 vs ...")
    assert "a reward with the wrong sign" in f.fix and "FROM promotions" in f.sql
    # candidates refused only for want of a gain ([gate] min_gain) are a plateau: not a finding
    write(tmp_path, [row(i, "promote" if i == 4 else "refuse", str(i + 1), "ok" if i == 4 else
                         "not better than the champion by more than min_gain 0: candidate 0.703 vs ...")
                     for i in range(4, 8)])
    f = findings(tmp_path)["promotion"]
    assert f.ok and f.summary == ("champion v5; 6 of 8 gated candidates refused, 3 in a row; none of the last 3 "
                                  "beat the champion by more than [gate] min_gain: a plateau, not a fault")


def test_candidates_that_get_worse_while_refused_point_at_a_starved_learner(tmp_path):
    from clawrl.records import PromotionRecord

    def row(i: int, mean: float | None) -> PromotionRecord:
        return PromotionRecord(f"p{i}", "refuse", str(i + 1), "0", "gate", "worse by more than the tolerance 0.05",
                               "k", 32, mean, 0.438, None, None, None, None, 0.05, 0.05, None,
                               created_at=T0 + timedelta(seconds=i))

    # the tools demo gated with a guard: 0.406, 0.375, 0.297, 0.156 on the evaluation set
    write(tmp_path, [row(i, m) for i, m in enumerate((0.406, 0.375, 0.297, 0.156))])
    f = findings(tmp_path)["promotion"]
    assert not f.ok and f.summary.endswith("4 in a row; candidates falling: 0.406 -> 0.375 -> 0.297 -> 0.156")
    assert "trains on v0's answers, not its own" in f.cause and "`clawrl promote VERSION`" in f.fix
    # not falling every time: the general finding, with the last reason
    write(tmp_path, [row(4, 0.2)])
    f = findings(tmp_path)["promotion"]
    assert not f.ok and f.summary.endswith("; last: worse by more than the tolerance 0.05")
    assert "scored worse than the champion v0" in f.cause


def test_fixes_never_suggest_the_method_the_run_already_uses(tmp_path):
    """combine learns from the score already: its hint and signal findings point at hints, not at combine."""
    recs = []
    for i in range(8):
        s = f"s{i // 2}"
        recs += [turn(i, s, i % 2), NextStateRecord(f"t{i}", s, i % 2, True, "[]", "next_request"),
                 verdict(i, -1, [-1, -1, -1], ["\\boxed{-1}"] * 3, hint_raw=json.dumps(["I cannot help."])),
                 FateRecord(f"t{i}", s, H, "sample", "")]
    ids = [f"x{k}" for k in range(4)]
    recs += [SampleRecord(sid, "t", "s", H, "combine", [1], [2], [-0.5], -1.0, False, None, "0") for sid in ids]
    recs.append(BatchRecord("b0", 0, ids, ["s"], "combine", "c", "1"))
    write(tmp_path, recs)
    combine = findings(tmp_path, "combine")
    assert failing(combine) == ["hints", "signal"]
    assert "combine" not in combine["hints"].fix and "grpo" in combine["hints"].fix
    assert "combine" not in combine["signal"].fix and "usable hints" in combine["signal"].fix
    assert "combine" in findings(tmp_path, "on_policy_distillation")["hints"].fix
    assert "combine / on_policy_distillation" in findings(tmp_path, "grpo")["signal"].fix


def _checked(root, **checks) -> dict:
    with open_catalog(root) as con:
        return {f.name: f for f in diagnose(con, H, method="grpo", **checks)}


def test_samples_alone_in_their_prompt_group_get_advantage_zero(tmp_path):
    """Centred on their prompt's group, the 4 samples alone with their prompt get R - R = 0 (one prompt is asked
    twice)."""
    ids = [f"x{k}" for k in range(6)]
    prompts = [[1, 2], [1, 2], [3], [4], [5], [6]]
    recs = [SampleRecord(sid, "t", "s", H, "grpo", p, [2], [-0.5], 1.0 if k % 2 else -1.0, False, None, "0")
            for k, (sid, p) in enumerate(zip(ids, prompts))]
    write(tmp_path, [*recs, BatchRecord("b0", 0, ids, ["s"], "grpo", "c", "1")])
    groups = _checked(tmp_path, group_by_prompt=True)["groups"]
    assert not groups.ok and groups.summary == "4 of 6 trained samples were alone with their prompt in their batch"
    assert "std 0 after centering" in groups.cause and "group_by = 'batch'" in groups.fix
    with open_catalog(tmp_path) as con:  # its query shows each group's size
        assert sorted(r[2] for r in con.sql(groups.sql).fetchall()) == [1, 1, 1, 1, 2]
    assert _checked(tmp_path, group_by_prompt=False)["groups"].ok  # a batch baseline: no groups of one


def test_judge_calls_without_a_timeout_and_placeholder_keys(tmp_path, monkeypatch, make_settings):
    from clawrl.doctor import settings_checks

    assert _checked(tmp_path, judge_timeout_s=float("inf"))["judge_timeout"].ok is False
    assert "times out after 120 s" in _checked(tmp_path, judge_timeout_s=120.0)["judge_timeout"].summary
    keys = _checked(tmp_path, placeholder_keys=["CLAWRL_PROVIDER_API_KEY"])["api_keys"]
    assert not keys.ok and keys.summary == "CLAWRL_PROVIDER_API_KEY holds a placeholder, not a key"
    monkeypatch.setenv("CLAWRL_PROVIDER_API_KEY", "sk-xxx")
    provider = make_settings({"prm.backend": "provider", "provider.base_url": "http://10.0.0.9/v1"})
    assert settings_checks(provider) == {"group_by_prompt": False, "judge_timeout_s": 120.0,
                                         "placeholder_keys": ["CLAWRL_PROVIDER_API_KEY"]}
    monkeypatch.setenv("CLAWRL_PROVIDER_API_KEY", "sk-live-1234")
    assert settings_checks(provider)["placeholder_keys"] == []
    rule = make_settings({"prm.backend": "rule", "ppo.group_by": "prompt", "ppo.advantage_estimator": "grpo"})
    assert settings_checks(rule) == {"group_by_prompt": True, "judge_timeout_s": None, "placeholder_keys": []}
    hook = make_settings({"prm.backend": "rule", "hooks.reward": "tests.utils.gate_eval:reward"})
    assert settings_checks(hook)["judge_timeout_s"] == 120.0  # a reward hook is bounded by the same timeout
