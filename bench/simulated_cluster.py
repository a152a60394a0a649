"""A cluster in virtual time: vLLM's real scheduler in every replica, the production
router code in front (the simulator's engine; its CLI is bench/simulator.py).

Each simulated replica is `blockserve.tools.engine_less.EngineLessReplica`: vLLM's own
Scheduler (the block-aware subclass and its policies), KV cache manager and block pool,
with one fabricated token per scheduled request, on the simulation's clock. A step takes
`StepTimeModel` seconds of virtual time. The router is the real `Ledger` +
`AdmissionQueue` + placement policy; snapshots reach it after `snapshot_delay_s`,
dispatches reach replicas after `dispatch_delay_s`. With `prefix_index="exact"` each
replica's vLLM KV cache events (the same batches its scheduler would publish over ZMQ,
router/kv_events.py's InProcessEvents) reach the router's exact prefix index after
`snapshot_delay_s` too, and prompts are hashed as vLLM hashes them.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

from blockserve.bench.client import RequestRecord
from blockserve.bench.step_time import StepTimeModel
from blockserve.bench.workloads import LengthMode, Lengths, RequestSpec
from blockserve.protocol.config import RouterConfig
from blockserve.protocol.hints import Hints
from blockserve.replica.scheduler import BlockAwareScheduler
from blockserve.router.admission import AdmissionQueue, Lease
from blockserve.router.demand import DemandEstimator, Rejected
from blockserve.router.kv_events import InProcessEvents, VllmBlockHasher, apply_batch
from blockserve.router.ledger import Ledger
from blockserve.router.prefix_cache import ApproximatePrefixIndex, ExactPrefixIndex
from blockserve.tools.engine_less import EngineLessReplica
from blockserve.tools.launch import EngineShape

SIMULATED_STOP_ID = 4000  # outside the fabricated filler ids 1..3999


@dataclass(order=True)
class Event:
    time: float
    order: int
    kind: str = field(compare=False)
    payload: object = field(compare=False, default=None)


@dataclass
class Flight:
    """One request's life in the simulation."""

    index: int
    spec: RequestSpec
    arrival: float
    lease: Lease | None = None
    first_token: float | None = None
    finished: float | None = None
    tokens: int = 0
    status: int = 200

    @property
    def request_id(self) -> str:
        return f"q{self.index}"


