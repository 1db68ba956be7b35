"""HF <-> Megatron weight conversion: exact round trips, tensor-parallel sharding by hand, and a
Megatron GPTModel that computes the same logits as the HF model it was loaded from."""

from __future__ import annotations

import pytest
import torch

from clawrl.train.convert import (
    compute_padded_vocab_size,
    hf_to_megatron,
    is_tp_sharded,
    megatron_config_from_hf,
    megatron_to_hf,
)


# megatron-core 0.16.1 warns about Transformer Engine/Apex being absent and deprecated arguments
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron", "ignore::UserWarning:megatron",
                                        "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

def _hf_state(model_dir):
    from clawrl.train.megatron_model import load_hf_state_dict

    return load_hf_state_dict(model_dir)


def _hf_config(model_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir))


@pytest.fixture(params=["tiny", "tiny-qwen3"])
def model_dir(request, tiny_dir, tiny_qwen3_dir):
    return {"tiny": tiny_dir, "tiny-qwen3": tiny_qwen3_dir}[request.param]


# --------------------------------------------------------------------------------------------
# config


def test_config_qwen3_uses_head_dim_qk_norm_and_untied_output(tiny_qwen3_dir):
    args = megatron_config_from_hf(_hf_config(tiny_qwen3_dir), dtype=torch.float32, tp=1)
    c, m = args.config_kwargs, args.model_kwargs
    assert c["kv_channels"] == 32  # head_dim, not hidden/heads = 64/4 = 16
    assert (c["num_attention_heads"], c["num_query_groups"], c["ffn_hidden_size"]) == (4, 2, 160)
    assert c["qk_layernorm"] is True and args.qk_layernorm is True
    assert c["layernorm_epsilon"] == 1e-5 and c["normalization"] == "RMSNorm"
    assert m["rotary_base"] == 10000.0 and m["share_embeddings_and_output_weights"] is False
    assert (args.vocab_size, args.padded_vocab_size, m["vocab_size"]) == (49152, 49152, 49152)


def test_config_llama_has_no_qk_norm_and_ties_embeddings(tiny_dir):
    args = megatron_config_from_hf(_hf_config(tiny_dir), dtype=torch.bfloat16, tp=2)
    assert args.config_kwargs["qk_layernorm"] is False
    assert args.config_kwargs["kv_channels"] == 16
    assert args.config_kwargs["bf16"] is True and args.config_kwargs["params_dtype"] == torch.bfloat16
    assert args.config_kwargs["tensor_model_parallel_size"] == 2
    assert args.model_kwargs["share_embeddings_and_output_weights"] is True


def test_padded_vocab_rounds_up_to_multiple_times_tp():
    # 151936 = 1187 * 128: no padding at TP 1; at TP 2 the step is 256 and 1187 is odd -> 594 * 256
    assert compute_padded_vocab_size(151936, 1) == 151936
    assert compute_padded_vocab_size(151936, 2) == 152064  # 594 * 256
    assert compute_padded_vocab_size(1000, 2) == 1024  # ceil(1000 / 256) = 4 -> 4 * 256


def test_unsupported_configs_raise_with_the_reason(tiny_dir):
    cfg = _hf_config(tiny_dir).to_dict()
    with pytest.raises(ValueError, match="rope_type 'llama3'"):
        megatron_config_from_hf({**cfg, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}},
                                 dtype=torch.float32, tp=1)
    with pytest.raises(ValueError, match="attention_bias"):
        megatron_config_from_hf({**cfg, "attention_bias": True}, dtype=torch.float32, tp=1)
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        megatron_config_from_hf({**cfg, "model_type": "gpt2"}, dtype=torch.float32, tp=1)
    with pytest.raises(ValueError, match="kv heads"):  # 2 kv heads cannot be split 4 ways
        megatron_config_from_hf(cfg, dtype=torch.float32, tp=4)


# --------------------------------------------------------------------------------------------
# mapping, by hand


def _toy_config(**kw):
    # 4 query heads, 2 kv heads, head_dim 1, hidden 1, ffn 4, vocab 3: every row is one number
    base = dict(model_type="llama", num_hidden_layers=1, hidden_size=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=1, intermediate_size=4, vocab_size=3,
                tie_word_embeddings=False, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return {**base, **kw}


def _toy_state():
    col = lambda *v: torch.tensor(v, dtype=torch.float32)[:, None]  # noqa: E731  (n, 1)
    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": col(1, 2, 3),
        "lm_head.weight": col(4, 5, 6),
        "model.norm.weight": torch.tensor([0.5]),
        p + "input_layernorm.weight": torch.tensor([0.25]),
        p + "post_attention_layernorm.weight": torch.tensor([0.75]),
        p + "self_attn.q_proj.weight": col(10, 11, 12, 13),
        p + "self_attn.k_proj.weight": col(20, 21),
        p + "self_attn.v_proj.weight": col(30, 31),
        p + "self_attn.o_proj.weight": torch.tensor([[40.0, 41, 42, 43]]),
        p + "mlp.gate_proj.weight": col(50, 51, 52, 53),
        p + "mlp.up_proj.weight": col(60, 61, 62, 63),
        p + "mlp.down_proj.weight": torch.tensor([[70.0, 71, 72, 73]]),
    }


def test_qkv_is_grouped_per_kv_head_and_split_by_group():
    cfg, hf = _toy_config(), _toy_state()
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    # kv head 0 serves q heads 0,1; kv head 1 serves q heads 2,3: [q0 q1 k0 v0 | q2 q3 k1 v1]
    assert hf_to_megatron(hf, cfg)[qkv].flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    assert hf_to_megatron(hf, cfg, 0, 2)[qkv].flatten().tolist() == [10, 11, 20, 30]  # group 0
    assert hf_to_megatron(hf, cfg, 1, 2)[qkv].flatten().tolist() == [12, 13, 21, 31]  # group 1


