"""Steady request traffic on background threads while a test swaps weights under it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import httpx


@contextlib.contextmanager
def steady_traffic(send: Callable[[httpx.Client], httpx.Response], *, threads: int = 1,
                   key: Callable[[httpx.Response], object] = lambda r: r.status_code
                   ) -> Iterator[tuple[list, list]]:
    """``threads`` clients each calling ``send`` one request after another until the block ends.
    Yields ``(served, failures)``: ``key(response)`` of each 200, and the status of every other
    answer or the repr of a transport error (which also stops that client)."""
    served: list = []
    failures: list = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=300) as c:  # a slow answer on a busy machine is not a failure here
            while not stop.is_set():
                try:
                    r = send(c)
                except httpx.HTTPError as e:
                    failures.append(repr(e))
                    return
                (served.append(key(r)) if r.status_code == 200 else failures.append(r.status_code))

    workers = [threading.Thread(target=client, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    try:
        yield served, failures
    finally:
        stop.set()
        for w in workers:
            w.join(30)


def side_chat(base_url: str) -> Callable[[httpx.Client], httpx.Response]:
    """A side-turn chat completion against the gateway at ``base_url`` (an OpenAI ``/v1`` base)."""
    return lambda c: c.post(base_url + "/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "turn_type": "side"})


def generate(base_url: str, input_ids: list[int]) -> Callable[[httpx.Client], httpx.Response]:
    """A 4-token ``/generate`` of ``input_ids`` against the engine at ``base_url``."""
    return lambda c: c.post(base_url + "/generate", json={"input_ids": input_ids,
                                                          "sampling_params": {"max_new_tokens": 4}})


def WEIGHT_VERSION(r: httpx.Response) -> str | None:  # noqa: N802 - used as a key function's name
    return r.headers.get("x-weight-version")


def canary_sessions(share: float, n: int = 40) -> tuple[list[str], list[str]]:
    """Session ids ``user-<i>`` of the open namespace whose routing key falls below ``share`` (a canary's
    sessions: clawrl.engine.canary) and the others."""
    import hashlib

    from clawrl.engine.canary import bucket

    ids = [f"user-{i}" for i in range(n)]
    key = lambda sid: hashlib.blake2b(f"open:{sid}".encode(), digest_size=8).hexdigest()  # noqa: E731
    return [i for i in ids if bucket(key(i)) < share], [i for i in ids if bucket(key(i)) >= share]
