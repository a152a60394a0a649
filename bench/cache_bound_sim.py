"""Issue 17's comparison at cluster sizes one machine cannot hold: bench/cache_bound.py's
tenant and session workloads, scaled to `--replicas`, in bench/simulated_cluster.py
(vLLM's real scheduler and block pool in every replica, the production router code, the
exact index fed by each engine-less scheduler's own KV event batches).

    python -m blockserve.bench.cache_bound_sim --replicas 64 [--preset a100-llama3-8b]
        [--out docs/results/cache_bound_sim_64]

Scaling, from the two-replica benchmark's per-replica shape: 6 tenants per replica (each
640 tokens = 20 blocks: the prefixes fill 75% of the cluster's cache, 120 blocks per
replica when partitioned), 30 requests per replica; 4 six-turn sessions per replica.
Both arrive at the benchmark's rate rule for the simulated cluster's capacity (bench/
cache_bound.py `at_capacity`: each second brings as many tokens as all caches hold;
the JSON's `scaling`). The step time is
a preset of bench/step_time.py; with `a100-llama3-8b` (fitted to vidur's measured A100
profile, docs/simulator.md) a prompt token costs more than a decode token, as on a GPU,
where prefix hits shorten prefill; with `cpu-tiny` (measured here) a decode token costs
6x a prompt token. The engines keep deploy.yaml's shape either way.
Hit rate = vLLM's prefix-cache hits / queries summed over the replicas' steps.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path

from blockserve.bench import traces
from blockserve.bench.cache_bound import at_capacity, sessions, tenants
from blockserve.bench.cache_bound_report import CACHE_AWARE_EXACT
from blockserve.bench.report import SLO_ITL_S, SLO_TTFT_S, percentile, ratio, summarise
from blockserve.bench.simulated_cluster import SimulatedCluster, records_of
from blockserve.bench.step_time import PRESETS
from blockserve.bench.workloads import LengthMode
from blockserve.tools.launch import EngineShape

# name -> (placement, prefix index); replicas run vLLM's own scheduling, as in the real run
CONFIGS = {CACHE_AWARE_EXACT: ("cache_aware", "exact"),
           "cache-aware, approximate index": ("cache_aware", "approximate"),
           "Dynamo cost, exact index": ("dynamo", "exact"),
           "power of two": ("power_of_two", "approximate")}


def workloads(replicas: int, seed: int) -> dict:
    """name -> (requests, scaling): the benchmark's workloads per replica, at its rate rule
    (bench/cache_bound.py `at_capacity`) for `replicas` of deploy.yaml's engines."""
    capacity = dataclasses.replace(traces.Capacity.of_deployment(), replicas=replicas)
    return {"tenants": at_capacity(tenants(n=30 * replicas, count=6 * replicas, seed=seed),
                                   capacity),
            "sessions": at_capacity(sessions(n=24 * replicas, seed=seed,
                                             max_model_len=capacity.max_model_len), capacity)}


def simulate(name: str, replicas: int, specs, preset: str, shape: EngineShape) -> dict:
    placement, index = CONFIGS[name]
    cluster = SimulatedCluster(replicas, shape, placement=placement, queue_order="fcfs",
                               scheduler={}, step_time=PRESETS[preset], prefix_index=index,
                               output_predictor="online_quantile",
                               length_mode=LengthMode.UNKNOWN)
    started = time.time()
    records = records_of(asyncio.run(cluster.run(specs)))
    makespan = max((r.e2e_s + s.arrival_s for r, s in zip(records, specs)), default=0.0)
    summary = summarise(records, makespan, 0, SLO_TTFT_S, SLO_ITL_S)
    return {"summary": summary, "cache": {
        "ttft_p90_s": percentile([r.ttft_s for r in records if r.status == 200], 0.9),
        "hit_rate": cluster.prefix_hits / cluster.prefix_queries if cluster.prefix_queries
        else None}, "simulated_s": time.time() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--preset", default="a100-llama3-8b", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/cache_bound_sim")
    args = parser.parse_args()
    shape = EngineShape.of()
    results: dict = {name: {} for name in CONFIGS}
    built = workloads(args.replicas, args.seed)
    for workload, (specs, _) in built.items():
        for name in CONFIGS:
            results[name][workload] = simulate(name, args.replicas, specs, args.preset, shape)
            print(name, workload, json.dumps(results[name][workload]["cache"]),
                  f"ttft p50 {results[name][workload]['summary']['ttft_p50_s']:.3f}")
    lines = []
    for workload in ("tenants", "sessions"):
        ours = results[CACHE_AWARE_EXACT][workload]
        for name in CONFIGS:
            if name != CACHE_AWARE_EXACT:
                theirs = results[name][workload]
                mine = {**ours["summary"], **ours["cache"]}
                other = {**theirs["summary"], **theirs["cache"]}
                lines.append(f"{workload}: ours / {name}: " + ", ".join(
                    f"{key} {ratio(mine, other, key):.2f}x" for key in
                    ("ttft_p50_s", "ttft_p90_s", "hit_rate", "output_tokens_per_s")))
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(
        {"args": vars(args), "shape": dataclasses.asdict(shape), "ours": CACHE_AWARE_EXACT,
         "scaling": {workload: scaling for workload, (_, scaling) in built.items()},
         "results": results, "report": lines}, indent=1))


if __name__ == "__main__":
    main()
