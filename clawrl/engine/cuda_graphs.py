"""Decode steps on CUDA at fixed shapes, replayed from CUDA graphs.

A decode step of a 28-layer model is ~1,700 small kernels. Launched one by one from Python, the
GPU waits on the launches for most of the step; replaying a captured CUDA graph launches them all
at once. A graph replays fixed shapes and fixed addresses, so :class:`GraphedDecode`

* pads the batch to a bucket (1, 2, 4, 8, then multiples of 8 up to the engine's batch size): a
  padded row is a free cache row fed token 0 at position 0, which nothing reads before a prefill
  rewrites that row;
* rounds the attention span up to a power of two (at least 64) within the cache's capacity;
* captures :meth:`CausalLMRunner.decode_rows` once per (bucket, span) and replays it with this
  step's tokens and positions copied into the graph's input tensors;
* drops its graphs when the KV cache reallocates its buffers (``KVCache.generation``), which the
  graphs read by address; they are captured again on demand. The scheduler keeps the buffers
  while idle on this path, so that happens only while the batch or the context grows.

A step with LoRA adapters (clawrl/engine/lora_step.py) replays graphs of its own, captured with the
adapters' slot pools (fixed addresses: loading an adapter copies into a slot) and with each row's slot
mask as one more input tensor; a pool that grows (a larger rank) gets its graphs captured again.

Weight updates copy into the parameters' storage (``param.copy_``), which the graphs read in place,
so a replay after an update computes with the new weights. Sampling stays outside the graph.

A replayed step still costs its kernels one after another, so the step itself is first made of
fewer kernels: on CUDA, with ``fuse`` (the default), the runner decodes through the compiled, fused layer
halves of :mod:`clawrl.engine.fused_decode` (compiled on the first step, in the warm-up pass).

With ``capture=False`` the same padded shapes run eagerly: the same kernels on the same shapes, the
reference a graph's output is checked against token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from clawrl.engine.lora_step import DenseStep, RowAdapters
from clawrl.engine.modeling import CausalLMRunner, KVBudgetError, KVCache

MIN_SPAN = 64


def batch_buckets(max_batch_size: int) -> list[int]:
    """The padded batch sizes: 1, 2, 4, 8, then every multiple of 8, up to and including ``max_batch_size``."""
    sizes = [b for b in (1, 2, 4) if b < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    return sizes + [max_batch_size]


def span_bucket(span: int, capacity: int) -> int:
    """``span`` rounded up to a power of two, at least :data:`MIN_SPAN`, at most ``capacity``."""
    return min(capacity, max(MIN_SPAN, 1 << (span - 1).bit_length()))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    tokens: Tensor  # the graph's inputs (bucket,) on the device: each replay reads them
    positions: Tensor
    logits: Tensor  # its output (bucket, vocab), rewritten by each replay
    lora: DenseStep | None = None  # its adapters' inputs (mask, has), with adapters


class GraphedDecode:
    """:meth:`decode` has :meth:`CausalLMRunner.decode`'s contract (see the module docstring)."""

    def __init__(self, runner: CausalLMRunner, max_batch_size: int, *, capture: bool = True, fuse: bool = True):
        if capture and runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {runner.device}")
        self.runner, self.capture = runner, capture
        if fuse and runner.device.type == "cuda":  # fewer, fused kernels a step (clawrl.engine.fused_decode);
            runner.fuse_decode()  # runner.fused says whether it took; the CPU checks of the padding stay unfused
        self.buckets = batch_buckets(max_batch_size)
        # (bucket, span, adapters: None or (slot pool generation, slots computed))
        self.graphs: dict[tuple[int, int, tuple[int, int] | None], _Graph] = {}
        self.generation: int | None = None  # the cache buffers the graphs were captured on
        self.pool = None  # the graphs' memory pool: a new one with each cache generation (see decode)
        # one stream for warm-ups and captures: cuBLAS makes a workspace per stream on its first use there,
        # which must not happen inside a capture
        self.stream = torch.cuda.Stream(runner.device) if capture else None
        self.captures = 0

    def rows(self, n: int) -> int:
        """The cache rows a step of ``n`` sequences uses: ``n`` padded to its bucket."""
        return next(size for size in self.buckets if size >= n)

    @torch.inference_mode()
    def decode(self, tokens: Tensor, positions: Tensor, cache: KVCache, lora: RowAdapters | None = None) -> Tensor:
        b = tokens.shape[0]
        bucket = self.rows(b)
        span = int(positions.max()) + 1
        try:
            cache.ensure(bucket, span)
        except KVBudgetError:  # the budget holds these rows but not the padded ones: this step unpadded
            return self.runner.decode(tokens, positions, cache, lora)
        width = span_bucket(span, cache.capacity)
        padded_tokens = torch.zeros(bucket, dtype=torch.long)
        padded_positions = torch.zeros(bucket, dtype=torch.long)
        padded_tokens[:b], padded_positions[:b] = tokens, positions
        if not self.capture:
            device = self.runner.device
            return self.runner.decode_rows(padded_tokens.to(device), padded_positions.to(device), cache, width,
                                           None if lora is None else lora.step(bucket))[:b]
        if cache.generation != self.generation:  # new buffers: new graphs, in a new memory pool
            self.graphs.clear()
            self.pool, self.generation = torch.cuda.graph_pool_handle(), cache.generation
        key = (bucket, width, None if lora is None else (lora.pool.generation, lora.slots_used))
        graph = self.graphs.get(key)
        if graph is None:
            if lora is not None:  # graphs of an older pool read tensors that are gone
                self.graphs = {k: g for k, g in self.graphs.items() if k[2] is None or k[2][0] == key[2][0]}
            graph = self.graphs[key] = self._capture(padded_tokens, padded_positions, cache, width,
                                                     None if lora is None else lora.step(bucket, static=True))
        else:
            graph.tokens.copy_(padded_tokens)
            graph.positions.copy_(padded_positions)
            if lora is not None:
                mask, has = DenseStep.inputs(lora.pool, lora.row_slots, bucket, lora.slots_used)
                graph.lora.mask.copy_(mask)
                graph.lora.has.copy_(has)
        graph.graph.replay()
        return graph.logits[:b]

    def _capture(self, tokens: Tensor, positions: Tensor, cache: KVCache, width: int,
                 lora: DenseStep | None = None) -> _Graph:
        """Capture the step at these shapes. Capturing runs nothing, so a warm-up pass first runs it
        on the capture stream (lazy initialisations must not happen inside a capture): with this
        step's own inputs, so the K/V it writes is what the replay writes again. ``thread_local``:
        another engine's thread in this process may go on with its own work meanwhile."""
        device = self.runner.device
        tokens, positions = tokens.to(device), positions.to(device)
        with torch.cuda.device(device):
            self.stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self.stream):
                self.runner.decode_rows(tokens, positions, cache, width, lora)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                logits = self.runner.decode_rows(tokens, positions, cache, width, lora)
            torch.cuda.current_stream(device).wait_stream(self.stream)
        self.captures += 1
        return _Graph(graph, tokens, positions, logits, lora)
