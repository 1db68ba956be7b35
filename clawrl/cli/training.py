"""The learning steps, run here and now: `judge`, `train`, `sync`, `replay`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, Optional

import typer

import clawrl.cli.adapters as per_namespace
from clawrl.cli.adapters import NamespaceOpt
from clawrl.cli.common import (RunConfigOpt, app, console, data_root_line, data_root_prefect, err, fail,
                               gateway_engine_url, run_in_up, settings_or_exit, sync_command, warn)
from clawrl.cli.data import status
from clawrl.config import ConfigError

if TYPE_CHECKING:
    from rich.table import Table

EngineUrlOpt = Annotated[Optional[str], typer.Option(help="SGLang server, `clawrl engine` or the gateway's /engine URL "
                                                          "(default: [engine] url when kind=http, else the `clawrl "
                                                          "serve` running on the data root).")]
ReasonOpt = Annotated[str, typer.Option(help="Why, in words (kept in the promotions table).")]


@app.command("judge")
def judge(
    config: RunConfigOpt = None,
    limit: Annotated[Optional[int], typer.Option(
        min=1, help="Most turns to judge (default: every ready turn).")] = None,
) -> None:
    """Judge every ready turn now, then print the status: a run of the `judge` deployment of the `clawrl up`
    running on the data root, else the Prefect flow `judge` run here."""
    from clawrl.flows.slots import JUDGE_DEPLOYMENT

    s = settings_or_exit(config)
    console.print(data_root_line(s, config), markup=False, highlight=False, soft_wrap=True)
    before = _counts(s)
    run = run_in_up(s, JUDGE_DEPLOYMENT, {"limit": limit} if limit else {})
    if run is None:
        with data_root_prefect(s):
            from clawrl.flows.judge import judge_flow

            judge_flow(config_path=str(config) if config else None, limit=limit)
    elif not run.state.is_completed():
        fail(f"{run.name} ended {run.state.name}: its logs are in the Prefect UI", code=1)
    console.print(judged_line(before, _counts(s)), markup=False, highlight=False, soft_wrap=True)
    status(config)


def _counts(s) -> dict:
    from clawrl.judge.runner import build_judge_config_hash
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.queries import pending_counts

    with open_catalog(s.storage.data_root) as con:
        return pending_counts(con, build_judge_config_hash(s), s.ppo.rollout_batch_size)


def judged_line(before: dict, after: dict) -> str:
    """What a judge run did, from ``pending_counts`` before and after it: the fates it wrote, or why it
    wrote none (nothing ready: the turns wait for their next state; or another run judges them)."""
    judged = after["judged"] - before["judged"]
    if judged:
        fates = {f: n - before["fates"].get(f, 0) for f, n in after["fates"].items()}
        return f"judged {judged} turn{'s' if judged != 1 else ''}: " + ", ".join(
            f"{n} {fate}" for fate, n in sorted(fates.items()) if n)
    ready = after["pending_judgment"] + after["pending_no_next_state"] + after["side_unmarked"]
    if ready:
        return f"judged 0 turns: {ready} ready, taken by another judge run (`clawrl up` judges every few seconds)"
    waiting = after["awaiting_next_state"]
    return (f"judged 0 turns: none is ready; {waiting} main turn{'s wait' if waiting != 1 else ' waits'} for its next "
            f"state (the next message of its session), {after['judged']} judged before")


@app.command("train")
def train(
    config: RunConfigOpt = None,
    steps: Annotated[int, typer.Option(min=1, help="Most PPO steps to run (one per full batch).")] = 1,
    trainer_url: Annotated[Optional[str], typer.Option(help="A `clawrl trainer` service (default: train here, or "
                                                            "in the `clawrl up` running on the data root).")] = None,
    engine_url: Annotated[Optional[str], typer.Option(help="Engine to sync (default: [engine] url when kind=http, "
                                                           "else the `clawrl serve` running on the data root).")] = None,
) -> None:
    """Claim a full batch, step, checkpoint, log lineage, gate, sync: a run of the `train` deployment of the
    `clawrl up` running on the data root, else the Prefect flow `train` run here."""
    from clawrl.flows.slots import TRAIN_DEPLOYMENT

    s = settings_or_exit(config)
    console.print(data_root_line(s, config), markup=False, highlight=False, soft_wrap=True)
    newest = max((c["step"] for c in _checkpoints(s)), default=0)
    run = run_in_up(s, TRAIN_DEPLOYMENT, {"max_steps": steps, **({"trainer_url": trainer_url} if trainer_url else {}),
                                          **({"engine_url": engine_url} if engine_url else {})})
    if run is not None:
        if not run.state.is_completed():
            fail(f"{run.name} ended {run.state.name}: its logs are in the Prefect UI", code=1)
        _print_steps_in_up(s, [c for c in _checkpoints(s) if c["step"] > newest])
        return
    with data_root_prefect(s):
        from clawrl.flows.train import train_flow

        out = train_flow(config_path=str(config) if config else None, max_steps=steps, trainer_url=trainer_url,
                         engine_url=engine_url)
    if not out["steps"]:
        console.print("no full batch of trainable samples yet (see `clawrl status`)")
    for st in out["steps"]:
        m = st["metrics"]
        if "namespace" in st:  # [ppo] adapters = "namespace": a namespace's adapter version
            gate = st["gate"]
            decided = "promoted" if gate["decision"] == "promote" else f"refused, {gate['serve_version']} serves"
            console.print(f"adapter {st['weight_version']}: loss {m.get('loss', float('nan')):.4f}, "
                          f"{int(m.get('num_seqs', 0))} samples, {st['path']}, gate: {decided} "
                          f"({gate['reason'].split(':')[0]}), sync: {st['sync']['message'] or 'ok'}", markup=False,
                          soft_wrap=True)
            if not st["sync"]["success"]:
                warn(f"adapter {st['weight_version']} is not served yet: {st['sync']['message']}; its namespace keeps "
                     "its previous one until its next step syncs")
            continue
        console.print(f"step {st['step']}: weight_version {st['weight_version']}, loss {m.get('loss', float('nan')):.4f}, "
                      f"{int(m.get('num_seqs', 0))} samples, checkpoint {st['path']}, sync: {st['sync']['message'] or 'ok'}",
                      markup=False)
        if not st["sync"]["success"]:
            waiting_after_sync(s, config, st["sync"])


def _checkpoints(s) -> list[dict]:
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.queries import recorded_checkpoints

    with open_catalog(s.storage.data_root) as con:
        return recorded_checkpoints(con)


def _print_steps_in_up(s, made: list[dict]) -> None:
    """The steps a train run in `clawrl up` made, from the tables: each checkpoint and what the gate made of it."""
    from clawrl.cli.common import promotion_note
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.promotions import champion_stack, promotion_log, unserved_versions

    if not made:
        console.print("no full batch of trainable samples yet (see `clawrl status`)")
        return
    with open_catalog(s.storage.data_root) as con:
        notes = promotion_log(con), champion_stack(con), unserved_versions(con)
    for c in made:
        console.print(f"step {c['step']}: weight_version {c['weight_version']}, checkpoint {c['path']}: "
                      f"{promotion_note(*notes, str(c['weight_version']))}", markup=False, highlight=False,
                      soft_wrap=True)


def waiting_after_sync(s, config, sync: dict) -> None:
    """Say loudly that the checkpoint a sync did not serve is waiting, and the command that serves it."""
    from clawrl.sync import NO_ENGINE

    v, url = sync["version"], sync.get("target")
    url = url if url and url.startswith("http") else None  # None: in this process
    if sync["message"] == NO_ENGINE:
        warn(f"checkpoint v{v} is WAITING: nothing serves it (no `clawrl serve` is running on {s.storage.data_root} "
             f"and no [engine] url). With the gateway running, serve it with: "
             f"{sync_command(config, v, gateway_engine_url(s))}")
    else:
        warn(f"weight sync FAILED: {sync['message']}; the engine serves version {sync['weight_version']} and "
             f"checkpoint v{v} is WAITING. Retry with: {sync_command(config, v, url)}", "bold red")


def _checkpoint_row(s, version: str) -> dict | None:
    """The checkpoints table's row of ``version`` ('latest': the newest) in the data root, or None."""
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.queries import find_checkpoint

    with open_catalog(s.storage.data_root) as con:
        return find_checkpoint(con, version)


