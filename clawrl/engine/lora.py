"""LoRA adapters in the embedded engine: PEFT directories read into tensors, the named adapters a
server has registered, and which of them are held in memory.

An adapter is a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``, what
``PeftModel.save_pretrained`` writes and SGLang and vLLM load) over some of the seven projections
of every decoder layer. Its delta on a projection's output is ``x·Aᵀ·Bᵀ·scale`` with ``scale =
lora_alpha / r`` (``lora_alpha / √r`` under ``use_rslora``); :func:`read_adapter` folds the scale
into B once, so serving adds ``x·Aᵀ·B'ᵀ``.

:class:`AdapterStore` keeps SGLang's registry semantics: ``/load_lora_adapter`` registers a name
for a path (a name is taken until it is unloaded, so a request never sees its adapter change
mid-answer), a request names the adapter it wants, and an unknown name is refused. At most
``max_loaded`` adapters are held in memory: the least recently used one that no running request
uses goes first, and is read from its path again when a request names it next. Reading runs on a
thread of its own, never on the engine's worker, so a cold adapter's first request waits for its
file while every other request keeps decoding; the worker moves what was read to the device (so
every device allocation and free of an adapter happens on the worker's CUDA stream). The store is
the worker thread's (its admission step calls :meth:`AdapterStore.ready`); only
:meth:`AdapterStore.lookup` and :meth:`AdapterStore.loaded` are called from elsewhere.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from clawrl.engine.types import BadRequestError

# The projections an adapter may target: every linear layer of a Llama/Qwen3 decoder layer.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(BadRequestError):
    """An adapter that cannot be registered or served: unknown name, unreadable or mismatched files."""


def projection_shapes(hf_model) -> dict[str, tuple[int, int]]:
    """(out, in) of each LoRA target projection of ``hf_model``'s decoder layers (all layers alike)."""
    layer = hf_model.model.layers[0]
    return {t: tuple(getattr(layer.self_attn if t in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp,
                             t).weight.shape) for t in LORA_TARGETS}


@dataclass(eq=False)
class LoRAWeights:
    """One adapter's tensors: per (layer, target) A (r, in) and scale·B (out, r), all views of one buffer
    ``flat`` (``layout``: layer, target, "A" or "B", offset, shape of each), so checking, scaling, casting or
    moving the adapter is one operation whatever its number of tensors."""

    rank: int
    flat: Tensor
    layout: tuple[tuple[int, str, str, int, tuple[int, int]], ...]
    a: dict[tuple[int, str], Tensor] = field(init=False)
    b: dict[tuple[int, str], Tensor] = field(init=False)

    def __post_init__(self) -> None:
        self.a, self.b = {}, {}
        for layer, target, half, offset, (rows, cols) in self.layout:
            view = self.flat[offset:offset + rows * cols].view(rows, cols)
            (self.a if half == "A" else self.b)[layer, target] = view

    @property
    def targets(self) -> frozenset[str]:
        return frozenset(t for _, t in self.a)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def to(self, device: torch.device | str) -> LoRAWeights:
        """On ``device``: itself when already there (no copy and no new views, which cost the worker ~1 ms for
        smollm2's 420 tensors), else a copy."""
        flat = self.flat.to(device)
        return self if flat is self.flat else LoRAWeights(self.rank, flat, self.layout)


def _adapter_config(d: Path) -> tuple[float, float]:
    """(r, scale) from ``d/adapter_config.json``, refusing the PEFT features serving does not apply."""
    try:
        cfg = json.loads((d / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"cannot read {d / ADAPTER_CONFIG}: {e}") from None
    if not isinstance(cfg, dict) or str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{d / ADAPTER_CONFIG}: peft_type {cfg.get('peft_type')!r} is not LORA")
    unsupported = {"use_dora": False, "bias": "none", "rank_pattern": {}, "alpha_pattern": {}, "fan_in_fan_out": False,
                   "modules_to_save": None, "layer_replication": None, "lora_bias": False}
    for key, neutral in unsupported.items():
        if (cfg.get(key) or neutral) != neutral:
            raise AdapterError(f"{d / ADAPTER_CONFIG}: {key} = {cfg[key]!r} is not supported (only {neutral!r})")
    targets = cfg.get("target_modules")
    if isinstance(targets, list) and (other := sorted(set(targets) - set(LORA_TARGETS))):
        raise AdapterError(f"{d / ADAPTER_CONFIG}: target_modules {other} are not among {', '.join(LORA_TARGETS)}")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise AdapterError(f"{d / ADAPTER_CONFIG}: r must be a positive integer and lora_alpha a number")
    return r, alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)


