"""The model cache under concurrent builders: torchrun's ranks (or several services) resolving the same
model on a fresh cache each build a copy; the first one renamed into place is kept and the others use it,
so no process ever reads a copy that another one is removing."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from clawrl.models import _cached
from tests.utils.waiting import spawn

REPO = Path(__file__).resolve().parents[2]


def test_a_build_that_finishes_second_keeps_the_first_copy(tmp_path):
    target = tmp_path / "model"

    def build(out: Path) -> None:
        other = tmp_path / "other"  # meanwhile another process renames its complete copy into place
        other.mkdir()
        for name, text in (("config.json", "{}"), (".complete", "ok\n"), ("first", "1")):
            (other / name).write_text(text)
        os.replace(other, target)
        (out / "config.json").write_text("{}")

    assert _cached(target, build) == target
    assert (target / "first").read_text() == "1"  # the first copy stays in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # this process's own copy is gone


def test_a_leftover_without_its_completion_marker_is_replaced(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text("partial")
    assert _cached(target, lambda out: (out / "config.json").write_text("{}")) == target
    assert (target / "config.json").read_text() == "{}" and (target / ".complete").is_file()


def test_two_processes_resolving_a_model_on_a_fresh_cache_both_load_it(tmp_path, tmp_path_factory, model_cache):
    tok = next(model_cache.glob("smollm2-tokenizer-*"), None)  # the tokenizer the tiny models share, if built
    if tok is not None:
        shutil.copytree(tok, tmp_path / tok.name)  # so only the model itself is built here, twice at once
    code = ("import sys; from pathlib import Path; from transformers import AutoConfig; "
            "from clawrl.models import resolve_model_dir; "
            "d = resolve_model_dir('tiny-qwen3', Path(sys.argv[1])); "
            "print(AutoConfig.from_pretrained(str(d)).model_type)")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    logs = tmp_path_factory.mktemp("logs")  # not in the cache: its listing is asserted below
    procs = [spawn([sys.executable, "-c", code, str(tmp_path)], logs, f"build{i}", env=env) for i in range(2)]
    outs = [p.result() for p in procs]
    assert [o.returncode for o in outs] == [0, 0], [o.stderr[-2000:] for o in outs]
    assert [o.stdout.strip() for o in outs] == ["qwen3", "qwen3"]
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("smollm2")] == ["tiny-qwen3-seed0-v1"]


def test_a_rank_that_transformers_would_not_let_write_the_model_fails_clearly(tmp_path, model_cache, monkeypatch):
    """Once torch.distributed is up, transformers' save_pretrained writes on rank 0 only: another rank's
    build must fail loudly, not cache a folder with a tokenizer and no model (`clawrl trainer` resolves the
    model before it starts the process group)."""
    import pytest
    from transformers import PreTrainedModel

    from clawrl.models import resolve_model_dir

    tok = next(model_cache.glob("smollm2-tokenizer-*"), None)
    if tok is not None:
        shutil.copytree(tok, tmp_path / tok.name)
    monkeypatch.setattr(PreTrainedModel, "should_save_on_this_rank", lambda self, is_main_process: False)
    with pytest.raises(RuntimeError, match="rank 0 only"):
        resolve_model_dir("tiny", tmp_path)
    assert not (tmp_path / "tiny-seed0-v1").exists() and not list(tmp_path.glob(".tiny-*"))
