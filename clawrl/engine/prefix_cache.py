"""The embedded engine's prefix cache: K/V of token prefixes that finished requests computed, kept
for the next request that starts the same way (an agent's system prompt and tools, a
conversation's history, the judge's instructions), so its prefill computes only what is new.

A trie of fixed-size token blocks (SGLang's RadixAttention keeps a radix tree of tokens; blocks
keep this one simple): a node is one block of ``block`` tokens under the blocks before it and holds
that block's K/V of every layer. A request's prompt is matched block by block from the root; the
matched blocks are copied into its row of the KV cache and only the rest is prefilled. Finished
requests add their blocks. At most ``max_tokens`` tokens are kept: the least recently used leaves
go first. Weights change: everything goes (the K/V belongs to the old weights).

K/V computed under a LoRA adapter belongs to that adapter: each adapter's prefixes hang under a root
of their own (``key``: the adapter's registration, 0 for the base model), so a request never reuses
K/V another adapter (or the base) computed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from clawrl.engine.modeling import KVCache


@dataclass(eq=False)
class _Block:
    parent: _Block | None
    key: tuple[int, ...]
    kv: Tensor | None = None  # (2, layers, kv_heads, block, head_dim); None for the root
    children: dict[tuple[int, ...], _Block] = field(default_factory=dict)


class PrefixCache:
    def __init__(self, block: int, max_tokens: int):
        self.block, self.max_blocks = block, max_tokens // block
        self.roots: dict[int, _Block] = {}  # key (the adapter; 0: none) -> its trie
        self._lru: OrderedDict[_Block, None] = OrderedDict()  # every block but the root, oldest first
        self.hits = self.tokens_saved = 0

    def __len__(self) -> int:
        return len(self._lru)

    def _keys(self, tokens: list[int], n_blocks: int):
        b = self.block
        return (tuple(tokens[i * b:(i + 1) * b]) for i in range(n_blocks))

    def match(self, tokens: list[int], limit: int, key: int = 0) -> list[_Block]:
        """The cached blocks ``tokens`` starts with under ``key``, at most ``limit`` tokens of them."""
        path, node = [], self.roots.get(key)
        if node is None:
            return path
        for key in self._keys(tokens, min(len(tokens), limit) // self.block):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        return path

    @torch.inference_mode()
    def load(self, tokens: list[int], limit: int, cache: KVCache, row: int, key: int = 0) -> int:
        """Copy the longest cached prefix of ``tokens`` (at most ``limit`` tokens) under ``key`` into cache
        row ``row``; returns how many tokens it covers."""
        path = self.match(tokens, limit, key)
        if not path:
            return 0
        n = len(path) * self.block
        cache.ensure(row + 1, n)
        kv = torch.cat([node.kv for node in path], dim=3)  # (2, layers, kv_heads, n, head_dim): one copy a layer
        for layer in range(len(cache.k)):
            cache.k[layer][row, :, :n] = kv[0, layer]
            cache.v[layer][row, :, :n] = kv[1, layer]
        for node in path:
            self._lru.move_to_end(node)
        self.hits += 1
        self.tokens_saved += n
        return n

    @torch.inference_mode()
    def store(self, tokens: list[int], cache: KVCache, row: int, key: int = 0) -> None:
        """Keep the K/V of ``tokens`` (all cached in row ``row``, computed under ``key``), whole blocks of them."""
        node, new = self.roots.setdefault(key, _Block(None, ())), []
        for i, key in enumerate(self._keys(tokens, min(len(tokens) // self.block, self.max_blocks))):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Block(node, key)
                new.append((i, child))
            self._lru[child] = None
            self._lru.move_to_end(child)
            node = child
        if new:  # the new blocks are the path's tail: read them from the row at once, then one copy each
            a, b = new[0][0] * self.block, (new[-1][0] + 1) * self.block
            kv = torch.stack([torch.stack([c[row, :, a:b] for c in buffers]) for buffers in (cache.k, cache.v)])
            for (_, block), part in zip(new, kv.split(self.block, dim=3)):
                block.kv = part.clone()
        self._evict()

    def _evict(self) -> None:
        while len(self._lru) > self.max_blocks:
            leaf = next(b for b in self._lru if not b.children)  # an inner block's children would be unreachable
            del self._lru[leaf]
            del leaf.parent.children[leaf.key]

    def clear(self) -> None:
        for block in self._lru:  # a block and its parent refer to each other: free the K/V now, not at a GC pass
            block.kv = None
        self.roots = {}
        self._lru.clear()

    def drop(self, key: int) -> None:
        """Forget every prefix kept under ``key`` (its adapter was unloaded)."""
        root = self.roots.pop(key, None)
        stack = list(root.children.values()) if root is not None else []
        while stack:
            block = stack.pop()
            stack.extend(block.children.values())
            self._lru.pop(block, None)
            block.kv = None
