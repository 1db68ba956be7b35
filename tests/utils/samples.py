"""Stored trainable samples and short sessions through a gateway, shared by the flow and e2e tests."""

from __future__ import annotations

import random

from clawrl.records import SampleRecord
from clawrl.storage.writer import DataStore


def write_samples(settings, n: int) -> None:
    """``n`` GRPO samples of random ids (rewards alternating -1, +1) under these settings' judge-config
    hash, written to their data root: a full batch for the trainer without any judging."""
    from clawrl.judge.runner import build_judge_config_hash

    rng, chash = random.Random(0), build_judge_config_hash(settings)
    recs = []
    for i in range(n):
        out = [rng.randrange(3, 40000) for _ in range(5)] + [2]
        recs.append(SampleRecord(sample_id=f"smp{i:02d}", turn_id=f"turn{i:02d}", session_id=f"sess{i:02d}",
                                 judge_config_hash=chash, method="grpo",
                                 prompt_ids=[1] + [rng.randrange(3, 40000) for _ in range(6)], output_ids=out,
                                 rollout_logprobs=[-rng.uniform(5, 11) for _ in out], reward=1.0 if i % 2 else -1.0,
                                 has_teacher=False, teacher_logprobs=None, weight_version="0"))
    with DataStore(settings.storage.data_root) as store:
        store.append(recs)


def two_turn_session(client, sid: str, first: str, reply_after: str) -> None:
    """One session of two main turns through the openai ``client``: ``first``, then ``reply_after`` as the
    user's next state (the second turn ends the session)."""
    msgs = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": first}]
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=12, extra_body={"session_id": sid})
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": reply_after}]
    client.chat.completions.create(model="m", messages=msgs, max_tokens=4,
                                   extra_body={"session_id": sid, "session_done": True})
