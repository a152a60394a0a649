"""Several routers in the simulator (issue 28): deploy.yaml's policies on 64 simulated
replicas behind 1, 2, 4 and 8 routers that share nothing, each with its own ledger and
snapshot delay (bench/simulated_cluster.py `routers`). Besides goodput and preemptions it
measures the over-grant the routers' blindness to each other causes: at the moment each
dispatch reaches its replica, the blocks granted there beyond capacity (the replica's
committed blocks plus every dispatch still in transit to it, minus its total), an oracle
no router has (docs/routers.md derives its bound).

    flock /tmp/blockserve-heavy.lock python -m blockserve.bench.routers_sim \
        --trace ../shared/data/traces/azure_llm_2023_code.csv --replicas 64 \
        --routers 1 2 4 8 --requests 1000 --rate-scale-per-replica 1 \
        --out docs/results/routers_sim

`--shared-grants` gives the routers one ledger: an oracle of what routers that shared
every grant before making it would do, which the issue rules out as consensus.

`--config` runs other policies than deploy.yaml's (bench/variants.py's overrides), e.g.
`scheduler.admission_gate=reservation`, the replica gate docs/routers.md recommends for
several routers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

from blockserve.bench.provenance import announce
from blockserve.bench.simulated_cluster import Flight, SimulatedCluster
from blockserve.bench.simulator import preset_shape, resolve
from blockserve.bench.step_time import PRESETS
from blockserve.bench.trace_files import Scaling, read_trace
from blockserve.bench.variants import Variant, parse_entry
from blockserve.bench.workloads import LengthMode
from blockserve.protocol.blocks import BlockStates
from blockserve.router.admission import Lease

SHOWN = ("ok", "goodput_rps", "shed", "preemptions", "ttft_p50_s", "ttft_p99_s",
         "token_itl_p50_s", "output_tokens_per_s")
# Goodput and preemptions within this share of one router's (the target).
TOLERANCE = 0.03


class OverGrantProbe(SimulatedCluster):
    """The simulated cluster with an oracle at every replica: blocks granted beyond its
    capacity when a dispatch arrives (committed + still in transit - total)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.in_transit: dict[str, int] = defaultdict(int)
        self.over_grants: list[int] = []  # per dispatch arriving: blocks beyond capacity
        # per step that preempted: when, its replica's running requests after it, and
        # how many of them were still in (chunked) prefill
        self.preempting_steps: list[dict] = []

    def _dispatch(self, lease: Lease) -> None:
        self.in_transit[lease.replica_id] += lease.reservation.blocks
        super()._dispatch(lease)

    def _on_step(self, replica_id: str) -> int:
        scheduler = self.replicas[replica_id].scheduler
        before = scheduler.preemptions_total
        handled = super()._on_step(replica_id)
        if scheduler.preemptions_total > before:
            running = scheduler.running
            self.preempting_steps.append({
                "at_s": round(self.now, 3), "preempted": scheduler.preemptions_total - before,
                "running": len(running),
                "running_in_prefill": sum(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in running)})
        return handled

    def _on_add(self, flight: Flight) -> int:
        replica_id = flight.lease.replica_id
        states = BlockStates.of(self.replicas[replica_id].scheduler.snapshot)
        self.over_grants.append(max(0, states.committed + self.in_transit[replica_id]
                                    - states.total))
        self.in_transit[replica_id] -= flight.lease.reservation.blocks
        return super()._on_add(flight)


