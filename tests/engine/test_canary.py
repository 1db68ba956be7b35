"""CanaryRouter's rules on in-process stand-in engines (tests/utils/fake_engine.py, which can fail the way a
dead engine's connection does); tests/flows/test_canary_flow.py runs the canary with real tiny-model
engines behind the gateway and the train flow."""

from __future__ import annotations

import asyncio

import pytest

from clawrl.engine.canary import CanaryRouter, bucket
from clawrl.engine.types import EngineUnreachableError, GenerateRequest, SamplingParams
from tests.utils.fake_engine import FakeEngine

# routing keys are hex digits; the first 8 read as a fraction of 16**8 place the session
LOW, JUST_BELOW_HALF, HALF, HIGH = "00000000aa", "7fffffffaa", "80000000aa", "ffffffffaa"


class Versioned(FakeEngine):
    """A fake engine at a given weight version that can be 'killed' (every call then fails as a refused
    connection does); counts what it served."""

    def __init__(self, version: str, **kw):
        super().__init__(**kw)
        self.weight_version, self.dead, self.served = version, False, 0

    def _alive(self) -> None:
        if self.dead:
            raise EngineUnreachableError("connection refused")

    async def generate_stream(self, req):
        self._alive()
        self.served += 1
        async for part in super().generate_stream(req):
            yield part

    async def model_info(self):
        self._alive()
        return await super().model_info()


def _req(key: str | None, main_turn: bool = True) -> GenerateRequest:
    return GenerateRequest(input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=2), routing_key=key,
                           main_turn=main_turn)


def test_bucket_reads_the_key_as_a_fraction():
    assert bucket(LOW) == 0.0
    assert bucket(HALF) == 0.5
    assert bucket(JUST_BELOW_HALF) == pytest.approx(0.5 - 1 / 16 ** 8)
    assert bucket("40000000") == 0.25


def test_main_turns_of_canary_sessions_get_the_newer_version_and_everything_else_the_champion():
    main, canary = Versioned("3"), Versioned("5")
    router = CanaryRouter(main, canary, 0.5, refresh_s=0.0)

    async def run():
        got = {k: (await router.generate(_req(k))).weight_version for k in (LOW, JUST_BELOW_HALF, HALF, HIGH)}
        side = (await router.generate(_req(LOW, main_turn=False))).weight_version
        keyless = (await router.generate(_req(None))).weight_version
        streamed = [r.weight_version async for r in router.generate_stream(_req(LOW))]
        return got, side, keyless, streamed

    got, side, keyless, streamed = asyncio.run(run())
    assert got == {LOW: "5", JUST_BELOW_HALF: "5", HALF: "3", HIGH: "3"}
    assert side == "3" and keyless == "3"  # a side turn or a request without a session: the champion
    assert streamed == ["5", "5"]
    assert (canary.served, main.served) == (3, 4) and router.canary_requests == 3


def test_the_canary_serves_only_while_it_holds_a_newer_version():
    main, canary = Versioned("4"), Versioned("4")
    router = CanaryRouter(main, canary, 0.5, refresh_s=0.0)

    async def run():
        same = (await router.generate(_req(LOW))).weight_version
        canary.weight_version = "5"  # the train flow loaded a refused candidate
        newer = (await router.generate(_req(LOW))).weight_version
        main.weight_version = "6"  # a later candidate promoted while the canary still holds 5
        older = (await router.generate(_req(LOW))).weight_version
        canary.weight_version = "frozen"  # a label that is not a version ranks lowest
        label = (await router.generate(_req(LOW))).weight_version
        return same, newer, older, label

    assert asyncio.run(run()) == ("4", "5", "6", "6")
    assert canary.served == 1


def test_versions_are_asked_at_most_once_per_refresh_interval():
    main, canary = Versioned("1"), Versioned("2")
    router = CanaryRouter(main, canary, 0.5, refresh_s=3600.0)

    async def run():
        first = (await router.generate(_req(LOW))).weight_version
        canary.weight_version = "0"  # not seen until the interval passes
        return first, (await router.generate(_req(LOW))).weight_version

    assert asyncio.run(run()) == ("2", "0")  # the second request still went to the canary engine
    assert canary.served == 2


def test_an_unreachable_canary_sends_its_sessions_to_the_champion_without_an_error():
    main, canary = Versioned("1"), Versioned("2")
    router = CanaryRouter(main, canary, 0.5, refresh_s=0.0, down_retry_s=3600.0)

    async def run():
        before = (await router.generate(_req(LOW))).weight_version
        canary.dead = True  # killed after its version was read: the request itself fails over
        during = [(await router.generate(_req(LOW))).weight_version for _ in range(3)]
        streamed = [r.weight_version async for r in router.generate_stream(_req(LOW))]
        return before, during, streamed

    before, during, streamed = asyncio.run(run())
    assert before == "2" and during == ["1", "1", "1"] and streamed == ["1", "1"]
    assert canary.served == 1  # one attempt, then left alone for down_retry_s
    assert main.served == 4


def test_an_unreachable_canary_at_start_is_never_tried():
    main, canary = Versioned("1"), Versioned("2")
    canary.dead = True
    router = CanaryRouter(main, canary, 0.9, refresh_s=0.0)
    assert asyncio.run(router.generate(_req(LOW))).weight_version == "1"
    assert canary.served == 0


def test_control_calls_and_limits_are_the_main_engines(tmp_path):
    main, canary = Versioned("1"), Versioned("2")
    main.max_context_len = 777
    router = CanaryRouter(main, canary, 0.25)

    async def run():
        assert (await router.update_weights_from_disk(str(tmp_path), "7")).success
        return (await router.model_info())["weight_version"]

    assert asyncio.run(run()) == "7" and main.weight_version == "7" and canary.weight_version == "2"
    assert router.max_context_len == 777


def test_a_share_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match=r"canary share must be in \[0, 1\), got 1"):
        CanaryRouter(Versioned("1"), Versioned("2"), 1.0)
