"""A cluster in virtual time: vLLM's real scheduler in every replica, the production
router code in front (the simulator's engine; its CLI is bench/simulator.py).

Each simulated replica is `blockserve.tools.engine_less.EngineLessReplica`: vLLM's own
Scheduler (the block-aware subclass and its policies), KV cache manager and block pool,
with one fabricated token per scheduled request, on the simulation's clock. A step takes
`StepTimeModel` seconds of virtual time, for the `StepBatch` it computed: a prefix hit skips
its tokens' prefill, and a preempted request pays its recompute again, less what still
hits (bench/step_costs.py counts that recompute tax). The router is the real `Ledger` +
`AdmissionQueue` + placement policy; snapshots reach it after `snapshot_delay_s`,
dispatches reach replicas after `dispatch_delay_s`. As router/relay.py does, a
request's first token acknowledges its reservation (its prompt leaves the replica's queued
prefill) and tells the placement its TTFT, and its end tells it its TPOT
(`Placement.on_outcome`); every response counts as streamed. With `routers` > 1 (issue 28) each
router has its own ledger, queue and predictor, takes every `routers`-th arrival (as
HAProxy spreads connections) and hears every replica after its own delay: router k
after `snapshot_delay_s * (1 + k / routers)`. What they share goes through a simulated
router board, as router/peers.py posts and reads it: every `board_interval_s`, router k
(at its phase k / routers of the interval) posts the lengths it saw finish and learns
the others' (router/shared_lengths.py). `shared_grants` is an oracle no deployment has:
the routers share one ledger, so each sees every grant the others make at once, as if
every reservation went through one shared service at no cost (docs/routers.md). With
`prefix_index="exact"` each replica's vLLM KV cache events (the same batches its
scheduler would publish over ZMQ, router/kv_events.py's InProcessEvents) reach each
router's exact prefix index with its snapshots, and prompts are hashed as vLLM hashes them.
"""

from __future__ import annotations

import heapq
import itertools
import random
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

from blockserve.bench.client import RequestRecord
from blockserve.bench.report import percentile, summarise
from blockserve.bench.step_costs import StepCosts
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


@dataclass
class SimulatedRouter:
    """One router of several: what it knows is its own (issue 28)."""

    ledger: Ledger
    queue: AdmissionQueue
    estimator: DemandEstimator
    snapshot_delay_s: float


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
    last_token: float | None = None
    status: int = 200
    router: SimulatedRouter | None = None

    @property
    def request_id(self) -> str:
        return f"q{self.index}"


