"""Per-namespace adapters (``[ppo] adapters = "namespace"``): `forget`, and what `status`, `doctor`, `lineage`,
`promote`, `rollback` and `replay` do with ``--namespace``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from clawrl.cli.common import (ConfigOpt, app, console, data_root_line, fail, print_findings, promotion_line,
                               promotion_note, settings_or_exit, warn)
from clawrl.records import GATEWAY_NAMESPACE_RE

SHOWN_NAMESPACES = 10  # `clawrl status` in namespace mode: the busiest namespaces, then "and K more"

NamespaceOpt = Annotated[Optional[str], typer.Option(
    "--namespace", "-n", metavar="NS", help="An API key's namespace ('key-' and 16 hex digits; 'open' in open mode): "
                                            "its own adapter instead of the shared policy ([ppo] adapters = "
                                            "'namespace'; `clawrl status` lists them).")]


def known_namespaces(s) -> list[str]:
    """The namespaces of the data root (its turns or adapter versions), busiest first."""
    from clawrl.storage.adapters import namespaces
    from clawrl.storage.catalog import open_catalog

    with open_catalog(s.storage.data_root) as con:
        return [r["namespace"] for r in namespaces(con)]


def namespace_or_exit(s, namespace: str, *, known: bool = True) -> str:
    """``namespace`` when it is one (and, with ``known``, one of the data root's); else a one-line error that
    says what a namespace is and lists the data root's."""
    if s.ppo.adapters != "namespace":
        fail(f"--namespace is about a namespace's own adapter ([ppo] adapters = 'namespace'); the run on "
             f"{s.storage.data_root} trains one shared policy")
    found = known_namespaces(s)
    if GATEWAY_NAMESPACE_RE.match(namespace) and (namespace in found or not known):
        return namespace
    listed = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "") or "none yet"
    what = "not a namespace" if not GATEWAY_NAMESPACE_RE.match(namespace) else f"no namespace in {s.storage.data_root}"
    fail(f"{what}: {namespace!r} (a namespace is 'key-' and the first 16 hex digits of the SHA-256 of an API key, "
         f"or 'open' in open mode); the data root's: {listed} (`clawrl status` lists them)")


def adapter_version_name(namespace: str, version: str) -> str:
    """``version`` (N, ``<namespace>@v<N>``) as the adapter's name; a one-line error for anything else."""
    from clawrl.records import adapter_name, adapter_number

    try:
        return adapter_name(namespace, adapter_number(namespace, version))
    except ValueError:
        pass
    fail(f"not a version of {namespace}'s adapter: {version!r} (its versions are 1, 2, ... or {namespace}@v<N>; 0: "
         "the base alone)")


@app.command("forget")
def forget(
    namespace: Annotated[str, typer.Argument(help="The namespace whose learning to forget (`clawrl status` lists them).")],
    config: ConfigOpt = None,
    reason: Annotated[str, typer.Option(help="Why, in words (kept in the adapter_serving table).")] = "",
    engine_url: Annotated[Optional[str], typer.Option(help="Engine to unload the adapter from (default: [engine] url "
                                                           "when set, else the `clawrl serve` running on the data "
                                                           "root).")] = None,
) -> None:
    """Forget a namespace: delete every version of its adapter, unload it from the serving engine (its requests
    get the base from then on), remove its turns, verdicts, samples and every other row of it from the tables
    and its MLflow experiment and model. The base model never saw them."""
    s = settings_or_exit(config)
    if s.ppo.adapters != "namespace":
        fail("clawrl forget removes a namespace's own adapter ([ppo] adapters = 'namespace'); the shared policy "
             "unlearns sessions by replay: clawrl replay VERSION --exclude-session NAMESPACE:SESSION_ID")
    namespace_or_exit(s, namespace, known=False)
    console.print(data_root_line(s, config), markup=False, highlight=False, soft_wrap=True)
    from clawrl.flows.adapters import forget_namespace

    out = forget_namespace(s, namespace, reason, engine_url)
    removed = ", ".join(out["removed"]) or "none"
    rows = ", ".join(f"{n} {table}" for table, n in out["rows"].items() if table != "wal_segments_left") or "none"
    console.print(f"forgot {namespace}: adapter versions removed: {removed}; "
                  f"{'unloaded ' + out['unloaded'] if out['unloaded'] else out['message']}; rows removed: {rows}; "
                  f"MLflow runs removed: {out['mlflow_runs']}", markup=False, soft_wrap=True)
    if out["rows"]["wal_segments_left"]:
        warn(f"{out['rows']['wal_segments_left']} write-ahead-log segments of another process were not converted in "
             "time: run clawrl forget again once it has written them")


