"""Reading the recorded data: `sql`, `status`, `doctor`, `lineage`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

import clawrl.cli.adapters as per_namespace
from clawrl.cli.adapters import NamespaceOpt
from clawrl.cli.common import (RunConfigOpt, app, console, data_root_line, err, fail, gateway_engine_url,
                               print_findings, promotion_line, promotion_note, require_data_root, settings_or_exit,
                               sync_command, warn)


@app.command("sql")
def sql(
    query: Annotated[str, typer.Argument(help="SQL over the views turns, next_states, verdicts, samples, "
                                               "turn_fate, batches, checkpoints, syncs, evaluations, promotions, "
                                               "verdict_attempts, turn_outcomes, learning_by_version "
                                               "(storage/catalog.py).")],
    fmt: Annotated[Literal["table", "csv", "json", "parquet"], typer.Option("--format", "-f",
                                                                           help="parquet needs --out.")] = "table",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the result to this file.")] = None,
    config: RunConfigOpt = None,
) -> None:
    """Query the recorded data with DuckDB, read-only: queries only, no file access outside the tables."""
    import duckdb

    from clawrl.storage.catalog import ReadOnlyQueryError, export_table, format_cell, run_query

    if fmt == "parquet" and out is None:
        fail("--format parquet needs --out FILE")
    if not query.strip():
        fail('no query: give one, e.g. clawrl sql "select count(*) from turns"')
    s = settings_or_exit(config)
    data_root = s.storage.data_root  # one that does not exist answers with empty views, under its name
    err.print(data_root_line(s, config), markup=False, highlight=False, soft_wrap=True)  # stdout: the result only
    from clawrl.storage.wal import wait_converted

    # a turn a running gateway acknowledged a moment ago is still in its write-ahead log: wait for it
    wait_converted(data_root / "tables")
    try:
        result = run_query(data_root, query, read_only=True)  # --out is written below, by clawrl
    except (duckdb.Error, ReadOnlyQueryError) as e:
        renamed = [f"{old} is now {new}" for old, new in RENAMED_VIEWS.items() if f"name {old} does" in str(e)]
        fail(one_line(str(e)) + "".join(f" (the view {x})" for x in renamed))
    if fmt != "table":
        text = export_table(result, fmt, out)
        if text is not None:
            typer.echo(text, nl=False)
        return
    view = Table(caption=f"{result.num_rows} row{'' if result.num_rows == 1 else 's'}")
    for name in result.column_names:
        view.add_column(Text(name))
    for row in result.to_pylist():
        # Token and log-prob lists are long: cut cells so the table stays readable. Text, not
        # markup: a "[red]" inside recorded text must print as is.
        cells = (format_cell(v) for v in row.values())
        view.add_row(*(Text(c if len(c) <= 80 else c[:79] + "…") for c in cells))
    if out is None:
        console.print(view)
    else:
        with out.open("w") as f:
            Console(file=f, width=200).print(view)


RENAMED_VIEWS = {"judgments": "verdicts", "judgment_attempts": "verdict_attempts"}  # named as their table now


def one_line(message: str) -> str:
    """DuckDB's error on one line: its query echo ('LINE 1: ...') and the caret under it left out, the
    rest (the error, 'Did you mean "verdicts"?') joined."""
    lines = [x.strip() for x in message.splitlines()]
    return " ".join(x for x in lines if x and not x.startswith("LINE ") and set(x) != {"^"})


@app.command("status")
def status(config: RunConfigOpt = None, namespace: NamespaceOpt = None) -> None:
    """Turns pending judgment, judged, trainable samples vs rollout_batch_size, exclusion reasons, the
    latest checkpoint, the version served, the last weight sync and the checkpoint waiting to be served.
    With [ppo] adapters = "namespace": one line per namespace, or with --namespace that one's in full."""
    s = settings_or_exit(config)
    require_data_root(s, config)
    if s.ppo.adapters == "namespace" or namespace is not None:
        if namespace is None:
            return per_namespace.status_overview(s, config)
        return per_namespace.status(s, config, per_namespace.namespace_or_exit(s, namespace))
    from clawrl.judge.runner import build_judge_config_hash
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.queries import find_checkpoint, pending_counts, sync_state
    from clawrl.doctor import judge_config_finding, learning_by_version
    from clawrl.storage.promotions import consecutive_refusals, promotion_log

    chash = build_judge_config_hash(s)
    with open_catalog(s.storage.data_root) as con:
        c = pending_counts(con, chash, s.ppo.rollout_batch_size)
        latest = find_checkpoint(con)
        st = sync_state(con)
        versions = learning_by_version(con, chash)
        log, consecutive = promotion_log(con), consecutive_refusals(con)
        judged_under = judge_config_finding(con, chash)
    console.print(data_root_line(s, config), markup=False, highlight=False, soft_wrap=True)
    if not judged_under.ok:
        warn(f"judge config mismatch: {judged_under.summary}; {judged_under.fix}")
    t = Table(title=f"clawrl status (judge config {chash})", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(justify="right")
    rows = [  # every turn is counted in one of the four rows after the first
        ("turns (main / side)", f"{c['turns']} ({c['main_turns']} / {c['side_turns']})"),
        ("judged", c["judged"]),
        ("main, awaiting next state", c["awaiting_next_state"]),
        ("main, pending judgment", c["pending_judgment"] + c["pending_no_next_state"]),
        ("side, not yet marked by the judge", c["side_unmarked"]),
        ("trainable samples waiting", f"{c['trainable']} / rollout_batch_size {c['rollout_batch_size']}"),
        ("samples consumed by batches", f"{c['consumed']} in {c['batches']} batches"),
    ]
    if c["samples_needed"]:
        rows.append(("next training step needs", f"{c['samples_needed']} more samples"))
    if latest:
        rows.append(("latest checkpoint", f"weight_version {latest['weight_version']} (step {latest['step']})"))
    served = served_version(s, st)
    rows.append(("served version", f"{served['version']} ({served['source']})"))
    rows += [(f"  excluded: {fate}", n) for fate, n in sorted(c["fates"].items()) if fate != "sample"]
    if versions:  # learning as users see it: the first version and the newest three (clawrl doctor has all)
        shown = [f"v{r['weight_version']} {r['mean_score']:+.2f} (n={r['n']})" for r in versions]
        rows.append(("live judged score by version", ", ".join(shown if len(shown) <= 4 else
                                                               [shown[0], "...", *shown[-3:]])))
    for k, v in rows:
        t.add_row(k, str(v))
    console.print(t)
    console.print(promotion_line(log, consecutive), markup=False, highlight=False, soft_wrap=True)
    console.print(sync_line(st), markup=False, highlight=False, soft_wrap=True)
    if s.gate.canary:
        console.print(f"canary: {s.gate.canary_share:.0%} of sessions get the newest trained version (engine "
                      f"{s.gate.canary_url or 'in the serving process'})", markup=False, highlight=False,
                      soft_wrap=True)
    waiting = waiting_line(s, config, st, served)
    if waiting:
        console.print(waiting, markup=False, highlight=False, soft_wrap=True, style="bold yellow")


def served_version(s, st: dict) -> dict:
    """The version served (``version``), where that is known from (``source``) and the engine a sync
    goes to (``engine_url``; None: no `clawrl serve` runs on the data root): the running gateway's own
    answer, else the newest version a sync saw served, else the initial weights."""
    import httpx

    from clawrl.serving import serving_gateway

    found = serving_gateway(s.storage.data_root)
    if found:
        try:
            version = httpx.get(f"{found['gateway_url']}/healthz", timeout=3.0).json()["weight_version"]
            return {"version": str(version), "source": f"live, from {found['gateway_url']}",
                    "engine_url": found.get("engine_url")}
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            pass  # the gateway does not answer: what the records say
    if st["last_seen_serving"] is not None:
        return {"version": str(st["last_seen_serving"]), "engine_url": None,
                "source": "as the last sync saw it; no `clawrl serve` answers"}
    return {"version": "0", "engine_url": None,
            "source": "the initial weights; no sync recorded, no `clawrl serve` answers"}


def waiting_line(s, config, st: dict, served: dict) -> str | None:
    """'checkpoint v4 is waiting: served version is v3 (run `clawrl sync 4 ...`)' when a checkpoint newer
    than the version served waits for a sync (candidates the gate refused never do); else None."""
    def newer(v: str) -> bool:
        return not served["version"].isdigit() or int(v) > int(served["version"])

    waiting = [v for v in st["waiting"] if newer(v)]
    if not waiting:
        return None
    v = waiting[-1]
    if served["engine_url"]:
        how = f"run `{sync_command(config, v, served['engine_url'])}`"
    elif s.engine.kind == "http" and s.engine.url:
        how = f"run `{sync_command(config, v)}`"
    else:
        how = f"run `{sync_command(config, v, gateway_engine_url(s))}` with `clawrl serve` running"
    return f"checkpoint v{v} is waiting: served version is v{served['version']} ({how})"


def sync_line(st: dict) -> str:
    """One line on weight sync, e.g. 'last sync: FAILED at <time> (version 4 -> URL): <reason>; serving
    version 3; checkpoint 4 waiting'. Plain text, never wrapped: scripts grep it."""
    last = st["last"]
    if last is None:
        waiting = f"; checkpoints {', '.join(st['waiting'])} waiting: nothing serves them (`clawrl sync`)" \
            if st["waiting"] else ""
        return f"last sync: none recorded{waiting}"
    when = last["created_at"].strftime("%Y-%m-%d %H:%M:%S UTC")
    head = (f"last sync: ok at {when} (version {last['weight_version']} -> {last['target']})" if last["ok"] else
            f"last sync: FAILED at {when} (version {last['weight_version']} -> {last['target']}): {last['error']}")
    serving = st["serving"] if st["serving"] is not None else (
        f"unknown (the engine did not answer; last seen serving {st['last_seen_serving']})")
    parts = [head, f"serving version {serving}"]
    if st["waiting"]:
        parts.append(f"checkpoint{'s' if len(st['waiting']) > 1 else ''} {', '.join(st['waiting'])} waiting")
    parts.append(f"{st['attempts']} sync attempts, {st['failures']} failed")
    return "; ".join(parts)


@app.command("doctor")
def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="The findings and the per-version scores as JSON.")] = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Draw the per-version scores into this PNG.")] = None,
    config: RunConfigOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Why the run is or is not learning: each stage from logged turns to served weights checked,
    with the cause and the fix of each problem, and the judged score of live turns per weight version.
    With --namespace: that namespace's turns, samples, served adapter and gate."""
    import json

    s = settings_or_exit(config)
    require_data_root(s, config)
    if namespace is not None:
        return per_namespace.doctor(s, config, per_namespace.namespace_or_exit(s, namespace), as_json)
    from clawrl.doctor import plot_learning_by_version, report, settings_checks
    from clawrl.judge.runner import build_judge_config_hash
    from clawrl.storage.catalog import open_catalog

    chash = build_judge_config_hash(s)
    with open_catalog(s.storage.data_root) as con:
        found = report(con, chash, method=s.ppo.advantage_estimator.value,
                       checkpoints=s.storage.data_root / "checkpoints", **settings_checks(s))
    versions = found["learning_by_version"]
    if plot is not None:
        plot_learning_by_version(versions, plot)
    if as_json:
        typer.echo(json.dumps({"data_root": str(s.storage.data_root), **found}))
        return
    console.print(data_root_line(s, config), markup=False, highlight=False, soft_wrap=True)
    print_findings(f"clawrl doctor (judge config {chash})", found["findings"])
    t = Table(title="judged score of live main turns, by the weight version that served them", title_justify="left")
    for name in ("version", "n", "mean", "95% interval"):
        t.add_column(name, justify="right")
    for r in versions:
        t.add_row(str(r["weight_version"]), str(r["n"]), f"{r['mean_score']:+.3f}",
                  f"{r['ci_low']:+.3f} .. {r['ci_high']:+.3f}")
    console.print(t)
    console.print(f"learning: {found['learning']}", markup=False, highlight=False, soft_wrap=True)
    if plot is not None:
        console.print(f"wrote {plot}", markup=False)