def run(routers: int, replicas: int, specs, preset: str, slo: SimpleNamespace,
        variant: Variant = Variant("blockserve", base="blockserve"), seed: int = 0,
        board_interval_s: float = 0.5, shared_grants: bool = False) -> dict:
    shape = preset_shape(preset)
    router, scheduler, shape = resolve(variant, shape)
    router = dict(router)
    prefix_index = router.pop("prefix_index")
    cluster = OverGrantProbe(
        replicas, shape, scheduler=scheduler, step_time=PRESETS[preset],
        length_mode=LengthMode.UNKNOWN, prefix_index=prefix_index, routers=routers,
        placement=router["placement"], queue_order=router["queue_order"],
        output_predictor=router["output_predictor"],
        queue_timeout_s=router.get("queue_timeout_s", 60.0), seed=seed,
        board_interval_s=board_interval_s, shared_grants=shared_grants)
    wall = time.perf_counter()
    flights = asyncio.run(cluster.run(specs))
    wall = time.perf_counter() - wall
    assert cluster.leftover() == (0, 0), "a simulated router leaked"
    summary = cluster.figures(flights, slo.slo_ttft, slo.slo_itl)
    grants = cluster.over_grants
    over = [g for g in grants if g]
    return {**{key: summary[key] for key in SHOWN}, "wall_s": wall,
            "snapshot_delays_s": [r.snapshot_delay_s for r in cluster.routers],
            "dispatches": len(grants), "dispatches_over_capacity": len(over),
            "over_grant_max_blocks": max(grants, default=0),
            "over_grant_mean_blocks_when_over": sum(over) / len(over) if over else 0.0,
            "preempting_steps": cluster.preempting_steps,
            "replica_total_blocks": next(iter(cluster.replicas.values())
                                         ).scheduler.snapshot.total_blocks}


def within(value: float, reference: float) -> bool:
    """`value` within TOLERANCE of `reference` (both 0 counts as within)."""
    return abs(value - reference) <= TOLERANCE * abs(reference) if reference else value == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--routers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--trace-start", type=int, default=0,
                        help="the first request replayed: another window of the trace")
    parser.add_argument("--seed", type=int, default=0,
                        help="the routers' placement draws (their spread over the cheapest)")
    parser.add_argument("--board-interval-s", type=float, default=0.5,
                        help="how often each router posts and reads the finished lengths "
                             "(router/shared_lengths.py); 0: they share none")
    parser.add_argument("--shared-grants", action="store_true",
                        help="an oracle: the routers share one ledger, so each sees every "
                             "grant at once (what no consensus-free router tier has)")
    parser.add_argument("--rate-scale-per-replica", type=float, default=1.0)
    parser.add_argument("--preset", default="a100-llama3-8b", choices=list(PRESETS))
    parser.add_argument("--config", default="blockserve",
                        help="deploy.yaml's policies, or overrides of them "
                             "(bench/variants.py: 'scheduler.admission_gate=reservation')")
    parser.add_argument("--out", default="docs/results/routers_sim")
    args = parser.parse_args()
    provenance = announce("routers_sim")
    shape = preset_shape(args.preset)
    replay = read_trace(args.trace, Scaling(rate_scale=args.rate_scale_per_replica
                                            * args.replicas, max_requests=args.requests,
                                            start=args.trace_start),
                        shape.max_model_len, shape.block_size)
    slo = SimpleNamespace(slo_ttft=2.0, slo_itl=0.1)
    variant = parse_entry(args.config, {"blockserve"})
    results: dict[str, dict] = {}
    for routers in args.routers:
        figures = run(routers, args.replicas, replay.specs, args.preset, slo, variant,
                      args.seed, args.board_interval_s, args.shared_grants)
        one = results.get("1 router")
        if one is not None:
            figures["targets_met"] = {key: within(figures[key], one[key])
                                      for key in ("goodput_rps", "preemptions")}
        results[f"{routers} router" + ("s" if routers > 1 else "")] = figures
        print(f"{routers} routers: " + ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
            for k, v in figures.items() if k != "preempting_steps"), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps({
            "command": "python -m blockserve.bench.routers_sim " + shlex.join(sys.argv[1:]),
            **provenance, "simulated": True, "preset": args.preset, "config": args.config,
            "shared_grants": args.shared_grants,
            "replicas": args.replicas, "workload": replay.scaling,
            "slo": vars(slo), "tolerance": TOLERANCE, "results": results}, indent=1))
    print(f"wrote {args.out}.json")


if __name__ == "__main__":
    main()
