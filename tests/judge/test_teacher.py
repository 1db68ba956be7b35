import asyncio
import math

import pytest
import torch

from clawrl.engine.types import GenerateResult
from clawrl.judge.teacher import (
    HINT_LABEL,
    TeacherAlignmentError,
    build_teacher_prompt_ids,
    compute_teacher_logprobs,
)

from tests.utils.turns import generate_turn

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


class _ScriptedEngine:
    """Answers prompt-logprob requests with SGLang's layout (``logprob_start_len``): entry j describes
    input_ids[s + j], entry 0 is null; the value -(s + j)/1000 encodes the position it describes.
    ``layout`` breaks it the way a wrong slicing assumption would."""

    def __init__(self, layout: str = "sglang"):
        self.layout = layout
        self.requests = []

    async def generate(self, req):
        self.requests.append(req)
        s, n = req.logprob_start_len, len(req.input_ids)
        entries = [None] + [-(s + j) / 1000 for j in range(1, n - s)]
        if self.layout == "no_null_entry":  # one entry per position from s, none of them null
            entries = [-(s + j) / 1000 for j in range(n - s)][1:]
        elif self.layout == "hole":
            entries[2] = None
        elif self.layout == "missing":
            entries = None
        return GenerateResult(rid=req.rid, text="", output_ids=[], prompt_tokens=n, completion_tokens=0,
                              finish_reason={"type": "length", "length": 0}, weight_version="0",
                              input_logprobs=entries, output_logprobs=[])


def test_teacher_request_is_prefill_only_and_slices_the_output_positions():
    engine = _ScriptedEngine()
    prompt, output = [5, 6, 7, 8, 9], [40, 41, 42]
    values = asyncio.run(compute_teacher_logprobs(engine, prompt, output))
    # s = P - 1 = 4: entries describe positions 4..7; entry 0 (position 4, the last prompt token) is
    # null and dropped; positions 5, 6, 7 are output tokens 0, 1, 2
    assert values == [-0.005, -0.006, -0.007]
    (req,) = engine.requests
    assert req.input_ids == prompt + output
    assert req.logprob_start_len == 4
    assert req.sampling_params.max_new_tokens == 0 and req.return_logprob


@pytest.mark.parametrize("layout,match", [
    ("no_null_entry", "returned 3 entries .* expected 4"),  # the reference's assumption: off by one
    ("hole", r"missing or not finite at output positions \[1\]"),
    ("missing", "no input log-probs"),
])
def test_misaligned_teacher_logprobs_raise(layout, match):
    with pytest.raises(TeacherAlignmentError, match=match):
        asyncio.run(compute_teacher_logprobs(_ScriptedEngine(layout), [5, 6, 7, 8, 9], [40, 41, 42]))


def test_empty_output_needs_no_request_and_empty_prompt_is_refused():
    engine = _ScriptedEngine()
    assert asyncio.run(compute_teacher_logprobs(engine, [1, 2], [])) == [] and engine.requests == []
    with pytest.raises(ValueError):
        asyncio.run(compute_teacher_logprobs(engine, [], [1]))


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_policy_as_teacher_with_empty_hint_reproduces_rollout_logprobs(tiny_engine, tools):
    """The check that catches the reference's off-by-one: same model, same prompt -> the teacher's
    log-probs of the sampled tokens are the sampler's own (temperature 1: both are log_softmax)."""
    turn = generate_turn(tiny_engine, MESSAGES, tools=tools, max_new_tokens=12, seed=7)
    prompt = build_teacher_prompt_ids(tiny_engine.tokenizer, MESSAGES, tools, hint="")
    assert prompt == turn.prompt_ids  # the teacher sees exactly the serving format
    teacher = asyncio.run(compute_teacher_logprobs(tiny_engine, prompt, turn.output_ids))
    assert len(teacher) == len(turn.output_ids) == 12
    assert max(abs(a - b) for a, b in zip(teacher, turn.rollout_logprobs)) < 1e-4


