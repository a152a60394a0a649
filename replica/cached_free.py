"""The count of free blocks that still hold a cached prefix, kept as blocks move.

The snapshot reports it (`cached_blocks`); walking vLLM's free list for it costs
O(free blocks), which at a GPU's tens of thousands of blocks was most of a simulated
step. Every block enters and leaves the free list through `FreeKVCacheBlockQueue`'s
methods, so the queue's class is set to a subclass here that counts the cached blocks
passing through them. A free block's hash changes only where the count is taken again
(`recount`): vLLM's prefix-cache reset, and a KV connector's evictions and offloads,
whose engines keep the walk (`CachedFreeCount.counts`), as do those of a vLLM whose
queue has methods this module does not know.

The same queue also lists the cached blocks it moves, for replica/held_prefix.py, once
that module sets `moved` to a list: a block enters or leaves the free queue exactly when
its ref_cnt reaches or leaves 0.
"""

from __future__ import annotations

from typing import Iterable

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock


def _cached(blocks: Iterable[KVCacheBlock]) -> int:
    return sum(1 for b in blocks if b.block_hash is not None)


def walk_cached_free(pool: BlockPool) -> int:
    """The count by walking the free list, O(free blocks)."""
    return _cached(pool.free_block_queue.get_all_free_blocks())


# Every method of vLLM's queue: those that move blocks, counted below, and those that
# only read it. A vLLM whose queue has another is not counted (its engines walk), so a
# new way in or out is never missed.
_MOVING = {"popleft", "popleft_n", "remove", "append", "append_n", "prepend_n"}
_READING = {"get_all_free_blocks", "iter_blocks_after"}


class _CountingFreeQueue(FreeKVCacheBlockQueue):
    """vLLM's free queue, counting the cached blocks in it (installed by class assignment)
    and, where `moved` is a list, listing the cached blocks that enter or leave it."""

    cached: int
    moved: list[KVCacheBlock] | None = None

    def _passed(self, blocks: list[KVCacheBlock], sign: int) -> None:
        hashed = [b for b in blocks if b.block_hash is not None]
        self.cached += sign * len(hashed)
        if self.moved is not None:
            self.moved += hashed

    def popleft(self) -> KVCacheBlock:
        block = super().popleft()
        self._passed([block], -1)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        blocks = super().popleft_n(n)
        self._passed(blocks, -1)
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        super().remove(block)
        self._passed([block], -1)

    def append(self, block: KVCacheBlock) -> None:
        super().append(block)
        self._passed([block], 1)

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        super().append_n(blocks)
        self._passed(blocks, 1)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        super().prepend_n(blocks)
        self._passed(blocks, 1)


class CachedFreeCount:
    """Free blocks holding a cached prefix in one pool: kept by the queue where only
    the scheduler's own allocation and freeing move blocks, else walked each time."""

    def __init__(self, pool: BlockPool, *, kv_connector: bool):
        self._pool = pool
        queue = pool.free_block_queue
        methods = {name for name, value in vars(FreeKVCacheBlockQueue).items()
                   if callable(value) and not name.startswith("__")}
        self.counts = pool.enable_caching and not kv_connector and \
            type(queue) is FreeKVCacheBlockQueue and methods <= _MOVING | _READING
        if self.counts:
            queue.__class__ = _CountingFreeQueue
            self.recount()

    def recount(self) -> None:
        """Take the count again from the free list (after hashes changed in it)."""
        if self.counts:
            self._pool.free_block_queue.cached = walk_cached_free(self._pool)

    def __call__(self) -> int:
        if not self._pool.enable_caching:
            return 0
        if self.counts:
            return self._pool.free_block_queue.cached
        return walk_cached_free(self._pool)