class SimulatedCluster:
    def __init__(self, replicas: int, shape: EngineShape, *, placement: str | dict,
                 queue_order: str | dict, scheduler: dict, step_time: StepTimeModel,
                 output_predictor: str | dict = "max_tokens",
                 snapshot_delay_s: float = 0.02, dispatch_delay_s: float = 0.005,
                 queue_timeout_s: float = 60.0, max_queued: int = 100_000,
                 length_mode: LengthMode = LengthMode.KNOWN, prefix_index: str = "approximate"):
        self.now = 0.0
        exact = prefix_index == "exact"
        # What requests say about their length (bench/workloads.py). One stop id is
        # enough: _fabricate emits it as a request's true last token.
        self.lengths = Lengths(length_mode, shape.max_model_len, SIMULATED_STOP_ID)
        self._rng = random.Random(0)
        self.step_time = step_time
        self.snapshot_delay_s, self.dispatch_delay_s = snapshot_delay_s, dispatch_delay_s
        self.block_size, self.max_model_len = shape.block_size, shape.max_model_len
        self.replicas: dict[str, EngineLessReplica] = {
            f"sim-{i:04d}": EngineLessReplica(
                shape.model, BlockAwareScheduler, **shape.engine_less_kwargs(),
                scheduler=scheduler, seed=i, sample=self._fabricate, clock=self.clock,
                kv_events_config={"enable_kv_cache_events": True, "publisher": "null"}
                if exact else None)
            for i in range(replicas)}
        self.ledger = Ledger(stale_after_s=1e9, clock=self.clock,
                             prefix_index=ExactPrefixIndex if exact else ApproximatePrefixIndex)
        for replica_id, replica in self.replicas.items():
            self.ledger.report(replica_id, replica.scheduler.snapshot)
        self.kv_events = {replica_id: InProcessEvents(replica.scheduler)
                          for replica_id, replica in self.replicas.items()} if exact else {}
        for replica_id in self.kv_events:
            self.ledger.replicas[replica_id].prefix.start()
        self.queue = AdmissionQueue(
            self.ledger, RouterConfig.policy_ref("placement", placement).policy,
            RouterConfig.policy_ref("queue_order", queue_order).policy, max_requests=max_queued,
            max_tokens=10**12, timeout_s=queue_timeout_s, clock=self.clock)
        self.queue.on_admit = self._dispatch
        self.estimator = DemandEstimator(
            None, RouterConfig.policy_ref("output_predictor", output_predictor).policy)
        if exact:  # the engine-less replicas derive NONE_HASH as a real engine does
            from blockserve.replica.kv_events import reproducible_seed

            self.estimator.block_hasher = VllmBlockHasher("sha256", reproducible_seed("sha256"))
        self._events: list[Event] = []
        self._order = itertools.count()
        self._busy: set[str] = set()
        self.flights: dict[str, Flight] = {}  # by request id, from arrival on
        self.steps = 0
        self.prefix_hits = self.prefix_queries = 0  # prompt tokens, all replicas

    def clock(self) -> float:
        """Virtual time: the router's and every replica scheduler's clock."""
        return self.now

    def _fabricate(self, request) -> int:
        """The simulated model: a stop id as the request's true last token, filler before
        (vLLM's min_tokens masking, played by the model)."""
        if request.num_output_tokens + 1 >= self.flights[request.request_id].spec.output_tokens:
            return SIMULATED_STOP_ID
        return self._rng.randrange(1, SIMULATED_STOP_ID)

    def schedule(self, at: float, kind: str, payload=None) -> None:
        heapq.heappush(self._events, Event(at, next(self._order), kind, payload))

    async def run(self, specs: list[RequestSpec], progress=None) -> list[Flight]:
        """Every request to its end (async: the admission queue's futures need a loop)."""
        for index, spec in enumerate(specs):
            self.schedule(spec.arrival_s, "arrive", (index, spec))
        while self._events:
            event = heapq.heappop(self._events)
            self.now = event.time
            finished = getattr(self, f"_on_{event.kind}")(event.payload)
            finished += self._expire_queue()
            if finished and progress is not None:
                progress.update(finished)
        return sorted(self.flights.values(), key=lambda f: f.index)

    # --- events -----------------------------------------------------------------------
    def _on_arrive(self, payload) -> int:
        index, spec = payload
        flight = Flight(index, spec, self.now)
        self.flights[flight.request_id] = flight
        try:
            demand = self.estimator.of_tokens([spec.prompt], 1,
                                              self.lengths.fields(spec)["max_tokens"],
                                              self.block_size, self.max_model_len,
                                              tenant=spec.tenant)
            self.queue.enqueue(demand, key=flight.request_id)
        except Rejected as rejection:
            flight.status, flight.finished = rejection.status, self.now
            return 1
        return 0

    def _dispatch(self, lease: Lease) -> None:
        """on_admit: the router's decision travels to the chosen replica."""
        flight = self.flights[lease.entry.key]
        flight.lease = lease
        self.schedule(self.now + self.dispatch_delay_s, "add", flight)

    def _on_add(self, flight: Flight) -> int:
        lease = flight.lease
        demand = lease.entry.demand
        hints = Hints(demand_blocks=demand.blocks, expected_output=demand.expected_output,
                      tenant=demand.tenant, admission_seq=lease.seq)
        self.replicas[lease.replica_id].add(flight.request_id, flight.spec.prompt, hints=hints,
                                            arrival=self.now, **self.lengths.fields(flight.spec))
        self._wake(lease.replica_id)
        return 0

    def _wake(self, replica_id: str) -> None:
        if replica_id not in self._busy and \
                self.replicas[replica_id].scheduler.has_unfinished_requests():
            self._busy.add(replica_id)
            self.schedule(self.now, "step", replica_id)

    def _on_step(self, replica_id: str) -> int:
        replica = self.replicas[replica_id]
        if not replica.scheduler.has_unfinished_requests():
            self._busy.discard(replica_id)
            return 0
        record = replica.step()
        self.steps += 1
        self.prefix_hits += record.prefix_hits  # vLLM's own prefix-cache counters
        self.prefix_queries += record.prefix_queries
        prefill = sum(n for n in record.scheduled.values() if n > 1)
        decode = sum(record.scheduled.values()) - prefill
        end = self.now + self.step_time(prefill, decode)
        self.schedule(end, "step_done", (replica_id, record))
        self.schedule(end + self.snapshot_delay_s, "report",
                      (replica_id, replica.scheduler.snapshot))
        if replica_id in self.kv_events:
            self.schedule(end + self.snapshot_delay_s, "kv_events",
                          (replica_id, self.kv_events[replica_id].take()))
        return 0

    def _on_step_done(self, payload) -> int:
        replica_id, record = payload
        replica = self.replicas[replica_id]
        for request_id in record.scheduled:
            flight = self.flights[request_id]
            request = replica.requests[request_id]
            if flight.first_token is None and request.num_output_tokens > 0:
                flight.first_token = self.now
            flight.tokens = request.num_output_tokens
        for request_id in record.finished:
            flight = self.flights[request_id]
            flight.finished = self.now
            self.queue.release(flight.lease)
            # What the router learns from the response's usage (router/usage.py).
            self.estimator.predictor.on_finished(len(flight.spec.prompt), flight.spec.tenant,
                                             flight.tokens)
            replica.forget(request_id)
        self._busy.discard(replica_id)
        self._wake(replica_id)
        return len(record.finished)

    def _on_report(self, payload) -> int:
        replica_id, snapshot = payload
        self.ledger.report(replica_id, snapshot)
        self.queue.pump()
        return 0

    def _on_kv_events(self, payload) -> int:
        replica_id, batches = payload
        for batch in batches:
            apply_batch(self.ledger.replicas[replica_id].prefix, batch)
        return 0

    def _expire_queue(self) -> int:
        """The router's queue timeout, in virtual time: 429 for each request it ends."""
        expired = self.queue.expire()
        for entry in expired:
            flight = self.flights[entry.key]
            flight.status, flight.finished = 429, self.now
        return len(expired)


def records_of(flights: list[Flight]) -> list[RequestRecord]:
    records = []
    for f in flights:
        ttft = f.first_token - f.arrival if f.first_token is not None else None
        e2e = (f.finished or f.arrival) - f.arrival
        itl = (e2e - ttft) / (f.tokens - 1) if ttft is not None and f.tokens > 1 else None
        records.append(RequestRecord(f.index, f.spec.tenant, f.status, ttft, itl, e2e,
                                     f.tokens if f.status == 200 else 0, len(f.spec.prompt)))
    return records