@app.command("sync")
def sync(
    version: Annotated[str, typer.Argument(help="Weight version to push (default: the latest checkpoint).")] = "latest",
    config: RunConfigOpt = None,
    engine_url: EngineUrlOpt = None,
) -> None:
    """Push a checkpoint to an HTTP engine (default: the `clawrl serve` running on the data root):
    pause -> update_weights_from_disk -> continue."""
    s = settings_or_exit(config)
    console.print(data_root_line(s, config), markup=False, highlight=False, soft_wrap=True)
    from clawrl.flows.common import engine_url_for, push_weights

    if (ck := _checkpoint_row(s, version)) is None:
        fail(f"no checkpoint for version {version!r} in {s.storage.data_root}")
    url = engine_url_for(s, engine_url)
    if not url:
        fail(f"checkpoint v{ck['weight_version']} is WAITING: no engine to sync (no `clawrl serve` is running on "
             f"{s.storage.data_root} and no [engine] url). Start `clawrl serve`, or name the engine: "
             f"{sync_command(config, ck['weight_version'], gateway_engine_url(s))}")
    # the train flow's sync path, recorded like its attempts (flushed: `clawrl status` and MLflow show it at once)
    rep = push_weights(s, ck, url)
    console.print(f"{'synced' if rep['success'] else 'FAILED'}: engine serves version {rep['weight_version']} "
                  f"({rep['message']}, {rep['seconds']:.2f} s)", markup=False)
    raise typer.Exit(0 if rep["success"] else 1)


