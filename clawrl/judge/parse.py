"""Read a judge's answer out of its raw text: the score in ``\\boxed{}`` and the hindsight hint.

Where we depart from OpenClaw-RL's single-digit regex:

1. Only the *visible* answer counts. ``<think>...</think>`` blocks are removed first; an unclosed
   ``<think>`` hides everything after it (a reply cut off mid-thought has no answer); a stray
   ``</think>`` with no opening tag hides everything before it (Qwen3-Thinking templates put the
   opening tag in the prompt, so the reply starts inside the thought).
2. The LAST ``\\boxed{...}`` of the visible text is the answer, and it alone decides: if it is
   malformed (``\\boxed{yes}``, ``\\boxed{2}``, an unclosed ``\\boxed{1``) the score is None, even
   when an earlier box held a valid value. Falling back to an earlier box would read a draft answer
   the judge moved away from.
3. Braces are matched, so ``\\boxed{\\text{1}}`` reads as 1; spaces, a leading ``+``, ``$`` signs
   and the unicode minus/dash characters a model may emit are tolerated.

Rule 2 makes a judge that quotes the conversation after its answer dangerous: a ``\\boxed{1}``
written by the user (or the policy) would be the last box. The prompts therefore never contain a
parseable box, think tag or hint marker inside the quoted conversation (``prompts.neutralize``):
a judge that echoes its prompt cannot hand this module a box copied from the conversation.
"""

from __future__ import annotations

import re

HINT_START = "[HINT_START]"
HINT_END = "[HINT_END]"

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_THINK_OPEN = re.compile(r"<think>", re.IGNORECASE)
_THINK_CLOSE = re.compile(r"</think>", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\s*\{")
# \text{1}, \mathrm{-1}, \textbf{+1}, \mathbf{0}: unwrap one formatting command around the value
_WRAPPER = re.compile(r"^\\(?:text|mathrm|textbf|mathbf|textnormal|mbox)\s*\{(.*)\}$", re.DOTALL)
_MINUS_LIKE = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2014": "-", "\ufe63": "-", "\uff0d": "-", "\uff0b": "+"})
_SCORE_VALUE = re.compile(r"^([+-]?)([01])(?:\.0*)?$")
_HINT_BLOCK = re.compile(re.escape(HINT_START) + r"(.*?)" + re.escape(HINT_END), re.DOTALL)

VALID_SCORES = (-1, 0, 1)


def visible_text(text: str) -> str:
    """``text`` without its thinking: closed think blocks removed, an unclosed one cut to the end,
    anything before a stray closing tag dropped."""
    text = _THINK_BLOCK.sub("", text)
    stray = list(_THINK_CLOSE.finditer(text))
    if stray:  # content before an unmatched </think> is thought whose <think> was in the prompt
        text = text[stray[-1].end():]
    opened = _THINK_OPEN.search(text)
    return text[: opened.start()] if opened else text


def _last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{`` in ``text`` up to its matching brace; None when there is no
    box. An unclosed last box returns the sentinel ``"\\x00unclosed"`` (malformed)."""
    boxes = list(_BOXED.finditer(text))
    if not boxes:
        return None
    start = boxes[-1].end()
    depth, i = 1, start
    while i < len(text):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return "\x00unclosed"


def _score_value(content: str) -> int | None:
    s = content.translate(_MINUS_LIKE).strip().strip("$").strip()
    while (m := _WRAPPER.match(s)) is not None:
        s = m.group(1).strip()
    s = re.sub(r"\s+", "", s)
    m = _SCORE_VALUE.match(s)
    if m is None:
        return None
    value = int(m.group(2)) * (-1 if m.group(1) == "-" else 1)
    return value if value in VALID_SCORES else None  # "-0" -> 0


def parse_score(text: str | None) -> int | None:
    """The judge's score: the value of the last ``\\boxed{}`` outside thinking, in {-1, 0, 1}, or None."""
    if not text:
        return None
    content = _last_boxed_content(visible_text(text))
    return None if content is None else _score_value(content)


def parse_hint(text: str | None) -> tuple[bool | None, str | None]:
    """(accepted, hint) from a hint-judge reply.

    accepted: True for ``\\boxed{1}``, False for ``\\boxed{-1}``, None when the decision is missing,
    malformed or 0 (the hint prompt allows only 1 or -1). hint: the stripped text of the last
    ``[HINT_START]...[HINT_END]`` block outside thinking, only when accepted; None if there is none
    or it is empty.
    """
    score = parse_score(text)
    if score not in (1, -1):
        return None, None
    if score == -1:
        return False, None
    blocks = _HINT_BLOCK.findall(visible_text(text or ""))
    hint = blocks[-1].strip() if blocks else ""
    return True, (hint or None)
