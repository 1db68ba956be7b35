"""Adding the LoRA deltas inside a forward: one adapter over a whole prefill, or each row its own in a decode step.

The runner computes every projection as before (the base matmul shared by all rows) and hands its
output here: :meth:`add` returns it with each row's delta ``x·Aᵀ·B'ᵀ`` added (B' carries the scale,
clawrl/engine/lora.py). A row without an adapter gets nothing added - its output is the base
matmul's, bit for bit - and a step whose rows have no adapter never comes here.

* :class:`OneAdapter` - a prefill batch or a chunk of one prompt, all of one adapter: two small matmuls
  on the adapter's own tensors per projection.
* A decode step (or a prefill batch) mixes adapters. Their tensors are copied into :class:`LoRASlots`, a pool of
  ``max_loras_per_batch`` slots per projection at fixed addresses (a copy into a slot is what a cold
  adapter costs a step; on CUDA the captured graphs read the pool in place). Two ways to add the
  deltas, the faster one per device (measured, docs/benchmarks.md):

  - :class:`GroupedStep` (CPU): the rows gathered by slot into ``(n, m, in)`` (n adapters in the
    step, m the most rows any of them has), two batched matmuls against the n slots, the result
    added back into the adapter rows. Every adapter's weights are read once and each row is
    multiplied by its own adapter only.
  - :class:`DenseStep` (CUDA): one matmul of every row against the first n slots' A (n: the step's
    adapters rounded up to a power of two, so few graphs serve every step), a mask keeping each row's
    own slot (``mask`` also zeroes rows without an adapter), one matmul against their B, and ``where``
    keeping the base output on rows without one. Static shapes and device inputs only, so a CUDA
    graph captures it; the extra multiply-adds are cheap where the GPU waits on memory.

The pool's rank is the largest rank of the adapters copied in so far (a smaller adapter's unused
rank is zeros): a larger one makes a new pool (``generation`` tells the CUDA graphs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from clawrl.engine.lora import LORA_TARGETS, LoRAWeights

# Rows a CPU matmul's kernels take at a time: MKL's sgemm computes a row of a partial block of 4 (M = 1..3, or the tail
# of 5..11 rows) with other kernels, which round differently (up to ~1e-6), and a batched matmul of m < 4 rows likewise
# (torch 2.13, MKL 2024.2, 1 to 8 threads). A step padded to a multiple of it gives each row the same bits whatever its
# batch mates (clawrl/engine/modeling.py).
GEMM_ROW_BLOCK = 4


def add_dense(x: Tensor, y: Tensor, a: Tensor, b: Tensor, mask: Tensor, has: Tensor | None) -> Tensor:
    """``y + ((x·Aᵀ) ⊙ mask)·Bᵀ`` where ``has``, ``y`` itself elsewhere. A (S·R, in) and B (out, S·R): every
    slot stacked; mask (..., S·R) keeps each row's own slot. Plain tensor ops: the compiled decode uses it too."""
    out = y + F.linear(F.linear(x, a) * mask, b)
    return out if has is None else torch.where(has, out, y)


@dataclass
class OneAdapter:
    """Every row of the forward uses ``weights``."""

    weights: LoRAWeights

    def add(self, layer: int, target: str, x: Tensor, y: Tensor) -> Tensor:
        a = self.weights.a.get((layer, target))
        return y if a is None else y + F.linear(F.linear(x, a), self.weights.b[layer, target])


