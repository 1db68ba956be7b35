"""Per-namespace adapters (``[ppo] adapters = "namespace"``): `forget`."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from clawrl.cli.common import ConfigOpt, app, console, fail, settings_or_exit


@app.command("forget")
def forget(
    namespace: Annotated[str, typer.Argument(help="The namespace whose learning to forget (`clawrl sql \"select "
                                                  "distinct namespace from turns\"`).")],
    config: ConfigOpt = None,
    reason: Annotated[str, typer.Option(help="Why, in words (kept in the adapter_serving table).")] = "",
    engine_url: Annotated[Optional[str], typer.Option(help="Engine to unload the adapter from (default: [engine] url "
                                                           "when set, else the `clawrl serve` running on the data "
                                                           "root).")] = None,
) -> None:
    """Forget a namespace's learning: delete every version of its adapter, unload it from the serving engine
    (its requests get the base from then on) and never train on its samples from before now. The base model
    never saw them."""
    from clawrl.adapters import check_namespace

    s = settings_or_exit(config)
    if s.ppo.adapters != "namespace":
        fail("clawrl forget removes a namespace's own adapter ([ppo] adapters = 'namespace'); the shared policy "
             "unlearns sessions by replay: clawrl replay VERSION --exclude-session NAMESPACE:SESSION_ID")
    try:
        check_namespace(namespace)
    except ValueError as e:
        fail(str(e))
    from clawrl.flows.adapters import forget_namespace

    out = forget_namespace(s, namespace, reason, engine_url)
    removed = ", ".join(out["removed"]) or "none"
    console.print(f"forgot {namespace}: adapter versions removed: {removed}; "
                  f"{'unloaded ' + out['unloaded'] if out['unloaded'] else out['message']}", markup=False)
