"""Where judge votes come from: one small protocol and its implementations.

* :class:`EngineJudge` - a model behind the :class:`~clawrl.engine.types.Engine` protocol (the
  embedded torch engine, or an SGLang server through ``SGLangClient``). It must be the FROZEN
  initial model, never the synced policy: a judge that learns together with the policy can be
  gamed by it (the policy drifts toward whatever the judge has drifted to like, and the reward
  stops measuring the user's satisfaction). OpenClaw-RL keeps its PRM out of weight sync for the
  same reason.
* :class:`ProviderJudge` - an external OpenAI-compatible chat-completions API (the ``openai`` SDK).
* :class:`RuleJudge` - deterministic keyword rules, named as such, for tests and the CPU demo.
* :class:`RewardHookBackend` - a ``[hooks] reward`` function's decision, in the judge's answer format.

Every backend issues its n completions concurrently and returns one entry per completion: the text,
or the exception that completion raised. A failed completion is a failed vote, not a failed turn.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Protocol, runtime_checkable

import openai

from clawrl.engine.types import Engine, GenerateRequest, SamplingParams
from clawrl.judge.parse import HINT_END, HINT_START
from clawrl.judge.prompts import prompt_kind, read_next_state
from clawrl.records import NextStateRecord, TurnRecord


class JudgeBackendError(RuntimeError):
    """One judge completion failed (HTTP error, timeout, malformed reply)."""


@runtime_checkable
class JudgeBackend(Protocol):
    async def complete(self, messages: list[dict[str, Any]], *, n: int, temperature: float,
                       max_tokens: int) -> list[str | Exception]:
        """``n`` independent completions of ``messages``, issued concurrently; a failed one is
        returned as its exception (never raised)."""
        ...


async def _gather_votes(coros: list) -> list[str | Exception]:
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, Exception):
            raise r  # cancellation and KeyboardInterrupt are not failed votes
    return results


def answer(kind: str, score: int, hint: str | None, why: str) -> str:
    """A decision made without a model (rules, a reward hook) in the judge's answer format, so it
    takes a model's parse -> vote path: the PRM prompt gets the score; the hint prompt gets
    ``\\boxed{1}`` and the hint, or ``\\boxed{-1}`` when there is none."""
    if kind == "prm":
        return f"{why}\n\\boxed{{{score}}}"
    return f"{why}\n\\boxed{{1}}\n{HINT_START}{hint}{HINT_END}" if hint else f"{why}\n\\boxed{{-1}}"


class EngineJudge:
    """Votes sampled from an engine holding the frozen judge model (see the module docstring).

    Messages are rendered with ``tokenizer``'s chat template (generation prompt added); vote i is
    sampled with ``sampling_seed = seed + i``, so votes differ from each other while a rerun of
    the same prompt reproduces them."""

    def __init__(self, engine: Engine, tokenizer, *, seed: int = 0):
        self.engine = engine
        self.tokenizer = tokenizer
        self.seed = seed

    async def complete(self, messages: list[dict[str, Any]], *, n: int, temperature: float,
                       max_tokens: int) -> list[str | Exception]:
        try:
            ids = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False))
        except Exception as e:  # noqa: BLE001 - a template failure fails every vote alike
            return [e] * n

        async def one(i: int) -> str:
            sp = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, sampling_seed=self.seed + i)
            result = await self.engine.generate(GenerateRequest(input_ids=ids, sampling_params=sp))
            return result.text

        return await _gather_votes([one(i) for i in range(n)])


class ProviderJudge:
    """Votes from an external OpenAI-compatible chat-completions API, through the ``openai`` SDK.

    n separate requests run concurrently (providers differ in whether they honour ``n``). One
    client is opened per :meth:`complete` call, so an instance is not tied to an event loop. The SDK
    retries what it deems transient (connection errors, 408/409/429/5xx) ``max_retries`` times; a
    request that still fails is a :class:`JudgeBackendError` naming the URL and why (the HTTP status
    and the provider's message, a timeout, an unreachable host, a reply without message content)."""

    def __init__(self, base_url: str, api_key: str | None, model: str, timeout_s: float = 60.0,
                 max_retries: int = 2):
        if not base_url:
            raise ValueError("ProviderJudge needs a base_url")
        self.base_url = base_url.rstrip("/")
        self.api_key, self.model, self.timeout_s, self.max_retries = api_key, model, timeout_s, max_retries

    async def complete(self, messages: list[dict[str, Any]], *, n: int, temperature: float,
                       max_tokens: int) -> list[str | Exception]:
        # the SDK insists on a key; without one, the header is left out rather than sent with a dummy
        request = dict(model=self.model, messages=messages, temperature=temperature, max_tokens=max_tokens,
                       extra_headers=None if self.api_key else {"Authorization": openai.omit})
        async with openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "none", timeout=self.timeout_s,
                                      max_retries=self.max_retries) as client:
            return await _gather_votes([self._one(client, request) for _ in range(n)])

    async def _one(self, client: openai.AsyncOpenAI, request: dict[str, Any]) -> str:
        url = f"{self.base_url}/chat/completions"
        try:
            reply = await client.chat.completions.create(**request)
        except openai.APITimeoutError:
            raise JudgeBackendError(f"provider {url} timed out after {self.timeout_s:g} s") from None
        except openai.APIConnectionError as e:
            raise JudgeBackendError(f"provider {url} unreachable: {e.__cause__ or e!r}") from None
        except openai.APIStatusError as e:
            detail = e.body.get("message", e.message) if isinstance(e.body, dict) else e.message
            raise JudgeBackendError(f"provider {url} answered HTTP {e.status_code}: {detail}") from None
        try:  # the SDK does not validate replies: a malformed one has missing or None fields
            content = reply.choices[0].message.content
        except (AttributeError, IndexError, TypeError):
            content = None
        if not isinstance(content, str):
            raise JudgeBackendError(f"provider {url} sent a malformed reply (no message content): {reply!r:.200}")
        return content


