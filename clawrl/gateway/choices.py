"""The choices of one chat completion: their log-probs, usage and stream chunks, and the merge of
their engine streams. A request with ``n`` choices runs ``n`` samples (GenerateRequest.samples:
sample i is seeded ``seed + i``); choice i is sample i.

Choices (OpenAI's ``n``, at most ``MAX_N`` = 8 a request): each choice is a sample of its own - the
engine gets ``n`` requests of one prompt (choice i seeded ``seed + i``, so choice 0 is what ``n =
1`` would answer; the embedded engine prefills the prompt once for all of them) - with its own
output ids, rollout log-probs, parsed tool calls and finish reason. All ``n`` turns are appended in
one write before the response's end is sent (a stream sends every choice's last chunk only then):
all are recorded or none is. Choice 0 is the request's turn (index k, the request's turn type: the
one that waits for the session's next state); choice i is a ``side`` turn at index k + i, with
``n`` and its own seed in ``request_params``. The judge therefore trains on choice 0 only, once
its next state comes; the other choices are logged for analysis (or groups of samples of one
prompt) and never trained. When the client goes on with another choice than choice 0, choice 0 is
closed without a next state (sessions.py), so a reply to another answer is never judged as its own.
A restarted gateway tells the choices apart again from the log (sessions.choice_digests)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from clawrl.chat import TOOL_CALL_OPEN, ParsedOutput
from clawrl.engine.types import GenerateResult


def choice_logprobs(decode: Callable[[int], str], result: GenerateResult, start: int,
                    n_top: int | None) -> dict[str, Any]:
    """OpenAI's choice logprobs of the output tokens from ``start`` on, as a dict:
    {"content": [{token, logprob, bytes, top_logprobs}]}."""
    ids, lps, tops = result.output_ids, result.output_logprobs or [], result.output_top_logprobs
    end = len(ids)
    if (result.finish_reason or {}).get("type") == "stop" and isinstance(result.finish_reason.get("matched"), int):
        end -= 1  # the EOS/stop token is recorded for training but not shown, as OpenAI does
    out = []
    for i in range(start, max(start, end)):
        tok = decode(ids[i])
        top = [{"token": (t_tok := decode(t)), "logprob": lp, "bytes": list(t_tok.encode())}
               for lp, t in (tops[i] if tops and i < len(tops) else [])][:n_top or 0]
        out.append({"token": tok, "logprob": lps[i], "bytes": list(tok.encode()), "top_logprobs": top})
    return {"content": out}


def usage(results: list[GenerateResult]) -> dict[str, Any]:
    """OpenAI's usage of a request's choices: the prompt counted once, the completions summed."""
    prompt, completion = results[0].prompt_tokens, sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": results[0].cached_tokens}}


class ChoiceStream:
    """What one choice of a stream has sent, and its next chunks' ``choices`` entries. Text is held
    back by the longest stop string (and the tool-call opener when tools are offered) less one
    character, and no content is sent once a tool call starts: the final chunk carries it."""

    def __init__(self, index: int, holdback: int, tools: bool, logprobs: Callable[[GenerateResult, int], Any] | None):
        self.index, self.holdback, self.tools, self.logprobs = index, holdback, tools, logprobs
        self.sent_chars = self.sent_tokens = 0
        self.tool_mode = False

    def entry(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def _new_logprobs(self, result: GenerateResult) -> Any:
        if self.logprobs is None or len(result.output_ids) <= self.sent_tokens:
            return None
        lp = self.logprobs(result, self.sent_tokens)
        self.sent_tokens = len(result.output_ids)
        return lp

    def partial(self, result: GenerateResult) -> dict[str, Any] | None:
        """The entry for an unfinished partial result, or None when it adds nothing to send."""
        text = result.text
        self.tool_mode = self.tool_mode or self.tools and TOOL_CALL_OPEN in text  # then no content until the end
        safe = max(self.sent_chars, len(text) - self.holdback)
        while safe > self.sent_chars and text[safe - 1] == "\ufffd":  # an incomplete UTF-8 char
            safe -= 1
        lp = self._new_logprobs(result)
        if not self.tool_mode and safe > self.sent_chars:
            delta, self.sent_chars = {"content": text[self.sent_chars:safe]}, safe
            return self.entry(delta, logprobs=lp)
        return None if lp is None else self.entry({}, logprobs=lp)

    def final(self, result: GenerateResult, parsed: ParsedOutput, finish: str) -> dict[str, Any]:
        """The last entry: the rest of the text, the parsed tool calls and the finish reason."""
        lp = self._new_logprobs(result)
        visible = (parsed.content or "") if parsed.tool_calls else result.text
        delta: dict[str, Any] = {}
        if len(visible) > self.sent_chars:
            delta["content"] = visible[self.sent_chars:]
        if parsed.tool_calls:
            delta["tool_calls"] = [{"index": i, **tc} for i, tc in enumerate(parsed.tool_calls)]
        return self.entry(delta, finish=finish, logprobs=lp)


async def until_stalled(stream: AsyncIterator[GenerateResult], stall_s: float) -> AsyncIterator[GenerateResult]:
    """The stream's items, for as long as each comes within ``stall_s`` of the one before (the first
    within ``stall_s`` of the start), else TimeoutError. Only the waits for the engine are timed:
    a context around the caller's loop would also time its yields."""
    it = aiter(stream)
    while True:
        async with asyncio.timeout(stall_s):  # no extra task per item, unlike wait_for
            item = await anext(it, None)  # an engine stream never yields None
        if item is None:
            return
        yield item


async def merged(streams: list[AsyncIterator[GenerateResult]]) -> AsyncIterator[tuple[int, GenerateResult]]:
    """The items of all ``streams`` as they come, each with its stream's position. An error in one
    ends the merge with that error; leaving early stops (and so aborts) the streams still running."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[GenerateResult]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, done))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    running = len(tasks)
    try:
        while running:
            i, item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