class SimulatedCluster:
    def __init__(self, replicas: int, shape: EngineShape, *, placement: str | dict,
                 queue_order: str | dict, scheduler: dict, step_time: StepTimeModel,
                 output_predictor: str | dict = "max_tokens",
                 snapshot_delay_s: float = 0.02, dispatch_delay_s: float = 0.005,
                 queue_timeout_s: float = 60.0, max_queued: int = 100_000,
                 length_mode: LengthMode = LengthMode.KNOWN, prefix_index: str = "approximate",
                 routers: int = 1, seed: int = 0, board_interval_s: float = 0.5,
                 shared_grants: bool = False):
        """`seed`: the routers' placement draws (router k draws from 1000 x seed + k);
        `board_interval_s`: the routers' poll interval (RouterConfig's default); 0: they
        share no lengths, as before router/shared_lengths.py; `shared_grants`: one ledger
        for all routers, fed by the first router's snapshots (module docstring)."""
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
        self.kv_events = {replica_id: InProcessEvents(replica.scheduler)
                          for replica_id, replica in self.replicas.items()} if exact else {}
        self.routers: list[SimulatedRouter] = []
        for k in range(routers):
            shared = self.routers[0].ledger if shared_grants and self.routers else None
            self.routers.append(self._router(placement, queue_order, output_predictor, exact,
                                             queue_timeout_s, max_queued,
                                             snapshot_delay_s * (1 + k / routers), shared))
        # who hears each step's snapshot (with shared grants, the one ledger once), and
        # whose queues place on what a router hears (with shared grants, every router's)
        self._listeners = self.routers[:1] if shared_grants else self.routers
        self._shared_grants = shared_grants
        for k, router in enumerate(self.routers):  # as router/peers.py tells each router
            router.queue.routers = routers
            router.queue.placement.rng = random.Random(1000 * seed + k)
        self.board_interval_s = board_interval_s
        self.board: dict[int, list] = {}  # router -> the lengths it posted last
        self._exchanges = 0  # board exchanges scheduled: the rest of the events are work
        # (time, order, handler, payload): plain tuples, which the heap compares fastest
        self._events: list[tuple] = []
        self._order = itertools.count()
        self._busy: set[str] = set()
        self.flights: dict[str, Flight] = {}  # by request id, from arrival on
        self.steps = 0
        self.prefix_hits = self.prefix_queries = 0  # prompt tokens, all replicas
        self.costs = StepCosts()
        self.token_gaps = array("d")  # every inter-token gap of every request, seconds

    def _router(self, placement, queue_order, output_predictor, exact: bool,
                queue_timeout_s: float, max_queued: int, delay_s: float,
                ledger: Ledger | None = None) -> SimulatedRouter:
        if ledger is None:
            ledger = Ledger(stale_after_s=1e9, clock=self.clock,
                            prefix_index=ExactPrefixIndex if exact else ApproximatePrefixIndex)
            for replica_id, replica in self.replicas.items():
                ledger.report(replica_id, replica.scheduler.snapshot)
                if exact:
                    ledger.replicas[replica_id].prefix.start()
        queue = AdmissionQueue(
            ledger, RouterConfig.policy_ref("placement", placement).policy,
            RouterConfig.policy_ref("queue_order", queue_order).policy, max_requests=max_queued,
            max_tokens=10**12, timeout_s=queue_timeout_s, clock=self.clock)
        queue.on_admit = self._dispatch
        estimator = DemandEstimator(
            None, RouterConfig.policy_ref("output_predictor", output_predictor).policy)
        if exact:  # the engine-less replicas derive NONE_HASH as a real engine does
            from blockserve.replica.kv_events import reproducible_seed

            estimator.block_hasher = VllmBlockHasher("sha256", reproducible_seed("sha256"))
        return SimulatedRouter(ledger, queue, estimator, delay_s)

    def learn(self, finished: Iterable[RequestSpec]) -> None:
        """Every router's predictor learns these requests' output lengths, as if they had
        finished before this run: a deployment that replayed another workload first (the
        harness replays its workloads one after the other on one deployment)."""
        for spec in finished:
            for router in self.routers:
                router.estimator.predictor.on_finished(len(spec.prompt), spec.tenant,
                                                       spec.output_tokens)

    def leftover(self) -> tuple[int, int]:
        """Blocks still reserved and requests still queued, over every router: (0, 0)
        once a run has ended, or the simulation leaked."""
        return (sum(router.ledger.reserved_blocks() for router in self._listeners),
                sum(len(router.queue.waiting) for router in self.routers))

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
        """`kind`'s handler `_on_<kind>(payload)` runs at virtual time `at`."""
        heapq.heappush(self._events, (at, next(self._order), getattr(self, f"_on_{kind}"),
                                      payload))

    async def run(self, specs: list[RequestSpec], progress=None) -> list[Flight]:
        """Every request to its end (async: the admission queue's futures need a loop)."""
        for index, spec in enumerate(specs):
            self.schedule(spec.arrival_s, "arrive", (index, spec))
        if len(self.routers) > 1 and self.board_interval_s > 0:
            for k in range(len(self.routers)):
                self._exchange_at(k / len(self.routers) * self.board_interval_s, k)
        events, pop = self._events, heapq.heappop
        while events:
            self.now, _, handler, payload = pop(events)
            finished = handler(payload)
            for router in self.routers:
                if router.queue.waiting:
                    finished += self._expire_queue(router.queue)
            if finished and progress is not None:
                progress.update(finished)
        return sorted(self.flights.values(), key=lambda f: f.index)

    # --- events -----------------------------------------------------------------------
    def _on_arrive(self, payload) -> int:
        index, spec = payload
        router = self.routers[index % len(self.routers)]
        flight = Flight(index, spec, self.now, router=router)
        self.flights[flight.request_id] = flight
        try:
            demand = router.estimator.of_tokens([spec.prompt], 1,
                                                self.lengths.fields(spec)["max_tokens"],
                                                self.block_size, self.max_model_len,
                                                tenant=spec.tenant)
            router.queue.enqueue(demand, key=flight.request_id)
        except Rejected as rejection:
            flight.status, flight.finished = rejection.status, self.now
            return 1
        return 0

    def _exchange_at(self, at: float, k: int) -> None:
        self._exchanges += 1
        self.schedule(at, "exchange", k)

    def _on_exchange(self, k: int) -> int:
        """Router k posts to the board and reads the others' posts; it goes on doing so
        while the simulation has other events."""
        self._exchanges -= 1
        lengths = self.routers[k].estimator.lengths
        self.board[k] = lengths.posted()
        lengths.hear({j: posted for j, posted in self.board.items() if j != k})
        if len(self._events) > self._exchanges:
            self._exchange_at(self.now + self.board_interval_s, k)
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
        """One engine step: its end, and the snapshot and KV events it publishes, are
        scheduled; the replica is busy until then (an idle one takes no events)."""
        replica = self.replicas[replica_id]
        if not replica.scheduler.has_unfinished_requests():
            self._busy.discard(replica_id)
            return 0
        record = replica.step()
        self.steps += 1
        self.prefix_hits += record.prefix_hits  # vLLM's own prefix-cache counters
        self.prefix_queries += record.prefix_queries
        requests = replica.requests
        batch = self.costs.batch(record.scheduled, record.computed_before,
                                 lambda request_id: requests[request_id].num_prompt_tokens)
        end = self.now + self.step_time(batch)
        self.schedule(end, "step_done", (replica_id, record))
        events = self.kv_events[replica_id].take() if replica_id in self.kv_events else ()
        for router in self._listeners:
            self.schedule(end + router.snapshot_delay_s, "report",
                          (router, replica_id, replica.scheduler.snapshot, events))
        return 0

    def _on_step_done(self, payload) -> int:
        replica_id, record = payload
        replica = self.replicas[replica_id]
        now, gaps = self.now, self.token_gaps
        for request_id in record.scheduled:
            flight = self.flights[request_id]
            tokens = replica.requests[request_id].num_output_tokens
            if tokens > flight.tokens:
                if flight.first_token is None:
                    flight.first_token = now
                    self._first_token(flight)
                else:
                    gaps.append(now - flight.last_token)
                flight.tokens, flight.last_token = tokens, now
        for request_id in record.finished:
            flight = self.flights[request_id]
            flight.finished = now
            if flight.tokens > 1:
                flight.router.queue.placement.on_outcome(
                    flight.lease.entry.demand, flight.lease.chosen, None,
                    (now - flight.first_token) / (flight.tokens - 1))
            flight.router.queue.release(flight.lease)
            # What the router learns from the response's usage (router/usage.py).
            flight.router.estimator.lengths.learn(len(flight.spec.prompt), flight.spec.tenant,
                                                  flight.tokens)
            replica.forget(request_id)
            self.costs.forget(request_id)
        self._busy.discard(replica_id)
        if replica.scheduler.has_unfinished_requests():  # the next step starts now
            self._busy.add(replica_id)
            self._on_step(replica_id)
        return len(record.finished)

    def _first_token(self, flight: Flight) -> None:
        """What the relay does with a response's first chunk (before the end of a
        one-token request releases its lease)."""
        router, lease = flight.router, flight.lease
        router.ledger.acknowledge(lease.reservation)
        router.queue.placement.on_outcome(lease.entry.demand, lease.chosen,
                                          self.now - lease.entry.admitted_at, None)
        router.queue.pump()

    def _on_report(self, payload) -> int:
        """A step's snapshot (and KV events) reach a router."""
        router, replica_id, snapshot, kv_batches = payload
        for batch in kv_batches:
            apply_batch(router.ledger.replicas[replica_id].prefix, batch)
        router.ledger.report(replica_id, snapshot)
        for placing in self.routers if self._shared_grants else (router,):
            placing.queue.pump()
        return 0

    def figures(self, flights: list[Flight], slo_ttft_s: float, slo_itl_s: float) -> dict:
        """A finished run's figures (issue 25): bench/report.py's summary (goodput counts
        requests answered within both SLOs, so shed ones are failures), TTFT p90, ITL over
        every inter-token gap, the router's admission wait, vLLM's prefix-cache hit rate, the
        recompute tax, the exceptions the replicas' policies raised (each answered by
        vLLM's behaviour)."""
        records = records_of(flights)
        makespan = max((f.finished or 0) for f in flights) - min(f.arrival for f in flights)
        preemptions = sum(r.scheduler.preemptions_total for r in self.replicas.values())
        summary = summarise(records, makespan, preemptions, slo_ttft_s, slo_itl_s)
        gaps = self.token_gaps
        # How long the router held each admitted request before placing it (must_fit).
        waits = [f.lease.entry.admitted_at - f.arrival for f in flights if f.lease]
        summary.update(
            admission_wait_mean_s=sum(waits) / len(waits) if waits else None,
            admission_wait_p99_s=percentile(waits, 0.99),
            slo_ttft_s=slo_ttft_s, slo_itl_s=slo_itl_s,
            shed=sum(r.status in (429, 503) for r in records),
            ttft_p90_s=percentile([r.ttft_s for r in records if r.status == 200], 0.9),
            token_itl_p50_s=percentile(gaps, 0.5), token_itl_p99_s=percentile(gaps, 0.99),
            prefix_hit_rate=self.prefix_hits / self.prefix_queries if self.prefix_queries
            else 0.0,
            prefix_hit_tokens=self.prefix_hits, prefix_query_tokens=self.prefix_queries,
            computed_tokens=self.costs.computed_tokens,
            recomputed_tokens=self.costs.recomputed_tokens,
            recompute_tax=self.costs.recompute_tax, steps=self.steps,
            policy_errors=sum(sum(r.scheduler.policy_errors.counts.values())
                              for r in self.replicas.values()))
        return summary

    def _expire_queue(self, queue: AdmissionQueue) -> int:
        """A router's queue timeout, in virtual time: 429 for each request it ends."""
        expired = queue.expire()
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
