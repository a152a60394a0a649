"""Typed interfaces of every policy the central router runs, beside the replica's
(protocol/policies.py), on the same `Policy` base and chosen by short name through the
same registry (protocol/registry.py):

- `Placement.choose(demand, candidates)` - which replica an admitted request goes to;
  `CostPlacement` composes it as llm-d composes filters, scorers and a picker: the
  candidates it `admits` (a filter), then the `cost` of each, then the cheapest;
- `OutputPredictor.predict(...)` - the output tokens a request is expected to generate;
- `PrefixIndex.credit(block_hashes)` - the prompt blocks a replica probably caches;
- `Transport.generate(replica_id, endpoint, body)` - how a request reaches its replica;
- the admission queue's order is a `QueueOrder` (protocol/policies.py), as a replica's.

The replica's convention holds here too: an order or a cost returns a sort key, smallest
first; a check returns a bool (a placement's filter, as llm-d's, the candidates that
pass); methods named `on_*` are notifications that return nothing. Placements see `Candidate`s (a replica as the ledger sees it) and a `DemandView`
(the request as the router estimated it); nothing here imports router code, so a user
reads one place for every policy kind. Prefix indexes and transports take run-time
parts (the replica, the Serve handle) as constructor arguments before their config's
(`PolicyKind.runtime_args`).
"""

from __future__ import annotations

import random
from abc import abstractmethod
from typing import Any, AsyncIterator, ClassVar, Iterable, NamedTuple, Protocol, Sequence

from blockserve.protocol.policies import Policy


class DemandView(Protocol):
    """A request as placements see it: its estimate, not its real output length."""

    @property
    def blocks(self) -> int:
        """KV blocks it is expected to need over its life: prompt + predicted output."""
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def prompt_blocks(self) -> int:
        """Blocks its prompt fills or starts."""
    @property
    def block_size(self) -> int: ...
    @property
    def prefix_hashes(self) -> tuple[int, ...]:
        """Its prompt's full blocks, hashed as the prefix index keys them."""


class Candidate(NamedTuple):
    """A replica as placement sees it (router/ledger.py keeps it current)."""

    replica_id: str
    total_blocks: int
    available_blocks: int  # total - committed - unreflected (protocol/blocks.py)
    prefix_credit: int  # prompt blocks likely cached there already
    ongoing: int
    usage: float
    cached_blocks: int = 0  # free blocks that still hold cached prefixes (evictable)
    prefill_blocks: int = 0  # prompt blocks dispatched there, first token not yet out

    def need(self, demand: DemandView) -> int:
        """Blocks the request still needs there after its prefix credit."""
        return max(0, demand.blocks - self.prefix_credit)

    def fits(self, demand: DemandView) -> bool:
        return self.need(demand) <= self.available_blocks

    def with_credit(self, prefix_credit: int) -> "Candidate":
        """The same replica with its prefix credit for one request (a third of the
        time of NamedTuple._replace, which runs per replica and decision)."""
        return tuple.__new__(Candidate, (*self[:3], prefix_credit, *self[4:]))


class Placement(Policy):
    """What `router.placement` must be: the chosen replica's id, or None to keep the
    request queued. Memory-aware placements return None when nothing fits; the
    baselines always choose, as the routers they copy do."""

    @abstractmethod
    def choose(self, demand: DemandView, candidates: Sequence[Candidate]) -> str | None:
        """The replica to place `demand` on, or None."""

    def pick(self, demand: DemandView, candidates: Sequence[Candidate]) -> Candidate | None:
        """`choose`'s replica as its Candidate, which the admission queue keeps
        (`Lease.chosen`). A placement that finds the Candidate itself overrides this
        (`CostPlacement`) and spares the search."""
        replica_id = self.choose(demand, candidates)
        if replica_id is None:
            return None
        for c in candidates:
            if c.replica_id == replica_id:
                return c
        raise ValueError(f"{type(self).__name__}.choose returned {replica_id!r}, "
                         f"which is not a candidate")

    def on_outcome(self, demand: DemandView, chosen: Candidate, ttft_s: float | None,
                   tpot_s: float | None) -> None:
        """A request placed on `chosen` (the replica as `choose` saw it) had its first
        token `ttft_s` after admission, or ended `tpot_s` per output token after that:
        what a placement that learns latency is trained on (router/relay.py reports
        streamed responses; a whole response shows no first token)."""


