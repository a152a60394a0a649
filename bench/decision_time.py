"""Placement decision time per request at 8, 64 and 1,024 replicas, in process.

    python -m blockserve.bench.decision_time [--requests 3000]

Measures the router's own code path for one admission (queue order, candidate
construction from the ledger, placement policy, reservation) and its release, with
every replica reporting and reservations in flight. Prints microseconds per decision
for each policy and the ratio to the targets (<= 50 us at 64, <= 500 us at 1,024).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from blockserve.protocol.queue_orders import FirstComeFirstServed
from blockserve.protocol.snapshot import BlockSnapshot
from blockserve.router.admission import AdmissionQueue
from blockserve.router.demand import Demand, prefix_hashes
from blockserve.router.ledger import Ledger
from blockserve.router.placement import BestFitBlocks, LeastKvUsage, PowerOfTwoChoices, RoundRobin

TARGETS_US = {64: 50.0, 1024: 500.0}


def make_queue(replicas: int, placement) -> AdmissionQueue:
    ledger = Ledger(stale_after_s=1e9)  # snapshots do not age during the measurement
    rng = random.Random(0)
    now = time.time()
    for i in range(replicas):
        held = rng.randrange(0, 2000)
        ledger.report(f"replica-{i:04d}", BlockSnapshot(
            timestamp=now, total_blocks=4096, block_size=16, free_blocks=4096 - held,
            held_blocks=held, running=rng.randrange(0, 64), max_model_len=8192))
    return AdmissionQueue(ledger, placement, FirstComeFirstServed(), max_requests=10_000,
                          max_tokens=10**9, timeout_s=60)


async def measure(replicas: int, placement, requests: int) -> float:
    queue = make_queue(replicas, placement)
    rng = random.Random(1)
    demands = [Demand(rng.randrange(50, 2000), rng.randrange(16, 512), 1, 16,
                      prefix_hashes([rng.randrange(8)] * 64 + [i] * 64, 16))
               for i in range(requests)]
    live = []
    started = time.perf_counter()
    for demand in demands:
        live.append(await queue.admit(demand))
        if len(live) > 8 * replicas:  # keep reservations in flight, like a busy cluster
            queue.release(live.pop(0))
    elapsed = time.perf_counter() - started
    for lease in live:
        queue.release(lease)
    assert queue.ledger.reserved_blocks() == 0
    return elapsed / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    policies = {"BestFitBlocks": BestFitBlocks, "LeastKvUsage": LeastKvUsage,
                "PowerOfTwoChoices": PowerOfTwoChoices, "RoundRobin": RoundRobin}
    print(f"{'replicas':>8} {'policy':<18} {'us/decision':>12} {'target':>8} {'ratio':>7}")
    for replicas in (8, 64, 1024):
        for name, policy in policies.items():
            samples = [asyncio.run(measure(replicas, policy(), args.requests)) for _ in range(3)]
            us = statistics.median(samples)
            target = TARGETS_US.get(replicas)
            ratio = f"{us / target:.2f}x" if target else "-"
            print(f"{replicas:>8} {name:<18} {us:>12.1f} {target or '-':>8} {ratio:>7}")


if __name__ == "__main__":
    main()
