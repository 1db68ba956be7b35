"""EnginePool's rules, on in-process stand-in engines (tests/utils/fake_engine.py) that can be told to
fail the way a dead engine's connection does; tests/e2e/test_engine_pool.py runs the same rules with
two `clawrl engine` processes behind a real gateway."""

from __future__ import annotations

import asyncio

import pytest

from clawrl.engine.pool import EnginePool, version_rank
from clawrl.engine.types import EngineUnreachableError, GenerateRequest, SamplingParams
from tests.utils.fake_engine import FakeEngine


class Switchable(FakeEngine):
    """A fake engine that can be 'killed': every call then fails as a refused connection does.
    ``loads`` records each update (path, version, whether it was paused then)."""

    def __init__(self, name: str, **kw):
        super().__init__(**kw)
        self.name, self.dead, self.served = name, False, 0
        self.loads: list[tuple[str, str, bool]] = []

    def _alive(self) -> None:
        if self.dead:
            raise EngineUnreachableError(f"engine {self.name} unreachable: connection refused")

    async def generate_stream(self, req):
        self._alive()
        self.served += 1
        async for part in super().generate_stream(req):
            self._alive()
            yield part

    async def model_info(self):
        self._alive()
        return await super().model_info()

    async def update_weights_from_disk(self, model_path, weight_version=None):
        self._alive()
        self.loads.append((model_path, weight_version, not self._resume.is_set()))
        return await super().update_weights_from_disk(model_path, weight_version)


def _req(key: str | None, tokens: int = 3) -> GenerateRequest:
    return GenerateRequest(input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=tokens),
                           routing_key=key)


def _pool(*engines, **kw) -> EnginePool:
    kw.setdefault("down_retry_s", 0.2)
    return EnginePool([(e.name, e) for e in engines], **kw)


def test_version_rank_orders_numbers_and_ranks_labels_lowest():
    assert [version_rank(v) for v in ("0", "7", "12", "frozen", None)] == [0, 7, 12, -1, -1]


def test_a_session_stays_on_its_engine_and_new_sessions_go_to_the_less_loaded_one():
    a, b = Switchable("a", step_s=0.01), Switchable("b", step_s=0.01)

    async def run():
        pool = _pool(a, b)
        await pool.start()
        # two sessions at once: the second one finds the first engine busy and goes to the other
        await asyncio.gather(pool.generate(_req("s1")), pool.generate(_req("s2")))
        assert (a.served, b.served) == (1, 1)
        for _ in range(3):  # each session comes back to its engine, one request at a time
            await pool.generate(_req("s1"))
            await pool.generate(_req("s2"))
        assert (a.served, b.served) == (4, 4)
        pin = {k: m.url for k, (m, _) in pool._keys.items()}
        assert sorted(pin.values()) == ["a", "b"]
        return pool.engine_states()

    states = asyncio.run(run())
    assert [(s["url"], s["requests"], s["up"]) for s in states] == [("a", 4, True), ("b", 4, True)]


def test_a_dead_engine_is_taken_out_its_sessions_move_and_it_catches_up_when_back(tmp_path):
    a, b = Switchable("a"), Switchable("b")
    ckpt = tmp_path / "v1"
    ckpt.mkdir()

    async def run():
        pool = _pool(a, b, sync_waves=1)
        await pool.start()
        await asyncio.gather(pool.generate(_req("s1")), pool.generate(_req("s2")))
        on_a = next(k for k, (m, _) in pool._keys.items() if m.url == "a")
        a.dead = True
        res = await pool.generate(_req(on_a))  # refused by a: sent again to b, one answer
        assert res.weight_version == "0" and b.served == 2
        assert [s["up"] for s in pool.engine_states()] == [False, True]
        assert pool.engine_states()[0]["failures"] == 1 and "connection refused" in pool.engine_states()[0]["last_error"]
        # a sync while a is out reaches b; a loads it once it is back
        await pool.pause_generation("retract")
        upd = await pool.update_weights_from_disk(str(ckpt), "1")
        await pool.continue_generation()
        assert upd.success and "out (loads it when back): a" in upd.message
        assert b.loads == [(str(ckpt), "1", True)] and a.loads == []
        a.dead = False
        a.weight_version = "0"  # restarted with the initial weights
        await asyncio.sleep(0.25)
        await pool.generate(_req("new"))  # the pick notices a's time out is over and revives it
        for _ in range(50):
            if pool.engine_states()[0]["up"]:
                break
            await asyncio.sleep(0.02)
        assert a.loads == [(str(ckpt), "1", True)] and a.weight_version == "1"
        res = await pool.generate(_req("newer"))  # the least loaded again: both serve version 1
        return res, pool.engine_states()

    res, states = asyncio.run(run())
    assert res.weight_version == "1" and [s["weight_version"] for s in states] == ["1", "1"]
    assert all(s["up"] for s in states)


