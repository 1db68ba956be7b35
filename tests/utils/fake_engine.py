"""A tiny deterministic stand-in for an Engine, for HTTP plumbing the real engine cannot be made to
do on demand (fail or stall in the middle of a stream). Token t+1 follows token t; every logprob is -1.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from clawrl.engine.types import BadRequestError, GenerateRequest, GenerateResult, UpdateResult


class FakeEngine:
    def __init__(self, vocab_size: int = 100, *, fail_stream_after: int | None = None, step_s: float = 0.0,
                 stall_after: int | None = None):
        self.vocab_size = vocab_size
        self.fail_stream_after = fail_stream_after
        self.stall_after = stall_after  # after this many tokens a request hangs, and health() says so, until cancelled
        self.stalled = False
        self.step_s = step_s
        self.weight_version = "0"
        self._resume = asyncio.Event()
        self._resume.set()
        self.running = 0
        self.tokens_out = 0  # every token any stream produced

    @property
    def stats(self) -> dict[str, Any]:
        return {"running": self.running, "queued": 0, "paused": not self._resume.is_set()}

    def _check(self, req: GenerateRequest) -> list[int]:
        ids = req.input_ids or [ord(c) % self.vocab_size for c in req.text or ""]
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise BadRequestError(f"token id outside [0, {self.vocab_size})")
        return ids

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]:
        ids = self._check(req)
        await self._resume.wait()
        n = req.sampling_params.max_new_tokens or 0
        out: list[int] = []
        self.running += 1
        try:
            for i in range(n):
                if self.fail_stream_after is not None and i == self.fail_stream_after:
                    raise BadRequestError("fake failure in the middle of the stream")
                if i == self.stall_after:
                    self.stalled = True
                    await asyncio.Event().wait()  # until the caller gives up (cancels)
                await asyncio.sleep(self.step_s)
                out.append(((out or ids)[-1] + 1) % self.vocab_size)
                self.tokens_out += 1
                done = i == n - 1
                yield GenerateResult(
                    rid=req.rid, text=" ".join(map(str, out)), output_ids=list(out), prompt_tokens=len(ids),
                    completion_tokens=len(out), finish_reason={"type": "length", "length": n} if done else None,
                    weight_version=self.weight_version, output_logprobs=[-1.0] * len(out),
                    weight_versions=[{"version": self.weight_version, "start": 0, "end": len(out)}] if done else [],
                )
        finally:
            self.running -= 1
            self.stalled = False

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        last = None
        async for last in self.generate_stream(req):
            pass
        return last

    async def model_info(self) -> dict[str, Any]:
        return {"model_path": "fake", "weight_version": self.weight_version}

    async def health(self) -> bool:
        return not self.stalled

    async def pause_generation(self, mode: str = "abort") -> None:
        self._resume.clear()

    async def continue_generation(self) -> None:
        self._resume.set()

    async def flush_cache(self) -> bool:
        return self.running == 0 or not self._resume.is_set()

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> UpdateResult:
        if not Path(model_path).is_dir():
            return UpdateResult(False, f"{model_path} is not a directory")
        self.weight_version = weight_version or self.weight_version
        return UpdateResult(True, "updated", self.weight_version)

    async def close(self) -> None:
        pass


class LoraFakeEngine(FakeEngine):
    """FakeEngine with SGLang's LoRA API: adapters loaded by name from a directory, a request naming one it
    does not hold refused with a 400 that names it (as SGLang does), and each output log-prob telling which
    adapter decoded it: -1 for the base, -(1 + N) for an adapter's version N."""

    def __init__(self, vocab_size: int = 100, **kw: Any):
        super().__init__(vocab_size, **kw)
        self.adapters: dict[str, str] = {}
        self.seen: list[str | None] = []  # lora_path of every request, in order
        self.loads: list[tuple[str, str]] = []

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]:
        self.seen.append(req.lora_path)
        if req.lora_path is not None and req.lora_path not in self.adapters:
            raise BadRequestError(f"LoRA adapter {req.lora_path!r} is not loaded; loaded: {sorted(self.adapters)}")
        lp = -1.0 - (0 if req.lora_path is None else int(req.lora_path.rpartition("@v")[2]))
        async for result in super().generate_stream(req):
            result.output_logprobs = [lp] * len(result.output_ids)
            yield result

    async def load_lora_adapter(self, name: str, path: str) -> UpdateResult:
        if name in self.adapters:
            return UpdateResult(False, f"adapter {name!r} is already loaded")
        if not Path(path).is_dir():
            return UpdateResult(False, f"{path} is not a directory")
        self.adapters[name] = path
        self.loads.append((name, path))
        return UpdateResult(True, f"loaded {name}")

    async def unload_lora_adapter(self, name: str) -> UpdateResult:
        if self.adapters.pop(name, None) is None:
            return UpdateResult(False, f"adapter {name!r} is not loaded")
        return UpdateResult(True, f"unloaded {name}")
