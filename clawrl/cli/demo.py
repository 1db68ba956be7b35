"""`clawrl demo`: the closed loop on a CPU laptop, with simulated users and a learning curve."""

from __future__ import annotations

import datetime as dt
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from clawrl.cli.common import FLOW_LOG, app, console, data_root_prefect, settings_or_exit
from clawrl.cli.data import status
from clawrl.cli.demo_users import ADAPTER_LR, run_users_demo
from clawrl.config import Settings, dump_toml
from clawrl.interrupts import ctrl_c_noted
from clawrl.sim.panel import DEFAULT_PANEL
from clawrl.sim.personas import PERSONAS
from clawrl.sim.prompts import QUESTIONS, VALIDATION_QUESTIONS
from clawrl.sim.tools import PLAIN_SHARE

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
TOOLS_EVALUATORS = ("clawrl.sim.validation:tools", "clawrl.sim.validation:tools_bfcl")  # tool calls judged
DEMO_CONFIGS = {"persona": CONF_DIR / "demo.toml", "tools": CONF_DIR / "demo-tools.toml",
                "users": CONF_DIR / "demo-users.toml"}
STEPS = {"persona": 16, "tools": 16, "users": 5}  # users: both arms in ~15 min alone on 2 cores (docs/demo.md)
USERS_HELDOUT = 12  # answered once: 12 per user a round, 48 for four (the persona demo scores 48)


@app.command("demo")
def demo(
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="Overlay (default conf/demo.toml, "
                                                   "conf/demo-tools.toml for --scenario tools).")] = None,
    scenario: Annotated[str, typer.Option(help="persona: users with a style preference | tools: tasks that need "
                                          "a calculator, a unit converter or a country lookup | users: several "
                                          "users with their own keys and personas, one shared policy vs one "
                                          "adapter each")] = "persona",
    steps: Annotated[Optional[int], typer.Option(min=1, help="Training steps (weight versions; users: rounds). "
                                                 "Default 16; users: 5.")] = None,
    users: Annotated[int, typer.Option(min=1, help="Simulated users per step.")] = 16,
    persona: Annotated[str, typer.Option(help=" | ".join(PERSONAS))] = "concise",
    max_tokens: Annotated[Optional[int], typer.Option(
        min=1, help="Answer budget per turn (default 48; tools: 64).")] = None,
    run_dir: Annotated[Optional[Path], typer.Option(help="Data root of this run (default: a new one).")] = None,
    model: Annotated[Optional[str], typer.Option(help="Model (default from the config).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the simulated users and evaluation.")] = 0,
    heldout: Annotated[Optional[int], typer.Option(
        min=1, help="Held-out questions scored after every step (tools: half of them "
                    "tool tasks, half plain questions; users: asked by every user). Default 24; users: 12.")] = None,
    eval_samples: Annotated[Optional[int], typer.Option(
        min=1, help="Answers scored per held-out question (distinct seeds). Default 2; users: 1.")] = None,
    group_size: Annotated[int, typer.Option(min=1, help="Users per step asking the same question (for ppo.group_by = 'prompt').")] = 1,
    plain_share: Annotated[float, typer.Option(
        min=0.0, max=1.0, help="Tools: share of the users per step who ask "
                               "a plain question (rounded down).")] = PLAIN_SHARE,
    personas: Annotated[str, typer.Option(help="Users: the panel, one user per persona, comma-separated.")] = ",".join(
        DEFAULT_PANEL),
    arm: Annotated[str, typer.Option(help="Users: both | shared | per-user.")] = "both",
    turns: Annotated[int, typer.Option(min=1, help="Users: questions each user asks per round.")] = 8,
    adapter_lr: Annotated[float, typer.Option(min=0.0, help="Users: learning rate of the per-user adapters.")] = ADAPTER_LR,
) -> None:
    """The closed loop on CPU: simulated users -> gateway -> judge -> train -> sync, with a learning curve."""
    if scenario not in DEMO_CONFIGS:
        raise typer.BadParameter(f"{scenario!r}; valid: {', '.join(DEMO_CONFIGS)}", param_hint="--scenario")
    conf = config or DEMO_CONFIGS[scenario]
    base = settings_or_exit(conf)
    root = _run_root(base, conf, run_dir)
    max_tokens = max_tokens or (64 if scenario == "tools" else 48)
    steps = steps or STEPS[scenario]
    if scenario == "users":  # two data roots under the run's directory, one per arm
        with ctrl_c_exits(f"interrupted: the rounds so far are kept in {root}"):
            return run_users_demo(conf, base, root.expanduser().resolve(), model=model, panel_text=personas, arm=arm,
                                  rounds=steps, turns=turns, adapter_lr=adapter_lr, max_tokens=max_tokens,
                                  seed=seed, heldout=heldout or USERS_HELDOUT, eval_samples=eval_samples or 1)
    heldout, eval_samples = heldout or 24, eval_samples or 2
    s = settings_or_exit(conf, {"storage.data_root": str(root), "storage.model_cache": str(base.storage.models_dir),
                                "model.name": model, **_gate_overrides(base, scenario, persona, seed, max_tokens)})
    _check_settings(s, scenario, persona, heldout, model)
    root = s.storage.data_root  # absolute: the commands printed work from any directory
    root.mkdir(parents=True, exist_ok=True)
    run_conf = root / "config.toml"  # the flows read this; replay re-reads it
    run_conf.write_text(dump_toml(s))
    # the run's own Prefect home: `clawrl up -c <run>/config.toml` shows the same flow runs
    with ctrl_c_exits(f"interrupted: the steps so far are kept in {root} (`{clawrl_command()} status -c {run_conf}`)"), \
            data_root_prefect(s) as prefect_api:
        console.print(f"Prefect UI of this run while it runs: {prefect_api.removesuffix('/api')}", markup=False)
        out = _run_loop(s, run_conf, steps=steps, users=users, persona=persona, max_tokens=max_tokens,
                        seed=seed, heldout=heldout, eval_samples=eval_samples, group_size=group_size,
                        scenario=scenario, plain_share=plain_share)
    _print_rows(out["rows"], scenario, persona)
    console.print(f"learning curve: {out['png']} (also in MLflow run {out['mlflow_run_id']})", markup=False,
                  soft_wrap=True)
    status(run_conf)
    console.print(WHERE_TO_LOOK.format(clawrl=clawrl_command(), conf=run_conf,
                                       log=s.storage.data_root / "logs" / FLOW_LOG), markup=False, soft_wrap=True)


