"""Placement that counts what the cache is worth, in one unit: KV blocks of work.

For each replica that can hold the request (its available blocks cover the blocks the
request still needs after prefix credit), the cost of placing it there is

    prefill_weight * (queued prefill + this prompt's uncached blocks)
  + decode_weight  * active blocks (held by running requests, plus unreflected ones)
  + evict_weight   * cached blocks this prompt's new blocks would evict

and the cheapest replica wins (ties: fewer requests in flight, then the replica id).

- Prefix credit comes from the ledger's prefix index: exact (router/prefix_cache.py,
  from vLLM's KV events) or the approximate guess.
- Queued prefill: prompt blocks dispatched to the replica whose first token has not come
  back yet, less the credit they got; a prompt placed there waits behind them.
- Eviction: a replica's empty blocks are used first; beyond them vLLM evicts cached
  prefixes that other requests could have hit. Keeping a prefix's requests together
  keeps the cluster's working set partitioned across the replicas' caches instead of
  duplicated in each.
- Hot prefixes spread once their replica saturates: the credit a prefix earns is at most
  its prompt blocks, while the load terms grow with the work queued on the holder, so
  once the holder's extra queued prefill and active blocks exceed the prefill the prefix
  saves, the next request goes elsewhere (which then caches the prefix too).

`DynamoCost` is NVIDIA Dynamo's published KV router cost as a configuration of this one:
overlap-weighted prefill blocks (including the worker's queued prefill) plus active
decode blocks, argmin (temperature 0), no eviction term; like Dynamo it always picks a
worker, whether or not its blocks suffice.
"""

from __future__ import annotations

from typing import Sequence

from blockserve.protocol.blocks import blocks_for
from blockserve.router.demand import Demand
from blockserve.router.placement import Candidate, Placement


class CacheAwarePlacement(Placement):
    """`cache_aware`: the replica where the request costs least (module docstring)."""

    def __init__(self, prefill_weight: float = 1.0, decode_weight: float = 1.0,
                 evict_weight: float = 1.0, must_fit: bool = True):
        for name, weight in (("prefill_weight", prefill_weight),
                             ("decode_weight", decode_weight), ("evict_weight", evict_weight)):
            if weight < 0:
                raise ValueError(f"{name} must be >= 0, not {weight}")
        self.prefill_weight = prefill_weight
        self.decode_weight = decode_weight
        self.evict_weight = evict_weight
        self.must_fit = must_fit

    def cost(self, demand: Demand, c: Candidate) -> float:
        prompt_blocks = blocks_for(demand.prompt_tokens, demand.block_size)
        new_prefill = prompt_blocks - min(c.prefix_credit, prompt_blocks)
        active = c.usage * c.total_blocks
        empty = max(0.0, c.total_blocks - active - c.cached_blocks)
        evicted = min(float(c.cached_blocks), max(0.0, new_prefill - empty))
        return (self.prefill_weight * (c.prefill_blocks + new_prefill)
                + self.decode_weight * active + self.evict_weight * evicted)

    def choose(self, demand: Demand, candidates: Sequence[Candidate]) -> str | None:
        best, best_key = None, None
        for c in candidates:
            if self.must_fit and c.need(demand) > c.available_blocks:
                continue
            key = (self.cost(demand, c), c.ongoing, c.replica_id)
            if best_key is None or key < best_key:
                best, best_key = c.replica_id, key
        return best


class DynamoCost(CacheAwarePlacement):
    """`dynamo`: Dynamo's KV router cost (module docstring); `overlap_weight` is its
    `overlap_score_weight` (default 1)."""

    def __init__(self, overlap_weight: float = 1.0):
        super().__init__(prefill_weight=overlap_weight, decode_weight=1.0, evict_weight=0.0,
                         must_fit=False)