def _serve_by_hand(config, version: str | None, action: str, reason: str, engine_url: str | None,
                   namespace: str | None = None) -> None:
    """Serve ``version`` (None: the champion before the current one) through the same sync path as the
    train flow, then record it as a ``promotions`` row and move the MLflow ``champion`` alias.
    Nothing is recorded when the engine did not take the weights, and nothing is tried (no sync
    attempt recorded) for a version whose weights were pruned. ``namespace``: of its adapter."""
    s = settings_or_exit(config)
    console.print(data_root_line(s, config), markup=False, highlight=False, soft_wrap=True)
    if namespace is not None:
        return per_namespace.serve_by_hand(s, per_namespace.namespace_or_exit(s, namespace), version, action, reason,
                                           engine_url)
    from clawrl.flows.common import data_store, engine_url_for, push_weights, serve_target

    url = engine_url_for(s, engine_url)
    if not url:
        fail(f"no engine to serve it: no `clawrl serve` is running on {s.storage.data_root} and no [engine] url is "
             f"set; start `clawrl serve`, or pass --engine-url (e.g. {gateway_engine_url(s)})")
    from clawrl.lineage import set_policy_alias
    from clawrl.promotion import ROLLBACK_DEPTH, GateError, WeightsPruned, record_manual, servable_versions
    from clawrl.records import PromotionAction
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.promotions import current_champion, previous_champion

    with open_catalog(s.storage.data_root) as con:
        champion = current_champion(con)
        if version is None:
            version = previous_champion(con)
            if version is None:
                fail(f"nothing to roll back to: the champion is version {champion}, the initial weights")
    try:
        target = serve_target(s, version)
    except WeightsPruned:
        reach = (f" (kept besides the newest checkpoints: the champion's and the {ROLLBACK_DEPTH} champions' before "
                 "it)" if action == "rollback" else "")
        verb = "roll back to" if action == "rollback" else "promote"
        fail(f"cannot {verb} version {version}: its weights were pruned{reach}; still servable: "
             f"{', '.join(servable_versions(s.storage.data_root))} (`clawrl promote VERSION`); serving is unchanged")
    except GateError as e:
        fail(f"{e} in {s.storage.data_root}")
    rep = push_weights(s, target, url)  # the train flow's sync path, recorded like its attempts
    if not rep["success"]:
        fail(f"FAILED: engine serves version {rep['weight_version']}, champion stays {champion} ({rep['message']})",
             code=1)
    v = target["weight_version"]
    record_manual(data_store(s), s.storage.data_root, action=PromotionAction(action), version=v,
                  reason=reason or f"clawrl {action}", mlflow_run_id=target["mlflow_run_id"])
    data_store(s).flush()
    set_policy_alias(s.storage.data_root, "champion", v)
    verb = "promoted" if action == "promote" else f"rolled back from version {champion} to"
    console.print(f"{verb} version {v}: the engine serves version {rep['weight_version']} ({rep['seconds']:.2f} s)",
                  markup=False)


