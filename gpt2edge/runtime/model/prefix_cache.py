"""PrefixCache: the keys and values of earlier prompts and generations, bounded in bytes, found by token ids.

A request whose prompt starts with tokens seen before (a fixed system prompt, a chat that resends its history)
copies their cached keys and values into its cache row and prefills only the rest (the serve scheduler's join,
gpt2edge.runtime.model.slot_prefix; the Generator's one-row generations).

Layout: a radix tree over token ids in blocks of BLOCK tokens (vLLM's automatic prefix caching hashes blocks the
same way). Each node holds one block's keys and values as one (2 x n_layer, n_head, BLOCK, head_dim) array of its
own (a copy: never a view of a buffer the next decode step overwrites), under its parent's node, keyed by the
block's ids: a node's KV depends on every token before it, so a path from the root is one prefix. Blocks rather
than whole entries: twenty chats under one system prompt hold it once, not twenty times, and a chat's next turn
adds only its new blocks. The cost: a match is a whole number of blocks (at most BLOCK - 1 tokens less than
the longest common prefix).

Bounds: at most max_bytes of blocks. Eviction takes the least recently used leaf (a block no other block
continues; every use touches the whole path leaf first, so a parent is never older than its children and an
inner block is not dropped under its children). Memory pressure: a block is not added, and the oldest are
evicted instead, while it would take more than a fifth of what the machine still has available
(gpt2edge.budget.memory): the cache gives way, never the requests. Thread-safe (one lock): the scheduler's thread adds
and looks up, /metrics reads the counters.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from gpt2edge.budget.memory import SHARE, available_bytes

BLOCK = 16  # tokens per node: a match is a multiple of it


@dataclass(eq=False)
class _Node:
    parent: _Node | None
    key: tuple[int, ...]
    kv: np.ndarray | None  # (n_tensors, nh, BLOCK, hs); None for the root
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)


@dataclass
class PrefixStats:
    """Counters since start (monotonic, for /metrics) and what is held now."""

    lookups: int = 0
    hits: int = 0  # lookups that reused at least one block
    tokens_reused: int = 0
    evictions: int = 0  # blocks dropped to make room (bound or memory pressure)
    bytes_held: int = 0
    blocks: int = 0


class PrefixCache:
    """Cached KV of token-id prefixes for one model's cache shape (n_tensors, nh, hs, dtype)."""

    def __init__(self, max_bytes: int, n_tensors: int, n_head: int, head_dim: int, dtype) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.shape = (n_tensors, n_head, BLOCK, head_dim)
        self.dtype = np.dtype(dtype)
        self.block_bytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self.stats = PrefixStats()
        self._root = _Node(None, (), None)
        self._lru: OrderedDict[int, _Node] = OrderedDict()  # id(node) -> node, least recently used first
        self._lock = threading.Lock()

    @classmethod
    def for_graph(cls, graph, max_bytes: int) -> PrefixCache:
        """A cache shaped for an OrtGraph's (or BodyGraph body's) KV tensors."""
        return cls(max_bytes, len(graph.past_names), graph.n_head, graph.head_dim, graph.kv_dtype)

    def lookup(self, ids: Sequence[int], limit: int) -> list[np.ndarray]:
        """The blocks of the longest cached prefix of ids[:limit] (callers pass len(ids) - 1: the last prompt
        token is always prefilled, its log-probs are needed). Each block is (n_tensors, nh, BLOCK, hs) and is never
        written again (eviction only drops the reference), so copying it after the lock is released is safe."""
        with self._lock:
            self.stats.lookups += 1
            path = self._walk(ids, max(0, limit) // BLOCK)
            if path:
                self.stats.hits += 1
                self.stats.tokens_reused += len(path) * BLOCK
                self._touch(path)
            return [node.kv for node in path]

    def peek(self, ids: Sequence[int], limit: int) -> int:
        """How many of ids[:limit] lookup would supply now (no counters, no recency: an admission estimate)."""
        with self._lock:
            return len(self._walk(ids, max(0, limit) // BLOCK)) * BLOCK

    def held(self, ids: Sequence[int]) -> list[np.ndarray]:
        """The blocks held now for ids' longest cached prefix (no counters, no recency: what a saved server slot
        writes to its file)."""
        with self._lock:
            return [node.kv for node in self._walk(ids, len(ids) // BLOCK)]

    def insert(self, ids: Sequence[int], tensors: Sequence[np.ndarray]) -> int:
        """Remember the KV of ids: tensors[t] is (nh, >= len(ids), hs) for the first len(ids) positions (views are
        fine: the blocks not held yet are copied). Only whole blocks are kept. Returns the blocks added."""
        if self.max_bytes < self.block_bytes:
            return 0
        n_blocks = len(ids) // BLOCK
        added = 0
        with self._lock:
            path = self._walk(ids, n_blocks)
            self._touch(path)
            node = path[-1] if path else self._root
            for b in range(len(path), n_blocks):
                if not self._make_room(set(map(id, [*path, node]))):
                    break
                kv = np.empty(self.shape, self.dtype)
                for t, arr in enumerate(tensors):
                    kv[t] = arr[:, b * BLOCK : (b + 1) * BLOCK]
                key = tuple(int(i) for i in ids[b * BLOCK : (b + 1) * BLOCK])
                child = _Node(node, key, kv)
                node.children[key] = child
                self._lru[id(child)] = child
                self.stats.bytes_held += self.block_bytes
                self.stats.blocks += 1
                path.append(child)
                node, added = child, added + 1
            self._touch(path)
        return added

    def snapshot(self) -> dict[str, int]:
        """The counters, read together (another thread may be adding)."""
        with self._lock:
            return asdict(self.stats)

    def clear(self) -> None:
        with self._lock:
            self._root.children.clear()
            self._lru.clear()
            self.stats.bytes_held = self.stats.blocks = 0

    def _walk(self, ids: Sequence[int], n_blocks: int) -> list[_Node]:
        """The nodes of the longest cached path over ids' first n_blocks blocks."""
        path, node = [], self._root
        for b in range(n_blocks):
            node = node.children.get(tuple(int(i) for i in ids[b * BLOCK : (b + 1) * BLOCK]))
            if node is None:
                break
            path.append(node)
        return path

    def _touch(self, path: list[_Node]) -> None:
        """Most recently used: the path's leaf first, the root's child last (a parent never older than a child)."""
        for node in reversed(path):
            self._lru.move_to_end(id(node))

    def _make_room(self, keep: set[int]) -> bool:
        """Evict least recently used leaves until one more block fits the bound and the machine's memory; False
        when it cannot (every block left is on the path being added)."""
        while self._lru and (self.stats.bytes_held + self.block_bytes > self.max_bytes or self._pressed()):
            victim = next((n for n in self._lru.values() if not n.children and id(n) not in keep), None)
            if victim is None:
                return False
            del victim.parent.children[victim.key]
            del self._lru[id(victim)]
            self.stats.bytes_held -= self.block_bytes
            self.stats.blocks -= 1
            self.stats.evictions += 1
        return self.stats.bytes_held + self.block_bytes <= self.max_bytes and not self._pressed()

    def _pressed(self) -> bool:
        """One more block would take more than the share of the machine's available memory that no plan uses."""
        avail = available_bytes()
        return avail is not None and self.block_bytes > (1 - SHARE) * avail
