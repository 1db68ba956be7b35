"""The LoRA benchmark on the tiny model: its three parts run end to end, count what they claim, and its bounds are
the hand-computed ones."""

from __future__ import annotations

import math
import statistics

import pytest

from clawrl.bench.engine import build_bench_prompts
from clawrl.bench.lora import format_lora_section, run_lora_bench
from clawrl.models import load_tokenizer

pytestmark = [pytest.mark.bench]


def test_the_lora_bench_measures_throughput_cold_adapters_and_syncs(model_cache, tiny_dir):
    labels: list[str] = []
    result = run_lora_bench("tiny", cache_dir=model_cache, adapters=2, rank=4, concurrency=4, new_tokens=4,
                            repeats=1, registered=6, held=2, cold_requests=12, device="cpu", progress=labels.append)
    t, c, s = result["throughput"], result["cold"], result["sync"]
    assert labels == ["base (pass 1/1)", "adapters (pass 1/1)"]
    assert (t["adapters"], t["rank"], t["concurrency"]) == (2, 4, 4) and t["base_tok_s"] > 0 < t["adapters_tok_s"]
    # tiny (fp32): per layer q, o 64x64, k, v 32x64, gate, up 160x64, down 64x160 -> 41,984 weights; 2 layers and
    # the tied 49,152 x 64 LM head -> 3,229,696 weights read, 12,918,784 bytes. A rank-4 adapter: 4 x (in + out)
    # per projection = 4 x (128 + 96 + 96 + 128 + 224 + 224 + 224) = 4,480 a layer, 8,960 weights, 35,840 bytes.
    assert t["adapter_mb"] == round(35_840 / 2**20, 1)
    assert t["flops_bound"] == round(3_229_696 / (3_229_696 + 8_960), 3)  # each row times its own adapter: 0.997
    # bytes: those weights, the norms (5 x 64 x 4 = 1,280 bytes) and the K/V of 4 rows at the mean length (prompt and
    # half the answer) at 2 layers x 2 (K, V) x 2 heads x 16 x 4 bytes = 512 bytes a position; 2 adapters.
    context = statistics.mean(len(p) for p in build_bench_prompts(load_tokenizer(tiny_dir), 8)) + 2
    base = 12_918_784 + 1_280 + 4 * context * 512
    assert t["bytes_bound"] == round(base / (base + 2 * 35_840), 3)
    assert c["failed"] == 0 and c["cold"] + c["warm"] == 12 and c["cold"] >= 1 and c["registered"] == 6
    assert s["adapter_s"] > 0 and s["full_s"] > 0 and math.isclose(s["ratio"], s["adapter_s"] / s["full_s"], rel_tol=0.02)  # times rounded to 0.1 ms
    text = format_lora_section(result)
    assert text.startswith("## LoRA adapters side by side\nMachine: ") and "| many users | 6 adapters registered" in text
    assert "no failed request (failed): MET (0)" in text and text.count("\n| ") == 4  # the head and three parts