def test_waves_keep_one_engine_serving_and_a_session_never_goes_back_a_version(tmp_path):
    a, b = Switchable("a", step_s=0.005), Switchable("b", step_s=0.005)
    ckpt = tmp_path / "v1"
    ckpt.mkdir()
    seen: dict[str, list[str]] = {"s1": [], "s2": []}

    pool = _pool(a, b, sync_waves=2)

    async def traffic(stop: asyncio.Event):
        while not stop.is_set():
            for key in seen:
                seen[key].append((await pool.generate(_req(key))).weight_version)

    async def run():
        await pool.start()
        await asyncio.gather(pool.generate(_req("s1")), pool.generate(_req("s2")))
        stop = asyncio.Event()
        task = asyncio.create_task(traffic(stop))
        await asyncio.sleep(0.05)
        await pool.pause_generation("retract")  # waves: each wave pauses its own engines, nothing here
        assert a._resume.is_set() and b._resume.is_set()
        upd = await pool.update_weights_from_disk(str(ckpt), "1")
        await pool.continue_generation()
        await asyncio.sleep(0.05)
        stop.set()
        await task
        return upd

    upd = asyncio.run(run())
    assert upd.success and "2 waves" in upd.message
    # each engine loaded while paused by itself, one after the other
    assert a.loads == [(str(ckpt), "1", True)] and b.loads == [(str(ckpt), "1", True)]
    for key, versions in seen.items():
        ranks = [int(v) for v in versions]
        assert ranks == sorted(ranks) and ranks[-1] == 1, (key, versions)  # never back to 0 once 1 was seen
    assert pool.version == "1"


def test_a_refused_load_stops_the_waves_and_serving_stays_on_the_old_version(tmp_path):
    a, b = Switchable("a"), Switchable("b")

    async def run():
        pool = _pool(a, b, sync_waves=2)
        await pool.start()
        upd = await pool.update_weights_from_disk(str(tmp_path / "missing"), "1")
        res = await pool.generate(_req("s"))
        return pool, upd, res

    pool, upd, res = asyncio.run(run())
    assert not upd.success and "0 of 2 engines load version 1" in upd.message and "is not a directory" in upd.message
    assert len(a.loads) + len(b.loads) == 1  # the second wave never ran
    assert pool.version == "0" and res.weight_version == "0"


def test_a_stream_is_retried_before_its_first_token_and_fails_cleanly_after_it():
    a, b = Switchable("a"), Switchable("b")

    async def run():
        pool = _pool(a, b)
        await pool.start()
        a.dead = True  # refused at once: the stream goes to b
        parts = [p async for p in pool.generate_stream(_req("s", tokens=3))]
        assert parts[-1].finished and b.served == 1
        a.dead = False
        pool.members[0].down_until = 0.0
        pool._keys.clear()
        stream = pool.generate_stream(_req("t", tokens=5))
        first = await stream.__anext__()  # "t" goes to a (both idle: the first one)
        a.dead = True
        with pytest.raises(EngineUnreachableError):
            await stream.__anext__()
        return first

    first = asyncio.run(run())
    assert first.output_ids and not first.finished
    assert a.served == 1 and b.served == 1  # the broken stream was not sent again


def test_all_engines_dead_is_a_clear_unreachable_error():
    a, b = Switchable("a"), Switchable("b")

    async def run():
        pool = _pool(a, b)
        await pool.start()
        a.dead = b.dead = True
        with pytest.raises(EngineUnreachableError, match="no engine of the pool answers.*a: out.*b: out"):
            await pool.generate(_req("s"))

    asyncio.run(run())


def test_engines_at_capacity_pass_the_request_on_and_all_full_is_a_503_not_unreachable():
    from clawrl.engine.types import EngineOverloadedError

    class Full(Switchable):
        async def generate_stream(self, req):
            self.served += 1
            raise EngineOverloadedError(f"engine {self.name}: queue full")
            yield  # an async generator

    a, b = Full("a"), Switchable("b")

    async def run():
        pool = _pool(a, b)
        await pool.start()
        res = await pool.generate(_req(None))  # a is full: b answers, and a stays in rotation
        assert res.finished and (a.served, b.served) == (1, 1)
        assert [s["up"] for s in pool.engine_states()] == [True, True]
        pool.members[1].engine = Full("b2")
        with pytest.raises(EngineOverloadedError, match="queue full"):
            await pool.generate(_req(None))

    asyncio.run(run())
