"""How much could any admission or placement policy gain over power of two on this
deployment, even one told every output length? An oracle bound for issue 15's targets,
in simulation.

    python -m blockserve.bench.admission_bound [--seeds 8] [--workloads pressure azure_code
        mooncake] [--jobs 2] [--out docs/results/admission_bound]

Every workload is replayed once per seed (bench/harness.py `workload`: a different draw
or trace window each) on deploy/deploy.yaml's replica count, in the simulator
(bench/simulated_cluster.py: vLLM's scheduler in engine-less replicas, the production
router code, virtual time, the `cpu-tiny-deployed` step-time preset), by:

- `blockserve`: deploy.yaml as it is (its router, replica scheduler and `watermark`);
  every configuration keeps deploy.yaml's prefix index, as the harness's do;
- `blockserve, no watermark`: the same on vLLM's default watermark (0), where deploy.yaml
  sets a watermark;
- `oracle`: deploy.yaml's router and scheduler, leases of `max_tokens` and the known
  length mode, so every lease is the request's true length; watermark 0;
- `oracle, shortest first`: the oracle admitting the shortest demand first;
- `power of two`, `round robin`: the harness's baselines (vLLM's scheduling, watermark 0).

Only the oracles are told the lengths; everybody else runs the unknown mode. The oracles
are this router's own policies with perfect length information, not every conceivable
policy: where even they miss a target, no output-length predictor can reach it with
these policies, and what is left to win is bounded by how little the oracle gains. Each
target is checked on every seed's ratio, against the run of the same seed, and judged
on the median over the seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from blockserve.bench.harness import BASELINES, VLLM_ENGINE_DEFAULTS, workload
from blockserve.bench.report import OURS, SLO_ITL_S, SLO_TTFT_S, TARGETS, ratio
from blockserve.bench.simulator import deployed_prefix_index, sim_config, simulate_policies
from blockserve.bench.workloads import LengthMode
from blockserve.tools.launch import EngineShape, load_config, replica_count

PRESET = "cpu-tiny-deployed"
SHORTEST_FIRST = {"cls": "shortest_demand", "kwargs": {"max_wait_s": 10}}
NO_WATERMARK = "blockserve, no watermark"
ORACLE, ORACLE_SHORTEST = "oracle", "oracle, shortest first"
POWER_OF_TWO, ROUND_ROBIN = "power of two", "round robin"
BASES = (POWER_OF_TWO, ROUND_ROBIN)
TARGET_KEYS = {"output_tokens_per_s": "tok/s", "goodput_rps": "goodput",
               "ttft_p99_s": "TTFT p99", "preemptions": "preempt"}


@dataclass(frozen=True)
class Configuration:
    """What one simulated run is given: policies, engine settings in place of
    deploy.yaml's, what requests say about their length, and the router's prefix index
    (deploy.yaml's for all, as on the deployment)."""

    router: dict
    scheduler: dict
    engine: dict
    length_mode: LengthMode
    prefix_index: str


def configurations(seed: int) -> dict[str, Configuration]:
    """The compared configurations, from deploy.yaml as it is now (read once per call);
    power of two draws its random pairs from `seed`."""
    router, scheduler = sim_config(OURS)
    oracle = {**router, "output_predictor": "max_tokens"}
    unknown, known, index = LengthMode.UNKNOWN, LengthMode.KNOWN, deployed_prefix_index()

    def baseline(label: str) -> Configuration:
        policies, vllm_scheduling = BASELINES[label]
        if label == POWER_OF_TWO:
            policies = {**policies, "placement": {"cls": policies["placement"],
                                                  "kwargs": {"seed": seed}}}
        return Configuration(policies, vllm_scheduling, VLLM_ENGINE_DEFAULTS, unknown, index)

    ours = {OURS: Configuration(router, scheduler, {}, unknown, index)}
    if EngineShape.of().watermark:  # what deploy.yaml's watermark does, where it sets one
        ours[NO_WATERMARK] = Configuration(router, scheduler, VLLM_ENGINE_DEFAULTS, unknown,
                                           index)
    return {
        **ours,
        ORACLE: Configuration(oracle, scheduler, VLLM_ENGINE_DEFAULTS, known, index),
        ORACLE_SHORTEST: Configuration({**oracle, "queue_order": SHORTEST_FIRST}, scheduler,
                                       VLLM_ENGINE_DEFAULTS, known, index),
        **{label: baseline(label) for label in BASES},
    }


@functools.lru_cache(maxsize=8)
def _specs(name: str, n: int | None, seed: int) -> tuple[list, dict]:
    return workload(name, n, seed)


def run_one(config: Configuration, workload_name: str, seed: int, args, shape: EngineShape,
            replicas: int) -> dict:
    """One configuration on one seed of one workload, on `shape`'s engines (deploy.yaml's)
    with the configuration's engine settings: its summary."""
    specs, _ = _specs(workload_name, args.requests, seed)
    return simulate_policies(config.router, config.scheduler, replicas, specs,
                             dataclasses.replace(shape, **config.engine), config.length_mode,
                             args, config.prefix_index, label=workload_name)["summary"]


def _median(values: list[float]) -> float | None:
    """Median of the defined values (a 0/0 ratio is nan: no seed to judge by)."""
    known = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(known) if known else None


def target_rows(by_config: dict[str, list[dict]]) -> list[dict]:
    """Issue 15's memory-blind targets for every configuration but the bases: the
    per-seed ratios, their median and range, met or missed on the median."""
    rows = []
    for name, mine in by_config.items():
        if name in BASES:
            continue
        for target in TARGETS:
            for against in target.against:
                if against not in by_config:
                    continue
                ratios = [ratio(a, b, target.key) for a, b in zip(mine, by_config[against])]
                known = [r for r in ratios if r is not None and not math.isnan(r)]
                median = _median(ratios)
                met = (all(target.check(a, b)[1] for a, b in zip(mine, by_config[against]))
                       if median is None else
                       median >= target.bound if target.at_least else median <= target.bound)
                rows.append({"configuration": name, "against": against, "metric": target.key,
                             "bound": target.bound_text,
                             "median_ratio": median, "min_ratio": min(known, default=None),
                             "max_ratio": max(known, default=None), "seed_ratios": ratios,
                             "met": met})
    return rows


def _x(value: float | None) -> str:
    return "-" if value is None else "inf" if math.isinf(value) else f"{value:.2f}"


def tables(workload_name: str, by_config: dict[str, list[dict]], rows: list[dict],
           modes: dict[str, str]) -> list[str]:
    seeds = len(next(iter(by_config.values())))
    lines = [f"\n{workload_name}: median over {seeds} seeds",
             f"{'configuration':<26}{'lengths':>8}{'tok/s':>8}{'goodput':>9}{'TTFT p50':>10}"
             f"{'TTFT p99':>10}{'preempt':>9}{'leases at true length':>23}"]
    for name, summaries in by_config.items():
        med = {key: _median([s[key] for s in summaries]) for key in
               ("output_tokens_per_s", "goodput_rps", "ttft_p50_s", "ttft_p99_s", "preemptions")}
        lines.append(f"{name:<26}{modes[name]:>8}{med['output_tokens_per_s']:>8.0f}"
                     f"{med['goodput_rps']:>9.2f}{med['ttft_p50_s']:>10.2f}"
                     f"{med['ttft_p99_s']:>10.2f}{med['preemptions']:>9.1f}"
                     f"{_share(summaries):>23}")
    bounds = {row["metric"]: row["bound"] for row in rows}
    lines += [f"\n{workload_name}: issue 15's targets, ratio per seed (configuration / base): "
              "median [min-max], judged on the median",
              (f"{'configuration':<26}{'vs':<14}" + "".join(
                  f"{label + ' ' + bounds[key]:<25}" for key, label in TARGET_KEYS.items())
               ).rstrip()]
    for name in (n for n in by_config if n not in BASES):
        for against in BASES:
            cells = {row["metric"]: row for row in rows
                     if row["configuration"] == name and row["against"] == against}
            lines.append(f"{name:<26}{against:<14}" + "".join(
                f"{_cell(cells[key]):<25}" for key in TARGET_KEYS).rstrip())
    lines.append("(a seed where both ran without a preemption, 0/0, is left out of the median; "
                 "inf: only the base had none)")
    return lines


def _share(summaries: list[dict]) -> str:
    """Leases whose predicted output was the true length, all seeds together."""
    exact, leases = (sum(s[key] for s in summaries) for key in ("leases_at_true_length",
                                                                 "leases"))
    return f"{exact}/{leases}"


def _cell(row: dict) -> str:
    verdict = "met" if row["met"] else "missed"
    if row["median_ratio"] is None:
        return f"0/0 every seed {verdict}"
    return f"{_x(row['median_ratio'])}x [{_x(row['min_ratio'])}-{_x(row['max_ratio'])}] {verdict}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8, help="seeds 0..N-1 of every workload")
    parser.add_argument("--workloads", nargs="+", default=["pressure", "azure_code", "mooncake"])
    parser.add_argument("--requests", type=int,
                        help="requests per workload (default: each workload's own size)")
    parser.add_argument("--jobs", type=int, default=2, help="simulations run at once")
    parser.add_argument("--out", default="docs/results/admission_bound")
    args = parser.parse_args()
    args.preset, args.slo_ttft, args.slo_itl = PRESET, SLO_TTFT_S, SLO_ITL_S
    # deploy.yaml read once, here: every run gets what the report records
    deployed = load_config()
    shape, replicas = EngineShape.of(deployed), replica_count(deployed)
    configs, seeds = {seed: configurations(seed) for seed in range(args.seeds)}, range(args.seeds)
    names = list(configs[0])
    runs = [(name, w, seed) for w in args.workloads for seed in seeds for name in names]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {(name, w, seed): pool.submit(run_one, configs[seed][name], w, seed, args,
                                                shape, replicas)
                   for name, w, seed in runs}
        done = {run: future.result() for run, future in futures.items()}
    modes = {name: config.length_mode.value for name, config in configs[0].items()}
    lines = [f"Admission bound: SIMULATION (bench/simulated_cluster.py: vLLM's scheduler in "
             f"engine-less replicas, the production router, virtual time; step-time preset "
             f"{PRESET}), not the deployment. {replicas} replicas as deploy/deploy.yaml, "
             f"seeds 0..{args.seeds - 1} of each workload; goodput: TTFT <= {SLO_TTFT_S}s and "
             f"ITL <= {SLO_ITL_S}s; only the oracles are told output lengths (this router's "
             "policies with perfect length information: a bound on what length prediction can "
             "win, not a proof over every policy)."]
    output: dict = {"workloads": {}, "summaries": {}, "targets": {}}
    for w in args.workloads:
        by_config = {name: [done[name, w, seed] for seed in seeds] for name in names}
        rows = target_rows(by_config)
        lines += tables(w, by_config, rows, modes)
        output["workloads"][w] = {seed: {"requests": len(specs), "scaling": scaling}
                                  for seed in seeds for specs, scaling in
                                  [_specs(w, args.requests, seed)]}
        output["summaries"][w], output["targets"][w] = by_config, rows
    report = "\n".join(lines)
    print(report)
    app = deployed["applications"][0]["args"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps({
        "args": vars(args), "replicas": replicas, "engine_shape": dataclasses.asdict(shape),
        "deploy_yaml": {"router": {k: v for k, v in app["router"].items() if k != "api_key"},
                        "scheduler": app["replica"].get("scheduler", {}),
                        "engine_args": app["replica"]["engine_args"]},
        "configurations": {name: dataclasses.asdict(config)  # power of two: seed = the run's
                           for name, config in configs[0].items()},
        **output, "report": report}, indent=1, default=str))
    print(f"\nwrote {args.out}.json")


if __name__ == "__main__":
    main()