class CostPlacement(Placement):
    """A placement as three stages: the candidates it `admits` (a filter; by default
    those whose available blocks hold what the request still needs), their `cost` (in
    KV blocks, lowest wins), and the cheapest, ties broken by fewer requests in flight,
    then the replica id.

    `prefix_weight` adds a prefix term to any cost: each prompt block already cached on
    a replica lowers its cost by that many blocks.

    `routers`: how many routers place on the same replica views (the admission queue
    sets it). Routers that share one snapshot would all pick its cheapest replica until
    the next snapshot shows what the others sent there (docs/routers.md). With several,
    each picks at random, by `rng`, among the `routers` cheapest that cost at most one
    request's blocks more than the cheapest.
    """

    routers: int = 1
    rng: random.Random = random.Random()

    def __init__(self, prefix_weight: float = 0.0):
        if prefix_weight < 0:
            raise ValueError(f"prefix_weight must be >= 0, not {prefix_weight}")
        self.prefix_weight = prefix_weight

    def admits(self, demand: DemandView, candidates: Sequence[Candidate]
               ) -> Sequence[Candidate]:
        """The candidates the request may go to: those it fits (their available blocks
        hold what it still needs after prefix credit). One pass over the list, as
        llm-d's filters, so that a decision calls no method per replica here."""
        blocks = demand.blocks
        return [c for c in candidates if blocks - c.prefix_credit <= c.available_blocks]

    @abstractmethod
    def cost(self, demand: DemandView, candidate: Candidate) -> float:
        """What placing the request there costs; the cheapest admitted replica wins."""

    def costs(self, demand: DemandView, candidates: Sequence[Candidate]) -> list[float]:
        """The `cost` of each candidate, in one call as llm-d's scorers score all pods:
        a placement whose cost is worth a loop without a method call per replica
        overrides this and derives `cost` from it (router/cache_placement.py)."""
        cost = self.cost
        return [cost(demand, c) for c in candidates]

    def pick(self, demand: DemandView, candidates: Sequence[Candidate]) -> Candidate | None:
        # The cheapest, found by min/index/count, which loop in C: this runs per
        # decision over every replica (bench/decision_time.py). Ties: fewer requests in
        # flight, then the replica id.
        admitted = self.admits(demand, candidates)
        if not admitted:
            return None
        values = self.costs(demand, admitted)
        if self.prefix_weight:
            weight = self.prefix_weight
            values = [v - weight * c.prefix_credit for v, c in zip(values, admitted)]
        best = min(values)
        if self.routers > 1 and len(admitted) > 1:
            spread = self._spread(demand, admitted, values, best)
            if spread is not None:
                return spread
        first = values.index(best)
        if values.count(best) == 1:
            return admitted[first]
        # A NaN cost ties with nothing; min() returns it only when it comes first.
        return min((c for c, v in zip(admitted, values) if v == best),
                   key=lambda c: (c.ongoing, c.replica_id), default=admitted[first])

    def _spread(self, demand: DemandView, admitted: Sequence[Candidate],
                values: list[float], best: float) -> Candidate | None:
        """One of the `routers` cheapest within one request's blocks of `best` (None
        where a NaN cost leaves none)."""
        bound = best + demand.blocks
        near = sorted((v, c.ongoing, c.replica_id, i)
                      for i, (c, v) in enumerate(zip(admitted, values)) if v <= bound)
        return admitted[self.rng.choice(near[:self.routers])[3]] if near else None

    def choose(self, demand: DemandView, candidates: Sequence[Candidate]) -> str | None:
        chosen = self.pick(demand, candidates)
        return None if chosen is None else chosen.replica_id


class OutputPredictor(Policy):
    """What `router.output_predictor` must be. It sees only what a production router
    sees (router/predictors.py): never the true output length before the end."""

    @abstractmethod
    def predict(self, prompt_tokens: int, max_tokens: int | None, room: int,
                tenant: str = "default") -> int:
        """Expected output tokens per sequence, within `max_tokens` and `room`."""

    def on_finished(self, prompt_tokens: int, tenant: str, output_tokens: int) -> None:
        """A request finished after generating `output_tokens` per sequence."""


class PrefixIndex(Policy):
    """What `router.prefix_index` must be: one replica's record of the prompt blocks it
    caches, built by the ledger for each replica as `cls(replica_id, capacity, owners,
    **kwargs)`. `owners` (shared by all replicas of a ledger) maps a block hash to the
    replicas that hold it, so placement computes credit only where there can be any."""

    # Its replicas must publish vLLM's KV cache events (replica.publish_kv_events),
    # which the router then follows into it (router/kv_events.py).
    follows_kv_events: ClassVar[bool] = False

    @abstractmethod
    def credit(self, block_hashes: Iterable[int]) -> int:
        """Leading prompt blocks probably cached on the replica."""

    def on_dispatched(self, block_hashes: Iterable[int]) -> None:
        """A request with these prompt blocks was dispatched to the replica."""

    def on_removed(self) -> None:
        """The replica left the ledger: forget everything it held."""


class Transport(Policy):
    """What `router.transport` must be: how a request reaches the replica placement
    chose, built once per router as `cls(replicas, **kwargs)` with the replicas' Serve
    handle. Whatever the transport, a replica that cannot serve raises
    router/dispatch.py's `ReplicaUnavailable`, which router/failover.py acts on."""

    async def connect(self, replica_id: str) -> None:
        """Called before the replica gets work."""

    def on_removed(self, replica_id: str) -> None:
        """The replica is gone: drop what is kept for it."""

    @abstractmethod
    def generate(self, replica_id: str, endpoint: str, body: dict
                 ) -> AsyncIterator[Any]:
        """The replica's response chunks (`ReplicaChunk`s); closing it early aborts the
        request on the replica."""
