"""collate_samples: layout by hand, alignment with next-token targets, and loud misalignment."""

from __future__ import annotations

import pytest
import torch

from clawrl.records import SampleRecord
from clawrl.train.batch import BatchAlignmentError, collate_samples

PAD = 2


def sample(sid="a", prompt=(10, 11, 12), output=(20, 21), rollout=(-0.1, -0.2), reward=1.0,
           has_teacher=False, teacher=None) -> SampleRecord:
    return SampleRecord(sample_id=sid, turn_id=f"t-{sid}", session_id="s", judge_config_hash="h",
                        method="combine", prompt_ids=list(prompt), output_ids=list(output),
                        rollout_logprobs=list(rollout), reward=reward, has_teacher=has_teacher,
                        teacher_logprobs=None if teacher is None else list(teacher), weight_version="v0")


def test_layout_by_hand():
    b = collate_samples([
        sample("a"),
        sample("b", prompt=(10,), output=(30, 31, 32), rollout=(-1.0, -2.0, -3.0), reward=-1.0,
               has_teacher=True, teacher=(-0.5, -0.6, -0.7)),
    ], pad_id=PAD)
    # lengths 3+2 = 5 and 1+3 = 4 -> L = 5, targets L-1 = 4
    assert b.input_ids.tolist() == [[10, 11, 12, 20, 21], [10, 30, 31, 32, PAD]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # row a: P=3 -> outputs predicted at positions 2, 3; row b: P=1 -> positions 0, 1, 2
    assert b.response_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    torch.testing.assert_close(b.rollout_logprobs, torch.tensor([[0, 0, -0.1, -0.2], [-1, -2, -3, 0]]))
    torch.testing.assert_close(b.teacher_logprobs, torch.tensor([[0, 0, 0, 0], [-0.5, -0.6, -0.7, 0]]))
    assert b.has_teacher.tolist() == [False, True]
    assert b.reward.tolist() == [1.0, -1.0]
    assert b.sample_ids == ["a", "b"]


def test_response_mask_selects_exactly_the_output_ids_as_targets():
    recs = [sample("a"), sample("b", prompt=(5, 6, 7, 8, 9), output=(40,), rollout=(-0.3,)),
            sample("c", prompt=(1,), output=(50, 51, 52, 53), rollout=(-1.0,) * 4)]
    b = collate_samples(recs, pad_id=PAD)
    targets = b.input_ids[:, 1:]
    for i, r in enumerate(recs):
        row_mask = b.response_mask[i].bool()
        assert targets[i][row_mask].tolist() == r.output_ids  # trained tokens == sampled tokens
        assert b.rollout_logprobs[i][row_mask].tolist() == pytest.approx(r.rollout_logprobs)


def test_identical_prompts_share_a_group():
    b = collate_samples([sample("a"), sample("b", prompt=(1, 2)), sample("c"), sample("d", prompt=(1, 2))],
                        pad_id=PAD)
    assert b.group_ids.tolist() == [0, 1, 0, 1]


def test_teacher_logprobs_ignored_without_has_teacher():
    b = collate_samples([sample(has_teacher=False, teacher=(-5.0, -5.0))], pad_id=PAD)
    assert b.teacher_logprobs.abs().sum().item() == 0.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(rollout=(-0.1,)), "1 rollout_logprobs for 2 output_ids"),
    (dict(rollout=(-0.1, -0.2, -0.3)), "3 rollout_logprobs for 2 output_ids"),
    (dict(has_teacher=True, teacher=(-0.1,)), "1 teacher_logprobs for 2 output_ids"),
    (dict(has_teacher=True, teacher=None), "has_teacher but teacher_logprobs is None"),
    (dict(output=(), rollout=()), "empty output_ids"),
    (dict(prompt=()), "empty prompt_ids"),
    (dict(rollout=(0.5, -0.2)), "finite and <= 0"),  # probabilities stored as log-probs
    (dict(rollout=(float("nan"), -0.2)), "finite and <= 0"),
])
def test_misalignment_raises_naming_the_sample(kwargs, message):
    with pytest.raises(BatchAlignmentError, match=message) as e:
        collate_samples([sample("good"), sample("bad", **kwargs)], pad_id=PAD)
    assert "sample bad" in str(e.value)


def test_slice_trims_to_own_length():
    b = collate_samples([sample("a", prompt=(1,) * 10), sample("b", prompt=(1,)), sample("c", prompt=(2,))],
                        pad_id=PAD)
    mb = b.slice(1, 3)
    # rows b, c: 1 + 2 = 3 tokens each -> input width 3, target width 2
    assert mb.input_ids.shape == (2, 3) and mb.response_mask.shape == (2, 2)
    assert mb.sample_ids == ["b", "c"] and mb.response_mask.tolist() == [[1, 1], [1, 1]]
    assert torch.equal(b.slice(0, 3).input_ids, b.input_ids)


def test_empty_batch_raises():
    with pytest.raises(ValueError, match="at least one sample"):
        collate_samples([], pad_id=PAD)


def test_topk_rows_are_placed_at_the_output_positions_and_checked():
    topk = dict(student_topk_logprobs=[[-0.1, -2.0], [-0.3, -0.4]], teacher_topk_logprobs=[[-1.0, -1.5], [-0.2, -3.0]])
    a = sample("a", has_teacher=True, teacher=(-0.5, -0.6))
    a.student_topk_logprobs, a.teacher_topk_logprobs = topk["student_topk_logprobs"], topk["teacher_topk_logprobs"]
    b = collate_samples([a, sample("b", prompt=(10,))], pad_id=PAD)
    assert b.student_topk_logprobs.shape == (2, 4, 2) and b.has_topk.tolist() == [True, False]
    # row a: P = 3 -> output positions 2, 3
    torch.testing.assert_close(b.teacher_topk_logprobs[0], torch.tensor([[0, 0], [0, 0], [-1.0, -1.5], [-0.2, -3.0]]))
    assert b.slice(0, 1).student_topk_logprobs.shape == (1, 4, 2) and b.select([1]).has_topk.tolist() == [False]
    assert collate_samples([sample("c")], pad_id=PAD).student_topk_logprobs.shape == (1, 4, 0)
    bad = sample("bad", has_teacher=True, teacher=(-0.5, -0.6))
    bad.student_topk_logprobs, bad.teacher_topk_logprobs = [[-0.1, -2.0]], topk["teacher_topk_logprobs"]
    with pytest.raises(BatchAlignmentError, match="student_topk_logprobs holds 1 rows for 2 output_ids"):
        collate_samples([bad], pad_id=PAD)
    bad.student_topk_logprobs = [[-0.1], [-0.2]]
    with pytest.raises(BatchAlignmentError, match="one width"):
        collate_samples([bad], pad_id=PAD)
    bad.student_topk_logprobs = [[0.5, -2.0], [-0.3, -0.4]]
    with pytest.raises(BatchAlignmentError, match="finite and <= 0"):
        collate_samples([bad], pad_id=PAD)
    c = sample("c", has_teacher=True, teacher=(-0.5, -0.6))
    c.student_topk_logprobs = c.teacher_topk_logprobs = [[-0.1], [-0.2]]
    with pytest.raises(BatchAlignmentError, match=r"different widths \[1, 2\]"):
        collate_samples([a, c], pad_id=PAD)