def test_hinted_teacher_logprobs_match_an_independent_forward_pass(tiny_engine, tiny_dir):
    from clawrl.models import load_causal_lm

    turn = generate_turn(tiny_engine, MESSAGES, max_new_tokens=10, seed=3)
    prompt = build_teacher_prompt_ids(tiny_engine.tokenizer, MESSAGES, None, hint="Answer with a warm colour.")
    assert prompt != turn.prompt_ids
    teacher = asyncio.run(compute_teacher_logprobs(tiny_engine, prompt, turn.output_ids))
    model = load_causal_lm(tiny_dir, dtype="float32", device="cpu")
    with torch.no_grad():
        logits = model(torch.tensor([prompt + turn.output_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    p = len(prompt)
    # output token k sits at position p + k and is predicted by the logits at position p + k - 1
    expected = [logprobs[p + k - 1, t].item() for k, t in enumerate(turn.output_ids)]
    assert len(teacher) == len(expected) == 10
    assert max(abs(a - b) for a, b in zip(teacher, expected)) < 1e-4
    assert max(abs(a - b) for a, b in zip(teacher, turn.rollout_logprobs)) > 1e-6  # the hint changed the context


def _decode(tokenizer, ids):
    return tokenizer.decode(ids)


def test_the_hint_is_appended_to_the_last_user_message(tiny_engine):
    tok = tiny_engine.tokenizer
    hint = "Prefer warm colours."
    last_user = _decode(tok, build_teacher_prompt_ids(tok, MESSAGES, None, f"  {hint} "))
    assert f"Another one?\n\n{HINT_LABEL} {hint}" in last_user
    assert last_user.count(hint) == 1 and last_user.index("Name a colour.") < last_user.index(hint)
    # a tool loop started without a user turn: the hint goes to the last message
    no_user = _decode(tok, build_teacher_prompt_ids(tok, MESSAGES[:1], None, hint))
    assert f"You are terse.\n\n{HINT_LABEL} {hint}" in no_user


def test_teacher_topk_logprobs_line_up_with_the_students_topk(tiny_engine, tiny_dir):
    """Top-k OPD: the student's k ids per output position (the policy's prefill-only top-k), then the
    teacher's log-probs at exactly those ids under the hinted prompt, one row per output token."""
    from clawrl.judge.teacher import compute_student_topk, compute_teacher_topk_logprobs
    from clawrl.models import load_causal_lm

    from clawrl.engine.types import GenerateRequest, SamplingParams

    k = 4
    turn = generate_turn(tiny_engine, MESSAGES, max_new_tokens=10, seed=3)
    # a greedy reply: every output id is the policy's top-1, so the sampled id is always among its top k
    greedy = asyncio.run(tiny_engine.generate(GenerateRequest(input_ids=turn.prompt_ids, sampling_params=SamplingParams(
        max_new_tokens=10, temperature=0.0, ignore_eos=True))))
    turn.output_ids = list(greedy.output_ids)
    ids, student = asyncio.run(compute_student_topk(tiny_engine, turn.prompt_ids, turn.output_ids, k))
    assert len(ids) == len(student) == len(turn.output_ids) == 10
    assert all(len(row) == k and len(set(row)) == k for row in ids)
    assert all(a >= b for row in student for a, b in zip(row, row[1:]))  # best first
    hinted = build_teacher_prompt_ids(tiny_engine.tokenizer, MESSAGES, None, hint="Answer with a warm colour.")
    sampled, topk = asyncio.run(compute_teacher_topk_logprobs(tiny_engine, hinted, turn.output_ids, ids))
    assert len(topk) == len(turn.output_ids) and all(len(row) == k for row in topk)
    assert all(math.isfinite(v) and v <= 0 for row in topk for v in row)
    # the sampled-token values are today's teacher log-probs, and equal the top-k value where the sampled id is in it
    assert sampled == pytest.approx(asyncio.run(compute_teacher_logprobs(tiny_engine, hinted, turn.output_ids)),
                                    abs=1e-6)
    hits = [(pos, row.index(t)) for pos, (row, t) in enumerate(zip(ids, turn.output_ids)) if t in row]
    assert len(hits) == len(turn.output_ids)
    assert all(abs(topk[pos][j] - sampled[pos]) < 1e-6 for pos, j in hits)
    # against an independent forward pass of each model's prompt
    model = load_causal_lm(tiny_dir, dtype="float32", device="cpu")
    for prompt, want_ids, got in ((turn.prompt_ids, ids, student), (hinted, ids, topk)):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([prompt + turn.output_ids])).logits[0].float(), dim=-1)
        p = len(prompt)
        expected = [[lp[p + pos - 1, t].item() for t in row] for pos, row in enumerate(want_ids)]
        assert max(abs(a - b) for r1, r2 in zip(got, expected) for a, b in zip(r1, r2)) < 1e-4
    # the student's ids are the forward pass's top k on the turn's own prompt
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([turn.prompt_ids + turn.output_ids])).logits[0].float(), dim=-1)
    p = len(turn.prompt_ids)
    assert [set(row) for row in ids] == [set(lp[p + pos - 1].topk(k).indices.tolist()) for pos in range(len(ids))]


def test_teacher_topk_refuses_misaligned_rows_and_decoding_with_token_ids(tiny_engine):
    from clawrl.engine.types import BadRequestError, GenerateRequest, SamplingParams
    from clawrl.judge.teacher import compute_teacher_topk_logprobs

    with pytest.raises(ValueError, match="2 top-k rows for 3 output ids"):
        asyncio.run(compute_teacher_topk_logprobs(tiny_engine, [5, 6], [7, 8, 9], [[1], [2]]))
    with pytest.raises(TeacherAlignmentError, match="no input token-ids log-probs"):
        asyncio.run(compute_teacher_topk_logprobs(_ScriptedEngine(), [5, 6], [7, 8, 9], [[1], [2], [3]]))
    with pytest.raises(BadRequestError, match="max_new_tokens = 0"):
        asyncio.run(tiny_engine.generate(GenerateRequest(input_ids=[5, 6, 7], return_logprob=True, logprob_start_len=1,
                                                         token_ids_logprob=[3], sampling_params=SamplingParams(
                                                             max_new_tokens=2))))