_TOOL_ERROR = re.compile(
    r"\b(error|errors|exception|traceback|failed|failure|not found|no such file|permission denied|"
    r"timed out|invalid)\b", re.IGNORECASE)
_LEAD_IN = re.compile(  # one rejecting or filler phrase at the start of a message, with its punctuation
    r"^\s*(?:"
    r"(?:no|nope|actually|hmm|ok|okay|thanks|thank you|but|sorry)\b[\s,.!:;\u2014-]*"
    r"|(?:wrong|incorrect)\s*[,.!:;\u2014-]+\s*"  # "wrong, ..." is a lead-in; "wrong city" is the content
    r"|that(?:'s| is) (?:not (?:what i (?:asked|wanted|meant)(?: for)?|right|correct|it)|wrong|incorrect)\b"
    r"[\s,.!:;\u2014-]*)", re.IGNORECASE)
_CORRECTION = re.compile(
    r"(^\s*(no|nope|actually)\b|\bwrong\b|\bincorrect\b|not what i (asked|wanted|meant)|\bredo\b|"
    r"\btry again\b|\bshorter\b|\blonger\b|\bin lowercase\b|\bin uppercase\b|\bplease use\b|"
    r"\bi said\b|\bi meant\b)", re.IGNORECASE)
_PRAISE = re.compile(r"\b(thanks|thank you|great|perfect|next question|moving on|well done)\b", re.IGNORECASE)
_RETRY_ONLY = re.compile(r"^(please\s+)?(redo( it)?|try again|again)(\s+please)?$", re.IGNORECASE)


def correction_to_hint(text: str) -> str | None:
    """A user correction rewritten as an instruction: rejecting lead-ins stripped ("no, shorter
    please" -> "shorter please"); None when nothing instructive is left ("no, try again")."""
    rest = text.strip()
    while (m := _LEAD_IN.match(rest)) is not None:
        rest = rest[m.end():]
    rest = rest.strip().strip(".!").strip()
    if not rest or _RETRY_ONLY.match(rest):
        return None
    return rest


def judge_by_rules(next_state: list[tuple[str, str]]) -> tuple[int, str, str | None]:
    """(score, rule, hint) from role-labelled next-state messages; first matching rule wins:

    1. a tool result reporting an error -> -1 ``tool_error``
    2. a user message correcting or rejecting the turn -> -1 ``user_correction`` (hint: the
       correction as an instruction, when it carries one)
    3. a user message thanking or explicitly moving on -> +1 ``user_praise``
    4. a tool result without error words -> +1 ``tool_success``: the call ran and returned
       something, which is what the PRM prompt counts as progress
    5. otherwise 0 ``no_signal``
    """
    tools = [t for label, t in next_state if label == "[tool result]"]
    users = [t for label, t in next_state if label == "[user]"]
    if any(_TOOL_ERROR.search(t) for t in tools):
        return -1, "tool_error", None
    for t in users:
        if _CORRECTION.search(t):
            return -1, "user_correction", correction_to_hint(t)
    if any(_PRAISE.search(t) for t in users):
        return 1, "user_praise", None
    if tools:
        return 1, "tool_success", None
    return 0, "no_signal", None


class RuleJudge:
    """Deterministic rule-based judge (not a model): reads the next-state section of the same
    prompts a model judge gets and answers in the same text format, so its replies take the same
    parse -> vote path. All n votes are identical."""

    async def complete(self, messages: list[dict[str, Any]], *, n: int, temperature: float,
                       max_tokens: int) -> list[str | Exception]:
        try:
            kind = prompt_kind(messages)
            score, rule, hint = judge_by_rules(read_next_state(messages))
        except ValueError as e:
            return [e] * n
        return [answer(kind, score, hint, f"Rule judge (deterministic): the next state matches rule '{rule}'.")] * n


class RewardHookBackend:
    """Adapts a ``[hooks] reward`` function to the JudgeBackend protocol: its (score, hint) is
    written in the judge's answer format, so votes, hints, teacher log-probs and fates take the
    same path as a model judge's."""

    def __init__(self, hook, turn: TurnRecord, next_state: NextStateRecord | None, timeout_s: float | None = None):
        self.hook, self.turn, self.next_state, self.timeout_s = hook, turn, next_state, timeout_s

    async def complete(self, messages: list[dict[str, Any]], *, n: int, temperature: float,
                       max_tokens: int) -> list[str | Exception]:
        try:  # a hook that never answers must not hold the judge run (and the training after it) for good
            score, hint = await asyncio.wait_for(self.hook(turn=self.turn, next_state=self.next_state), self.timeout_s)
            if score not in (-1, 0, 1):
                raise ValueError(f"reward hook returned score {score!r}; expected -1, 0 or 1")
        except TimeoutError:
            return [JudgeBackendError(f"reward hook timed out after {self.timeout_s:g} s")] * n
        except Exception as e:  # a failing hook is a failed vote, like a failing judge model
            return [e] * n
        return [answer(prompt_kind(messages), score, hint, "reward hook")] * n
