"""Built-in block policies, on the interfaces of protocol/policies.py only.

Each is chosen by its short name (protocol/registry.py) or import path in the
replica's `scheduler` config; constructor arguments go in `kwargs`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from blockserve.protocol.policies import (BlockBudget, BlockUsage, BlockView, EvictionPolicy,
                                         RequestView, RetentionPolicy)


class ProtectSharedPrefixes(EvictionPolicy):
    """Cached blocks that many requests hit get second chances before reuse.

    vLLM evicts in pure LRU order, so one long scan can flush a hot system prompt.
    A block's credit is its hit count (capped) halved for every time it was spared
    (CLOCK-style aging); a block with credit of at least `min_hits` is spared. Credit
    halves on each spare, so protection always runs out.
    """

    def __init__(self, min_hits: int = 2, max_credit: int = 8):
        if min_hits < 1 or max_credit < min_hits:
            raise ValueError("need 1 <= min_hits <= max_credit")
        self.min_hits = min_hits
        self.max_credit = max_credit

    def may_evict(self, block: BlockView, now: float) -> bool:
        return min(block.hits, self.max_credit) >> block.spared < self.min_hits


@dataclass
class _Entry:
    in_main: bool
    used_hits: int  # hits already spent on second chances (or before promotion)


class S3Fifo(EvictionPolicy):
    """S3-FIFO: Yang, Zhang, Qiu, Yue, Rashmi, "FIFO queues are all you need for cache
    eviction", SOSP 2023 (https://doi.org/10.1145/3600006.3613147).

    A small FIFO S (`small_share` of the cached blocks) takes newly cached blocks; a
    block leaving S is promoted to the main FIFO M if it was hit at least
    `promote_hits` times there, else evicted and its hash remembered in a ghost FIFO G.
    A block whose hash is in G goes straight to M when cached again. M evicts FIFO with
    reinsertion: a block with hits left (frequency capped at 3) is spared and loses
    one. Eviction takes from S while S holds at least its share, else from M.

    Mapped onto vLLM's single free queue: S and M membership is kept here, the queue
    holds both in free order. Sparing a block (to promote it, reinsert it, or to reach
    the queue that is due) moves it to the back, which keeps each queue's own FIFO
    order. Only cached blocks that were freed at least once are in S or M (blocks in use
    cannot be evicted). Reaching the due queue can cost a pass over the free blocks.
    """

    MAX_FREQ = 3  # the paper's 2-bit frequency counter

    def __init__(self, small_share: float = 0.1, promote_hits: int = 2):
        if not 0 < small_share < 1 or promote_hits < 1:
            raise ValueError("need 0 < small_share < 1 and promote_hits >= 1")
        self.small_share = small_share
        self.promote_hits = promote_hits
        self._entries: dict[int, _Entry] = {}
        self._small = 0
        self._ghost: OrderedDict[bytes, None] = OrderedDict()

    def on_free(self, block: BlockView) -> None:
        if block.block_id in self._entries or block.prefix_hash is None:
            return
        in_main = block.prefix_hash in self._ghost
        if in_main:
            del self._ghost[block.prefix_hash]
        self._entries[block.block_id] = _Entry(in_main, 0)
        self._small += not in_main

    def on_evict(self, block: BlockView) -> None:
        entry = self._entries.pop(block.block_id, None)
        if entry is None:
            return
        if not entry.in_main:
            self._small -= 1
            if block.prefix_hash is not None:
                self._ghost[block.prefix_hash] = None
                while len(self._ghost) > max(1, len(self._entries)):
                    self._ghost.popitem(last=False)

    def may_evict(self, block: BlockView, now: float) -> bool:
        entry = self._entries.get(block.block_id)
        if entry is None:  # cached before this policy saw it free
            self.on_free(block)
            entry = self._entries[block.block_id]
        freq = min(self.MAX_FREQ, block.hits - entry.used_hits)
        small_due = self._small >= self.small_share * len(self._entries)
        if not entry.in_main:
            if freq >= self.promote_hits:
                entry.in_main, entry.used_hits = True, block.hits
                self._small -= 1
                return False
            return small_due  # not due: skip it, evict from M
        if small_due and self._small:
            return False  # S is due: skip M blocks
        if freq > 0:
            entry.used_hits += 1
            return False
        return True


class PriorityRetention(RetentionPolicy):
    """Freed blocks of less urgent requests are reused first, so the urgent keep theirs.

    A freed cached block goes to the back of the eviction order (vLLM) only if its last
    request had priority <= `retained_priority` (lower is more urgent), its tenant is
    not in `evict_first_tenants`, and, with `evict_output_first`, it holds prompt tokens
    (output blocks are reused only by a follow-up that repeats the answer).
    """

    def __init__(self, retained_priority: int = 0, evict_first_tenants: list[str] | None = None,
                 evict_output_first: bool = False):
        self.retained_priority = retained_priority
        self.evict_first_tenants = frozenset(evict_first_tenants or ())
        self.evict_output_first = evict_output_first

    def retain(self, block: BlockView) -> bool:
        return (block.priority <= self.retained_priority
                and block.tenant not in self.evict_first_tenants
                and (block.is_prompt or not self.evict_output_first))


class TenantBlockQuota(BlockBudget):
    """Per-tenant block quota: a tenant's admitted requests together reserve at most its
    quota (each reserves prompt + max_tokens), so their blocks never exceed it.

    A request that would exceed its tenant's quota waits until the tenant's running
    requests finish. A tenant with nothing admitted is always admitted one request, so
    a request larger than its quota is served alone rather than never.
    """

    def __init__(self, quotas: dict[str, int] | None = None, default_quota: int | None = None):
        self.quotas = dict(quotas or {})
        self.default_quota = default_quota
        if any(q < 1 for q in self.quotas.values()) or (default_quota is not None
                                                          and default_quota < 1):
            raise ValueError("quotas are numbers of blocks, at least 1")

    def may_admit(self, request: RequestView, usage: BlockUsage) -> bool:
        quota = self.quotas.get(request.tenant, self.default_quota)
        reserved = usage.reserved(request.tenant)
        return quota is None or reserved == 0 or reserved + request.max_blocks <= quota