def read_adapter(path: str | Path, shapes: dict[str, tuple[int, int]], num_layers: int, dtype: torch.dtype,
                 device: torch.device | str, buffers: SpareBuffers | None = None) -> LoRAWeights:
    """Read and check a PEFT LoRA directory against the served model's ``shapes`` (:func:`projection_shapes`)
    and ``num_layers``: every tensor a lora_A/lora_B pair of a known target of an existing layer, of rank r,
    finite. Raises :class:`AdapterError` naming the file and the key. ``buffers``: host memory to read into."""
    d = Path(path)
    if not d.is_dir():
        raise AdapterError(f"lora_path {str(d)!r} is not a directory")
    r, scale = _adapter_config(d)
    buffers = buffers or SpareBuffers(0)
    raw, header = _read_safetensors(d / ADAPTER_WEIGHTS, buffers)
    layout = []
    for key, (shape, offset) in header.items():
        m = _KEY.search(key)
        if m is None or m[2] not in shapes or int(m[1]) >= num_layers:
            raise AdapterError(f"{d / ADAPTER_WEIGHTS}: {key} is not a lora_A/lora_B weight of "
                               f"{', '.join(LORA_TARGETS)} in layers 0..{num_layers - 1}")
        layer, target, half = int(m[1]), m[2], m[3]
        out, inp = shapes[target]
        want = (r, inp) if half == "A" else (out, r)
        if shape != want:
            raise AdapterError(f"{d / ADAPTER_WEIGHTS}: {key} has shape {shape}, expected {want} (r = {r})")
        layout.append((layer, target, half, offset, shape))
    halves = {half: {(layer, target) for layer, target, h, *_ in layout if h == half} for half in "AB"}
    if not layout or halves["A"] != halves["B"]:
        unpaired = sorted(halves["A"] ^ halves["B"])
        raise AdapterError(f"{d / ADAPTER_WEIGHTS}: " + (f"lora_A/lora_B unpaired at {unpaired[:3]}" if unpaired
                                                           else "holds no LoRA weights"))
    flat = raw.float()  # the checks and the scale in float32 (a copy only when the file is not)
    _check_finite(flat, header, d / ADAPTER_WEIGHTS)
    weights = LoRAWeights(r, flat, tuple(layout))
    # B's tensors one by one, through the views the adapter serves from: each below torch's grain for splitting
    # an op over its threads (all of smollm2's at rank 16) is scaled on the calling thread
    torch._foreach_mul_(list(weights.b.values()), scale)
    out = weights.to(device) if dtype == flat.dtype else LoRAWeights(r, flat.to(device, dtype), weights.layout)
    for spent in {id(t): t for t in (raw, flat) if t is not out.flat}.values():
        buffers.give(spent)
    return out


def _check_finite(flat: Tensor, header: dict[str, tuple[tuple[int, ...], int]], f: Path) -> None:
    """AdapterError naming the first tensor of ``flat`` (float32, on the host) holding NaN or inf. The sum is
    numpy's, on the calling thread: torch splits a sum this large over its intra-op threads, and on a busy
    2-core machine (load 8) waiting for them took 11-16 ms of an adapter's ~20 ms load (smollm2, rank 16: 4.9M
    values); numpy's takes 0.9 ms, torch's on one thread 0.3 ms."""
    with np.errstate(all="ignore"):
        total = np.add.reduce(flat.numpy())
    if math.isfinite(total):  # NaN or inf anywhere makes the sum so
        return
    bad = next((k for k, (shape, o) in header.items() if not torch.isfinite(flat[o:o + math.prod(shape)]).all()),
               None)
    if bad is None:  # every value finite, but so large that their sum is not: they would overflow when served
        raise AdapterError(f"{f}: values too large to serve (their sum overflows float32)")
    raise AdapterError(f"{f}: {bad} holds NaN or infinite values")


# Host buffers of dropped adapters kept for the next read: a new buffer costs a page fault every 4 KiB on its
# first touch, which was half of reading an adapter from the page cache (smollm2, rank 16: 17 ms, 9 of them faults).
SPARE_BUFFERS = 4