def serve_by_hand(s, namespace: str, version: str | None, action: str, reason: str, engine_url: str | None) -> None:
    """`clawrl promote VERSION --namespace NS` / `clawrl rollback --namespace NS`: serve that version of the
    namespace's adapter (None: the champion before the current one), then a ``promotions`` row of the namespace
    and its model's ``champion`` alias. A version whose weights were pruned is refused before anything loads."""
    from clawrl.lineage import namespace_model, set_policy_alias
    from clawrl.promotion import (ROLLBACK_DEPTH, GateError, WeightsPruned, adapter_target, record_manual,
                                  servable_versions)
    from clawrl.records import PromotionAction
    from clawrl.storage.adapters import find_adapter
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.promotions import current_champion, previous_champion
    from clawrl.sync import NO_ENGINE

    root = s.storage.data_root
    with open_catalog(root) as con:
        champion = current_champion(con, namespace)
        name = adapter_version_name(namespace, version) if version is not None else previous_champion(con, namespace)
        if name is None:
            fail(f"nothing to roll back to: {namespace} is served {champion}, its base alone")
        row = find_adapter(con, name)
    try:
        target = adapter_target(root, name)
    except WeightsPruned:
        reach = f" (kept: the champion's and the {ROLLBACK_DEPTH} champions' before it)" if action == "rollback" else ""
        fail(f"cannot {'roll back to' if action == 'rollback' else 'promote'} {name}: its weights were pruned{reach}; "
             f"still servable: {', '.join(servable_versions(root, namespace))}; serving is unchanged")
    except GateError as e:
        fail(f"{e} in {root}")
    from clawrl.flows.adapters import push_adapter  # Prefect: only once there is something to serve
    from clawrl.flows.common import data_store

    rep = push_adapter(s, target, engine_url, reason=reason or f"clawrl {action}")
    if not rep["success"] and rep["message"] != NO_ENGINE:
        fail(f"FAILED: {namespace} keeps {champion} ({rep['message']})", code=1)
    record_manual(data_store(s), root, action=PromotionAction(action), version=name, reason=reason or f"clawrl {action}",
                  mlflow_run_id=row["mlflow_run_id"] if row else None, namespace=namespace)
    set_policy_alias(root, "champion", name, namespace_model(namespace))
    verb = "promoted" if action == "promote" else f"rolled back from {champion} to"
    where = "" if rep["message"] != NO_ENGINE else " (no engine runs: the gateway loads it on its next request)"
    console.print(f"{verb} {name}: {namespace} is served it{where}", markup=False, soft_wrap=True)