def _check_settings(s: Settings, scenario: str, persona: str, heldout: int, model: str | None) -> None:
    """The persona and tools demos' settings that cannot run, each as one line before anything starts."""
    from clawrl.models import ModelNotFoundError, check_model_name

    if scenario == "persona" and persona not in PERSONAS:
        raise typer.BadParameter(f"{persona!r}; valid: {', '.join(PERSONAS)}", param_hint="--persona")
    try:
        check_model_name(s.model.name)
    except ModelNotFoundError as e:
        raise typer.BadParameter(str(e), param_hint="--model" if model else "[model] name") from None
    if scenario == "persona" and heldout >= len(QUESTIONS):
        raise typer.BadParameter(f"{heldout} held-out questions leave none of the {len(QUESTIONS)} to train on",
                                 param_hint="--heldout")
    if s.gate.enabled and s.gate.validation_evaluator.startswith("clawrl.sim.validation:") and \
            s.gate.size > len(VALIDATION_QUESTIONS):
        raise typer.BadParameter(f"[gate] size = {s.gate.size}: the demo has {len(VALIDATION_QUESTIONS)} validation "
                                 "questions", param_hint="--config")
    if s.gate.enabled and s.gate.validation_evaluator == TOOLS_EVALUATORS[1]:
        from clawrl.sim.bfcl import BfclMissing, bfcl_python

        try:
            bfcl_python()
        except BfclMissing as e:
            raise typer.BadParameter(f"[gate] evaluator = {s.gate.evaluator!r}: {e}", param_hint="--config") from None


def clawrl_command() -> str:
    """`clawrl` when that name runs this installation, else the absolute path of this one's: the commands
    the demo prints work from any directory (after `make demo`, `clawrl` is on no PATH)."""
    mine = Path(sys.executable).parent / "clawrl"
    on_path = shutil.which("clawrl")
    return "clawrl" if on_path and Path(on_path).resolve() == mine.resolve() else str(mine)


def _run_root(base: Settings, conf: Path, run_dir: Path | None) -> Path:
    """The run's one data root: ``--run-dir``, else the data root the environment names (it wins over
    every config file, the run's own too: the flows and every command printed would read it), else a new
    ``<data_root>/runs/demo-<time>``."""
    from clawrl.config import setting_origin

    origin = setting_origin(conf, "storage", "data_root")
    if not origin.startswith("env "):
        return run_dir or base.storage.data_root / "runs" / dt.datetime.now().strftime("demo-%Y%m%d-%H%M%S")
    if run_dir is not None and run_dir.expanduser().resolve() != base.storage.data_root:
        raise typer.BadParameter(f"{run_dir}, but {origin.removeprefix('env ')} = {base.storage.data_root} sets the "
                                 "data root of every command: unset it, or leave --run-dir out to run there",
                                 param_hint="--run-dir")
    return base.storage.data_root


