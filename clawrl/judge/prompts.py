"""Chat messages for the judge model: the PRM score prompt and the hindsight-hint prompt.

Both prompts show the same material (OpenClaw-RL's show only the turn and its next state; we add
the task context):

    ## System prompt of the conversation       share 0.10
    ## Conversation before the request          share 0.10  (most recent kept when cut)
    ## The user's request                       share 0.20
    ## Between the request and the turn         share 0.10  (tool calls and results in an agent loop)
    ## The assistant turn to judge              share 0.25
    ## Next state (what followed the turn)      share 0.25
    ## Your answer                              (the instruction; not counted in the budget)

``budget_chars`` bounds the characters of that material. When it does not fit, each section gets
its share of the budget, a section that needs less than its share passes the rest on to the others
(water-filling, :func:`allocate_budget`), and a long text keeps its head and tail with the cut
marked (:func:`truncate_text`). Empty optional sections are left out.

The rule judge (``backends.RuleJudge``) answers these same prompts; :func:`read_next_state` and
:func:`prompt_kind` are how it reads them back.

Quoted material is neutralised (:func:`neutralize`): the conversation is written by users, tools
and the policy being trained, and must not be able to speak in the judge's answer format. A fake
``\\boxed{1}`` in a user message, echoed by a judge model after its own answer, would otherwise be
the last box and decide the score; an echoed ``</think>`` would hide the judge's real answer; a
line starting ``[user]`` inside a tool result would read back as a user reply.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from clawrl.judge.context import ROLE_LABELS, TOOL_CALL_LABEL, JudgeContext
from clawrl.judge.parse import HINT_END, HINT_START

PROMPTS_VERSION = "v2"  # part of the judge config hash: change it whenever a prompt's wording changes

NEXT_STATE_HEADER = "## Next state (what followed the turn)"
ANSWER_HEADER = "## Your answer"
_SECTIONS = (  # (header, budget share, share of a cut text kept from its head)
    ("## System prompt of the conversation", 0.10, 0.5),
    ("## Conversation before the request (most recent last)", 0.10, 0.2),
    ("## The user's request", 0.20, 0.5),
    ("## Between the request and the turn", 0.10, 0.3),
    ("## The assistant turn to judge", 0.25, 0.5),
    (NEXT_STATE_HEADER, 0.25, 0.5),
)
_OPTIONAL = {0, 1, 3}  # section indexes left out when empty

PRM_SYSTEM = """\
You review one turn of an AI assistant's conversation. You are shown the task context (the \
conversation's system prompt, the user's request and what came just before it), the assistant's \
turn, and the next state: the message or messages that came right after the turn. The next state \
is your evidence of how the turn went.

Roles in the next state:
- [user]: the user's next message.
- [tool result]: the output of a tool the assistant called in this turn. It exists because of the \
call; a normal, error-free result means the call worked.

Score the turn:
+1: the turn moved the task forward. The user accepts it, thanks the assistant or moves on to \
something new, or a tool call returned the expected result without error.
-1: the next state shows the turn was wrong or unwanted. The user corrects or rejects it, \
complains, asks for a redo or a change, or repeats the same request in other words; or a tool \
call returned an error or was used wrongly. A request to change the answer is negative feedback, \
not a neutral new instruction.
0: the next state does not tell: an unrelated follow-up, or too little information.

