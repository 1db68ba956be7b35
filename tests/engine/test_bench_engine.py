"""The engine benchmark: row shapes, exact token counts, and the markdown section it maintains."""

from __future__ import annotations

import pytest

from clawrl.bench import cpu_model
from clawrl.bench.common import write_section
from clawrl.bench.engine import build_bench_prompts, format_engine_section, run_engine_bench
from clawrl.models import load_tokenizer

pytestmark = [pytest.mark.bench]


def test_bench_rows_count_every_generated_token(model_cache):
    labels: list[str] = []
    rows = run_engine_bench(("tiny",), concurrencies=(1, 2), new_tokens=4, cache_dir=model_cache,
                            hf_batch_sizes=(2,), repeats=1, device="cpu", progress=labels.append)
    assert labels == ["tiny embedded 1 (pass 1/1)", "tiny embedded 2 (pass 1/1)", "tiny hf_generate 2 (pass 1/1)"]
    assert [(r["system"], r["concurrency"], r["requests"]) for r in rows] == [
        ("embedded", 1, 2), ("embedded", 2, 4), ("hf_generate", 2, 4)]
    # ignore_eos / min_new_tokens: every request makes exactly 4 tokens
    assert [r["tokens"] for r in rows] == [2 * 4, 4 * 4, 4 * 4]
    assert rows[1]["max_batch"] == 2  # two in flight were decoded together
    for r in rows:  # seconds is rounded to 0.1 ms in the row, tokens/s is not
        assert abs(r["tokens_per_s"] * r["seconds"] - r["tokens"]) <= 0.03 * r["tokens"]
    assert rows[0]["vs_c1"] == 1.0 and rows[2]["vs_c1"] is None
    assert {(r["device"], r["dtype"]) for r in rows} == {("cpu", "float32")}


def test_prompts_are_chat_templated(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    prompts = build_bench_prompts(tok, 3)
    assert len(prompts) == 3 and len({tuple(p) for p in prompts}) == 3
    assert tok.decode(prompts[0]).endswith("<|im_start|>assistant\n")


def test_markdown_section_is_replaced_in_place(tmp_path):
    path = tmp_path / "benchmarks.md"
    path.write_text("# Benchmarks\n\n## Training\n\nkeep me\n")
    rows = [dict(model="m", system="embedded", concurrency=c, requests=c, tokens=32 * c, seconds=1.0,
                 tokens_per_s=32.0 * c, load_1m=0.5, vs_c1=float(c), vs_hf_b16=c / 4, device="cpu", dtype="float32")
            for c in (1, 16)]
    rows.append(dict(model="m", system="hf_generate", concurrency=16, requests=16, tokens=512, seconds=4.0,
                     tokens_per_s=128.0, load_1m=0.5, vs_c1=None, vs_hf_b16=1.0, device="cpu", dtype="float32"))
    section = format_engine_section(rows)
    write_section("engine", section, path)
    path.write_text(path.read_text() + "\n## After\n\nkeep me too\n")
    write_section("engine", section, path)  # a rerun replaces, never duplicates
    text = path.read_text()
    assert text.count("<!-- engine-bench:start -->") == 1 and text.count("<!-- engine-bench:end -->") == 1
    assert "keep me" in text and text.endswith("keep me too\n")
    assert f"; device cpu ({cpu_model()}), float32; " in text  # which device the figures are from, by name
    assert "Greedy, `ignore_eos`, 32 new tokens per request" in text
    assert "| m | embedded | 16 | 16 | 512 | 1 | 512 | 16 | 4 | 0.5 |" in text
    assert "- m: 16 concurrent = 16.0x the engine at 1 and 4.0x HF generate at batch 16." in text
