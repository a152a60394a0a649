"""Placement policies: which replica an admitted request goes to.

Each gets the request's demand and the candidate replicas (protocol/router_policies.py:
`Candidate`, available blocks in protocol/blocks.py's words, prefix credit, requests in
flight, usage) and returns the chosen replica id, or None to keep the request queued.
The memory-aware ones are `CostPlacement`s: the replicas that fit, the cost of each,
the cheapest (so `prefix_weight` adds a prefix term to any of them); the baselines copy
another router's rule, blind to request size, and two write their `choose` by hand.
Built-ins are chosen by the short names in their docstrings (protocol/registry.py), a
user class (a `Placement` or `CostPlacement` subclass) by import path.
"""

from __future__ import annotations

import itertools
import random
from typing import Sequence

from blockserve.protocol.router_policies import Candidate, CostPlacement, DemandView, Placement


class BestFitBlocks(CostPlacement):
    """`best_fit`: the replica left with the fewest available blocks after taking the
    request (counting prefix credit), so large requests still find room elsewhere."""

    def cost(self, demand: DemandView, c: Candidate) -> float:
        return c.available_blocks - max(0, demand.blocks - c.prefix_credit)


class MostFreeBlocks(CostPlacement):
    """`most_free`, memory-aware spreading: the fitting replica with the most available
    blocks left."""

    def cost(self, demand: DemandView, c: Candidate) -> float:
        return max(0, demand.blocks - c.prefix_credit) - c.available_blocks


class BalancedBlocks(MostFreeBlocks):
    """`balanced`, spreading: `most_free` with a prefix term, each prompt block already
    cached on a replica counting `prefix_weight` free blocks. Spreads work (every
    replica's compute is used) but keeps a prefix where it is cached unless another
    replica is much emptier."""

    def __init__(self, prefix_weight: float = 4.0):
        super().__init__(prefix_weight)


class LeastKvUsage(CostPlacement):
    """`least_kv`, a baseline: the replica with the lowest KV cache usage, blind to
    request size (every replica is admitted)."""

    def admits(self, demand: DemandView, candidates: Sequence[Candidate]
               ) -> Sequence[Candidate]:
        return candidates

    def cost(self, demand: DemandView, c: Candidate) -> float:
        return c.usage


class RoundRobin(Placement):
    """`round_robin`, a baseline: replicas in turn, blind to blocks."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, demand: DemandView, candidates: Sequence[Candidate]) -> str | None:
        if not candidates:
            return None
        ordered = sorted(candidates, key=lambda c: c.replica_id)
        return ordered[next(self._counter) % len(ordered)].replica_id


class PowerOfTwoChoices(Placement):
    """`power_of_two`, a baseline (Ray Serve's default router): of two random replicas,
    the one with fewer ongoing requests. `rng` draws them (the simulator seeds it)."""

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def choose(self, demand: DemandView, candidates: Sequence[Candidate]) -> str | None:
        if not candidates:
            return None
        pair = self.rng.sample(list(candidates), min(2, len(candidates)))
        return min(pair, key=lambda c: c.ongoing).replica_id