@app.command("promote")
def promote(
    version: Annotated[str, typer.Argument(help="Weight version to serve as the champion (0: the initial weights; "
                                                "with --namespace a version of its adapter, 0: the base alone).")],
    config: RunConfigOpt = None,
    engine_url: EngineUrlOpt = None,
    reason: ReasonOpt = "",
    namespace: NamespaceOpt = None,
) -> None:
    """Serve VERSION as the champion now, whatever the gate decided (no rejected requests: the usual sync)."""
    _serve_by_hand(config, version, "promote", reason, engine_url, namespace)


@app.command("rollback")
def rollback(
    config: RunConfigOpt = None,
    engine_url: EngineUrlOpt = None,
    reason: ReasonOpt = "",
    namespace: NamespaceOpt = None,
) -> None:
    """Serve the champion before the current one again (no rejected requests: the usual sync)."""
    _serve_by_hand(config, None, "rollback", reason, engine_url, namespace)


@app.command("replay")
def replay_cmd(
    version: Annotated[str, typer.Argument(help="Weight version to rebuild (1..N), 'latest', or an MLflow run id.")],
    config: RunConfigOpt = None,
    exclude_session: Annotated[Optional[list[str]], typer.Option(
        "--exclude-session", metavar="NAMESPACE:SESSION_ID",
        help="Leave this session's samples out (repeatable). NAMESPACE is the API-key namespace ('open' without "
             "keys); a bare SESSION_ID is accepted when only one namespace uses it.")] = None,
    reason: Annotated[str, typer.Option(help="Why sessions are excluded (kept in the lineage).")] = "",
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Counterfactual SECTION.KEY=VALUE (repeatable).")] = None,
    fmt: Annotated[Literal["table", "json"], typer.Option("--format", "-f", help="json: the whole report, for "
                                                                               "scripts.")] = "table",
    namespace: NamespaceOpt = None,
) -> None:
    """Re-run training from the logged samples, recorded config and seeds; compare checkpoint hashes.
    Exit code 1 when an exact replay did not reproduce the checkpoints byte for byte. With --namespace: the
    versions of that namespace's adapter, their adapter files compared."""
    from clawrl.config import parse_override
    from clawrl.replay import check_replay

    s = settings_or_exit(config)
    (err if fmt == "json" else console).print(data_root_line(s, config), markup=False, highlight=False,
                                              soft_wrap=True)  # --format json: stdout is the report alone
    if namespace is not None:
        per_namespace.namespace_or_exit(s, namespace)
    try:  # a bad version, session or --set is told before the flow starts
        check_replay(s, version, tuple(exclude_session or []), dict(parse_override(x) for x in set_ or []), namespace)
    except (ValueError, FileNotFoundError, ConfigError) as e:
        fail(f"replay failed: {e}")
    with data_root_prefect(s):
        from clawrl.flows.replay import replay_flow

        try:
            report = replay_flow(config_path=str(config) if config else None, version=version,
                                 exclude_sessions=exclude_session or [], reason=reason, set_overrides=set_ or [],
                                 namespace=namespace)
        except (ValueError, FileNotFoundError, ConfigError) as e:
            fail(f"replay failed: {e}")
    code = 0 if report["identical"] is not False else 1
    if fmt == "json":
        typer.echo(json.dumps(report, default=str))
        raise typer.Exit(code)
    console.print(_replay_table(report))
    if report["identical"] is not None:
        console.print("checkpoints byte-identical: " + ("yes" if report["identical"] else "NO"), markup=False)
    if (ranks := max((st.get("trained_ranks", 1) for st in report["steps"]), default=1)) > 1:
        diffs = [st["max_abs_diff"] for st in report["steps"] if st.get("max_abs_diff") is not None]
        console.print(f"trained on {ranks} ranks, replayed on 1: sums in another order, so not byte-comparable; "
                      f"largest weight difference {max(diffs, default=0.0):.3g}", markup=False)
    from clawrl.lineage import REPLAY_EXPERIMENT, namespace_experiment

    experiment = REPLAY_EXPERIMENT if namespace is None else namespace_experiment(namespace)
    console.print(f"replayed {'adapter' if namespace else 'checkpoint'}: {report['final_path']} (MLflow run "
                  f"{report['mlflow_run_id']} in experiment {experiment})", markup=False, soft_wrap=True)
    if report["excluded_sessions"]:
        console.print("excluded: " + ", ".join(":".join(p) for p in report["excluded_sessions"]), markup=False, soft_wrap=True)
    if report["final_version"] is not None:
        whose = f" --namespace {namespace}" if namespace else ""
        console.print(f"its lineage: clawrl lineage {report['final_version']} --replay {report['replay_id']}{whose}",
                      markup=False, soft_wrap=True)
    raise typer.Exit(code)


