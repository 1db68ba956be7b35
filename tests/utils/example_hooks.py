"""Tiny custom hooks for the contract tests (tests/test_hooks.py)."""

import json
import random

import torch

from clawrl.engine.types import GenerateRequest, SamplingParams
from clawrl.records import SampleRecord

CALLS: dict[str, int] = {}


def _count(name: str) -> None:
    CALLS[name] = CALLS.get(name, 0) + 1


async def reward(turn, next_state):
    """+1 when the user says thanks, else -1 with the user's words as the hint."""
    _count("reward")
    said = " ".join(m.get("content") or "" for m in json.loads(next_state.messages or "[]"))
    return (1, None) if "thank" in said.lower() else (-1, "reply in exactly three words")


def loss(mb, *, logprobs, old_logprobs, ref_logprobs, entropy, reward, hp, num_tokens, num_seqs):
    """Plain REINFORCE: -R * logprob, token mean."""
    _count("loss")
    per_token = -(reward[:, None] * logprobs) * mb.response_mask
    value = per_token.sum() / num_tokens
    return value, {"loss": float(value), "custom_loss": 1.0}


async def generate(engine, request: GenerateRequest):
    """Caps every completion at 3 tokens."""
    _count("generate")
    sp = SamplingParams(**{**request.sampling_params.__dict__, "max_new_tokens": 3})
    return await engine.generate(GenerateRequest(input_ids=request.input_ids, sampling_params=sp,
                                                 return_logprob=True, top_logprobs_num=request.top_logprobs_num))


def sample_source(data_root, judge_config_hash, limit):
    """Synthetic samples (the same two every call, so a second call finds them consumed)."""
    _count("sample_source")
    rng = random.Random(1)
    out = []
    for i in range(limit):
        ids = [rng.randrange(3, 40000) for _ in range(4)] + [2]
        out.append(SampleRecord(sample_id=f"custom{i}", turn_id=f"custom-turn{i}", session_id="custom-source",
                                judge_config_hash=judge_config_hash, method="grpo", prompt_ids=[1, 42, 7],
                                output_ids=ids, rollout_logprobs=[-8.0] * len(ids), reward=1.0 - 2 * (i % 2),
                                has_teacher=False, teacher_logprobs=None, weight_version="0"))
    return out


def not_async_reward(turn, next_state):
    return 1, None


async def reward_missing_param(turn):
    return 1, None


def loss_needs_extra(mb, *, logprobs, old_logprobs, ref_logprobs, entropy, reward, hp, num_tokens, num_seqs, alpha):
    return torch.zeros(()), {}


NOT_CALLABLE = 3
