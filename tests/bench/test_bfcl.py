"""`clawrl bench bfcl` without BFCL's environment (CI has none): BFCL's answer and score files are
hand-built here in its format (one JSON object a line; a score file's first line is the summary, each
further line one failed entry), and the comparison, interval and table are checked on them."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI
from pydantic import ValidationError
from typer.testing import CliRunner

from clawrl.bench.bfcl import compare, format_section, format_table, read_verdicts, wilson
from clawrl.cli import app


def _lines(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _side(root, label, category, ids, failed, group="non_live"):
    """BFCL's files of one side: the answers of ``ids`` and the score file failing ``failed``."""
    _lines(root / label / "clawrl" / group / f"BFCL_v4_{category}_result.json",
           [{"id": i, "result": "Error during inference: 400" if i == "x" else "text"} for i in ids])
    _lines(root / f"score_{label}" / "clawrl" / group / f"BFCL_v4_{category}_score.json",
           [{"accuracy": 1 - len(failed) / len(ids), "correct_count": len(ids) - len(failed), "total_count": len(ids)}]
           + [{"id": i, "valid": False} for i in failed])


def test_verdicts_are_read_from_bfcls_answer_and_score_files(tmp_path):
    ids = [f"irrelevance_{i}" for i in range(4)]
    _side(tmp_path, "base", "irrelevance", ids, failed=["irrelevance_2"])
    got = read_verdicts(tmp_path / "base", tmp_path / "score_base", ["irrelevance"])
    assert got == {"irrelevance": {"irrelevance_0": True, "irrelevance_1": True, "irrelevance_2": False,
                                   "irrelevance_3": True}}
    # a score file that counts other answers than the result file holds is an error, not a silent mismatch
    _lines(tmp_path / "score_base" / "clawrl" / "non_live" / "BFCL_v4_irrelevance_score.json",
           [{"accuracy": 1.0, "correct_count": 5, "total_count": 5}])
    with pytest.raises(ValueError, match="5 scored, 4 answered"):
        read_verdicts(tmp_path / "base", tmp_path / "score_base", ["irrelevance"])


def test_wilson_interval_by_hand():
    # k=10, n=20: p 0.5, z² = 3.8415; centre (0.5 + 3.8415/40) / (1 + 3.8415/20) = 0.5,
    # half 1.96·sqrt(0.25/20 + 3.8415/1600) / 1.19207 = 1.96·0.12204 / 1.19207 = 0.20070
    low, high = wilson(10, 20)
    assert (low, high) == (pytest.approx(0.29930, abs=1e-5), pytest.approx(0.70070, abs=1e-5))
    # k=0: from 0 to z²/(n + z²) = 3.8415/23.8415 = 0.16113; k=n mirrors it, clamped to 1
    assert wilson(0, 20) == (0.0, pytest.approx(0.16113, abs=1e-5))
    assert wilson(20, 20) == (pytest.approx(0.83887, abs=1e-5), 1.0)


def test_a_category_is_worse_by_the_gates_rule_on_paired_verdicts():
    irr = [f"irrelevance_{i}" for i in range(20)]
    simple = [f"simple_python_{i}" for i in range(20)]
    first = {"irrelevance": dict.fromkeys(irr, True), "simple_python": dict.fromkeys(simple, False)}
    second = {"irrelevance": {i: k < 14 for k, i in enumerate(irr)},  # 6 of 20 irrelevance prompts now get a call
              "simple_python": {i: k < 5 for k, i in enumerate(simple)}}  # 5 of 20 right calls
    rows = {r["category"]: r for r in compare(first, second, tolerance=0.05, alpha=0.05)}
    irr_row, simple_row = rows["irrelevance"], rows["simple_python"]
    # irrelevance: 1.000 -> 0.700, d̄ = -0.3 < -0.05: worse; simple: 0.000 -> 0.250, not worse
    assert (irr_row["n"], irr_row["first"], irr_row["second"], irr_row["diff"]) == (20, 1.0, 0.7, pytest.approx(-0.3))
    assert irr_row["worse"] and irr_row["p"] == pytest.approx(0.00508, abs=1e-5)
    assert not simple_row["worse"] and simple_row["diff"] == pytest.approx(0.25)
    assert simple_row["second_ci"] == pytest.approx(wilson(5, 20))
    table = format_table(list(rows.values()), ("smollm2-135m", "run/v000016"), {"irrelevance": (0, 2)})
    section = format_section([table, table], machine="Machine: m.", pins="pins", per_category=20, seed=0,
                             tolerance=0.05, alpha=0.05)
    assert section.count("| category | n | smollm2-135m | run/v000016 |") == 2
    assert "| irrelevance | 20 | 1.000 (0.84-1.00) | 0.700 (0.48-0.85) | -0.300 | 0.00508 | **yes** | 0 / 2 |" in section
    assert "| simple_python | 20 | 0.000 (0.00-0.16) | 0.250 (0.11-0.47) | +0.250 | 0.99 | no | 0 / 0 |" in section
    assert "20 prompts per category drawn with seed 0; pins." in section