def lineage(s, namespace: str, version: str, replay: str | None) -> None:
    """`clawrl lineage VERSION --namespace NS`: what trained that version of the namespace's adapter - its
    versions back to the fresh adapter, each with its batch, sessions and turns (all the namespace's) - and
    what the gate made of it."""
    from rich.tree import Tree

    from clawrl.checkpoint import short_digest
    from clawrl.records import adapter_name, parse_adapter_name
    from clawrl.storage.adapters import adapter_chain, latest_adapter_version
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.promotions import champion_stack, promotion_log, unserved_versions

    root = s.storage.data_root if replay is None else replay_root(s, replay)
    with open_catalog(root) as con:
        name = adapter_name(namespace, latest_adapter_version(con, namespace)) if version == "latest" else \
            adapter_version_name(namespace, version)
        chain = adapter_chain(con, namespace, parse_adapter_name(name)[1])
        notes = None if replay is not None else \
            (promotion_log(con, namespace), champion_stack(con, namespace), unserved_versions(con, namespace))
    if name.endswith("@v0"):
        console.print(f"{name} = the base alone: weight version 0 of {s.model.name} with no adapter, what {namespace} "
                      "is served before its first promoted version", markup=False, soft_wrap=True)
        return
    if not chain:
        fail(f"no adapter version {name} in {root}")
    note = "" if notes is None else f": {promotion_note(*notes, name)}"  # a replay's versions serve nobody
    # the heading on a line of its own: a tree's label wraps at the terminal's width, a sentence need not
    console.print(f"adapter {name}{'' if replay is None else f' of replay {replay}'} over weight version "
                  f"{chain[0]['base_version']} of {s.model.name}{note}", markup=False, highlight=False, soft_wrap=True)
    tree = Tree(f"{name}: {len(chain)} step{'s' if len(chain) != 1 else ''} from the base")
    for c in chain:
        node = tree.add(f"{c['name']} <- {c['parent']}: batch {c['batch_id']} ({len(c['sample_ids'])} samples, "
                        f"{c['method']}), mlflow run {c['mlflow_run_id']}, sha256 {short_digest(c['sha256'])}")
        for ns, sid in c["sessions"]:
            node.add(f"session {ns}:{sid}")
        node.add(f"turns: {', '.join(t[:8] for t in c['turn_ids'])}")
    console.print(tree, markup=False)


def _overview_rows(s) -> list[dict]:
    """One row per namespace: its turns, samples waiting, adapter versions, the one served and its last gate."""
    from clawrl.adapters import read_served
    from clawrl.judge.runner import build_judge_config_hash
    from clawrl.storage.adapters import namespace_samples, namespaces
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.promotions import promotion_log

    with open_catalog(s.storage.data_root) as con:
        rows = namespaces(con)
        waiting: dict[str, int] = {}
        for r in namespace_samples(con, build_judge_config_hash(s)):
            waiting[r["namespace"]] = waiting.get(r["namespace"], 0) + 1
        for r in rows:
            log = promotion_log(con, r["namespace"])
            r["last_gate"] = f"{log[-1]['action']} {log[-1]['weight_version'].rpartition('@')[2]}" if log else "-"
    checkpoints = s.storage.data_root / "checkpoints"
    for r in rows:
        served = read_served(checkpoints, r["namespace"])
        r["waiting"], r["served"] = waiting.get(r["namespace"], 0), f"v{served.version}" if served else "base"
    return rows


def status_overview(s, config) -> None:
    """`clawrl status` in namespace mode: one line per namespace, the busiest ``SHOWN_NAMESPACES`` of them."""
    from rich import box

    rows = _overview_rows(s)
    console.print(data_root_line(s, config), markup=False, highlight=False, soft_wrap=True)
    t = Table(title=f"clawrl status: {len(rows)} namespace{'s' if len(rows) != 1 else ''}, an adapter each "
                    f"(rollout_batch_size {s.ppo.rollout_batch_size})", title_justify="left",
              box=box.SIMPLE_HEAD, pad_edge=False)  # one line per namespace, as grep reads it
    for col in ("namespace", "turns", "samples waiting", "versions", "served", "last gate"):
        t.add_column(col, justify="left" if col == "namespace" else "right", no_wrap=True)
    for r in rows[:SHOWN_NAMESPACES]:
        t.add_row(r["namespace"], str(r["turns"]), str(r["waiting"]), str(r["versions"]), r["served"], r["last_gate"])
    console.print(t)
    if len(rows) > SHOWN_NAMESPACES:
        console.print(f"and {len(rows) - SHOWN_NAMESPACES} more namespaces", markup=False)
    console.print("one namespace in full: clawrl status --namespace NS", markup=False)


