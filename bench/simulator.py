"""Cluster simulator: vLLM's real scheduler in every replica, the production router code in
front, virtual time. For cluster sizes one machine cannot hold.

    python -m blockserve.bench.simulator --replicas 8 64 --workload poisson --requests 10000 \
        --rate 200 [--configs blockserve "power of two" "scheduler.block_eviction=s3fifo"] \
        [--sweep scheduler.block_eviction.head_blocks=1,2,4] [--preset cpu-tiny] [--out PREFIX]
    python -m blockserve.bench.simulator --trace azure.csv --rate-scale 20 --max-requests 20000
    python -m blockserve.bench.simulator --against docs/results/unknown_lengths.json

`--workload` is a built-in workload (bench/workloads.py; `--workload-kwargs NAME:KEY=VALUE`
sets its options) or any trace or workload file, which `--trace` names too: Azure CSV,
length-only CSV, Mooncake JSONL or this project's workload JSONL, replayed with the
`--rate-scale`, `--length-scale` and `--max-requests` stated (bench/trace_files.py).
`--configs` entries are configurations by name (SIM_CONFIGS) or overrides of deploy.yaml's
router, scheduler and engine settings, with kwargs (bench/variants.py); `--sweep` runs each
once per value of one setting. Per configuration and cluster size the report and
`--out PREFIX`.json give: requests answered and shed (429/503, failures in goodput),
throughput, goodput (within `--slo-ttft` and `--slo-itl`), TTFT p50/p90/p99, ITL p50/p99
(every inter-token gap), preemptions, vLLM's prefix-cache hit rate, the recompute tax
(bench/step_costs.py), the policy exceptions caught (replica/policy_errors.py), the block
policies it ran and the wall time per simulated request.

The third form replays a real benchmark run (bench/harness.py's JSON) in simulation:
the same seeded workloads and configurations on as many simulated replicas as
deploy/deploy.yaml runs, and prints each metric real vs simulated.

The simulated cluster (replicas, router, virtual time) is bench/simulated_cluster.py;
its replicas take the GPU preset's engine shape (bench/gpu_presets.py) or, on a CPU preset,
deploy/deploy.yaml's (the checkout's own: bench/provenance.py prints which), and a step lasts what the step-time preset says for the batch it computed
(bench/step_time.py). Output lengths stay unknown to routers and schedulers by default
(`--length-mode unknown`: a loose `max_tokens`, the simulated model ends each request at its
true length).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import json
import os
import resource
import shlex
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from tqdm import tqdm

from blockserve.bench.harness import BASELINES, VLLM_ENGINE_DEFAULTS, WORST_CASE
from blockserve.bench.provenance import announce
from blockserve.bench.simulated_cluster import SimulatedCluster, records_of
from blockserve.bench.step_time import PRESETS, StepTimeModel
from blockserve.bench.trace_files import Scaling, load_workload
from blockserve.bench.variants import (BLOCK_POLICIES, Variant, policy_label, scheduler_policies,
                                      variants, workload_kwargs)
from blockserve.bench.workloads import WORKLOADS, LengthMode, RequestSpec
from blockserve.protocol.config import RouterConfig, SchedulerConfig, Slo
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


def simulate(name: str, replicas: int, specs, args, shape: EngineShape,
             finished_before: Sequence[RequestSpec] = ()) -> dict:
    """A named configuration (SIM_CONFIGS) in `args.length_mode`."""
    return simulate_variant(Variant(name, base=name), replicas, specs, args, shape,
                            finished_before)


SCHEDULER_KINDS = ("queue_order", "admission_gate", "preemption", *BLOCK_POLICIES,
                   "step_tokens")
# Router settings the simulated cluster models (SimulatedCluster's arguments), by the
# config's key; any other router override is refused rather than silently ignored.
MODELLED_ROUTER = {"placement": "placement", "queue_order": "queue_order",
                   "output_predictor": "output_predictor", "prefix_index": "prefix_index",
                   "queue_timeout_s": "queue_timeout_s", "max_queued_requests": "max_queued"}


def resolve(variant: Variant, shape: EngineShape) -> tuple[dict, dict, EngineShape]:
    """(router settings, scheduler section, engine shape) of a configuration: its named
    base (deploy.yaml's "blockserve" where it names none), with its overrides, validated
    by the deployment's config schema."""
    base = variant.base or "blockserve"
    router, scheduler = sim_config(base)
    router = variant.applied("router", {**router, "prefix_index": deployed_prefix_index()})
    scheduler = variant.applied("scheduler", scheduler)
    engine = variant.applied("engine", VLLM_ENGINE_DEFAULTS if base in BASELINES else {})
    unmodelled = sorted(set(router) - set(MODELLED_ROUTER))
    if unmodelled:
        raise ValueError(f"{variant.label}: the simulator does not model router {unmodelled} "
                         f"(it models {', '.join(MODELLED_ROUTER)})")
    RouterConfig.model_validate(router)
    SchedulerConfig.model_validate(scheduler)
    fields = {f.name for f in dataclasses.fields(EngineShape)}
    if set(engine) - fields:
        raise ValueError(f"{variant.label}: engine settings are {sorted(fields)}, "
                         f"not {sorted(set(engine) - fields)}")
    return router, scheduler, dataclasses.replace(shape, **engine)


def simulate_variant(variant: Variant, replicas: int, specs, args, shape: EngineShape,
                     finished_before: Sequence[RequestSpec] = ()) -> dict:
    """One run of a configuration on `replicas` engines of `shape` (as `resolve` changes
    it); `args` gives the step-time preset, the length mode and the goodput SLOs."""
    router, scheduler, shape = resolve(variant, shape)
    router = dict(router)
    prefix_index = router.pop("prefix_index")
    return simulate_policies(router, scheduler, replicas, specs, shape,
                             LengthMode(args.length_mode), args, prefix_index, variant.label,
                             finished_before)


def simulate_policies(router: dict, scheduler: dict, replicas: int, specs, shape: EngineShape,
                      length_mode: LengthMode, args, prefix_index: str,
                      label: str = "", finished_before: Sequence[RequestSpec] = ()) -> dict:
    """One run of these (router, replica scheduler) policies on `shape`'s engines; `args`
    gives the step-time preset (a name, or a StepTimeModel of its own) and the goodput
    SLOs; the routers' predictors first learn `finished_before` (`SimulatedCluster.learn`).
    The summary also counts the leases whose predicted output was the request's
    true length (all of them only where the router was told every length)."""
    step_time = (args.preset if isinstance(args.preset, StepTimeModel)
                 else PRESETS[args.preset])
    # The goodput SLOs are the service's promise, as a deployment's `slo` is.
    promised = Slo(ttft_s=args.slo_ttft, tpot_s=args.slo_itl).fill(
        {"router": router, "replica": {"scheduler": scheduler}})
    router, scheduler = promised["router"], promised["replica"]["scheduler"]
    cluster = SimulatedCluster(replicas, shape, scheduler=scheduler,
                               step_time=step_time, length_mode=length_mode,
                               prefix_index=prefix_index,
                               **{MODELLED_ROUTER[key]: value for key, value in router.items()})
    cluster.learn(finished_before)
    wall = time.perf_counter()
    with tqdm(total=len(specs), desc=f"{label} x{replicas}", unit="req", leave=False,
              disable=not sys.stderr.isatty()) as bar:
        flights = asyncio.run(cluster.run(specs, bar))
    wall = time.perf_counter() - wall
    summary = cluster.figures(flights, args.slo_ttft, args.slo_itl)
    summary.update(replicas=replicas, wall_s=wall, simulated_requests_per_wall_s=len(specs) / wall,
                   max_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   leases=sum(f.lease is not None for f in flights),
                   leases_at_true_length=sum(
                       f.lease is not None
                       and f.lease.entry.demand.expected_output == f.spec.output_tokens
                       for f in flights))
    assert cluster.leftover() == (0, 0), "the simulated ledger leaked"
    return {"summary": summary, "router": {**router, "prefix_index": prefix_index},
            "scheduler": scheduler, "policies": scheduler_policies(scheduler, SCHEDULER_KINDS),
            "engine": dataclasses.asdict(shape),
            "records": [r.to_dict() for r in records_of(flights)], "kv_usage": []}


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
    """Simulate what a real harness run measured; rows of real vs simulated. The harness
    replays a seed's workloads one after the other on one deployment, so a simulated
    router's predictor first learns the outputs of the seed's earlier workloads (the
    prefix index and the engines' caches start empty: the workloads share no prompts)."""
    real = json.loads(Path(path).read_text())
    n = real["args"]["requests"]
    args.length_mode = real["args"].get("length_mode", LengthMode.KNOWN.value)
    replicas = replica_count()
    lines, output = [f"{path}: real run vs simulation ({replicas} replicas, "
                     f"step time preset {args.preset}, {args.length_mode} lengths)"], {}
    workloads = real["args"]["workloads"]
    for position, workload in enumerate(workloads):
        for name, by_workload in real["results"].items():
            if name not in SIM_CONFIGS or workload not in by_workload:
                continue
            # each seed the run replayed (a run before --seeds: its one `seed`)
            for run in by_workload[workload].get("seeds") or [
                    {"seed": real["args"]["seed"], "summary": by_workload[workload]["summary"]}]:
                specs = workload_specs(workload, n, run["seed"])
                measured = run["summary"]
                earlier = [spec for before in workloads[:position]
                           for spec in workload_specs(before, n, run["seed"])]
                simulated = simulate(name, replicas, specs, args, shape, earlier)["summary"]
                output[f"{name}: {workload}, seed {run['seed']}"] = {"real": measured,
                                                                     "simulated": simulated}
                lines.append(f"\n{name}, {workload}, seed {run['seed']} ({len(specs)} requests)")
                lines.append(f"{'metric':<14}{'real':>10}{'simulated':>11}{'sim/real':>10}")
                for key, label in COMPARED:
                    a, b = measured[key], simulated[key]
                    ratio = f"{b / a:.2f}x" if a and b is not None else "-"
                    lines.append(f"{label:<14}{a or 0:>10.3f}{b or 0:>11.3f}{ratio:>10}")
    return lines, output


# The report's columns: (summary key, heading, format); times in seconds.
COLUMNS = [("ok", "ok", "{}"), ("shed", "shed", "{}"), ("output_tokens_per_s", "tok/s", "{:.0f}"),
           ("goodput_rps", "goodput/s", "{:.2f}"), ("ttft_p50_s", "TTFT p50", "{:.3f}"),
           ("ttft_p90_s", "TTFT p90", "{:.3f}"), ("ttft_p99_s", "TTFT p99", "{:.3f}"),
           ("token_itl_p50_s", "ITL p50", "{:.4f}"), ("token_itl_p99_s", "ITL p99", "{:.4f}"),
           ("preemptions", "preempt", "{}"), ("prefix_hit_rate", "hit rate", "{:.3f}"),
           ("recompute_tax", "recompute", "{:.3f}"), ("policy_errors", "pol errors", "{}"),
           ("simulated_requests_per_wall_s", "sim req/s", "{:.1f}")]


def table(rows: dict[str, dict]) -> list[str]:
    """One line per run (label -> its summary), and the block policies each ran."""
    width = max(len(label) for label in rows) + 2
    lines = ["configuration".ljust(width) + "".join(f"{h:>11}" for _, h, _ in COLUMNS)]
    for label, run in rows.items():
        s = run["summary"]
        lines.append(label.ljust(width) + "".join(
            f"{'-' if s[key] is None else fmt.format(s[key]):>11}" for key, _, fmt in COLUMNS))
    lines.append("")
    lines += [f"{label}: " + ", ".join(f"{k} {v}" for k, v in run["policies"].items())
              + f"; router {policy_label(run['router']['placement'])}, "
              f"{run['router']['prefix_index']} index"
              for label, run in rows.items()]
    return lines


def sweep(args, shape: EngineShape) -> tuple[list[str], dict]:
    """Every configuration at every cluster size, on one workload. Each run is one
    process; `--jobs` runs that many at once (runs share nothing)."""
    runs = [(variant, replicas) for replicas in args.replicas for variant in args.variants]
    settings = SimpleNamespace(preset=args.preset, length_mode=args.length_mode,
                               slo_ttft=args.slo_ttft, slo_itl=args.slo_itl)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {(v.label, replicas): pool.submit(simulate_variant, v, replicas, args.specs,
                                                    settings, shape) for v, replicas in runs}
        done = {run: future.result() for run, future in futures.items()}
    results = {f"{label} x{replicas}": run for (label, replicas), run in done.items()}
    lines = [f"{args.workload_label}: {len(args.specs)} requests, preset {args.preset}, "
             f"{args.length_mode} lengths, goodput SLO TTFT <= {args.slo_ttft}s and "
             f"ITL <= {args.slo_itl}s", *table(results)]
    return lines, results


def preset_shape(preset: str) -> EngineShape:
    """A GPU preset's own engine (bench/gpu_presets.py: its model on its GPUs, vLLM's
    defaults); a CPU preset's is deploy.yaml's."""
    from blockserve.bench import gpu_presets

    if preset in gpu_presets.ENGINES:
        return gpu_presets.engine_shape(preset)
    return EngineShape.of()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[64])
    parser.add_argument("--requests", type=int,
                        help="requests (default: 10,000 of a built-in workload, all of a file)")
    parser.add_argument("--rate", type=float, default=100.0,
                        help="arrivals per second (built-in workloads that have a rate, and "
                             "trace files without timestamps)")
    parser.add_argument("--workload", default="poisson",
                        help=f"a built-in workload ({', '.join(sorted(WORKLOADS))}) or a file")
    parser.add_argument("--workload-kwargs", nargs="+", default=[], metavar="NAME:KEY=VALUE",
                        help="options of the workload, e.g. cross_tenant:tenants=16")
    parser.add_argument("--trace", metavar="FILE", help="replay this trace or workload file")
    parser.add_argument("--rate-scale", type=float, default=1.0,
                        help="trace files: arrivals this many times as fast")
    parser.add_argument("--length-scale", type=float, default=1.0,
                        help="trace files: prompt and output lengths times this")
    parser.add_argument("--max-requests", type=int, help="trace files: the first N requests")
    parser.add_argument("--trace-start", type=int, default=0,
                        help="trace files: the first request replayed")
    parser.add_argument("--configs", nargs="+", default=["blockserve"], metavar="ENTRY",
                        help=f"by name ({', '.join(SIM_CONFIGS)}) or overrides "
                             "SECTION.KEY=VALUE,... (bench/variants.py)")
    parser.add_argument("--sweep", metavar="SECTION.KEY=V1,V2",
                        help="run every configuration once per value of one setting")
    parser.add_argument("--preset", choices=list(PRESETS),
                        help="step-time model (default: cpu-tiny; cpu-tiny-deployed with "
                             "--against)")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO, seconds")
    parser.add_argument("--slo-itl", type=float, default=0.1, help="goodput SLO, seconds")
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
    parser.add_argument("--out", default="results/simulation", help="writes OUT.json")
    args = parser.parse_args()
    args.preset = args.preset or ("cpu-tiny-deployed" if args.against else "cpu-tiny")
    provenance = announce("simulator")
    shape = preset_shape(args.preset)
    if args.model_dir:
        shape = dataclasses.replace(shape, model=os.path.expanduser(args.model_dir))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    workload = None
    if args.against:
        lines, output = against_real(args.against, args, shape)
    else:
        try:
            args.variants = variants(args.configs, SIM_CONFIGS, args.sweep)
            for variant in args.variants:
                resolve(variant, shape)
            source = args.trace or args.workload
            kwargs = workload_kwargs(args.workload_kwargs, [source])[source]
            if source in WORKLOADS and "rate" in inspect.signature(WORKLOADS[source]).parameters:
                kwargs = {"rate": args.rate, **kwargs}
            n = args.requests if args.requests or args.trace else 10_000
            workload = load_workload(source, n, args.seed, kwargs, Scaling(
                args.rate_scale, args.length_scale, args.max_requests, args.trace_start,
                args.rate, args.seed), shape.max_model_len, shape.block_size)
        except ValueError as error:
            parser.error(str(error))
        args.specs, args.workload_label = workload.specs, source
        lines, output = sweep(args, shape)
    report = "\n".join(lines)
    print(report)
    saved = {k: v for k, v in vars(args).items() if k not in ("specs", "variants")}
    Path(f"{args.out}.json").write_text(json.dumps({
        "command": "python -m blockserve.bench.simulator " + shlex.join(sys.argv[1:]),
        **provenance, "args": saved, "workload": workload and workload.scaling,
        "results": {label: {k: v for k, v in run.items() if k != "records"}
                    for label, run in output.items()} if not args.against else output,
        "report": report}, indent=1))
    print(f"wrote {args.out}.json")


if __name__ == "__main__":
    main()
