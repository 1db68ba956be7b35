"""`clawrl demo`: the closed loop on a CPU laptop, with simulated users and a learning curve."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from clawrl.cli.common import app, console, settings_or_exit
from clawrl.cli.data import status
from clawrl.config import Settings, dump_toml

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "conf" / "demo.toml"


@app.command("demo")
def demo(
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="Overlay (default conf/demo.toml).")] = None,
    steps: Annotated[int, typer.Option(help="Training steps (weight versions).")] = 16,
    users: Annotated[int, typer.Option(help="Simulated users per step.")] = 16,
    persona: Annotated[str, typer.Option(help="concise | signoff | lowercase | bullets | french")] = "concise",
    max_tokens: Annotated[int, typer.Option(help="Answer budget per turn.")] = 48,
    run_dir: Annotated[Optional[Path], typer.Option(help="Data root of this run (default: a new one).")] = None,
    model: Annotated[Optional[str], typer.Option(help="Model (default from the config).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the simulated users and evaluation.")] = 0,
    heldout: Annotated[int, typer.Option(help="Held-out questions scored after every step.")] = 24,
    eval_samples: Annotated[int, typer.Option(min=1, help="Answers scored per held-out question (distinct seeds).")] = 2,
    group_size: Annotated[int, typer.Option(min=1, help="Users per step asking the same question (for ppo.group_by = 'prompt').")] = 1,
) -> None:
    """The closed loop on CPU: simulated users -> gateway -> judge -> train -> sync, with a learning curve."""
    from clawrl.config import use_prefect_home

    conf = config or DEMO_CONFIG
    base = settings_or_exit(conf)
    root = run_dir or base.storage.data_root / "runs" / dt.datetime.now().strftime("demo-%Y%m%d-%H%M%S")
    s = settings_or_exit(conf, {"storage.data_root": str(root), "storage.model_cache": str(base.storage.models_dir),
                                "model.name": model})
    root.mkdir(parents=True, exist_ok=True)
    run_conf = root / "config.toml"  # the flows read this; replay re-reads it
    run_conf.write_text(dump_toml(s))
    use_prefect_home(base.storage.data_root / "prefect")
    out = _run_loop(s, run_conf, steps=steps, users=users, persona=persona, max_tokens=max_tokens, seed=seed,
                    heldout=heldout, eval_samples=eval_samples, group_size=group_size)
    rows = out["rows"]
    t = Table(title=f"held-out score per step (persona {persona})")
    for col in ("step", "score", "on-topic", "persona", "KL", "words"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["step"]), f"{r['score']:.3f}", f"{r['on_topic_rate']:.3f}", f"{r['persona_rate']:.3f}",
                  f"{r['kl']:.4f}", f"{r['mean_words']:.1f}")
    console.print(t)
    console.print(f"base score {rows[0]['score']:.3f} -> {rows[-1]['score']:.3f} after {len(rows) - 1} steps "
                  f"(best {max(r['score'] for r in rows):.3f}); on-topic {rows[0]['on_topic_rate']:.3f} -> "
                  f"{rows[-1]['on_topic_rate']:.3f}", markup=False)
    console.print(f"learning curve: {out['png']} (also in MLflow run {out['mlflow_run_id']})", markup=False)
    status(run_conf)
    console.print(WHERE_TO_LOOK.format(conf=run_conf, last=len(out["rows"]) - 1, root=root,
                                       prefect=base.storage.data_root / "prefect"), markup=False)


def _run_loop(s: Settings, run_conf: Path, **loop_args) -> dict:
    """Serve the policy engine behind the gateway on a thread and run the learning loop against it."""
    from clawrl.flows.common import attach_policy_engine, data_store, load_flow_settings
    from clawrl.flows.loop import learning_loop
    from clawrl.gateway.routes import build_engine, create_app
    from clawrl.serving import serve_in_thread

    with console.status(f"preparing {s.model.name} (first run converts the GGUF once)"):
        engine, tokenizer = build_engine(s)  # the gateway's own: the newest checkpoint of a run continued
    attach_policy_engine(engine)  # the train flow syncs this engine in-process
    # the flows and the gateway share one store; settings are cached by config path in flows.common
    store = data_store(load_flow_settings(str(run_conf)))
    gw = serve_in_thread(create_app(s, engine=engine, tokenizer=tokenizer, store=store))
    console.print(f"gateway (OpenAI API) on {gw.url}/v1, run data in {s.storage.data_root}", markup=False)
    try:
        return learning_loop(config_path=str(run_conf), gateway_url=gw.url, **loop_args)
    finally:
        gw.stop()
        attach_policy_engine(None)
        store.flush()


WHERE_TO_LOOK = """
where to look:
  clawrl status  -c {conf}
  clawrl sql "select * from turn_fate" -c {conf}
  clawrl lineage {last} -c {conf}
  Prefect UI: PREFECT_HOME={prefect} .venv/bin/prefect server start  -> http://127.0.0.1:4200 (flow runs 'learning-loop', 'judge', 'train')
  MLflow UI:  .venv/bin/mlflow ui --backend-store-uri sqlite:///{root}/mlflow/mlflow.db  -> http://127.0.0.1:5000 (experiment 'clawrl', model 'clawrl-policy')
  or `clawrl up -c {conf}` to bring up the gateway and both UIs on this run's data"""