class LoRASlots:
    """``slots`` adapters' tensors at fixed addresses, for the decode step (module docstring). ``dense``:
    the :class:`DenseStep` layout, A (S·R, in) and B (out, S·R) per projection; else :class:`GroupedStep`'s,
    A (S, in, R) and B (S, R, out). Owned by the engine's worker thread."""

    def __init__(self, shapes: dict[str, tuple[int, int]], num_layers: int, slots: int, dtype: torch.dtype,
                 device: torch.device | str, *, dense: bool):
        self.shapes, self.num_layers, self.slots = shapes, num_layers, slots
        self.dtype, self.device, self.dense = dtype, device, dense
        self.rank = 0
        self.a: dict[tuple[int, str], Tensor] = {}
        self.b: dict[tuple[int, str], Tensor] = {}
        self.owner: list[int | None] = [None] * slots  # the adapter uid each slot holds
        self.generation = 0  # new pool tensors: graphs captured on the old ones are stale
        self.copies = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))

    def assign(self, adapters: list) -> list[int]:
        """Slots 0..n-1 for the n distinct ``adapters`` (:class:`~clawrl.engine.lora.Adapter` s, in memory):
        one already in one of them stays, the others are copied in (from a higher slot or their weights)."""
        n = len(adapters)
        if n > self.slots:
            raise ValueError(f"{n} adapters in one step, but {self.slots} slots (max_loras_per_batch)")
        self._fit(max(a.weights.rank for a in adapters))
        needed = {a.uid for a in adapters}
        placed: dict[int, int] = {}
        for i in range(n):
            if self.owner[i] in needed and self.owner[i] not in placed:
                placed[self.owner[i]] = i
        taken = set(placed.values())
        free = iter(i for i in range(n) if i not in taken)
        for a in adapters:
            if a.uid in placed:
                continue
            slot = next(free)
            src = self.owner.index(a.uid) if a.uid in self.owner else None
            self._copy_slot(src, slot) if src is not None else self._copy_in(a.weights, slot)
            self.owner[slot], placed[a.uid] = a.uid, slot
        return [placed[a.uid] for a in adapters]

    def _fit(self, rank: int) -> None:
        """Pool tensors of at least ``rank`` (the slots' contents carried over)."""
        if rank <= self.rank:
            return
        old_a, old_b, old_rank = self.a, self.b, self.rank
        self.a, self.b, self.rank = {}, {}, rank
        s = self.slots
        for layer in range(self.num_layers):
            for target in LORA_TARGETS:
                out, inp = self.shapes[target]
                k = (layer, target)
                if self.dense:
                    a, b = self._zeros(s, rank, inp), self._zeros(out, s, rank)
                    if old_rank:
                        a[:, :old_rank] = old_a[k].view(s, old_rank, inp)
                        b[:, :, :old_rank] = old_b[k].view(out, s, old_rank)
                    self.a[k], self.b[k] = a.view(s * rank, inp), b.view(out, s * rank)
                else:
                    self.a[k], self.b[k] = self._zeros(s, inp, rank), self._zeros(s, rank, out)
                    if old_rank:
                        self.a[k][:, :, :old_rank] = old_a[k]
                        self.b[k][:, :old_rank] = old_b[k]
        self.generation += 1

    def _zeros(self, *shape: int) -> Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _views(self, k: tuple[int, str]) -> tuple[Tensor, Tensor]:
        """Slot-major views (S, in, R) and (S, R, out) of one projection's pool, in either layout."""
        if not self.dense:
            return self.a[k], self.b[k]
        out, inp = self.shapes[k[1]]
        return self.a[k].view(self.slots, self.rank, inp).transpose(1, 2), \
            self.b[k].view(out, self.slots, self.rank).permute(1, 2, 0)

    @torch.inference_mode()
    def _copy_in(self, weights: LoRAWeights, slot: int) -> None:
        r = weights.rank
        for k in self.a:
            a, b = self._views(k)
            a[slot].zero_()
            b[slot].zero_()
            if k in weights.a:
                a[slot, :, :r] = weights.a[k].t()
                b[slot, :r] = weights.b[k].t()
        self.copies += 1

    @torch.inference_mode()
    def _copy_slot(self, src: int, dst: int) -> None:
        for k in self.a:
            a, b = self._views(k)
            a[dst] = a[src]
            b[dst] = b[src]
        self.copies += 1


