"""Each waiting request's held prefix, walked once and kept until a block of it changes.

The snapshot's `waiting_blocks` counts, for every waiting request after every step, the
leading prompt blocks that running requests already hold (`BlockBook._held_prefix`: the
walk over the prompt's block hashes, O(prompt blocks)). In an overloaded replica of long
prompts that walk was most of a simulated step. Its answer depends only on whether each
of the prompt's hashes maps to a block (vLLM's `get_cached_block`: the first block under
the hash) whose ref_cnt is above 0, and that changes only where
  - the pool's hash map gains or loses a block under a hash (`BlockHashToBlockMap.insert`
    and `pop`, listed by a subclass installed on the map here; vLLM's prefix-cache reset
    replaces the map, and everything is walked again), or
  - a cached block's ref_cnt reaches or leaves 0, which is exactly when it enters or
    leaves the free queue (listed by replica/cached_free.py's queue).
So a request's walked length is kept until one of those changes names a hash of its
prompt. Where the queue is not counted (a KV connector, a vLLM whose queue or map has
methods this module does not know), every request is walked each time, as before.
"""

from __future__ import annotations

from typing import Callable

from vllm.v1.core.block_pool import BlockHashToBlockMap, BlockPool
from vllm.v1.core.kv_cache_utils import get_block_hash
from vllm.v1.request import Request

from blockserve.replica.cached_free import CachedFreeCount

# Every method of vLLM's map: those that change it, listed below, and those that only read.
_CHANGING = {"insert", "pop"}
_READING = {"get_one_block", "contain", "_unexpected_blocks_type"}


class _WatchedHashMap(BlockHashToBlockMap):
    """vLLM's hash map, listing the keys it inserts or pops (installed by class assignment)."""

    changed: list

    def insert(self, key, block) -> None:
        super().insert(key, block)
        self.changed.append(key)

    def pop(self, key, block_id: int):
        self.changed.append(key)
        return super().pop(key, block_id)


class HeldPrefixes:
    """The held-prefix length of each waiting request, kept while none of its hashes
    changes (see the module docstring)."""

    def __init__(self, pool: BlockPool, cached_free: CachedFreeCount,
                 walk: Callable[[Request], int]):
        """`walk`: the length by walking the request's hashes (used when not kept)."""
        self._pool, self._walk = pool, walk
        methods = {name for name, value in vars(BlockHashToBlockMap).items()
                   if callable(value) and not name.startswith("__")}
        self.keeps = cached_free.counts and methods <= _CHANGING | _READING and \
            type(pool.cached_block_hash_to_block) is BlockHashToBlockMap
        self._lengths: dict[str, int] = {}  # request id -> its length, while valid
        self._watched: dict[str, tuple[Request, int]] = {}  # request id -> it, hashes watched
        self._by_hash: dict[bytes, set[str]] = {}  # block hash -> watched requests' ids
        if self.keeps:
            pool.free_block_queue.moved = []
            self._watch_map()

    def _watch_map(self) -> None:
        hash_map = self._pool.cached_block_hash_to_block
        hash_map.__class__ = _WatchedHashMap
        hash_map.changed = []
        self._lengths.clear()

    def length(self, request: Request) -> int:
        """The request's held-prefix length, as `walk` gives it."""
        if not self.keeps:
            return self._walk(request)
        self._drop_changed()
        rid = request.request_id
        watched = self._watched.get(rid)
        if watched is None or watched[0] is not request or \
                watched[1] != len(request.block_hashes):
            self._unwatch(rid)
            self._watched[rid] = (request, len(request.block_hashes))
            for block_hash in request.block_hashes:
                self._by_hash.setdefault(block_hash, set()).add(rid)
        length = self._lengths.get(rid)
        if length is None:
            length = self._lengths[rid] = self._walk(request)
        return length

    def keep_only(self, request_ids: set[str]) -> None:
        """Stop watching the requests not in `request_ids` (no longer waiting)."""
        for rid in [rid for rid in self._watched if rid not in request_ids]:
            self._unwatch(rid)

    def _unwatch(self, rid: str) -> None:
        self._lengths.pop(rid, None)
        watched = self._watched.pop(rid, None)
        if watched is None:
            return
        for block_hash in watched[0].block_hashes[:watched[1]]:
            ids = self._by_hash.get(block_hash)
            if ids is not None:
                ids.discard(rid)
                if not ids:
                    del self._by_hash[block_hash]

    def _drop_changed(self) -> None:
        """Forget the lengths of the requests whose hashes changed since last asked."""
        pool = self._pool
        if type(pool.cached_block_hash_to_block) is not _WatchedHashMap:  # reset: a new map
            self._watch_map()
        keys, moved = pool.cached_block_hash_to_block.changed, pool.free_block_queue.moved
        if not keys and not moved:
            return
        extra = getattr(pool, "cached_block_hashes_by_block", {})  # partial-block keys
        for block in moved:  # a hash it lost since is among `keys` (the map's pop)
            if block.block_hash is not None:
                keys.append(block.block_hash)
            keys.extend(extra.get(block.block_id, ()))
        for key in keys:
            for rid in self._by_hash.get(get_block_hash(key), ()):
                self._lengths.pop(rid, None)
        keys.clear()
        moved.clear()
