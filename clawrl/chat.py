"""Chat messages and tools, and how they become prompt token ids: the gateway renders requests with
:class:`ChatAdapter`, the judge's teacher renders hinted prompts with it, so both give the same ids.

Tool calls use the Hermes/Qwen2.5 format (SGLang's ``qwen25``/``hermes`` parsers)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Chat templates that render ``tools`` themselves (Qwen3, Llama 3.x) get them passed through. For
templates that know nothing of tools (SmolLM2's: role + content only) the adapter renders the tool
list into the system message and assistant tool calls / tool results into message content, in the
same format the parser reads back, so a tool-call round trip keeps its shape in the prompt.
Limitation: no grammar-constrained decoding, so ``tool_choice: "required"`` or a named function is
an instruction in the prompt, not a guarantee (SGLang constrains decoding there).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from jsonschema import Draft202012Validator, SchemaError
from jsonschema.validators import validator_for
from pydantic import BaseModel, ConfigDict, Field, field_validator


class Lenient(BaseModel):
    # Clients send fields we do not act on (user metadata, store, service_tier...): accept them.
    model_config = ConfigDict(extra="allow")


class FunctionCall(Lenient):
    name: str
    arguments: str = "{}"  # a JSON string, as in OpenAI's API

    @field_validator("arguments")
    @classmethod
    def _json_text(cls, v: str) -> str:
        if v.strip():
            try:
                json.loads(v)
            except ValueError:
                raise ValueError("must be the call's arguments as a JSON-encoded string, "
                                 "e.g. '{\"city\": \"Paris\"}'") from None
        return v


class ToolCall(Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p["text"] for p in self.content)


class FunctionDef(Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @field_validator("parameters")
    @classmethod
    def _json_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """A JSON Schema (the model is shown it, and trained on it): checked against the metaschema
        of its ``$schema`` draft, Draft 2020-12 without one; the error names the place in it."""
        if v is None:
            return v
        draft = v.get("$schema")  # not a string: the 2020-12 metaschema says so below
        checker = validator_for(v, default=Draft202012Validator) if isinstance(draft, str) else Draft202012Validator
        try:
            checker.check_schema(v)
        except SchemaError as e:
            raise ValueError(f"parameters{''.join(f'.{p}' for p in e.path)}: {e.message:.200}") from None
        return v


class ToolDef(Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool_calls objects


class SegmentEncoder:
    """Token ids of rendered chat text, encoded piece by piece between the tokenizer's added tokens.

    A Hugging Face tokenizer cuts text at its added tokens (``<|im_start|>``, ``<|im_end|>``...)
    before normalizing and pre-tokenizing, so ``encode(a + SPECIAL + b)`` is ``encode(a)``, the
    special id, ``encode(b)``. Every turn of a conversation re-renders all of its history, whose
    pieces are the same strings each time: they come from an LRU cache, so a turn costs the
    encoding of its new messages only, not of the whole conversation (about 0.2 us per character
    on one CPU core: 3 ms for a 16k-character history, each turn). Only for tokenizers where the
    cut is exact: added tokens without lstrip/rstrip/single_word, and no normalizer if any is
    matched after normalization; :meth:`ChatAdapter._fast_renderer` also checks it on a probe.
    """

    def __init__(self, backend, max_cached_chars: int = 16_000_000):
        added = backend.get_added_tokens_decoder()
        if any(t.lstrip or t.rstrip or t.single_word for t in added.values()):
            raise ValueError("added tokens strip or match single words: pieces would not be independent")
        if backend.normalizer is not None and any(t.normalized for t in added.values()):
            raise ValueError("added tokens are matched on normalized text")
        self.backend = backend
        self._ids = {t.content: i for i, t in added.items()}
        alternatives = sorted(self._ids, key=len, reverse=True)  # leftmost, then longest, as the tokenizer
        self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if alternatives else None
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._chars, self.max_cached_chars = 0, max_cached_chars

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self.backend.encode(text, add_special_tokens=False).ids
        out: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # an added token
                out.append(self._ids[piece])
            elif piece:
                out.extend(self._piece(piece))
        return out

    def _piece(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is not None:
            self._cache.move_to_end(piece)
            return ids
        ids = self.backend.encode(piece, add_special_tokens=False).ids
        if len(piece) <= self.max_cached_chars // 4:  # one huge piece does not flush the cache
            self._cache[piece] = ids
            self._chars += len(piece)
            while self._chars > self.max_cached_chars:
                old, _ = self._cache.popitem(last=False)
                self._chars -= len(old)
        return ids


class ChatAdapter:
    """Renders requests into prompt ids with the tokenizer's chat template; parses tool calls."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        template = tokenizer.chat_template or ""
        self.native_tools = "tools" in template  # the template renders a `tools` variable itself
        self._fast = self._fast_renderer(tokenizer)

    @staticmethod
    def _fast_renderer(tokenizer):
        """Render with the compiled template and encode with the Rust tokenizer directly: the same
        ids as ``apply_chat_template`` at a fraction of its per-call overhead (about 0.2 ms of a
        gateway budget of ~1 ms). Verified against ``apply_chat_template`` on a probe conversation;
        any mismatch or error falls back to the slow path."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(tokenizer.chat_template)
            specials = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
            backend = tokenizer.backend_tokenizer
            probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "héllo\n<b>"},
                     {"role": "assistant", "content": " x  \n\n"}, {"role": "user", "content": "y 12345 日本語 \t"}]
            slow = list(tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False))
            text = compiled.render(messages=probe, add_generation_prompt=True, **specials)
            segments: SegmentEncoder | None = None
            with contextlib.suppress(ValueError):  # added tokens that strip, or match normalized text
                segments = SegmentEncoder(backend)
            if segments is not None and (segments.encode(text) != slow or segments.encode(text) != slow):
                segments = None  # the pieces' ids differ, cold or from the cache: encode whole texts
            encode = segments.encode if segments else lambda t: backend.encode(t, add_special_tokens=False).ids

            def fast(msgs: list[dict[str, Any]], **kw: Any) -> list[int]:
                return encode(compiled.render(messages=msgs, add_generation_prompt=True, **specials, **kw))

            fast.segments = segments  # type: ignore[attr-defined]  # the piece cache in use, if any
            return fast if fast(probe) == slow else None
        except Exception:  # noqa: BLE001 - any surprise: keep the reference path
            return None

    def render(self, messages: list[ChatMessage], tools: list[ToolDef] | None = None,
               tool_choice: str | dict | None = None) -> list[int]:
        msgs, kwargs = self._template_input(messages, tools, tool_choice)
        if self._fast is not None:
            return self._fast(msgs, **kwargs)
        ids = self.tokenizer.apply_chat_template(
            msgs, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
        )
        return list(ids)

    def render_reply(self, messages: list[ChatMessage], reply: ChatMessage, tools: list[ToolDef] | None = None,
                     tool_choice: str | dict | None = None) -> list[int]:
        """The ids of the assistant message ``reply`` as the model writes them after
        ``render(messages, tools, tool_choice)``: through its end-of-turn (EOS) token. Raises
        ValueError when the template does not render the conversation with that prompt as a prefix."""
        prompt = self.render(messages, tools, tool_choice)
        msgs, kwargs = self._template_input([*messages, reply], tools, tool_choice)
        full = list(self.tokenizer.apply_chat_template(msgs, add_generation_prompt=False, tokenize=True,
                                                       return_dict=False, **kwargs))
        rest = full[len(prompt):]
        if full[:len(prompt)] != prompt or self.tokenizer.eos_token_id not in rest:
            raise ValueError("the chat template does not render the reply after the prompt, ending in EOS")
        return rest[:rest.index(self.tokenizer.eos_token_id) + 1]

    def _template_input(self, messages: list[ChatMessage], tools: list[ToolDef] | None,
                        tool_choice: str | dict | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        use_tools = bool(tools) and tool_choice != "none"
        msgs = [self._message_dict(m) for m in messages]
        kwargs: dict[str, Any] = {}
        if use_tools and self.native_tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools or []]
        elif use_tools:
            block = _tools_block(tools or [], tool_choice)
            if msgs and msgs[0]["role"] == "system":
                msgs[0] = {**msgs[0], "content": (msgs[0]["content"] + "\n\n" + block).strip()}
            else:
                msgs.insert(0, {"role": "system", "content": block})
        return msgs, kwargs

    def _message_dict(self, m: ChatMessage) -> dict[str, Any]:
        role = "system" if m.role == "developer" else m.role
        content = m.text()
        if m.role == "assistant" and m.tool_calls:
            if self.native_tools:
                return {"role": "assistant", "content": content,
                        "tool_calls": [tc.model_dump(exclude_none=True) for tc in m.tool_calls]}
            rendered = []
            for tc in m.tool_calls:  # arguments: JSON text (FunctionCall checks it), or blank
                args = tc.function.arguments
                call = {"name": tc.function.name, "arguments": json.loads(args) if args.strip() else args}
                rendered.append(f"{TOOL_CALL_OPEN}\n{json.dumps(call)}\n{TOOL_CALL_CLOSE}")
            content = "\n".join(([content] if content else []) + rendered)
        elif m.role == "tool" and not self.native_tools:
            content = f"<tool_response>\n{content}\n</tool_response>"
        out: dict[str, Any] = {"role": role, "content": content}
        if m.role == "tool" and m.tool_call_id and self.native_tools:
            out["tool_call_id"] = m.tool_call_id
        return out

    def parse(self, text: str, tools: list[ToolDef] | None, tool_choice: str | dict | None = None) -> ParsedOutput:
        """Split model text into content and OpenAI tool calls (only for declared tool names)."""
        if not tools or tool_choice == "none" or TOOL_CALL_OPEN not in text:
            return ParsedOutput(content=text)
        names = {t.function.name for t in tools}
        calls: list[dict[str, Any]] = []
        numbers = itertools.count()  # every match is numbered, kept or not: the ids depend on it

        def take(m: re.Match) -> str:  # a call of a declared tool leaves the content; anything else stays
            i, call = next(numbers), _parse_call(m.group(1), names)
            if call is None:
                return m.group(0)
            name, args = call
            digest = hashlib.sha256(f"{i}:{name}:{args}:{text}".encode()).hexdigest()[:24]
            calls.append({"id": f"call_{digest}", "type": "function", "function": {"name": name, "arguments": args}})
            return ""

        rest = _TOOL_CALL_RE.sub(take, text).strip()
        return ParsedOutput(content=rest or None, tool_calls=calls) if calls else ParsedOutput(content=text)


def tool_calls_in(text: str, names: set[str]) -> list[tuple[str, str]]:
    """(name, JSON arguments) of each well-formed call of a tool in ``names`` in raw model text, as
    :meth:`ChatAdapter.parse` would find them."""
    return [c for m in _TOOL_CALL_RE.finditer(text) if (c := _parse_call(m.group(1), names)) is not None]


def _parse_call(body: str, names: set[str]) -> tuple[str, str] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args)


def _tools_block(tools: list[ToolDef], tool_choice: str | dict | None) -> str:
    sigs = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in tools)
    text = (
        "You can call functions. Their signatures are inside <tools></tools>:\n"
        f"<tools>\n{sigs}\n</tools>\n"
        "To call a function, reply with one JSON object per call inside <tool_call></tool_call> tags:\n"
        f'{TOOL_CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{TOOL_CALL_CLOSE}'
    )
    if tool_choice == "required":
        text += "\nYou must call at least one function."
    elif isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if name:
            text += f"\nYou must call the function {name}."
    return text
