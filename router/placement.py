"""Placement policies: which replica an admitted request goes to.

A policy gets the request's `Demand` and the candidate replicas (`Candidate`: available
blocks (protocol/blocks.py), prefix credit, ongoing requests, usage) and returns the
chosen replica id, or None to keep the request queued. Memory-aware policies return
None when nothing fits; the baselines always choose, as the routers they copy do.
Built-ins are chosen by the short names in their docstrings (protocol/registry.py),
a user class (a `Placement` subclass) by import path.
"""

from __future__ import annotations

import itertools
import random
from typing import NamedTuple, Sequence

from blockserve.router.demand import Demand


class Candidate(NamedTuple):
    replica_id: str
    total_blocks: int
    available_blocks: int  # total - committed - unreflected (protocol/blocks.py)
    prefix_credit: int  # prompt blocks likely cached there already
    ongoing: int
    usage: float
    cached_blocks: int = 0  # free blocks that still hold cached prefixes (evictable)
    prefill_blocks: int = 0  # prompt blocks dispatched there, first token not yet out

    def need(self, demand: Demand) -> int:
        return max(0, demand.blocks - self.prefix_credit)

    def fits(self, demand: Demand) -> bool:
        return self.need(demand) <= self.available_blocks


class Placement:
    """What `router.placement` must be."""

    def choose(self, demand: Demand, candidates: Sequence[Candidate]) -> str | None:
        raise NotImplementedError


class BestFitBlocks(Placement):
    """`best_fit`: the replica left with the fewest available blocks after taking the request
    (counting prefix credit), so large requests still find room elsewhere."""

    def choose(self, demand: Demand, candidates: Sequence[Candidate]) -> str | None:
        blocks, best, best_key = demand.blocks, None, None
        for c in candidates:  # one plain loop: this runs per decision over every replica
            need = blocks - c.prefix_credit
            leftover = c.available_blocks - need if need > 0 else c.available_blocks
            if leftover >= 0 and (best_key is None or (leftover, c.ongoing) < best_key):
                best, best_key = c.replica_id, (leftover, c.ongoing)
        return best


class BalancedBlocks(Placement):
    """`balanced`, spreading: among replicas that can hold the request, the one left with the
    most available blocks, where each prompt block already cached there counts
    `affinity_weight` times. Spreads work (every replica's compute is used) but keeps a
    prefix where it is cached unless another replica is much emptier."""

    def __init__(self, affinity_weight: float = 4.0):
        self.affinity_weight = affinity_weight

    def choose(self, demand: Demand, candidates: Sequence[Candidate]) -> str | None:
        blocks, weight, best, best_key = demand.blocks, self.affinity_weight, None, None
        for c in candidates:
            leftover = c.available_blocks - max(0, blocks - c.prefix_credit)
            if leftover < 0:
                continue
            key = (leftover + weight * min(c.prefix_credit, blocks), -c.ongoing)
            if best_key is None or key > best_key:
                best, best_key = c.replica_id, key
        return best


class MostFreeBlocks(Placement):
    """`most_free`, memory-aware spreading: the fitting replica with the most available
    blocks left."""

    def choose(self, demand: Demand, candidates: Sequence[Candidate]) -> str | None:
        fitting = [c for c in candidates if c.fits(demand)]
        if not fitting:
            return None
        best = max(fitting, key=lambda c: (c.available_blocks - c.need(demand), -c.ongoing))
        return best.replica_id


class RoundRobin(Placement):
    """`round_robin`, a baseline: replicas in turn, blind to blocks."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, demand: Demand, candidates: Sequence[Candidate]) -> str | None:
        if not candidates:
            return None
        ordered = sorted(candidates, key=lambda c: c.replica_id)
        return ordered[next(self._counter) % len(ordered)].replica_id


class PowerOfTwoChoices(Placement):
    """`power_of_two`, a baseline (Ray Serve's default router): of two random replicas,
    the one with fewer ongoing requests."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, demand: Demand, candidates: Sequence[Candidate]) -> str | None:
        if not candidates:
            return None
        pair = self._rng.sample(list(candidates), min(2, len(candidates)))
        return min(pair, key=lambda c: c.ongoing).replica_id


class LeastKvUsage(Placement):
    """`least_kv`, a baseline: the replica with the lowest KV cache usage, blind to
    request size."""

    def choose(self, demand: Demand, candidates: Sequence[Candidate]) -> str | None:
        if not candidates:
            return None
        return min(candidates, key=lambda c: (c.usage, c.ongoing)).replica_id