def _gate_overrides(base: Settings, scenario: str, persona: str, seed: int, max_tokens: int) -> dict:
    """The demos' gates score their own validation prompts with the demo's seed and answer budget: the
    persona demo's as its user would, the tools demo's with ``clawrl.sim.validation:tools`` when the
    config names it, or with its BFCL variant ``tools_bfcl`` (a persona evaluator cannot judge tool calls:
    the tools demo is then ungated)."""
    budget = {"gate.seed": seed, "ppo.max_new_tokens": max_tokens}  # the gate answers within the users' budget
    if not base.gate.enabled or not base.gate.validation_evaluator.startswith("clawrl.sim.validation:"):
        return {}  # an evaluator of the user's own is left as it is
    if scenario == "tools":
        if base.gate.evaluator not in TOOLS_EVALUATORS:
            return {"gate.enabled": False, "gate.canary_share": 0.0}
        return budget
    return {"gate.evaluator": f"clawrl.sim.validation:{persona}", **budget}


def _print_rows(rows: list[dict], scenario: str, persona: str) -> None:
    from clawrl.flows.loop import CURVES

    cols = [(k, k.removesuffix("_rate").replace("_", " ")) for k, _ in CURVES[scenario]] + [("kl", "KL")]
    title = "held-out rates per step (tool tasks and plain questions)" if scenario == "tools" else \
        f"held-out score per step (persona {persona})"
    t = Table(title=title)
    for _, label in [("step", "step"), *cols, ("served", "served"), ("gate", "gate")]:
        t.add_column(label, justify="right")
    for r in rows:  # "-": not measured (a refused candidate's score in the tools scenario)
        t.add_row(str(r["step"]), *("-" if r.get(k) is None else f"{r[k]:.4f}" if k == "kl" else f"{r[k]:.3f}"
                                    for k, _ in cols), f"v{r['weight_version']}", r.get("gate", "-"))
    console.print(t)
    first, last = rows[0], rows[-1]
    lines = ", ".join(f"{label} {first[k]:.3f} -> {last[k]:.3f} (best {max(r[k] for r in rows):.3f})"
                      for k, label in cols[:2])
    console.print(f"after {len(rows) - 1} steps: {lines}", markup=False)


@contextmanager
def ctrl_c_exits(message: str) -> Iterator[None]:
    """Ctrl-C ends the block with ``message`` and exit code 130 (what a shell reports for SIGINT), not a
    traceback. DuckDB catches the KeyboardInterrupt a Ctrl-C raises mid-query and raises RuntimeError("Query
    interrupted") instead, so whatever the block raises after a SIGINT counts as the interruption; a block that
    ends normally after one (its KeyboardInterrupt swallowed to the end) is interrupted too."""
    with ctrl_c_noted() as ctrl_c_came:
        try:
            yield
        except BaseException as e:
            if not (isinstance(e, KeyboardInterrupt) or ctrl_c_came()):
                raise
        else:
            if not ctrl_c_came():
                return
    console.print(message, markup=False, soft_wrap=True)
    raise typer.Exit(130)


def _run_loop(s: Settings, run_conf: Path, **loop_args) -> dict:
    """Serve the policy engine behind the gateway on a thread and run the learning loop against it."""
    from clawrl.engine.canary import CanaryRouter
    from clawrl.flows.common import attach_canary_engine, attach_policy_engine, data_store, load_flow_settings
    from clawrl.flows.loop import learning_loop
    from clawrl.gateway.routes import build_engine, canary_engine
    from clawrl.serving import serve_own_gateway

    with console.status(f"preparing {s.model.name} (first run converts the GGUF once)"):
        engine, tokenizer = build_engine(s)  # the gateway's own: the newest checkpoint of a run continued
    attach_policy_engine(engine)  # the train flow syncs this engine in-process
    served = engine
    if s.gate.canary:  # a canary engine in this process unless the config names one
        canary = canary_engine(s) if s.gate.canary_url else build_engine(s)[0]
        attach_canary_engine(None if s.gate.canary_url else canary)
        served = CanaryRouter(engine, canary, s.gate.canary_share)
    # the flows and the gateway share one store; settings are cached by config path in flows.common
    store = data_store(load_flow_settings(str(run_conf)))
    # open on loopback for the simulated users, whatever keys the environment holds for `clawrl serve`
    gw = serve_own_gateway(s, engine=served, tokenizer=tokenizer, store=store)
    console.print(f"gateway (OpenAI API) on {gw.url}/v1 for the simulated users, run data in {s.storage.data_root}",
                  markup=False, soft_wrap=True)
    try:
        return learning_loop(config_path=str(run_conf), gateway_url=gw.url, **loop_args)
    finally:
        gw.stop()
        attach_canary_engine(None)
        attach_policy_engine(None)
        store.flush()


WHERE_TO_LOOK = """
where to look:
  {clawrl} status -c {conf}
  {clawrl} sql "select * from turn_fate" -c {conf}
  {clawrl} lineage latest -c {conf}
  {clawrl} up -c {conf}
    the gateway, the Prefect UI (flow runs 'learning-loop', 'judge', 'train') and the MLflow UI (experiment 'clawrl', model 'clawrl-policy') on this run's data, at the URLs it prints; the links between the two UIs lead to the ones it starts
  every log line of the flows: {log}"""
