"""The embedded engine worker's control calls (clawrl/engine/scheduler.py): pause, continue, flush, relabel,
weight swaps, and registering or unloading LoRA adapters. Each runs on the worker thread between two steps,
so no step sees half of one, and resolves the future ``done`` it is given.

A weight swap waits for the requests submitted before it (``barrier``) unless generation is paused; an
adapter's registration or unloading waits for nothing: other requests keep decoding, and a request already
holding an unloaded adapter finishes on it (names are never reused while in use).
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from clawrl.engine.lora import AdapterError, LoRAWeights
from clawrl.engine.types import LoRAUpdateResult, UpdateResult


@dataclass
class PendingUpdate:
    apply: Callable[[], None]
    version: str | None
    barrier: int  # requests with order <= barrier finish before the swap
    done: concurrent.futures.Future


class ControlCalls:
    """Mixed into :class:`~clawrl.engine.scheduler.Scheduler`, whose state the calls change."""

    def do_pause(self, mode: str, barrier: int, done: concurrent.futures.Future) -> None:
        self.paused, self.pause_mode = True, mode
        if mode == "abort":
            self._abort_where(lambda s: s.order <= barrier, "generation paused (abort mode)")
        elif mode == "retract":
            retracted = list(self.running)
            for s in reversed(retracted):
                self._release_row(s)
                s.cache_len, s.prefilling = 0, False
                if not s.prefilled_once:  # scored again from the start when prefilled again
                    s.input_logprobs = s.input_top = s.input_token_ids = None
            self.counters["retractions"] += len(retracted)
            with self.cv:  # back to the queue, in submission order, ahead of later arrivals
                self.waiting = deque(sorted([*retracted, *self.waiting], key=lambda s: s.order))
        if not self.running and not self._keep_cache:
            self.cache.reset()
        done.set_result(None)

    def do_continue(self, done: concurrent.futures.Future) -> None:
        self.paused, self.pause_mode = False, None
        done.set_result(None)

    def do_flush(self, done: concurrent.futures.Future) -> None:
        with self.cv:
            busy = bool(self.running) or (bool(self.waiting) and not self.paused)
        if not busy:
            if self.prefix is not None:
                self.prefix.clear()
            self.cache.reset(release=True)  # the prefix cache's memory goes back to the system too
        done.set_result(not busy)

    def do_relabel(self, version: str, done: concurrent.futures.Future) -> None:
        self.weight_version = version
        done.set_result(None)

    def do_update(self, apply: Callable[[], None], version: str | None, barrier: int, pause_mode: str | None,
                  done: concurrent.futures.Future) -> None:
        update = PendingUpdate(apply, version, barrier, done)
        if pause_mode is not None and not self.paused:  # pause, swap and continue in one call, not three
            self.do_pause(pause_mode, barrier, concurrent.futures.Future())
            self.paused, self.pause_mode = False, None  # before the result: no step runs until this returns
            self._apply_update(update)
        elif self.paused:
            self._apply_update(update)  # the pause already stopped the stepping: swap now
        else:
            self._updates.append(update)  # drain first (see _step)

    def _apply_update(self, update: PendingUpdate) -> None:
        try:
            update.apply()
        except Exception as e:  # copy failed part-way (e.g. dtype): report, keep the label
            update.done.set_result(UpdateResult(False, f"weights update failed: {type(e).__name__}: {e}",
                                                self.weight_version))
            return
        self.epoch += 1
        if self.prefix is not None:  # its K/V came from the old weights
            self.prefix.clear()
        if update.version is not None:
            self.weight_version = str(update.version)
        if not self.running and not self._keep_cache:  # in_place-paused requests keep their (stale) KV, as in SGLang
            self.cache.reset(release=self.prefix is not None)
        self.counters["weight_updates"] += 1
        update.done.set_result(UpdateResult(True, "Succeeded to update model weights.", self.weight_version))



    def do_add_adapter(self, name: str, path: str, weights: LoRAWeights, done: concurrent.futures.Future) -> None:
        try:
            self.adapters.store.add(name, path, weights)
        except AdapterError as e:
            done.set_result(LoRAUpdateResult(False, str(e), self.adapters.store.loaded()))
            return
        done.set_result(LoRAUpdateResult(True, "", self.adapters.store.loaded()))

    def do_remove_adapter(self, name: str, done: concurrent.futures.Future) -> None:
        try:
            adapter = self.adapters.store.remove(name)
        except AdapterError as e:
            done.set_result(LoRAUpdateResult(False, str(e), self.adapters.store.loaded()))
            return
        self.adapters.forget(adapter)
        if self.prefix is not None:
            self.prefix.drop(adapter.uid)
        done.set_result(LoRAUpdateResult(True, "", self.adapters.store.loaded()))
