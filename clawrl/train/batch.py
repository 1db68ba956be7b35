"""Sample records -> one right-padded token batch, aligned with next-token targets.

Layout for a sample with P prompt ids and T output ids, padded to length L:

    input_ids      p0 .. p(P-1) o0 .. o(T-1) pad ..        (L,)
    targets        input_ids[1:]                            (L-1,)
    response_mask  1.0 at positions P-1 .. P+T-2            (L-1,)  target is an output id
    *_logprobs     logprob of o_j at position P-1+j, else 0 (L-1,)
    *_topk_logprobs the k top-k log-probs of o_j's position at P-1+j, else 0 (L-1, k)

The ids are the exact ones the engine saw and sampled: nothing here re-tokenizes. Any length
mismatch between ids and log-probs raises; nothing is padded or truncated to make it fit (the
reference zero-pads and silently trains on misaligned log-probs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from clawrl.records import SampleRecord


class BatchAlignmentError(ValueError):
    """A sample whose ids and log-probs do not line up."""


@dataclass
class TokenBatch:
    input_ids: Tensor  # (B, L) long, prompt + output, right-padded with pad_id
    attention_mask: Tensor  # (B, L) long, 1 on real tokens
    response_mask: Tensor  # (B, L-1) float32, 1.0 where the target input_ids[:, 1:] is an output id
    rollout_logprobs: Tensor  # (B, L-1) float32, the engine's logprobs at the output positions
    teacher_logprobs: Tensor  # (B, L-1) float32, the teacher's at the output positions (0 without one)
    has_teacher: Tensor  # (B,) bool
    ref_logprobs: Tensor  # (B, L-1) float32, the frozen reference's at the output positions (0 without them)
    has_ref: Tensor  # (B,) bool, the sample came with reference log-probs (scored at judge time)
    # top-k OPD: the policy's / the teacher's log-probs of the policy's top-k ids at the output positions
    student_topk_logprobs: Tensor  # (B, L-1, k) float32, 0 elsewhere; k = 0 when no sample has them
    teacher_topk_logprobs: Tensor  # (B, L-1, k) float32
    has_topk: Tensor  # (B,) bool
    reward: Tensor  # (B,) float32, the judge's score
    group_ids: Tensor  # (B,) long, samples with identical prompt ids share a group (GRPO)
    sample_ids: list[str]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, stop: int) -> TokenBatch:
        """Rows start:stop, trimmed to their own longest sequence (right padding only, so the
        dropped columns are padding that no real token attends to)."""
        rows = slice(start, stop)
        length = max(int(self.attention_mask[rows].sum(-1).max()), 2)
        cols, tcols = slice(0, length), slice(0, length - 1)
        return TokenBatch(input_ids=self.input_ids[rows, cols], attention_mask=self.attention_mask[rows, cols],
                          response_mask=self.response_mask[rows, tcols],
                          rollout_logprobs=self.rollout_logprobs[rows, tcols],
                          teacher_logprobs=self.teacher_logprobs[rows, tcols], has_teacher=self.has_teacher[rows],
                          ref_logprobs=self.ref_logprobs[rows, tcols], has_ref=self.has_ref[rows],
                          student_topk_logprobs=self.student_topk_logprobs[rows, tcols],
                          teacher_topk_logprobs=self.teacher_topk_logprobs[rows, tcols], has_topk=self.has_topk[rows],
                          reward=self.reward[rows], group_ids=self.group_ids[rows], sample_ids=self.sample_ids[rows])

    def select(self, rows: Sequence[int]) -> TokenBatch:
        """These rows, in this order, at the batch's full length."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.input_ids.device)
        picked = {f.name: getattr(self, f.name) for f in fields(self)}
        picked = {k: v.index_select(0, index) if isinstance(v, Tensor) else v for k, v in picked.items()}
        picked["sample_ids"] = [self.sample_ids[i] for i in rows]
        return TokenBatch(**picked)

    def to(self, device: str | torch.device) -> TokenBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: v.to(device) if isinstance(v, Tensor) else v for k, v in moved.items()})


def collate_samples(samples: Sequence[SampleRecord], pad_id: int) -> TokenBatch:
    """Stack samples into a :class:`TokenBatch`; raises :class:`BatchAlignmentError` on any
    sample whose log-probs do not match its output ids one for one."""
    if not samples:
        raise ValueError("collate_samples needs at least one sample")
    for s in samples:
        _check_sample(s)
    lengths = [len(s.prompt_ids) + len(s.output_ids) for s in samples]
    B, L = len(samples), max(lengths)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    response_mask = torch.zeros((B, L - 1), dtype=torch.float32)
    rollout = torch.zeros((B, L - 1), dtype=torch.float32)
    teacher = torch.zeros((B, L - 1), dtype=torch.float32)
    ref = torch.zeros((B, L - 1), dtype=torch.float32)
    k = _topk_width(samples)
    student_topk = torch.zeros((B, L - 1, k), dtype=torch.float32)
    teacher_topk = torch.zeros((B, L - 1, k), dtype=torch.float32)
    groups: dict[tuple[int, ...], int] = {}
    group_ids = []
    for i, s in enumerate(samples):
        P, T = len(s.prompt_ids), len(s.output_ids)
        input_ids[i, : P + T] = torch.tensor(list(s.prompt_ids) + list(s.output_ids), dtype=torch.long)
        attention_mask[i, : P + T] = 1
        out = slice(P - 1, P - 1 + T)  # position t predicts input_ids[t+1]; o_0 sits at P
        response_mask[i, out] = 1.0
        rollout[i, out] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        if s.has_teacher:
            teacher[i, out] = torch.tensor(s.teacher_logprobs, dtype=torch.float32)
        if s.ref_logprobs is not None:
            ref[i, out] = torch.tensor(s.ref_logprobs, dtype=torch.float32)
        if _has_topk(s):
            student_topk[i, out] = torch.tensor(s.student_topk_logprobs, dtype=torch.float32)
            teacher_topk[i, out] = torch.tensor(s.teacher_topk_logprobs, dtype=torch.float32)
        group_ids.append(groups.setdefault(tuple(s.prompt_ids), len(groups)))
    return TokenBatch(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                      rollout_logprobs=rollout, teacher_logprobs=teacher,
                      has_teacher=torch.tensor([s.has_teacher for s in samples], dtype=torch.bool),
                      ref_logprobs=ref, has_ref=torch.tensor([s.ref_logprobs is not None for s in samples]),
                      student_topk_logprobs=student_topk, teacher_topk_logprobs=teacher_topk,
                      has_topk=torch.tensor([_has_topk(s) for s in samples], dtype=torch.bool),
                      reward=torch.tensor([float(s.reward) for s in samples], dtype=torch.float32),
                      group_ids=torch.tensor(group_ids, dtype=torch.long), sample_ids=[s.sample_id for s in samples])