class SpareBuffers:
    """Host buffers to read adapters into, handed back when an adapter leaves memory (any thread)."""

    def __init__(self, keep: int = SPARE_BUFFERS):
        self.keep, self._free, self._lock = keep, [], threading.Lock()

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        with self._lock:
            for i, t in enumerate(self._free):
                if t.numel() == numel and t.dtype == dtype:
                    return self._free.pop(i)
        return torch.empty(numel, dtype=dtype)

    def give(self, t: Tensor) -> None:
        if t.device.type == "cpu" and t.is_contiguous() and t.storage_offset() == 0:
            with self._lock:
                if len(self._free) < self.keep:
                    self._free.append(t)


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _read_safetensors(f: Path, buffers: SpareBuffers) -> tuple[Tensor, dict[str, tuple[tuple[int, ...], int]]]:
    """A safetensors file (an 8-byte header length, a JSON header, then the tensors back to back) read whole
    into one buffer: the buffer, and each tensor's shape and element offset in it. One read instead of a tensor
    object per key, which is what an adapter's hundreds of small tensors cost most in (safetensors' loader
    makes each its own)."""
    try:
        with f.open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
            header.pop("__metadata__", None)
            dtypes = {v["dtype"] for v in header.values()}
            if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES:
                raise ValueError(f"tensors of dtype {sorted(dtypes)}: expected one of {', '.join(_DTYPES)}")
            dtype = _DTYPES[dtypes.pop()]
            nbytes = max((v["data_offsets"][1] for v in header.values()), default=0)
            if f.stat().st_size - 8 - size < nbytes:
                raise ValueError("the file ends before its data")
            flat = buffers.take(nbytes // dtype.itemsize, dtype)  # read straight into it: no zero-fill
            fh.readinto(memoryview(flat.view(torch.uint8).numpy()))
        for k, v in header.items():
            begin, end = v["data_offsets"]
            if end - begin != math.prod(v["shape"]) * dtype.itemsize or len(v["shape"]) != 2:
                raise ValueError(f"{k}: data_offsets {v['data_offsets']} do not hold a matrix of shape {v['shape']}")
        return flat, {k: (tuple(v["shape"]), v["data_offsets"][0] // dtype.itemsize) for k, v in header.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # missing, truncated, not safetensors
        raise AdapterError(f"cannot read {f}: {e}") from None


def write_random_adapters(model, dirs: Iterable[str | Path], *, rank: int = 16, alpha: float = 32.0,
                          targets: Iterable[str] = LORA_TARGETS, seed: int = 0, std: float = 0.02) -> list[Path]:
    """PEFT LoRA adapters over the HF ``model`` with seeded Gaussian A and B (std ``std``), one per directory
    of ``dirs`` (seeds ``seed``, ``seed + 1``, ...), written by PEFT's own ``save_pretrained`` into a temp
    directory renamed into place. For tests and benchmarks: the model itself is left as it was."""
    import copy

    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                                                 target_modules=list(targets), bias="none"))
    lora = [(name, p) for name, p in peft_model.named_parameters() if ".lora_" in name]
    written = []
    for i, d in enumerate(map(Path, dirs)):
        g = torch.Generator().manual_seed(seed + i)
        with torch.no_grad():
            for _, p in lora:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.", dir=d.parent))
        try:
            peft_model.save_pretrained(str(tmp))
            os.replace(tmp, d)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        written.append(d)
    return written


@dataclass(eq=False)
class Adapter:
    """A registered name: where its adapter is read from, and its tensors while held in memory."""

    name: str
    path: str
    uid: int  # unique per registration: what slots and the prefix cache key on
    weights: LoRAWeights | None = None
    reading: Future | None = None  # its file being read on the store's thread
    users: int = 0  # running requests: while > 0 it stays in memory
    registered: bool = True  # False once unloaded: requests that named it before still finish on it


@dataclass
class AdapterStore:
    """The registry and the memory bound (module docstring). ``read(path)`` returns an adapter's
    :class:`LoRAWeights` on the host, ``device`` is where they serve from; ``wake()`` tells the worker a read
    finished."""

    read: Callable[[str], LoRAWeights]
    max_loaded: int
    device: torch.device | str = "cpu"
    buffers: SpareBuffers = field(default_factory=lambda: SpareBuffers(0))  # what ``read`` reads into
    wake: Callable[[], None] = lambda: None
    names: dict[str, Adapter] = field(default_factory=dict)
    held: OrderedDict[Adapter, None] = field(default_factory=OrderedDict)  # in memory or being read; LRU first
    counters: dict[str, int] = field(default_factory=lambda: {"adapter_reads": 0, "adapter_evictions": 0})

    def __post_init__(self) -> None:
        self._uids = itertools.count(1)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="clawrl-lora-read")

    def lookup(self, name: str) -> Adapter:
        """The adapter registered as ``name`` (any thread); SGLang's words when there is none."""
        adapter = self.names.get(name)  # one dict read: atomic while the worker registers others
        if adapter is None:
            raise AdapterError(f"The following requested LoRA adapters are not loaded: {name}\n"
                               f"Loaded adapters: {sorted(self.names)}.")
        return adapter

    def loaded(self) -> dict[str, str]:
        """name -> path of every registered adapter (SGLang's ``loaded_adapters``)."""
        return {a.name: a.path for a in list(self.names.values())}

    def add(self, name: str, path: str, weights: LoRAWeights) -> None:
        """Register ``name`` for ``path`` with its weights already read (held if there is room)."""
        if name in self.names:
            raise AdapterError(f"LoRA with name {name} already exists. Loaded LoRAs: {sorted(self.names)}")
        adapter = self.names[name] = Adapter(name, path, next(self._uids))
        if self._make_room():
            adapter.weights = self._place(weights)
            self.held[adapter] = None

    def remove(self, name: str) -> Adapter:
        """Unregister ``name``: new requests are refused; those already holding it finish on it."""
        adapter = self.names.pop(name, None)
        if adapter is None:
            raise AdapterError(f"LoRA with name {name} does not exist. Loaded LoRAs: {sorted(self.names)}")
        adapter.registered = False
        if adapter.users == 0 and adapter.reading is None:
            self._drop(adapter)
        return adapter

    def ready(self, adapter: Adapter) -> bool | None:
        """Whether ``adapter`` is in memory (a use: it becomes the most recently used); if not, its read
        starts when there is room (False) or there is none: every held adapter is in use (None).
        A read that failed raises :class:`AdapterError`."""
        if adapter.weights is None and adapter.reading is not None and adapter.reading.done():
            reading, adapter.reading = adapter.reading, None
            try:
                adapter.weights = self._place(reading.result())
            except Exception as e:
                self.held.pop(adapter, None)
                raise AdapterError(f"adapter {adapter.name} could not be read again from {adapter.path}: {e}") \
                    from None
        if adapter.weights is not None:
            self.held.move_to_end(adapter)
            return True
        if adapter.reading is not None:
            return False
        if not self._make_room():
            return None
        adapter.reading = self._reader.submit(self.read, adapter.path)
        adapter.reading.add_done_callback(lambda _: self.wake())
        self.held[adapter] = None
        self.counters["adapter_reads"] += 1
        return False

    def pin(self, adapter: Adapter) -> None:
        adapter.users += 1

    def unpin(self, adapter: Adapter) -> None:
        adapter.users -= 1
        if adapter.users == 0 and not adapter.registered:
            self._drop(adapter)

    def _make_room(self) -> bool:
        """Below ``max_loaded`` held adapters, evicting the least recently used unused ones; False if all are in use."""
        while len(self.held) >= self.max_loaded:
            victim = next((a for a in self.held if a.users == 0 and (a.reading is None or a.reading.done())), None)
            if victim is None:
                return False
            self._drop(victim)
            self.counters["adapter_evictions"] += 1
        return True

    def _place(self, weights: LoRAWeights) -> LoRAWeights:
        """``weights`` on the serving device (the host buffer they were read into goes back for the next read)."""
        placed = weights.to(self.device)
        if placed.flat is not weights.flat:
            self.buffers.give(weights.flat)
        return placed

    def _drop(self, adapter: Adapter) -> None:
        self.held.pop(adapter, None)
        if adapter.weights is not None:  # no step uses it: only running requests' adapters are in steps
            self.buffers.give(adapter.weights.flat)
        adapter.weights = adapter.reading = None

    def memory(self) -> dict[str, Any]:
        held = [a.weights for a in self.held if a.weights is not None]
        return {"adapters_registered": len(self.names), "adapters_held": len(held),
                "adapters_bytes": sum(w.nbytes for w in held), **self.counters}

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)