Judge the turn against what the user asked for, not against your own taste. Reason briefly, in a \
few sentences, then give the final answer on the last line as \\boxed{1}, \\boxed{0} or \\boxed{-1}."""

PRM_INSTRUCTION = """\
First say which case the next state is: (a) the task moved forward, (b) the turn was corrected, \
rejected or failed, (c) unclear. Then end with \\boxed{1}, \\boxed{-1} or \\boxed{0}."""

HINT_SYSTEM = f"""\
You help an AI assistant learn from hindsight. You are shown the task context, one assistant \
turn, and the next state that followed it ([user]: the user's next message; [tool result]: the \
output of a tool the turn called. A normal tool result means the call worked; it is not something \
the assistant should have known in advance).

Decide whether the next state holds information that would have made the turn better, had the \
assistant known it while writing the turn: a correction, a preference, a missing requirement, an \
error message that shows the right approach.

Output rules:
- Reason briefly, then give exactly one decision: \\boxed{{1}} if there is such information, \
\\boxed{{-1}} if there is not.
- With \\boxed{{1}}, write a hint between {HINT_START} and {HINT_END}: one to three short sentences \
phrased as an instruction to the assistant (for example "Answer in one word."), concrete and \
actionable; do not copy the whole next state.
- With \\boxed{{-1}}, write no hint block."""

HINT_INSTRUCTION = f"""\
Decide, then answer \\boxed{{1}} followed by {HINT_START}your hint{HINT_END}, or \\boxed{{-1}} alone."""

RATING_VERSION = "r1"  # part of a replay evaluation's key: change it whenever the rating prompt's wording changes

RATING_SYSTEM = """\
You rate one answer of an AI assistant. You are shown the task context (the conversation's system \
prompt, the user's request and what came just before it) and the assistant's answer. Nothing that \
came after the answer is shown: judge it from the conversation alone.

Score the answer:
+1: it does what the user asked for, correctly and in the form they asked for; a tool call is the \
right call with the right arguments.
-1: it is wrong, off topic, ignores an instruction of the user or of the system prompt, or calls a \
tool wrongly: the user would have to correct it or ask again.
0: you cannot tell, or it is only partly right.

Judge the answer against what the user asked for, not against your own taste. Reason briefly, in a \
few sentences, then give the final answer on the last line as \\boxed{1}, \\boxed{0} or \\boxed{-1}."""

RATING_INSTRUCTION = """\
First say whether the answer (a) does what was asked, (b) is wrong or unwanted, (c) is unclear. Then \
end with \\boxed{1}, \\boxed{-1} or \\boxed{0}."""

INTRO = "Here is the turn to review."
CUT_MARKER = "\n[... {n} characters cut ...]\n"


def truncate_text(text: str, limit: int, head_share: float = 0.5) -> str:
    """``text`` if it fits in ``limit`` characters, else its head and tail around a marker that
    says how many characters were cut; the result never exceeds ``limit``."""
    if len(text) <= limit:
        return text
    keep = limit - len(CUT_MARKER.format(n=len(text)))  # the widest marker this text can need
    if keep <= 0:
        return text[: max(limit, 0)]
    head = int(keep * head_share)
    tail = keep - head
    cut = len(text) - keep
    return text[:head] + CUT_MARKER.format(n=cut) + (text[-tail:] if tail else "")


def allocate_budget(lengths: list[int], shares: list[float], budget: int) -> list[int]:
    """Characters allowed per section: everything when it all fits; otherwise each section gets
    its share of what is left, and a section that needs less than its share gives the rest back."""
    if sum(lengths) <= budget:
        return list(lengths)
    limits = [0] * len(lengths)
    active = [i for i, n in enumerate(lengths) if n > 0]
    left = budget
    while active:
        total = sum(shares[i] for i in active)
        fair = {i: left * shares[i] / total for i in active}
        small = [i for i in active if lengths[i] <= fair[i]]
        if not small:
            for i in active:
                limits[i] = int(fair[i])
            break
        for i in small:
            limits[i] = lengths[i]
            left -= lengths[i]
            active.remove(i)
    return limits


_BOX = re.compile(r"\\(boxed)", re.IGNORECASE)  # \boxed -> boxed: still readable, never parsed
_THINK_TAG = re.compile(r"<(/?)(think)>", re.IGNORECASE)  # <think> -> [think], </think> -> [/think]
_HINT_MARK = re.compile(r"\[(HINT_START|HINT_END)\]")  # [HINT_START] -> (HINT_START)
_STRUCTURE_LINE = re.compile(  # a line that would read as a role label or a section header of ours
    r"^(?=## |(?:" + "|".join(re.escape(lb) for lb in sorted(set(ROLE_LABELS.values()) | {TOOL_CALL_LABEL})) + r"))",
    re.MULTILINE)


def neutralize(text: str) -> str:
    """Quoted text with everything that could pass for the judge's answer format or for this
    prompt's structure defused, visibly: ``\\boxed`` loses its backslash, think tags and hint
    markers change brackets, and a line starting like a role label or a ``## `` header is prefixed
    with ``| ``. parse.py never reads a score or hint out of the result."""
    text = _BOX.sub(r"\1", text)
    text = _THINK_TAG.sub(r"[\1\2]", text)
    text = _HINT_MARK.sub(r"(\1)", text)
    return _STRUCTURE_LINE.sub("| ", text)


def _join(messages: list[tuple[str, str]]) -> str:
    return "\n".join(f"{label} {neutralize(text)}" for label, text in messages)


def _section_texts(ctx: JudgeContext) -> list[str]:
    turn = "\n".join(([neutralize(ctx.assistant_text)] if ctx.assistant_text else [])
                     + [f"{TOOL_CALL_LABEL} {neutralize(c)}" for c in ctx.tool_calls])
    return [
        neutralize(ctx.system_prompt),
        _join(ctx.context_before),
        neutralize(ctx.user_request) or "(no user message before the turn)",
        _join(ctx.since_request),
        turn or "(empty turn)",
        _join(ctx.next_state) or "(empty)",
    ]


def _body(ctx: JudgeContext, budget_chars: int, instruction: str, next_state: bool = True) -> str:
    if budget_chars < 1:
        raise ValueError(f"budget_chars must be >= 1, got {budget_chars}")
    texts = _section_texts(ctx)
    if not next_state:  # the rating prompt: no next-state section at all
        texts[-1] = ""
    optional = _OPTIONAL if next_state else _OPTIONAL | {len(_SECTIONS) - 1}
    limits = allocate_budget([len(t) for t in texts], [s[1] for s in _SECTIONS], budget_chars)
    parts = [INTRO]
    for i, ((header, _, head_share), text, limit) in enumerate(zip(_SECTIONS, texts, limits)):
        if i in optional and not text:
            continue
        parts.append(f"{header}\n{truncate_text(text, limit, head_share)}")
    parts.append(f"{ANSWER_HEADER}\n{instruction}")
    return "\n\n".join(parts)


def build_prm_messages(ctx: JudgeContext, budget_chars: int) -> list[dict[str, str]]:
    """System + user messages asking for a score in {-1, 0, 1} as ``\\boxed{}``."""
    return [{"role": "system", "content": PRM_SYSTEM},
            {"role": "user", "content": _body(ctx, budget_chars, PRM_INSTRUCTION)}]


def build_hint_messages(ctx: JudgeContext, budget_chars: int) -> list[dict[str, str]]:
    """System + user messages asking for ``\\boxed{1}`` and a hint block, or ``\\boxed{-1}``."""
    return [{"role": "system", "content": HINT_SYSTEM},
            {"role": "user", "content": _body(ctx, budget_chars, HINT_INSTRUCTION)}]


def build_rating_messages(ctx: JudgeContext, budget_chars: int) -> list[dict[str, str]]:
    """System + user messages asking for a score in {-1, 0, 1} of an answer with no next state (the
    promotion gate's replay evaluation): the PRM prompt's material without its next-state section."""
    return [{"role": "system", "content": RATING_SYSTEM},
            {"role": "user", "content": _body(ctx, budget_chars, RATING_INSTRUCTION, next_state=False)}]


def prompt_kind(messages: list[dict[str, Any]]) -> Literal["prm", "hint"]:
    system = next((m.get("content") or "" for m in messages if m.get("role") == "system"), "")
    if system == PRM_SYSTEM:
        return "prm"
    if system == HINT_SYSTEM:
        return "hint"
    raise ValueError("not a clawrl judge prompt (unknown system message)")


_LABELS = tuple(sorted(set(ROLE_LABELS.values()) | {TOOL_CALL_LABEL}, key=len, reverse=True))


def read_next_state(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The (label, text) messages of the next-state section of a prompt built here."""
    body = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "user"), "")
    start = body.rfind("\n" + NEXT_STATE_HEADER + "\n")
    if start < 0:
        raise ValueError("the prompt has no next-state section")
    section = body[start + len(NEXT_STATE_HEADER) + 2:]
    end = section.rfind("\n\n" + ANSWER_HEADER + "\n")
    section = section[:end] if end >= 0 else section
    out: list[tuple[str, str]] = []
    for line in section.split("\n"):
        label = next((lb for lb in _LABELS if line == lb or line.startswith(lb + " ")), None)
        if label is not None:
            out.append((label, line[len(label) + 1:]))
        elif out:
            out[-1] = (out[-1][0], out[-1][1] + "\n" + line)
    return out
