"""Cluster simulator: vLLM's real scheduler in every replica, the production router code in
front, virtual time. For cluster sizes one machine cannot hold.

    python -m blockserve.bench.simulator --replicas 64 --requests 10000 --rate 200 \
        [--configs blockserve "power of two"] [--preset cpu-tiny]
    python -m blockserve.bench.simulator --against docs/results/unknown_lengths.json

The second form replays a real benchmark run (bench/harness.py's JSON) in simulation:
the same seeded workloads and configurations on as many simulated replicas as
deploy/deploy.yaml runs, and prints each metric real vs simulated.

The simulated cluster (replicas, router, virtual time) is bench/simulated_cluster.py;
its replicas take deploy/deploy.yaml's engine shape, and a step lasts what the step-time
preset says (bench/step_time.py). Workloads, their length modes (`--length-mode`,
default unknown: the router and the schedulers see a loose `max_tokens`, the simulated
model ends each request at its true length) and the report are the benchmark harness's
(bench/workloads.py, bench/harness.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import json
import os
import resource
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tqdm import tqdm

from blockserve.bench.harness import (BASELINES, VLLM_ENGINE_DEFAULTS, WORST_CASE, absolute_table,
                                      plot, ratio_table, summarise)
from blockserve.bench.simulated_cluster import SimulatedCluster, records_of
from blockserve.bench.step_time import PRESETS
from blockserve.bench.workloads import WORKLOADS, LengthMode, RequestSpec
from blockserve.tools.launch import EngineShape, app_config, load_config, replica_count


ROUTER_KEYS = ("placement", "queue_order", "output_predictor")  # what the simulation runs
# deploy/deploy.yaml's router and scheduler policies, with these (router, scheduler)
# changes: the default itself and the alternatives it was chosen over (docs/admission.md).
DEPLOYED_VARIANTS = {
    "blockserve": ({}, {}),
    "blockserve best fit": ({"placement": "best_fit"}, {}),
    "blockserve no headroom": ({}, {"admission_gate": "reservation"}),
    "blockserve shortest first": ({"queue_order": {
        "cls": "shortest_demand", "kwargs": {"max_wait_s": 2}}}, {}),
}
SIM_CONFIGS = {
    **dict.fromkeys(DEPLOYED_VARIANTS),
    "blockserve worst case": WORST_CASE,
    "blockserve balanced": ({**WORST_CASE[0], "placement": "balanced"}, WORST_CASE[1]),
    **BASELINES,
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


def deployed_prefix_index() -> str:
    """deploy.yaml's router.prefix_index, which every configuration keeps, as on the
    deployment (bench/targets.py changes only the policies)."""
    return app_config().router.prefix_index.cls


def simulate(name: str, replicas: int, specs, args, shape: EngineShape) -> dict:
    """A named configuration (SIM_CONFIGS) in `args.length_mode`."""
    router, scheduler = sim_config(name)
    if name in BASELINES:  # as on the deployment: the baselines run vLLM's own engine defaults
        shape = dataclasses.replace(shape, **VLLM_ENGINE_DEFAULTS)
    return simulate_policies(router, scheduler, replicas, specs, shape,
                             LengthMode(args.length_mode), args, deployed_prefix_index(),
                             label=name)


def simulate_policies(router: dict, scheduler: dict, replicas: int, specs, shape: EngineShape,
                      length_mode: LengthMode, args, prefix_index: str,
                      label: str = "") -> dict:
    """One run of these (router, replica scheduler) policies on `shape`'s engines;
    `args` gives the step-time preset and the goodput SLO. The summary also counts the
    leases whose predicted output was the request's true length (all of them only where
    the router was told every length)."""
    cluster = SimulatedCluster(replicas, shape, **router, scheduler=scheduler,
                               step_time=PRESETS[args.preset], length_mode=length_mode,
                               prefix_index=prefix_index)
    wall = time.perf_counter()
    with tqdm(total=len(specs), desc=f"{label} x{replicas}", unit="req", leave=False) as bar:
        flights = asyncio.run(cluster.run(specs, bar))
    wall = time.perf_counter() - wall
    records = records_of(flights)
    makespan = max((f.finished or 0) for f in flights) - min(f.arrival for f in flights)
    preemptions = sum(r.scheduler.preemptions_total for r in cluster.replicas.values())
    summary = summarise(records, makespan, preemptions, args.slo_ttft, args.slo_itl)
    summary.update(wall_s=wall, steps=cluster.steps,
                   simulated_requests_per_wall_s=len(specs) / wall,
                   max_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   leases=sum(f.lease is not None for f in flights),
                   leases_at_true_length=sum(
                       f.lease is not None
                       and f.lease.entry.demand.expected_output == f.spec.output_tokens
                       for f in flights))
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


def against_real(path: str, args, shape: EngineShape) -> tuple[list[str], dict]:
    """Simulate what a real harness run measured; rows of real vs simulated."""
    real = json.loads(Path(path).read_text())
    n = real["args"]["requests"]
    args.length_mode = real["args"].get("length_mode", LengthMode.KNOWN.value)
    replicas = replica_count()
    lines, output = [f"{path}: real run vs simulation ({replicas} replicas, "
                     f"step time preset {args.preset}, {args.length_mode} lengths)"], {}
    for workload in real["args"]["workloads"]:
        for name, by_workload in real["results"].items():
            if name not in SIM_CONFIGS or workload not in by_workload:
                continue
            # each seed the run replayed (a run before --seeds: its one `seed`)
            for run in by_workload[workload].get("seeds") or [
                    {"seed": real["args"]["seed"], "summary": by_workload[workload]["summary"]}]:
                specs = workload_specs(workload, n, run["seed"])
                measured = run["summary"]
                simulated = simulate(name, replicas, specs, args, shape)["summary"]
                output[f"{name}: {workload}, seed {run['seed']}"] = {"real": measured,
                                                                     "simulated": simulated}
                lines.append(f"\n{name}, {workload}, seed {run['seed']} ({len(specs)} requests)")
                lines.append(f"{'metric':<14}{'real':>10}{'simulated':>11}{'sim/real':>10}")
                for key, label in COMPARED:
                    a, b = measured[key], simulated[key]
                    ratio = f"{b / a:.2f}x" if a and b is not None else "-"
                    lines.append(f"{label:<14}{a or 0:>10.3f}{b or 0:>11.3f}{ratio:>10}")
    return lines, output


def sweep(args, shape: EngineShape) -> tuple[list[str], dict]:
    """Every configuration at every cluster size, on one seeded workload. Each run is
    one process; `--jobs` runs that many at once (runs share nothing)."""
    specs = workload_specs(args.workload, args.requests, args.seed, args.rate)
    runs = [(name, replicas) for replicas in args.replicas for name in args.configs]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {run: pool.submit(simulate, *run, specs, args, shape)
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
    parser.add_argument("--model-dir", help="the model's config (no weights are read); "
                        "default: deploy/deploy.yaml's model")
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
    shape = EngineShape.of()
    if args.model_dir:
        shape = dataclasses.replace(shape, model=os.path.expanduser(args.model_dir))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.against:
        lines, output = against_real(args.against, args, shape)
    else:
        lines, output = sweep(args, shape)
    report = "\n".join(lines)
    print(report)
    Path(f"{args.out}.json").write_text(json.dumps({"args": vars(args), "summaries": output,
                                                    "report": report}, indent=1))


if __name__ == "__main__":
    main()