@app.command("lineage")
def lineage(
    version: Annotated[str, typer.Argument(help="A weight version, e.g. 3, or 'latest'.")],
    config: RunConfigOpt = None,
    replay: Annotated[Optional[str], typer.Option(help="A version of this replay (its id, as `clawrl replay` "
                                                       "printed it), not of the training run.")] = None,
    namespace: NamespaceOpt = None,
) -> None:
    """What trained a version: its batches -> sessions (NAMESPACE:SESSION_ID) -> turns, with MLflow runs and
    checkpoint hashes. With --namespace: a version of that namespace's adapter (N, or latest)."""
    s = settings_or_exit(config)
    require_data_root(s, config)
    from rich.tree import Tree

    from clawrl.checkpoint import short_digest
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.promotions import champion_stack, promotion_log, unserved_versions
    from clawrl.storage.queries import latest_version, lineage_chain

    root = s.storage.data_root if replay is None else per_namespace.replay_root(s, replay)
    console.print(data_root_line(s, config), markup=False, highlight=False, soft_wrap=True)
    if namespace is not None:
        return per_namespace.lineage(s, per_namespace.namespace_or_exit(s, namespace, known=replay is None), version,
                                     replay)
    with open_catalog(root) as con:
        if version == "latest":
            version = str(latest_version(con))
            if version == "0":
                fail(f"no checkpoint in {root} yet")
        chain = lineage_chain(con, version)
        children = [r[0] for r in con.execute("SELECT DISTINCT weight_version FROM checkpoints WHERE "
                                              "parent_version = '0' ORDER BY step").fetchall()]
        notes = (promotion_log(con), champion_stack(con), unserved_versions(con)) if replay is None else None
    if version == "0":  # no checkpoint: the weights every run starts from
        trained = f"versions trained from it: {', '.join(children)}" if children else "no version trained from it yet"
        console.print(f"weight_version 0{'' if replay is None else f' of replay {replay}'} = the initial weights of "
                      f"{s.model.name} ([model] name), as loaded before any training step: no batch, no checkpoint; "
                      f"{trained}", markup=False, highlight=False, soft_wrap=True)
        return
    if not chain:
        fail(f"no checkpoint with weight_version {version!r} in {root}")
    what = "" if replay is None else f" of replay {replay}"
    note = "" if notes is None else f": {promotion_note(*notes, version)}"  # a replay's versions serve nobody
    # the heading on a line of its own: a tree's label wraps at the terminal's width, a sentence need not
    console.print(f"weight_version {version}{what} (from version 0 = {s.model.name}){note}", markup=False,
                  highlight=False, soft_wrap=True)
    tree = Tree(f"v{version}: {len(chain)} step{'s' if len(chain) != 1 else ''} from the initial weights")
    for c in chain:
        source = f" re-training batch {c['source_batch_id']}" if c["source_batch_id"] else ""
        node = tree.add(f"v{c['weight_version']} <- v{c['parent_version']}: batch {c['batch_id']}{source} "
                        f"({len(c['sample_ids'])} samples, {c['method']}), mlflow run {c['mlflow_run_id']}, "
                        f"sha256 {short_digest(c['sha256'])}")
        for namespace, sid in c["sessions"]:
            node.add(f"session {namespace}:{sid}")
        node.add(f"turns: {', '.join(t[:8] for t in c['turn_ids'])}")
    console.print(tree, markup=False)