def test_fc1_shard_holds_its_gate_rows_then_its_up_rows():
    cfg, hf = _toy_config(), _toy_state()
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    assert hf_to_megatron(hf, cfg)[fc1].flatten().tolist() == [50, 51, 52, 53, 60, 61, 62, 63]
    # not a plain split of cat(gate, up): rank 0 gets gate[0:2] + up[0:2]
    assert hf_to_megatron(hf, cfg, 0, 2)[fc1].flatten().tolist() == [50, 51, 60, 61]
    assert hf_to_megatron(hf, cfg, 1, 2)[fc1].flatten().tolist() == [52, 53, 62, 63]


def test_row_parallel_and_vocab_parallel_shards():
    cfg, hf = _toy_config(), _toy_state()
    r1 = hf_to_megatron(hf, cfg, 1, 2, vocab_multiple=2)  # padded vocab: ceil(3 / 4) * 4 = 4
    assert r1["decoder.layers.0.self_attention.linear_proj.weight"].tolist() == [[42.0, 43.0]]  # columns 2:4
    assert r1["decoder.layers.0.mlp.linear_fc2.weight"].tolist() == [[72.0, 73.0]]
    assert r1["embedding.word_embeddings.weight"].flatten().tolist() == [3.0, 0.0]  # row 2, then a zero pad row
    assert r1["output_layer.weight"].flatten().tolist() == [6.0, 0.0]
    assert r1["decoder.layers.0.input_layernorm.weight"].tolist() == [0.25]  # replicated


def test_tp_sharded_names():
    assert is_tp_sharded("decoder.layers.3.self_attention.linear_qkv.weight")
    assert is_tp_sharded("embedding.word_embeddings.weight") and is_tp_sharded("output_layer.weight")
    assert not is_tp_sharded("decoder.layers.3.self_attention.q_layernorm.weight")
    assert not is_tp_sharded("decoder.final_layernorm.weight")


# --------------------------------------------------------------------------------------------
# round trips on the real tiny checkpoints


@pytest.mark.parametrize("tp_size", [1, 2])
def test_round_trip_is_exact(model_dir, tp_size):
    hf, cfg = _hf_state(model_dir), _hf_config(model_dir)
    shards = [hf_to_megatron(hf, cfg, r, tp_size) for r in range(tp_size)]
    back = megatron_to_hf(shards, cfg, tp_size)
    expected = {k for k in hf if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    assert set(back) == expected
    for k in expected:
        assert torch.equal(back[k], hf[k]), k  # max diff 0.0
    # a fresh copy, never a view of the input
    assert back["model.norm.weight"].data_ptr() != hf["model.norm.weight"].data_ptr()


def test_round_trip_drops_vocab_padding(tiny_qwen3_dir):
    hf, cfg = _hf_state(tiny_qwen3_dir), _hf_config(tiny_qwen3_dir)
    shards = [hf_to_megatron(hf, cfg, r, 2, vocab_multiple=1000) for r in range(2)]
    # 49152 rounded up to a multiple of 2000 is 50000: 848 zero rows at the end of rank 1
    assert shards[1]["output_layer.weight"].shape == (25000, 64)
    assert torch.count_nonzero(shards[1]["output_layer.weight"][-848:]) == 0
    back = megatron_to_hf(shards, cfg, 2)
    assert torch.equal(back["lm_head.weight"], hf["lm_head.weight"])
    assert torch.equal(back["model.embed_tokens.weight"], hf["model.embed_tokens.weight"])


def test_shard_count_must_match_tp_size(tiny_dir):
    hf, cfg = _hf_state(tiny_dir), _hf_config(tiny_dir)
    with pytest.raises(ValueError, match="1 shards for tp_size=2"):
        megatron_to_hf([hf_to_megatron(hf, cfg)], cfg, 2)


# --------------------------------------------------------------------------------------------
# a megatron model loaded from HF weights computes what HF computes


@pytest.fixture(scope="module")
def megatron_tp1():
    from clawrl.train.megatron_shims import init_megatron, shutdown_megatron

    runtime = init_megatron(1, seed=0)
    yield runtime
    shutdown_megatron(runtime)


@pytest.mark.parametrize("vocab_multiple", [128, 1000])
def test_megatron_logits_and_logprobs_match_hf(megatron_tp1, model_dir, vocab_multiple):
    from clawrl.models import load_causal_lm
    from clawrl.train.megatron_model import build_gpt_model, compute_vocab_parallel_logprobs, load_megatron_weights

    hf_model = load_causal_lm(model_dir)
    cfg = hf_model.config
    args = megatron_config_from_hf(cfg, dtype=torch.float32, tp=1, vocab_multiple=vocab_multiple)
    model = build_gpt_model(args)
    load_megatron_weights(model, hf_to_megatron(hf_model.state_dict(), cfg, vocab_multiple=vocab_multiple))
    model.eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf_model(input_ids=ids).logits
        logits = model(input_ids=ids, position_ids=torch.arange(24).expand(2, 24), attention_mask=None)
        lp, ent = compute_vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], vocab_start=0,
                                                  vocab_size=cfg.vocab_size)
    assert logits.shape == (2, 24, args.padded_vocab_size)  # 49152, or 50000 with 848 padding columns
    assert (logits[..., : cfg.vocab_size] - ref).abs().max() < 1e-4
    ref_lp = torch.log_softmax(ref[:, :-1], -1)
    assert (lp - ref_lp.gather(-1, ids[:, 1:, None]).squeeze(-1)).abs().max() < 1e-4
    assert (ent - -(ref_lp.exp() * ref_lp).sum(-1)).abs().max() < 1e-4  # padding columns take no mass