def _has_topk(s: SampleRecord) -> bool:
    """Top-k OPD rows are read only for a sample with a teacher, as its teacher log-probs."""
    return s.has_teacher and s.teacher_topk_logprobs is not None


def _topk_width(samples: Sequence[SampleRecord]) -> int:
    """The one k of the batch's top-k samples (0 without any); different k in one batch raise."""
    widths = {len(row) for s in samples if _has_topk(s) for row in s.teacher_topk_logprobs}
    if len(widths) > 1:
        raise BatchAlignmentError(f"top-k rows of different widths {sorted(widths)} in one batch")
    return widths.pop() if widths else 0


def _check_topk(s: SampleRecord, where: str) -> list[float]:
    """The sample's top-k log-probs (flattened) after checking one row of k per output id."""
    T = len(s.output_ids)
    rows = {"student_topk_logprobs": s.student_topk_logprobs, "teacher_topk_logprobs": s.teacher_topk_logprobs}
    for name, value in rows.items():
        if value is None or len(value) != T:
            raise BatchAlignmentError(f"{where}: {name} holds {None if value is None else len(value)} rows "
                                      f"for {T} output_ids")
    k = len(s.teacher_topk_logprobs[0])
    if k == 0 or any(len(row) != k for value in rows.values() for row in value):
        raise BatchAlignmentError(f"{where}: top-k rows are not all of one width k >= 1")
    return [x for value in rows.values() for row in value for x in row]


def _check_sample(s: SampleRecord) -> None:
    where = f"sample {s.sample_id}"
    if not s.prompt_ids:
        # the first output id is predicted from the last prompt position
        raise BatchAlignmentError(f"{where}: empty prompt_ids")
    if not s.output_ids:
        raise BatchAlignmentError(f"{where}: empty output_ids, nothing to train on")
    T = len(s.output_ids)
    if len(s.rollout_logprobs) != T:
        raise BatchAlignmentError(f"{where}: {len(s.rollout_logprobs)} rollout_logprobs for {T} output_ids")
    if s.has_teacher:
        if s.teacher_logprobs is None:
            raise BatchAlignmentError(f"{where}: has_teacher but teacher_logprobs is None")
        if len(s.teacher_logprobs) != T:
            raise BatchAlignmentError(f"{where}: {len(s.teacher_logprobs)} teacher_logprobs for {T} output_ids")
    if s.ref_logprobs is not None and len(s.ref_logprobs) != T:
        raise BatchAlignmentError(f"{where}: {len(s.ref_logprobs)} ref_logprobs for {T} output_ids")
    # has_teacher is the authority: teacher log-probs on a sample without it are never read.
    used = (list(s.rollout_logprobs) + (list(s.teacher_logprobs) if s.has_teacher else [])
            + list(s.ref_logprobs or []) + (_check_topk(s, where) if _has_topk(s) else []))
    # a positive value means probabilities or logits were stored, not log-probs (1e-3 of slack
    # for engines whose float32 log-softmax rounds a near-certain token above 0)
    bad = [x for x in used if not (math.isfinite(x) and x <= 1e-3)]
    if bad:
        raise BatchAlignmentError(f"{where}: log-probs must be finite and <= 0, got {bad[:3]}")


def synthetic_batch(vocab: int, *, batch_size: int, prompt_len: int, output_len: int, seed: int = 0,
                    pad_id: int = 0, teacher: bool = False) -> TokenBatch:
    """Random full-length samples for benchmarks and smoke runs, fixed by ``seed``: ids in
    [3, vocab), rewards alternating +-1, rollout log-probs in (-3, 0], and with ``teacher`` every
    other sample with teacher log-probs too."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(batch_size):
        ids = torch.randint(3, vocab, (prompt_len + output_len,), generator=g).tolist()
        has_teacher = teacher and i % 2 == 0
        samples.append(SampleRecord(
            sample_id=f"synthetic-{i}", turn_id=f"synthetic-{i}", session_id="synthetic", judge_config_hash="",
            method="combine" if teacher else "grpo", prompt_ids=ids[:prompt_len], output_ids=ids[prompt_len:],
            rollout_logprobs=(-3.0 * torch.rand(output_len, generator=g)).tolist(), reward=1.0 - 2.0 * (i % 2),
            has_teacher=has_teacher, weight_version="0",
            teacher_logprobs=(-3.0 * torch.rand(output_len, generator=g)).tolist() if has_teacher else None))
    return collate_samples(samples, pad_id)