class GroupedStep:
    """A decode step's deltas by batched matmuls over the rows grouped by slot (module docstring).
    ``row_slots[b]``: row b's slot, or None (no adapter: nothing is added to it). ``block``: each group padded
    to a multiple of it (:data:`GEMM_ROW_BLOCK`: a row's delta is then the same whatever the other groups' size)."""

    def __init__(self, pool: LoRASlots, row_slots: list[int | None], targets: frozenset[str], block: int = 1):
        self.pool, self.targets = pool, targets
        device = pool.device
        used = sorted({s for s in row_slots if s is not None})
        self.n = len(used)  # slots 0..n-1 (LoRASlots.assign)
        members = [[b for b, s in enumerate(row_slots) if s == slot] for slot in range(self.n)]
        most = max(len(rows) for rows in members)
        self.m = most + -most % block
        # rows gathered slot by slot, each group padded to m with its first row (its result is never read)
        gather = [rows[i] if i < len(rows) else rows[0] for rows in members for i in range(self.m)]
        where = {b: slot * self.m + i for slot, rows in enumerate(members) for i, b in enumerate(rows)}
        adapter_rows = sorted(where)
        self.gather = torch.tensor(gather, dtype=torch.long, device=device)
        self.pick = torch.tensor([where[b] for b in adapter_rows], dtype=torch.long, device=device)
        self.rows = None if len(adapter_rows) == len(row_slots) else \
            torch.tensor(adapter_rows, dtype=torch.long, device=device)
        self._x: Tensor | None = None  # the last input gathered (q, k and v share theirs)
        self._xg: Tensor | None = None

    def add(self, layer: int, target: str, x: Tensor, y: Tensor) -> Tensor:
        if target not in self.targets:
            return y
        a, b = self.pool._views((layer, target))
        if x is not self._x:
            self._x, self._xg = x, x.reshape(-1, x.shape[-1]).index_select(0, self.gather).view(self.n, self.m, -1)
        delta = torch.bmm(torch.bmm(self._xg, a[:self.n]), b[:self.n]).view(self.n * self.m, -1)
        delta = delta.index_select(0, self.pick)
        flat = y.view(-1, y.shape[-1])
        if self.rows is None:
            flat += delta
        else:
            flat.index_add_(0, self.rows, delta)
        return y


class DenseStep:
    """A decode step's deltas through :func:`add_dense` over all slots (module docstring). ``mask``
    (rows, 1, S·R) and ``has`` (rows, 1, 1) are device tensors (a captured graph's inputs); ``has`` None:
    every row has an adapter."""

    def __init__(self, pool: LoRASlots, mask: Tensor, has: Tensor | None, targets: frozenset[str]):
        self.pool, self.mask, self.has, self.targets = pool, mask, has, targets
        self.width = mask.shape[-1]  # n slots x the pool's rank

    def weights(self, layer: int, target: str) -> tuple[Tensor, Tensor]:
        """A (n·R, in) and B (out, n·R) of the step's first n slots: views at fixed addresses."""
        return self.pool.a[layer, target][:self.width], self.pool.b[layer, target][:, :self.width]

    @staticmethod
    def inputs(pool: LoRASlots, row_slots: list[int | None], rows: int, n: int) -> tuple[Tensor, Tensor]:
        """(mask, has) on the host for ``rows`` rows (padded rows: no adapter) over the first ``n`` slots."""
        mask = torch.zeros(rows, 1, n * pool.rank, dtype=pool.dtype)
        has = torch.zeros(rows, 1, 1, dtype=torch.bool)
        for b, slot in enumerate(row_slots):
            if slot is not None:
                mask[b, 0, slot * pool.rank:(slot + 1) * pool.rank] = 1
                has[b] = True
        return mask, has

    def add(self, layer: int, target: str, x: Tensor, y: Tensor) -> Tensor:
        if target not in self.targets:
            return y
        return add_dense(x, y, *self.weights(layer, target), self.mask, self.has)  # x, y: (rows, 1, features)