def _replay_table(report: dict) -> Table:
    """A row per step within 80 columns: ids and digests cut to their first characters, the replayed
    digest only where it differs from the original, the excluded samples and the weight difference
    only where there are any."""
    from rich import box
    from rich.table import Table

    from clawrl.checkpoint import short_digest

    steps = report["steps"]
    optional = [("excluded", "excluded_samples", str) if report["excluded_sessions"] else None,
                ("max |Δw|", "max_abs_diff", lambda d: f"{d:.3g}")
                if any(st.get("max_abs_diff") is not None for st in steps) else None]
    optional = [c for c in optional if c]
    t = Table(title=f"replay {report['replay_id']} of version {report['source_version']}", box=box.SIMPLE_HEAD,
              pad_edge=False, collapse_padding=True)
    for col in ("step", "batch", "replay", "samples", "sha256", "replayed", *(c[0] for c in optional)):
        t.add_column(col, no_wrap=True)
    for st in steps:
        replayed = st["replay_sha256"]
        shown = "-" if not replayed else "same" if st["identical"] else short_digest(replayed, 10)
        t.add_row(str(st["step"]), st["batch_id"][:8], (st["replay_batch_id"] or "-")[:8], str(st["samples"]),
                  short_digest(st["original_sha256"], 10), shown,
                  *("-" if st.get(key) is None else fmt(st[key]) for _, key, fmt in optional))
    return t


@app.command("mix")
def mix(
    checkpoint: Annotated[str, typer.Argument(help="A weight version of the data root (e.g. 16) or a checkpoint "
                                                   "directory (e.g. <run>/checkpoints/v000016).")],
    out: Annotated[Path, typer.Option(help="New model directory to write.")],
    alpha: Annotated[float, typer.Option(min=0.0, max=1.0, help="Share of the checkpoint's weights; the rest are "
                                                                "the base model's.")],
    base: Annotated[Optional[Path], typer.Option(help="Model directory to mix with (default: the config's "
                                                      "[model], the weights training started from).")] = None,
    config: RunConfigOpt = None,
) -> None:
    """Write a model whose weights are ALPHA x CHECKPOINT + (1 - ALPHA) x the base model's: less of what
    training changed, gains and losses alike (serve it with `[model] name = "OUT"`, or
    CLAWRL__MODEL__NAME=OUT clawrl serve)."""
    s = settings_or_exit(config)
    console.print(data_root_line(s, config), markup=False, highlight=False, soft_wrap=True)
    from clawrl.mix import mix_weights
    from clawrl.models import resolve_model_dir

    source = Path(checkpoint)
    if not (source / "config.json").is_file():
        if (ck := _checkpoint_row(s, checkpoint)) is None:
            fail(f"{checkpoint!r} is neither a model directory nor a checkpoint version in {s.storage.data_root}")
        source = Path(ck["path"])
    try:
        start = base or resolve_model_dir(s.model.name, s.storage.models_dir, s.model.seed)
        written = mix_weights(source, start, alpha, out)
    except (ValueError, FileExistsError, FileNotFoundError) as e:  # FileNotFoundError: ModelNotFoundError too
        fail(f"mix: {e}")
    console.print(f"wrote {written}: {alpha:g} x {source} + {1 - alpha:g} x {start}", markup=False)