def test_the_bench_says_how_to_get_bfcl_when_it_is_missing(tmp_path, monkeypatch):
    import clawrl.sim.bfcl as bfcl

    monkeypatch.setattr(bfcl, "BFCL_ENV", tmp_path / "nowhere")
    res = CliRunner().invoke(app, ["bench", "bfcl", "--versus", str(tmp_path)])
    text = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert "BFCL is not installed" in text and "`make bfcl` installs bfcl-eval==2026.3.23" in text, text


def test_a_side_done_on_the_same_prompts_is_read_again_not_run(tmp_path):
    from clawrl.bench.bfcl import errors_in, run_side

    ids = {"irrelevance": ["irrelevance_0", "x"]}
    _side(tmp_path, "base", "irrelevance", ids["irrelevance"], failed=[])
    (tmp_path / "base" / "done.json").write_text(json.dumps({"model": "/m", "ids": ids}))
    # no settings, no gateway, no BFCL: the stored verdicts are the answer
    assert run_side(None, "/m", tmp_path, "base", ids) == {"irrelevance": {"irrelevance_0": True, "x": True}}
    assert errors_in(tmp_path / "base", "irrelevance") == 1  # "x" was refused by the gateway
    with pytest.raises(FileNotFoundError):  # other prompts: it would have to run (here: reads /m/config.json)
        run_side(None, "/m", tmp_path, "base", {"irrelevance": ["irrelevance_0"]})


def test_a_checkpoint_whose_weights_were_pruned_is_named_before_anything_starts(tmp_path):
    """Training keeps only the newest checkpoints' weights (and the gate's); an older one holds trainer.json
    and config.json: `--versus` on it is one line naming it, not a loader's traceback minutes later."""
    ckpt = tmp_path / "checkpoints" / "v000008"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    (ckpt / "trainer.json").write_text("{}")
    res = CliRunner().invoke(app, ["bench", "tools", "--versus", str(ckpt)])
    text = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert f"--versus {ckpt}: no weights in it (no *.safetensors)" in text and "Traceback" not in text, text
    (ckpt / "model.safetensors").write_bytes(b"")
    res = CliRunner().invoke(app, ["bench", "tools", "--versus", str(tmp_path / "elsewhere")])
    assert res.exit_code == 2 and "not an HF model directory (no config.json)" in " ".join(res.output.split())


def test_the_bench_gateway_needs_no_keys_of_the_users(make_settings, tiny_dir, monkeypatch):
    """`bench bfcl` serves each side through a gateway of its own on loopback, asked by BFCL's client with
    its own key ("clawrl": clawrl.sim.bfcl.bfcl_env): it starts without keys in the environment and
    open_mode off (it failed there with a traceback after the progress bars), and answers BFCL's
    client when the user's keys are set. Its engine is the model directory's own, embedded, with the
    bench's stall timeout; a key [engine] lacks is an error, not ignored."""
    from clawrl.bench.bfcl import STALL_TIMEOUT_S
    from clawrl.bench.common import gateway_on, gateway_settings

    s = make_settings({"server.open_mode": False, "engine.url": "http://127.0.0.1:9"})
    built = gateway_settings(s, tiny_dir, s.storage.data_root / "bench", max_context_len=512,
                             stall_timeout_s=STALL_TIMEOUT_S)
    assert (built.engine.kind, built.engine.stall_timeout_s, built.engine.max_context_len) == ("embedded", 1800.0, 512)
    assert built.model.name == str(tiny_dir)
    with pytest.raises(ValidationError, match="request_timeout_s"):
        gateway_settings(s, tiny_dir, s.storage.data_root, request_timeout_s=1.0)
    for keys in (None, "sk-user-7f3a9c2e41"):
        if keys:
            monkeypatch.setenv(s.server.api_keys_env, keys)
        else:
            monkeypatch.delenv(s.server.api_keys_env, raising=False)
        with gateway_on(s, tiny_dir, max_context_len=512, stall_timeout_s=STALL_TIMEOUT_S) as url:
            client = OpenAI(base_url=url + "/v1", api_key="clawrl", max_retries=0)
            r = client.chat.completions.create(model="clawrl", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length") and r.model_extra["weight_version"] == "0"
