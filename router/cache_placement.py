"""Placement that counts what the cache is worth, in one unit: KV blocks of work.

For each replica that can hold the request (its available blocks cover the blocks the
request still needs after prefix credit), the cost of placing it there is

    prefill_weight * (queued prefill + this prompt's uncached blocks)
  + decode_weight  * active blocks (held by running requests, plus unreflected ones)
  + evict_weight   * cached blocks this prompt's new blocks would evict

and the cheapest replica wins (ties: fewer requests in flight, then the replica id).

- Active blocks weigh 0 by default: every step reads a running request's blocks
  wherever it runs, so decoding costs the cluster the same on any replica, while a
  prefix hit saves its prefill for good; memory is guarded by `must_fit`, not by the
  cost. At weight 1 the decode term outweighed the prefix credit and spread shared
  prefixes under load (docs/benchmarks.md: the steady-state contest, *simulated*, and
  the real deployment's no-regression run 7).

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
  once the holder's extra queued prefill (and active blocks, where they weigh) exceed the
  prefill the prefix saves, the next request goes elsewhere (which then caches the prefix
  too).

`DynamoCost` is NVIDIA Dynamo's published KV router cost as a configuration of this one:
overlap-weighted prefill blocks (including the worker's queued prefill) plus active
decode blocks, argmin (temperature 0), no eviction term; like Dynamo it always picks a
worker, whether or not its blocks suffice.
"""

from __future__ import annotations

from typing import Sequence

from blockserve.protocol.router_policies import Candidate, CostPlacement, DemandView


class CacheAwarePlacement(CostPlacement):
    """`cache_aware`: the replica where the request costs least (module docstring);
    `must_fit` False admits every replica, as Dynamo does. `fill_idle`: when the
    request fits no replica's available blocks (its prediction is a guess), a replica
    whose free blocks (total less held and unreflected) hold its prompt beyond the
    prompts already queued there still takes it: vLLM would start it there, and holding
    it here would leave those blocks idle.

    `max_queued_prefill_tokens`: a replica with more than this many prompt tokens
    queued (dispatched, first token not yet back) takes no more. The request waits in
    the router's queue instead, where the queue order chooses among every waiting
    request of the cluster, not only among the few queued at one replica. None: no
    limit."""

    def __init__(self, prefill_weight: float = 1.0, decode_weight: float = 0.0,
                 evict_weight: float = 1.0, must_fit: bool = True, prefix_weight: float = 0.0,
                 fill_idle: bool = True, max_queued_prefill_tokens: int | None = None):
        super().__init__(prefix_weight)
        for name, weight in (("prefill_weight", prefill_weight),
                             ("decode_weight", decode_weight), ("evict_weight", evict_weight)):
            if weight < 0:
                raise ValueError(f"{name} must be >= 0, not {weight}")
        if max_queued_prefill_tokens is not None and max_queued_prefill_tokens < 0:
            raise ValueError(f"max_queued_prefill_tokens must be >= 0 or None, "
                             f"not {max_queued_prefill_tokens}")
        self.prefill_weight = prefill_weight
        self.decode_weight = decode_weight
        self.evict_weight = evict_weight
        self.must_fit = must_fit
        self.fill_idle = fill_idle
        self.max_queued_prefill_tokens = max_queued_prefill_tokens

    def admits(self, demand: DemandView, candidates: Sequence[Candidate]
               ) -> Sequence[Candidate]:
        if self.max_queued_prefill_tokens is not None:
            limit = self.max_queued_prefill_tokens / demand.block_size
            candidates = [c for c in candidates if c.prefill_blocks <= limit]
        if not self.must_fit:
            return candidates
        fitting = super().admits(demand, candidates)
        if fitting or not self.fill_idle:
            return fitting
        prompt = demand.prompt_blocks
        return [c for c in candidates if prompt - c.prefix_credit + c.prefill_blocks
                <= c.total_blocks * (1 - c.usage)]

    def costs(self, demand: DemandView, candidates: Sequence[Candidate]) -> list[float]:
        # One loop, weights bound once, comparisons not min()/max() calls, floats compared
        # with 0.0 (a float-float comparison is quicker): this runs per replica and decision.
        prompt = demand.prompt_blocks
        prefill_weight, decode_weight = self.prefill_weight, self.decode_weight
        evict_weight = self.evict_weight
        values = []
        for c in candidates:
            credit, cached, total = c.prefix_credit, c.cached_blocks, c.total_blocks
            new_prefill = prompt - credit if credit < prompt else 0
            active = c.usage * total
            empty = total - active - cached
            # Empty blocks are used first; beyond them the new prefill evicts cached ones.
            beyond_empty = new_prefill - empty if empty > 0.0 else new_prefill
            evicted = (0.0 if beyond_empty <= 0.0 else cached if beyond_empty > cached
                       else beyond_empty)
            values.append(prefill_weight * (c.prefill_blocks + new_prefill)
                          + decode_weight * active + evict_weight * evicted)
        return values

    def cost(self, demand: DemandView, c: Candidate) -> float:
        return self.costs(demand, (c,))[0]


class DynamoCost(CacheAwarePlacement):
    """`dynamo`: Dynamo's KV router cost (module docstring); `overlap_weight` is its
    `overlap_score_weight` (default 1)."""

    def __init__(self, overlap_weight: float = 1.0):
        super().__init__(prefill_weight=overlap_weight, decode_weight=1.0, evict_weight=0.0,
                         must_fit=False)
