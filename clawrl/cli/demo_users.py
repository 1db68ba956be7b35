"""`clawrl demo --scenario users`: a panel of simulated users with their own keys and personas, the same
turns trained two ways (one shared policy, one adapter per user), each user's held-out score compared."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from clawrl.cli.common import FLOW_LOG, console, data_root_prefect, settings_or_exit
from clawrl.config import Settings, dump_toml
from clawrl.sim.panel import parse_panel, user_key, user_namespace
from clawrl.sim.prompts import QUESTIONS

ARM_CHOICES = ("both", "shared", "per-user")
ADAPTER_LR = 2e-4  # rank-16 LoRA over the frozen base: 10x the full fine-tune's lr (see docs/demo.md, Users)


def run_users_demo(conf: Path, base: Settings, root: Path, *, model: str | None, panel_text: str, arm: str,
                   rounds: int, turns: int, adapter_lr: float, max_tokens: int, seed: int, heldout: int,
                   eval_samples: int) -> None:
    """Both arms (or ``arm``) back to back, each on its own data root ``<root>/<arm>``; then the table, the
    curve and an MLflow run per arm."""
    from clawrl.flows.users import ARMS, report_panel, write_json
    from clawrl.sim.validation import panel_evaluator_path

    from clawrl.models import ModelNotFoundError, check_model_name

    try:
        check_model_name(model or base.model.name)
    except ModelNotFoundError as e:
        raise typer.BadParameter(str(e), param_hint="--model" if model else "[model] name") from None
    try:
        panel = parse_panel(panel_text)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--personas") from None
    if arm not in ARM_CHOICES:
        raise typer.BadParameter(f"{arm!r}; valid: {', '.join(ARM_CHOICES)}", param_hint="--arm")
    if heldout >= len(QUESTIONS):
        raise typer.BadParameter(f"{heldout} held-out questions leave none of the {len(QUESTIONS)} to train on",
                                 param_hint="--heldout")
    arms = list(ARMS) if arm == "both" else [arm]
    rows: dict[str, list[dict[str, Any]]] = {}
    confs: dict[str, Path] = {}
    for name in arms:
        per_user = ARMS[name] == "namespace"
        lr = adapter_lr if per_user else base.ppo.lr
        s = settings_or_exit(conf, {
            "storage.data_root": str(root / name), "storage.model_cache": str(base.storage.models_dir),
            "model.name": model, "ppo.adapters": ARMS[name], "ppo.lr": lr, "ppo.lr_min": min(base.ppo.lr_min, lr),
            "ppo.lr_decay_steps": rounds, "ppo.rollout_batch_size": turns if per_user else turns * len(panel),
            "ppo.max_new_tokens": max_tokens, "gate.seed": seed, "gate.evaluator": panel_evaluator_path(panel)})
        s.storage.data_root.mkdir(parents=True, exist_ok=True)
        confs[name] = run_conf = s.storage.data_root / "config.toml"
        run_conf.write_text(dump_toml(s))
        console.print(f"arm {name}: [ppo] adapters = {ARMS[name]!r}, lr {lr:g}, batches of "
                      f"{s.ppo.rollout_batch_size}; data root {s.storage.data_root}", markup=False, soft_wrap=True)
        with data_root_prefect(s) as prefect_api:
            console.print(f"Prefect UI of this arm while it runs: {prefect_api.removesuffix('/api')}", markup=False)
            rows[name] = _run_arm(s, run_conf, arm=name, panel=panel, rounds=rounds, turns=turns,
                                  max_tokens=max_tokens, seed=seed, heldout=heldout, eval_samples=eval_samples)
        write_json(s.storage.data_root / ARM_ROWS, {"panel": panel, "rows": rows[name]})
    for name in [a for a in ARMS if a not in rows]:  # an arm run before by `--arm` beside this one
        earlier = _earlier_rows(root / name / ARM_ROWS, panel, len(rows[arms[0]]))
        if earlier is not None:
            rows[name], confs[name] = earlier, root / name / "config.toml"
    rows = {a: rows[a] for a in ARMS if a in rows}  # shared first, whichever ran first
    report = report_panel(root, rows, {a: confs[a] for a in arms}, panel, params={
        "personas": ",".join(panel), "rounds": rounds, "turns_per_round": turns, "max_tokens": max_tokens,
        "seed": seed, "heldout": heldout, "eval_samples": eval_samples, "adapter_lr": adapter_lr,
        "shared_lr": base.ppo.lr, "model": model or base.model.name})
    print_panel(rows, panel, report["summary"])
    console.print(f"curves: {report['png']} (also in MLflow: "
                  + ", ".join(f"{a} run {r} in {confs[a].parent}" for a, r in report["runs"].items()) + ")",
                  markup=False, soft_wrap=True)
    console.print(f"every log line of the flows: {root}/<arm>/logs/{FLOW_LOG}", markup=False, soft_wrap=True)


ARM_ROWS = "reports/users_rows.json"  # under an arm's data root: its rows, for a report with an arm run later


def _earlier_rows(path: Path, panel: list[str], n_rows: int) -> list[dict[str, Any]] | None:
    """The rows an arm left in an earlier `--arm` run under the same run directory, when it ran the same
    panel for as many rounds (else None: not comparable)."""
    if not path.is_file():
        return None
    earlier = json.loads(path.read_text())
    if earlier["panel"] != panel or len(earlier["rows"]) != n_rows:
        console.print(f"{path}: another panel or number of rounds, left out of the report", markup=False)
        return None
    return earlier["rows"]


def _run_arm(s: Settings, run_conf: Path, **loop_args) -> list[dict[str, Any]]:
    """Serve the engine behind a gateway that takes the panel's keys, and run the arm's loop against it."""
    from clawrl.flows.common import attach_policy_engine, close_all, data_store, load_flow_settings
    from clawrl.flows.users import users_loop
    from clawrl.gateway.routes import build_engine
    from clawrl.serving import serve_own_gateway

    with console.status(f"preparing {s.model.name}"):
        engine, tokenizer = build_engine(s)
    attach_policy_engine(engine)
    store = data_store(load_flow_settings(str(run_conf)))
    gw = serve_own_gateway(s, engine=engine, tokenizer=tokenizer, store=store,
                           api_keys=[user_key(p) for p in loop_args["panel"]])
    try:
        return users_loop(config_path=str(run_conf), gateway_url=gw.url, **loop_args)
    finally:
        gw.stop()
        attach_policy_engine(None)
        store.flush()
        close_all()  # the arm's trainer, engines and store: the next arm loads its own


def print_panel(rows: dict[str, list[dict[str, Any]]], panel: list[str], summary: dict[str, dict[str, Any]]) -> None:
    arms = list(rows)
    t = Table(title=f"held-out score per user (persona AND on topic): {' / '.join(arms)}")
    t.add_column("round", justify="right")
    t.add_column("own turns", justify="right")
    for p in panel:
        t.add_column(p, justify="right", no_wrap=True)
    for i, first in enumerate(rows[arms[0]]):
        t.add_row(str(first["round"]), str(first["turns"]),
                  *("/".join(f"{rows[arm][i]['scores'][p]:.3f}" for arm in arms) for p in panel))
    console.print(t)
    both = len(arms) == 2
    s = Table(title="per user: final (best) score; 'turns': its own turns when first at its best ('-': never above "
                    "the base)" +
              ("; 'matched': per-user's turns when first at the shared arm's final score" if both else ""))
    s.add_column("user")
    s.add_column("base", justify="right")
    for arm in arms:
        s.add_column(arm, justify="right", no_wrap=True)
        s.add_column("turns", justify="right")
    if both:
        s.add_column("matched", justify="right")
    for p in panel:
        u = summary[p]
        cells = [p, f"{u['base']:.3f}"]
        for arm in arms:
            best = u[f"{arm}_turns_to_best"]
            cells += [f"{u[f'{arm}_final']:.3f} ({u[f'{arm}_best']:.3f})", "-" if best is None else str(best)]
        if both:
            matched = u["per-user_turns_to_shared_final"]
            cells.append("-" if u["shared_final"] <= u["base"] else "never" if matched is None else str(matched))
        s.add_row(*cells)
    console.print(s)
    console.print("namespaces: " + ", ".join(f"{p} = {user_namespace(p)}" for p in panel), markup=False,
                  soft_wrap=True)
