"""Session semantics: turn indices, next-state links, closing, bounded memory. No I/O here.

A session is keyed by (API-key namespace, session id), so one key can never add turns to another
key's session. Each session remembers at most one *pending* main turn: the last one whose next
state has not arrived. When the session's next main request arrives, the messages it adds after
that turn's assistant message (a user reply, or every tool result of the turn's tool calls) become
the pending turn's next state. A session ends on ``session_done``, after ``idle_timeout_s`` without
a request, or when evicted to keep at most ``max_sessions`` in memory; its pending turn is then
recorded as having no next state. Nothing waits forever.

Which session a request belongs to: the first id the client gives - the ``X-Session-Id`` header,
the body's ``session_id``, OpenAI's ``prompt_cache_key`` (less the suffix
``PROMPT_CACHE_KEY_BOUNDARY`` matches: OpenClaw sends ``<session id>:<compactions so far>``) and
``user`` fields, ``metadata.session_id`` (:func:`explicit_session_id`; agents such as OpenClaw cannot
send per-session headers but send their session id as ``prompt_cache_key``); else the session whose
last answer (and the message that asked for it, or - an answer of at least ``QUOTE_MIN_CHARS`` -
alone: an agent's summary may stand where the asking message was) the request continues, if the id
derived next is not an open session - so a conversation whose earlier messages an agent compacted
stays one session; else the session the request quotes (:meth:`SessionTracker.find`: a summariser
call quotes the answers of the conversation it summarises, the request after a compaction quotes
that summary, and one that quotes no answer - OpenClaw's summary of the first part of a turn it
splits quotes only the user's message - is found by that message, as the session's user wrote it);
else :func:`derive_session_id`, a hash of the namespace and the conversation's first
system and user messages with the parts agents change on every request (dates, times, numbers,
weekday and month names) left out. Two conversations that open with identical messages share a
derived id; clients that care send an id. Remembered answers live in memory only.

A request with ``n`` > 1 choices takes n turn indices; its choice 0 is the pending turn and
remembers the other choices' answers (in memory): when the next request continues one of those
instead (its assistant message is that choice's, not choice 0's), choice 0 is closed without a next
state (reason ``other_choice_continued``), so no reply to another answer is ever judged as its own.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import re
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from clawrl.records import NextStateRecord

SESSION_ID_RE = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")
# An answer found on its own (not with the message that asked for it), or inside another request's
# text, must be at least this long: short ones ("OK.", "Done!") are in every conversation.
QUOTE_MIN_CHARS = 24
# Sessions (most recent first) and summaries searched for a quoted answer: the one a summariser or a
# compacted conversation quotes was active moments ago, and the search stays a few milliseconds.
QUOTE_SEARCH = 256


# What an agent puts around its user's words when it sends them and leaves out when its summariser quotes
# them: a bracketed prefix (OpenClaw: "[Sun 2026-12-06 20:26 UTC] "), and paragraphs after the first
# (OpenClaw appends "Runtime: agent=main | ..." to a conversation's first message).
_ENVELOPE = re.compile(r"^\[[^\]\n]{1,64}\]\s*")


class BadSessionError(ValueError):
    pass


def validate_session_id(session_id: str) -> str:
    """Session ids are never used to build a file path; the character set and the refusal of
    '.' / '..' keep it that way should anything ever try (and keep them printable in logs)."""
    if not SESSION_ID_RE.match(session_id) or not session_id.strip("."):
        raise BadSessionError(
            "session id must be 1-128 characters from A-Z a-z 0-9 . _ : @ - and not only dots "
            f"(got {len(session_id)} characters)"
        )
    return session_id


# json.dumps(obj, sort_keys=True, default=str) builds this encoder on every call; the bytes hashed
# (and so every derived id) stay exactly those of that call.
_ID_ENCODER = json.JSONEncoder(sort_keys=True, default=str)


_VOLATILE = re.compile(r"\d+|\b(?:mon|tues|wednes|thurs|fri|satur|sun)day\b|\b(?:january|february|march|april|may|"
                       r"june|july|august|september|october|november|december)\b", re.IGNORECASE)


def _digest(*parts: Any) -> str:
    return hashlib.sha256(_ID_ENCODER.encode(list(parts)).encode()).hexdigest()[:20]


# The suffix an agent adds to prompt_cache_key at each context boundary, left out of the session id:
# OpenClaw sends "<session id>:<compactions so far>" and its compaction summariser the bare id. Other
# clients' keys ending in ':<digits>' lose that part too.
PROMPT_CACHE_KEY_BOUNDARY = re.compile(r":\d+$")
# A session idle this long is closed (its pending turn recorded without a next state); at most this many
# open sessions are held in memory, the least recently used closed beyond.
SESSION_IDLE_TIMEOUT_S, MAX_SESSIONS = 900.0, 10_000


def explicit_session_id(prompt_cache_key: Any, user: Any, metadata: Any) -> str | None:
    """The session id an OpenAI field carries (``prompt_cache_key``, ``user``, ``metadata.session_id``,
    in that order), as it is when it is a valid id, else as a stable hash of it; None if none is set.
    The suffix an agent adds to ``prompt_cache_key`` at each context boundary is left out
    (``PROMPT_CACHE_KEY_BOUNDARY``)."""
    if isinstance(prompt_cache_key, str):
        prompt_cache_key = PROMPT_CACHE_KEY_BOUNDARY.sub("", prompt_cache_key) or prompt_cache_key
    meta = metadata.get("session_id") if isinstance(metadata, dict) else None
    value = next((v for v in (prompt_cache_key, user, meta) if isinstance(v, str) and v), None)
    if value is None or (SESSION_ID_RE.match(value) and value.strip(".")):
        return value
    return "key-" + _digest(value)


def derive_session_id(namespace: str, messages: list[dict[str, Any]]) -> str:
    first_system = next((m.get("content") for m in messages if m.get("role") in ("system", "developer")), None)
    first_user = next((m.get("content") for m in messages if m.get("role") == "user"), None)
    if isinstance(first_system, str):
        first_system = _VOLATILE.sub("#", first_system)
    # the None: where the `user` field went before it became an id of its own; kept so that ids of
    # conversations without volatile parts stay what they were
    return "auto-" + _digest(namespace, None, first_system, first_user)


def _last_exchange(messages: list[dict[str, Any]]) -> list[str]:
    """Digests of the last assistant message with the message that asked for it: the last user or
    tool message before it, and the first one after the assistant message before that (they differ
    when agents append per-request context after the user's message, which the next request's
    history no longer carries - OpenClaw's internal-context block). Empty without an answer."""
    answers = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not answers:
        return []
    last, prev = answers[-1], (answers[-2] if len(answers) > 1 else -1)
    asking = [m.get("content") for m in messages[prev + 1:last] if m.get("role") in ("user", "tool")]
    answer = messages[last]
    calls = [(c.get("function") or {}).get("name") for c in answer.get("tool_calls") or []]  # ids and args get
    # re-serialised by clients: names only
    return list(dict.fromkeys(_digest(asked, answer.get("content") or "", calls) for asked in
                              (asking[-1:] + asking[:1] or [None])))


def _content(message: dict[str, Any]) -> str:
    """A message's text (the text of its parts joined)."""
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return content


def answer_digest(message: dict[str, Any]) -> str:
    """An assistant message's text and tool names, as a client sends an answer back (the text of
    its parts joined; tool call ids and arguments left out, clients re-serialise them)."""
    return _digest(_content(message), [(c.get("function") or {}).get("name") for c in message.get("tool_calls") or []])


def _long_answer(messages: list[dict[str, Any]]) -> list[str]:
    """The digest of the last assistant message on its own, if it is long enough to tell conversations apart."""
    answer = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    return [answer_digest(answer)] if answer and len(_content(answer).strip()) >= QUOTE_MIN_CHARS else []


def _asked_words(messages: list[dict[str, Any]]) -> str | None:
    """The user's own words that asked for the request's answer (the first user message after its last
    answer, less the agent's envelope: ``_ENVELOPE``), if long enough to tell conversations apart."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    asking = next((m for m in messages[last + 1:] if m.get("role") == "user"), None)
    words = _ENVELOPE.sub("", _content(asking)).split("\n\n", 1)[0].strip() if asking else ""
    return words if len(words) >= QUOTE_MIN_CHARS else None


def choice_digests(turns: list[dict[str, Any]], adapter: Any) -> tuple[str | None, tuple[str, ...]]:
    """The answer digests of a request's choices from their logged turns (``text``, ``request_tools``,
    in choice order), parsed by ``adapter`` as they were when served: (choice 0's, the others')."""
    from clawrl.chat import ToolDef

    digests = []
    for t in turns:
        tools = [ToolDef.model_validate(d) for d in json.loads(t["request_tools"])] if t["request_tools"] else None
        parsed = adapter.parse(t["text"], tools)
        digests.append(answer_digest({"content": parsed.content, "tool_calls": parsed.tool_calls}))
    return (digests[0], tuple(digests[1:])) if digests else (None, ())


@dataclass
class PendingTurn:
    turn_id: str
    turn_index: int
    message_count: int  # messages in the request that produced the turn
    answer: str | None = None  # answer_digest of the turn's answer, when other choices were sampled with it
    others: tuple[str, ...] = ()  # answer_digest of each other choice of the same request

    def next_state(self, session_id: str, reason: str, added: list[dict[str, Any]] | None = None) -> NextStateRecord:
        """The record that closes this turn: the messages ``added`` after it, or none (none will come)."""
        return NextStateRecord(self.turn_id, session_id, self.turn_index, has_next_state=bool(added),
                               messages=json.dumps(added) if added else None, reason=reason)


@dataclass
class SessionState:
    namespace: str
    session_id: str
    next_index: int = 0
    pending: PendingTurn | None = None
    last_active: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # serialises main turns of one session
    answers: deque[str] = field(default_factory=lambda: deque(maxlen=2))  # its last long main answers' texts
    asked: deque[str] = field(default_factory=lambda: deque(maxlen=2))  # the user's words that asked for them


class SessionTracker:
    def __init__(self, *, idle_timeout_s: float | None = None, max_sessions: int | None = None, clock=time.monotonic):
        self.idle_timeout_s = SESSION_IDLE_TIMEOUT_S if idle_timeout_s is None else idle_timeout_s
        self.max_sessions = MAX_SESSIONS if max_sessions is None else max_sessions
        self.clock = clock
        self._sessions: OrderedDict[tuple[str, str], SessionState] = OrderedDict()
        # Next turn index of sessions no longer in memory, so a returning session never reuses an
        # index. Bounded too: beyond it, indices restart (turn ids stay unique regardless).
        self._closed_index: OrderedDict[tuple[str, str], int] = OrderedDict()
        # (namespace, digest of a main turn's answer and the user message before it) -> its session
        self._answers: OrderedDict[tuple[str, str], str] = OrderedDict()
        # (namespace, a long side answer - a summary, say -, its session), newest last
        self._summaries: deque[tuple[str, str, str]] = deque(maxlen=QUOTE_SEARCH)

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def pending_turns(self) -> int:
        return sum(1 for s in self._sessions.values() if s.pending is not None)

    def open(self, namespace: str, session_id: str) -> tuple[SessionState, list[NextStateRecord]]:
        """The session's state (created on first sight) and records for sessions evicted to make room."""
        key = (namespace, session_id)
        evicted: list[NextStateRecord] = []
        state = self._sessions.get(key)
        if state is None:
            state = SessionState(namespace, session_id, next_index=self._closed_index.pop(key, 0))
            self._sessions[key] = state
            while len(self._sessions) > self.max_sessions:
                _, old = next(iter(self._sessions.items()))
                evicted.extend(self._close(old, "evicted"))
        self._sessions.move_to_end(key)
        state.last_active = self.clock()
        return state, evicted

    def is_open(self, namespace: str, session_id: str) -> bool:
        return (namespace, session_id) in self._sessions

    def find(self, namespace: str, messages: list[dict[str, Any]], maintenance: bool = False) -> str:
        """The session of a request without an id (module docstring): the derived id if that session
        is open, else the session whose recorded answer the messages continue, else the one they
        quote (:meth:`_quoted`), else the derived id. ``maintenance``: an agent's own call (side)."""
        derived = derive_session_id(namespace, messages)
        if self.is_open(namespace, derived):
            return derived
        keys = _last_exchange(messages) + _long_answer(messages)
        found = next((self._answers[k] for e in keys if (k := (namespace, e)) in self._answers), None)
        return found or self._quoted(namespace, messages, maintenance) or derived

    def _quoted(self, namespace: str, messages: list[dict[str, Any]], maintenance: bool) -> str | None:
        """The session whose answer the user and tool messages quote. An agent's summariser call
        (``maintenance``) quotes the conversation it summarises: one of the last two long answers of
        a recent open session, else (a summary of a turn's first part quotes no answer) the user's
        words that asked for one of them. Any request may quote a recent long side answer: the
        summary an agent put in place of the conversation it compacted."""
        text = "\n".join(_content(m) for m in messages if m.get("role") in ("user", "tool"))
        if maintenance:
            for quotes in (lambda s: s.answers, lambda s: s.asked):  # answers first: they tell sessions apart best
                recent = itertools.islice((s for s in reversed(self._sessions.values()) if s.namespace == namespace),
                                          QUOTE_SEARCH)
                if found := next((s.session_id for s in recent if any(q in text for q in quotes(s))), None):
                    return found
        return next((sid for ns, quote, sid in reversed(self._summaries) if ns == namespace and quote in text), None)

    def link_next_state(self, state: SessionState, messages: list[dict[str, Any]]) -> NextStateRecord | None:
        """Called when a new main request arrives: close the pending turn with what was added."""
        pending = state.pending
        if pending is None:
            return None
        state.pending = None
        n = pending.message_count
        if len(messages) > n and messages[n].get("role") == "assistant":
            if pending.others and (d := answer_digest(messages[n])) != pending.answer and d in pending.others:
                return pending.next_state(state.session_id, "other_choice_continued")
            added, reason = messages[n + 1 :], "next_request"
        else:
            # History was rewritten or truncated: take what follows the last assistant message; with
            # none left (an agent compacted it into a summary), what follows the turn's own request
            # length, at least the last message.
            last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
            start = last + 1 if last is not None else min(n, len(messages) - 1)
            added, reason = messages[start:], "next_request_realigned"
        return pending.next_state(state.session_id, reason if added else "no_new_messages", added)

    def finish_turn(self, state: SessionState, turn_id: str, turn_index: int, messages: list[dict[str, Any]],
                    answer: dict[str, Any] | None = None, *, main: bool, done: bool,
                    others: list[dict[str, Any]] = ()) -> list[NextStateRecord]:
        """Record a turn appended to the log under ``turn_index``, the session's next index, which
        it takes only now (a turn that could not be recorded leaves it free), with the ``others``
        choices of its request under the indices after it; returns the records to write if this
        closes the session. A main turn becomes the pending one, and its ``answer`` (and the
        others') is remembered (bounded) so that a request continuing it finds its session."""
        state.next_index = turn_index + 1 + len(others)
        state.last_active = self.clock()
        text = _content(answer).strip() if answer else ""
        if main:  # found by a summariser call that quotes it (find)
            if len(text) >= QUOTE_MIN_CHARS:
                state.answers.append(text)
            if asked := _asked_words(messages):
                state.asked.append(asked)
        elif len(text) >= QUOTE_MIN_CHARS:  # a summary, say: found by the request after a compaction
            self._summaries.append((state.namespace, text, state.session_id))
        if main:
            digests = (answer_digest(answer) if answer else None, tuple(answer_digest(o) for o in others))
            state.pending = PendingTurn(turn_id, turn_index, len(messages), *(digests if others else (None, ())))
            exchanges = [e for a in ([answer] if answer else []) + list(others)
                         for e in _last_exchange([*messages, a]) + _long_answer([a])]
            for exchange in exchanges:
                key = (state.namespace, exchange)
                self._answers[key] = state.session_id
                self._answers.move_to_end(key)
            while len(self._answers) > 2 * self.max_sessions:
                self._answers.popitem(last=False)
        if done:
            return self._close(state, "session_done")
        return []

    def sweep(self) -> list[NextStateRecord]:
        """Close sessions idle longer than the timeout."""
        now = self.clock()
        out: list[NextStateRecord] = []
        for state in list(self._sessions.values()):
            if now - state.last_active >= self.idle_timeout_s and not state.lock.locked():
                out.extend(self._close(state, "idle_timeout"))
        return out

    def restore(self, namespace: str, session_id: str, next_index: int, pending: PendingTurn | None,
                age_s: float = 0.0) -> None:
        """Rebuild a session from storage after a restart: open again if a turn of it waits for its
        next state (idle for ``age_s``), else only remembered where it stopped counting turns."""
        if pending is None:
            self._remember_index((namespace, session_id), next_index)
            return
        self._sessions[(namespace, session_id)] = SessionState(namespace, session_id, next_index=next_index,
                                                               pending=pending, last_active=self.clock() - age_s)

    def _remember_index(self, key: tuple[str, str], next_index: int) -> None:
        self._closed_index[key] = next_index
        self._closed_index.move_to_end(key)
        while len(self._closed_index) > 10 * self.max_sessions:
            self._closed_index.popitem(last=False)

    def _close(self, state: SessionState, reason: str) -> list[NextStateRecord]:
        key = (state.namespace, state.session_id)
        self._sessions.pop(key, None)
        self._remember_index(key, state.next_index)
        pending, state.pending = state.pending, None
        return [] if pending is None else [pending.next_state(state.session_id, reason)]
