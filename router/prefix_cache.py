"""Prefix indexes: which prompt blocks a replica caches, for placement's prefix credit.

Both are protocol/router_policies.py's `PrefixIndex`, one per replica.
`ApproximatePrefixIndex` (`router.prefix_index: approximate`) keeps the hashes the
router sent to the replica, in LRU order. `ExactPrefixIndex` (`exact`) knows which
KV blocks the replica's vLLM engine really caches: it follows the engine's own KV cache
events (router/kv_events.py: BlockStored, BlockRemoved, AllBlocksCleared), keyed by
vLLM's own block hashes, which the router computes from a prompt's token ids the same
way (`VllmBlockHasher`). Unlike the approximate index, it learns what vLLM evicts.

Two gaps remain between a decision and the events that follow it, and both are
covered on purpose:
- a request just dispatched has not had its blocks stored yet, so the next request
  with the same prefix would see no credit and could go anywhere: the dispatched
  hashes count as `pending` for `pending_s`, until the engine's events confirm them;
- before the replica's events are flowing (no subscription yet, or a replica whose
  hashes the router cannot reproduce), the index answers from its approximate
  fallback, so prefix credit degrades to today's guess instead of to nothing.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Iterable

from blockserve.protocol.router_policies import PrefixIndex


class ApproximatePrefixIndex(PrefixIndex):
    """`approximate`: the prompt block hashes the router sent to a replica (bounded
    LRU); it cannot see what the replica evicts."""

    def __init__(self, replica_id: str, capacity: int, owners: dict[int, set[str]]):
        self.replica_id = replica_id
        self.capacity = capacity
        self.owners = owners
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def credit(self, block_hashes: Iterable[int]) -> int:
        """Leading prompt blocks likely still cached on the replica."""
        hits = 0
        for block_hash in block_hashes:
            if block_hash not in self._hashes:
                break
            hits += 1
        return hits

    def on_dispatched(self, block_hashes: Iterable[int]) -> None:
        # A hash it holds is in `owners` under its replica already (only `_forget` takes
        # it out): it only moves up the LRU order. This runs once per decision.
        hashes = self._hashes
        for block_hash in block_hashes:
            if block_hash in hashes:
                hashes.move_to_end(block_hash)
                continue
            hashes[block_hash] = None
            holders = self.owners.get(block_hash)
            if holders is None:
                self.owners[block_hash] = {self.replica_id}
            else:
                holders.add(self.replica_id)
        while len(self._hashes) > self.capacity:
            self._forget(self._hashes.popitem(last=False)[0])

    def on_removed(self) -> None:
        for block_hash in list(self._hashes):
            self._forget(block_hash)
        self._hashes.clear()

    def _forget(self, block_hash: int) -> None:
        holders = self.owners.get(block_hash)
        if holders is not None:
            holders.discard(self.replica_id)
            if not holders:
                del self.owners[block_hash]


PENDING_S = 2.0  # a dispatched prompt's blocks are stored within a step or two


class ExactPrefixIndex(PrefixIndex):
    """`exact`: one replica's cached block hashes, from its engine's events (module
    docstring). `owners`: hash -> the replicas that hold it, stored or pending."""

    follows_kv_events = True

    def __init__(self, replica_id: str, capacity: int, owners: dict[int, set[str]],
                 pending_s: float = PENDING_S, clock: Callable[[], float] = time.monotonic):
        self.replica_id = replica_id
        self.owners = owners
        self.pending_s = pending_s
        self.clock = clock
        # The fallback keeps owners of its own: its LRU evictions must not unmark a
        # block the events say is cached. While it answers, `owners` only grows.
        self.fallback = ApproximatePrefixIndex(replica_id, capacity, {})
        self.live = False  # events are flowing: answer from them, not the fallback
        self.stored: set[int] = set()
        self._pending: OrderedDict[int, float] = OrderedDict()  # hash -> expiry
        self._claimed: set[int] = set()  # hashes this index put into `owners`

    # --- placement's side (PrefixIndex) ----------------------------------------------------
    def credit(self, block_hashes: Iterable[int]) -> int:
        """Leading prompt blocks cached on the replica (or about to be)."""
        if not self.live:
            return self.fallback.credit(block_hashes)
        now, hits = self.clock(), 0
        for block_hash in block_hashes:
            if block_hash not in self.stored and self._pending.get(block_hash, 0.0) <= now:
                break
            hits += 1
        return hits

    def on_dispatched(self, block_hashes: Iterable[int]) -> None:
        hashes = tuple(block_hashes)
        self.fallback.on_dispatched(hashes)
        if not self.live:
            for block_hash in hashes:
                self._claim(block_hash)
            return
        self._expire()
        expiry = self.clock() + self.pending_s
        for block_hash in hashes:
            if block_hash not in self.stored:
                self._pending[block_hash] = expiry
                self._pending.move_to_end(block_hash)
                self._claim(block_hash)

    def on_removed(self) -> None:
        self.fallback.on_removed()
        self.live = False
        self.reset()

    # --- the event stream's side ----------------------------------------------------------
    def start(self) -> None:
        """Events now flow (after a full resync): answer from them; owners claimed
        for the fallback that the events do not confirm are withdrawn."""
        self.live = True
        for block_hash in list(self._claimed):
            self._release(block_hash)

    def stored_blocks(self, block_hashes: Iterable[int]) -> None:
        for block_hash in block_hashes:
            self.stored.add(block_hash)
            self._pending.pop(block_hash, None)
            self._claim(block_hash)

    def removed_blocks(self, block_hashes: Iterable[int]) -> None:
        for block_hash in block_hashes:
            self.stored.discard(block_hash)
            self._release(block_hash)

    def reset(self) -> None:
        """AllBlocksCleared, or a resync that starts from nothing."""
        self.stored.clear()
        self._pending.clear()
        for block_hash in list(self._claimed):
            self._release(block_hash)

    # --- internals ------------------------------------------------------------------------
    def _expire(self) -> None:
        now = self.clock()
        while self._pending:
            block_hash, expiry = next(iter(self._pending.items()))
            if expiry > now:
                return
            del self._pending[block_hash]
            self._release(block_hash)

    def _claim(self, block_hash: int) -> None:
        if block_hash not in self._claimed:
            self._claimed.add(block_hash)
            self.owners.setdefault(block_hash, set()).add(self.replica_id)

    def _release(self, block_hash: int) -> None:
        """Unmark the replica as an owner unless this index still holds the block."""
        held = block_hash in self.stored or block_hash in self._pending
        if held and self.live or block_hash not in self._claimed:
            return
        self._claimed.discard(block_hash)
        holders = self.owners.get(block_hash)
        if holders is not None:
            holders.discard(self.replica_id)
            if not holders:
                del self.owners[block_hash]
