"""Placement decision time per request at 8, 64 and 1,024 replicas, in process.

    python -m blockserve.bench.decision_time [--requests 3000] [--replicas 8 64 1024]
        [--out FILE.json]

Measures the router's own code path for one admission (queue order, candidate
construction from the ledger, placement policy, reservation) and its release, with
every replica reporting and reservations in flight, for every built-in placement (by
its short name), a placement that learns latency trained first. Prints wall-clock and
CPU microseconds per decision and the CPU time's ratio to the targets (<= 50 us at 64,
<= 500 us at 1,024); `--out` writes the same figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

from blockserve.protocol.config import RouterConfig
from blockserve.protocol.registry import KINDS
from blockserve.protocol.router_policies import Candidate, Placement
from blockserve.protocol.snapshot import BlockSnapshot
from blockserve.router.admission import AdmissionQueue
from blockserve.router.demand import Demand, prefix_hashes
from blockserve.router.ledger import Ledger

TARGETS_US = {64: 50.0, 1024: 500.0}
REPLICA_COUNTS = (8, 64, 1024)
ROUNDS = 3  # the median of this many runs of `--requests` decisions
TRAINING_OUTCOMES = 256


def make_queue(replicas: int, placement: str) -> AdmissionQueue:
    ledger = Ledger(stale_after_s=1e9)  # snapshots do not age during the measurement
    rng = random.Random(0)
    now = time.time()
    for i in range(replicas):
        held = rng.randrange(0, 2000)
        ledger.report(f"replica-{i:04d}", BlockSnapshot(
            timestamp=now, total_blocks=4096, block_size=16, free_blocks=4096 - held,
            held_blocks=held, running=rng.randrange(0, 64), max_model_len=8192))
    return AdmissionQueue(ledger, RouterConfig.policy_ref("placement", placement).policy,
                          RouterConfig.policy_ref("queue_order", "fcfs").policy,
                          max_requests=10_000, max_tokens=10**9, timeout_s=60)


def train(placement: Placement, demands: list[Demand], rng: random.Random) -> None:
    """Outcomes of earlier requests, so that a placement that learns latency
    (predicted_latency) is timed as it decides once trained; the rest ignore them."""
    for demand in demands:
        chosen = Candidate(f"replica-{rng.randrange(8):04d}", 4096, rng.randrange(4096), 0,
                           rng.randrange(64), rng.random(), 0, rng.randrange(200))
        placement.on_outcome(demand, chosen, 0.05 + 0.002 * chosen.prefill_blocks,
                             0.01 + 0.0005 * chosen.ongoing)


async def measure(replicas: int, placement: str, requests: int) -> tuple[float, float]:
    """Wall-clock and CPU microseconds per decision (this process's CPU time: on a
    machine shared with other work, the wall clock also counts the time it waited)."""
    queue = make_queue(replicas, placement)
    rng = random.Random(1)
    demands = [Demand(rng.randrange(50, 2000), rng.randrange(16, 512), 1, 16,
                      prefix_hashes([rng.randrange(8)] * 64 + [i] * 64, 16))
               for i in range(requests)]
    train(queue.placement, demands[:TRAINING_OUTCOMES], rng)
    live = []
    started, cpu_started = time.perf_counter(), time.process_time()
    for demand in demands:
        live.append(await queue.admit(demand))
        if len(live) > 8 * replicas:  # keep reservations in flight, like a busy cluster
            queue.release(live.pop(0))
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    for lease in live:
        queue.release(lease)
    assert queue.ledger.reserved_blocks() == 0
    return elapsed / requests * 1e6, cpu / requests * 1e6


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--replicas", type=int, nargs="+", default=list(REPLICA_COUNTS))
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args()
    rows = []
    print(f"{'replicas':>8} {'placement':<14} {'wall us':>8} {'cpu us':>8} {'target':>8} "
          f"{'cpu/target':>10}")
    for replicas in args.replicas:
        for name in KINDS["router.placement"].names:
            runs = [asyncio.run(measure(replicas, name, args.requests)) for _ in range(ROUNDS)]
            wall, cpu = (statistics.median(run[i] for run in runs) for i in (0, 1))
            target = TARGETS_US.get(replicas)
            rows.append({"replicas": replicas, "placement": name, "wall_us": round(wall, 1),
                         "cpu_us": round(cpu, 1), "target_us": target,
                         "met": cpu <= target if target else None})
            ratio = f"{cpu / target:.2f}x" if target else "-"
            print(f"{replicas:>8} {name:<14} {wall:>8.1f} {cpu:>8.1f} {target or '-':>8} "
                  f"{ratio:>10}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m blockserve.bench.decision_time "
                                  + " ".join(sys.argv[1:]),
                       "commit": _commit(),
                       "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "load_average_1m": round(os.getloadavg()[0], 2),
                       "cpu_cores": os.cpu_count(),
                       "rounds": ROUNDS, "requests": args.requests, "results": rows},
                      f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