@dataclass
class RowAdapters:
    """A decode step's adapters before padding: ``row_slots[b]`` is row b's slot in ``pool`` (None: no adapter);
    ``targets``: the projections any of them adapts. The decoder makes its step of it (:meth:`step`)."""

    pool: LoRASlots
    row_slots: list[int | None]
    targets: frozenset[str]

    @property
    def slots_used(self) -> int:
        """The slots a :class:`DenseStep` computes: the step's adapters (slots 0..n-1) up to a power of two."""
        n = 1 + max(s for s in self.row_slots if s is not None)
        return min(self.pool.slots, 1 << (n - 1).bit_length())

    def step(self, rows: int | None = None, *, static: bool = False, width: int = 1,
             block: int = 1) -> GroupedStep | DenseStep:
        """The step over ``rows`` rows (the padded batch; default: these rows), in the pool's layout; ``width``
        positions a row (a prefill's padded length). ``static``: a :class:`DenseStep` over every target whose
        ``has`` is a tensor even when every row has an adapter (what a CUDA graph captures: the next replay's
        rows may not). ``block``: a :class:`GroupedStep`'s groups padded to a multiple of it (the CPU's
        batch-invariant decode: :data:`GEMM_ROW_BLOCK`)."""
        row_slots = self.row_slots + [None] * ((rows or len(self.row_slots)) - len(self.row_slots))
        if not self.pool.dense:  # its rows: each position of each row
            return GroupedStep(self.pool, [s for s in row_slots for _ in range(width)], self.targets, block)
        mask, has = DenseStep.inputs(self.pool, row_slots, len(row_slots), self.slots_used)
        every = not static and all(s is not None for s in row_slots)
        return DenseStep(self.pool, mask.to(self.pool.device), None if every else has.to(self.pool.device),
                         frozenset(LORA_TARGETS) if static else self.targets)


class StepAdapters:
    """The scheduler's side of LoRA (clawrl/engine/scheduler.py): a waiting request starts once its adapter
    is in memory, and holds it there until it ends; a decode step runs the rows of at most ``slots.slots``
    distinct adapters, the least recently run first, and the rows of the others ride along unsampled, so every
    adapter runs within ``ceil(adapters / slots)`` steps."""

    def __init__(self, store, slots: LoRASlots):
        self.store, self.slots = store, slots
        self.last_run: dict[int, int] = {}  # adapter uid -> the decode step it last ran in
        self.steps = self.deferred_rows = 0

    def admit(self, seq) -> bool | None:
        """True: ``seq`` may start (its adapter, if any, is in memory and now held for it); False: its
        adapter is being read; None: memory is full of adapters in use (raises AdapterError when a read failed)."""
        if seq.adapter is None:
            return True
        ready = self.store.ready(seq.adapter)
        if ready:
            self.store.pin(seq.adapter)
            seq.pinned = True
        return ready

    def release(self, seq) -> None:
        if seq.pinned:
            self.store.unpin(seq.adapter)
            seq.pinned = False

    def plan(self, adapters: list) -> tuple[RowAdapters | None, list[bool]]:
        """For a decode step whose row b has adapter ``adapters[b]`` (None: none, or not decoding): the rows'
        slots, and which rows wait for a later step."""
        distinct = list({a.uid: a for a in adapters if a is not None}.values())
        if not distinct:
            return None, [False] * len(adapters)
        self.steps += 1
        if len(distinct) > self.slots.slots:
            distinct.sort(key=lambda a: self.last_run.get(a.uid, -1))  # stable: then by row order
            distinct = distinct[:self.slots.slots]
        present = {a.uid for a in adapters if a is not None}
        self.last_run = {uid: step for uid, step in self.last_run.items() if uid in present}
        self.last_run.update((a.uid, self.steps) for a in distinct)
        chosen = {a.uid for a in distinct}
        deferred = [a is not None and a.uid not in chosen for a in adapters]
        self.deferred_rows += sum(deferred)
        return self.rows([a if a is not None and a.uid in chosen else None for a in adapters]), deferred

    def rows(self, adapters: list) -> RowAdapters:
        """Slots for the (at most ``slots.slots``) distinct ``adapters`` of a forward's rows (None: no adapter)."""
        distinct = list({a.uid: a for a in adapters if a is not None}.values())
        slot_of = dict(zip((a.uid for a in distinct), self.slots.assign(distinct)))
        return RowAdapters(self.slots, [None if a is None else slot_of[a.uid] for a in adapters],
                           frozenset().union(*(a.weights.targets for a in distinct)))

    def forget(self, adapter) -> None:
        """``adapter`` was unloaded: its slot may be reused at once."""
        self.slots.owner = [None if uid == adapter.uid else uid for uid in self.slots.owner]

    def stats(self) -> dict[str, int]:
        return {**self.store.memory(), "adapter_slots": self.slots.slots, "adapter_slot_bytes": self.slots.nbytes,
                "adapter_slot_copies": self.slots.copies, "adapter_deferred_rows": self.deferred_rows}