def status(s, config, namespace: str) -> None:
    """`clawrl status --namespace NS`: where its turns stand, its samples vs rollout_batch_size, its versions,
    the one served, its last sync and its gate."""
    from clawrl.adapters import read_served
    from clawrl.judge.runner import build_judge_config_hash
    from clawrl.storage.adapters import latest_adapter_version, namespace_samples, serving_changes
    from clawrl.storage.catalog import open_catalog
    from clawrl.storage.promotions import consecutive_refusals, promotion_log
    from clawrl.storage.queries import pending_counts

    chash, root = build_judge_config_hash(s), s.storage.data_root
    with open_catalog(root) as con:
        c = pending_counts(con, chash, s.ppo.rollout_batch_size, namespace)
        waiting = len(namespace_samples(con, chash, namespace))
        newest = latest_adapter_version(con, namespace)
        log, refused = promotion_log(con, namespace), consecutive_refusals(con, namespace)
        changes = serving_changes(con, namespace)
    served = read_served(root / "checkpoints", namespace)
    console.print(data_root_line(s, config), markup=False, highlight=False, soft_wrap=True)
    t = Table(title=f"clawrl status of {namespace} (judge config {chash})", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(justify="right")
    for k, v in [("turns (main / side)", f"{c['turns']} ({c['main_turns']} / {c['side_turns']})"),
                 ("judged", c["judged"]), ("main, awaiting next state", c["awaiting_next_state"]),
                 ("main, pending judgment", c["pending_judgment"] + c["pending_no_next_state"]),
                 ("side, not yet marked by the judge", c["side_unmarked"]),
                 ("trainable samples waiting", f"{waiting} / rollout_batch_size {s.ppo.rollout_batch_size}"),
                 ("samples consumed by batches", f"{c['consumed']} in {c['batches']} batches"),
                 ("newest adapter version", f"{namespace}@v{newest}" if newest else "none yet"),
                 ("served", served.name if served else "the base alone")]:
        t.add_row(k, str(v))
    console.print(t)
    console.print(promotion_line(log, refused).replace("(the initial weights)", "(the base alone)"), markup=False,
                  highlight=False, soft_wrap=True)
    if changes:
        last = changes[0]
        what = f"{last['action']} {last['adapter'] or 'the base alone'}"
        console.print(f"last sync: {'ok' if last['ok'] else 'FAILED'} at {last['created_at']:%Y-%m-%d %H:%M:%S} UTC "
                      f"({what})" + ("" if last["ok"] else f": {last['error']}"), markup=False, highlight=False,
                      soft_wrap=True)
    else:
        console.print("last sync: none recorded", markup=False)


def doctor(s, config, namespace: str, as_json: bool) -> None:
    """`clawrl doctor --namespace NS`: the namespace's own findings (``clawrl.doctor.namespace_findings``)."""
    import json

    from clawrl.adapters import read_served
    from clawrl.doctor import namespace_findings
    from clawrl.judge.runner import build_judge_config_hash
    from clawrl.storage.catalog import open_catalog

    chash = build_judge_config_hash(s)
    served = read_served(s.storage.data_root / "checkpoints", namespace)
    with open_catalog(s.storage.data_root) as con:
        found = [f.as_dict() for f in namespace_findings(con, chash, namespace, s.ppo.rollout_batch_size,
                                                         served.name if served else None)]
    if as_json:
        typer.echo(json.dumps({"data_root": str(s.storage.data_root), "namespace": namespace, "findings": found},
                              default=str))
        return
    console.print(data_root_line(s, config), markup=False, highlight=False, soft_wrap=True)
    print_findings(f"clawrl doctor of {namespace} (judge config {chash})", found)


def replay_root(s, replay: str) -> Path:
    """The data root of replay ``replay``; a one-line error when there is none."""
    root = s.storage.data_root / "replays" / replay
    if replay in ("", ".", "..") or "/" in replay or not (root / "tables").is_dir():
        fail(f"no replay {replay!r} in {s.storage.data_root / 'replays'}")
    return root
