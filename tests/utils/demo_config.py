"""`conf/demo.toml` made small for tests: the tiny model, batches of 4, a 4-prompt gate evaluation set."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def tiny_demo_config(directory: Path, model_cache: Path) -> Path:
    """Write the small demo config into ``directory`` (also its data root) and return its path."""
    conf = directory / "demo.toml"
    conf.write_text((REPO / "conf" / "demo.toml").read_text().replace('name = "smollm2-135m"', 'name = "tiny"')
                    .replace("rollout_batch_size = 16", "rollout_batch_size = 4")
                    .replace("\nsize = 32 ", "\nsize = 4 ")  # [gate] size: conf/demo.toml's only `size`
                    + f'\n[storage]\ndata_root = "{directory}"\nmodel_cache = "{model_cache}"\n')
    assert "\nsize = 4 " in conf.read_text(), "conf/demo.toml's [gate] size line changed: update this helper"
    return conf
