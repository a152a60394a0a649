"""The contest: blockserve against in-tree copies of the best routers there are, in the
simulator (vLLM's real scheduler in every replica, the production router code in front,
output lengths unknown to every router), on one GPU preset.

    python -m blockserve.bench.contest [--requests-per-replica 10 | --duration-s 30]
        [--replicas 16 64]
        [--loads 0.8 1.0 1.2] [--workloads azure_code mooncake llmd_shape sharegpt arxiv]
        [--preset a100-llama3-8b] [--jobs 2] [--out docs/results/contest/contest]
        [--candidates "blockserve + router.placement=cache_aware(must_fit=false)" ...]
    python -m blockserve.bench.contest --rescore OUT.json

1. Capacity, per workload, by CAPACITY_RULE, measured here.
2. Every configuration of CONFIGS on every workload (bench/contest_workloads.py), cluster
   size and load (a multiple of capacity); `QUEUE_VARIANTS` only at load 1.0. Each run has
   `--requests-per-replica` x replicas requests (a burst: at a high rate they all arrive
   within a second or two), or with `--duration-s`, that many seconds of arrivals at its
   rate (a steady state, where queues and KV use build up); the same requests for every
   configuration.
3. The targets (`TARGETS`, ours / the best peer unless said), met or missed, with every
   configuration in turn as ours, and `NEW_DEFAULT_RULE`'s verdict. A `--candidates`
   entry (a bench/variants.py entry: a would-be default) runs everywhere the default does
   and is judged as ours against the same peers; it is never a peer itself.

Goodput counts requests answered within TTFT <= 1 s and TPOT (a request's mean
inter-token gap) <= 50 ms; shed requests (429/503) are failures and are reported. Writes
OUT.json (every figure, the capacity runs, each target), OUT.md (the tables) and
OUT-ttft.png / OUT-goodput.png (TTFT p90 and goodput against load, a line per router).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from types import SimpleNamespace

from blockserve.bench import contest_workloads
from blockserve.bench.provenance import announce
from blockserve.bench.simulator import SIM_CONFIGS, preset_shape, simulate_variant
from blockserve.bench.variants import parse_entry

SLO_TTFT_S, SLO_TPOT_S = 1.0, 0.05
REQUESTS_PER_REPLICA = 10  # a run's default size: a burst (module docstring)
OURS = "blockserve"
LENGTH_RANK = "blockserve length rank"
FCFS = "blockserve FCFS"
QUEUE_VARIANTS = (LENGTH_RANK, FCFS)  # run at load 1.0 only, for the length-rank target
_VLLM = "scheduler.block_eviction=vllm"  # peers run vLLM's scheduling unchanged
_PREDICTOR = "router.output_predictor=online_quantile(quantile=0.8, prior_tokens=128, min_samples=8)"
# label -> a bench/variants.py entry; each peer is named for what it copies.
CONFIGS = {
    "round robin": f"round robin + {_VLLM}",
    "power of two": f"power of two + {_VLLM}",
    "llm-d load (least KV + queue)": f"power of two + router.placement=llmd_load, {_VLLM}",
    "approximate index (Ray Serve LLM / SGLang)":
        f"power of two + router.placement=cache_aware(decode_weight=1), "  # as first measured
        f"router.prefix_index=approximate, {_VLLM}",
    "llm-d precise (exact index + load)":
        f"power of two + router.placement=llmd_precise, router.prefix_index=exact, {_VLLM}",
    "Dynamo KV router": f"power of two + router.placement=dynamo, router.prefix_index=exact, "
                        f"{_VLLM}",
    "llm-d predicted latency": f"power of two + router.placement=predicted_latency, "
                               f"router.prefix_index=exact, {_PREDICTOR}, {_VLLM}",
    "vLLM watermark 0.05 + power of two": f"power of two + engine.watermark=0.05, {_VLLM}",
    OURS: "blockserve",  # deploy/deploy.yaml's router and scheduler policies, as they are
    # the same with the queues (router and replica) ordered by predicted length rank
    LENGTH_RANK: "blockserve + router.queue_order=shortest_demand(max_wait_s=2), "
                 "scheduler.queue_order=shortest_demand(max_wait_s=2)",
    # ... and first come, first served: what the issue measures length rank against
    FCFS: "blockserve + router.queue_order=fcfs, scheduler.queue_order=fcfs",
}
PEERS = [label for label in CONFIGS if label not in (OURS, *QUEUE_VARIANTS)]
LENGTH_RANK_TARGET = "mean TTFT of length rank / FCFS (p99 <= 1.2x)"
LLMD_PRECISE = "llm-d precise (exact index + load)"
POWER_OF_TWO = "power of two"
CAPACITY_RULE = (
    "a workload's capacity is the highest arrival rate per replica at which power of two "
    "keeps TTFT p90 <= 1 s with nothing shed, on the smallest cluster size of the run and "
    "the run's own size (requests per replica, or seconds of arrivals): doubled or halved "
    "from --capacity-start until it passes and fails, then --capacity-steps geometric "
    "bisections; the other sizes get the same rate per replica")
NEW_DEFAULT_RULE = (
    "a configuration replaces deploy.yaml's default only if, run as ours against all the "
    "others, it meets more of the targets than the default does and misses none that the "
    "default meets")


def run_settings(preset: str, seed: int, requests_per_replica: int = REQUESTS_PER_REPLICA,
                 duration_s: float | None = None) -> SimpleNamespace:
    """What every contest run shares: its preset, seed and size, lengths unknown, the
    SLOs."""
    if duration_s is not None and duration_s <= 0:
        raise ValueError(f"--duration-s must be > 0, not {duration_s}")
    return SimpleNamespace(preset=preset, length_mode="unknown", slo_ttft=SLO_TTFT_S,
                           slo_itl=SLO_TPOT_S, seed=seed,
                           requests_per_replica=requests_per_replica, duration_s=duration_s)


def run_requests(settings, replicas: int, rate: float) -> int:
    """A run's number of requests: `duration_s` of arrivals at `rate` where set (the
    run's length in time then does not shrink as the rate grows), else
    `requests_per_replica` x replicas. A trace shorter than that gives all it has."""
    if settings.duration_s is not None:
        return max(2, math.ceil(rate * settings.duration_s))
    return settings.requests_per_replica * replicas


def cell_rate(capacity: dict, replicas: int, load: float) -> float:
    """A cell's arrivals per second: `load` x the workload's capacity per replica (its
    `capacity` entry, CAPACITY_RULE) x `replicas`."""
    return load * capacity["per_replica_rps"] * replicas


@functools.lru_cache(maxsize=2)
def _shape(preset: str):
    return preset_shape(preset)


def run_one(workload: str, replicas: int, n: int, rate: float, label: str, settings,
            entry: str | None = None) -> dict:
    """One simulated run: `label`'s configuration (`entry`, else CONFIGS[label]) on
    `replicas` replicas, `n` requests of `workload` at `rate` arrivals per second (a worker
    process runs it)."""
    shape = _shape(settings.preset)
    specs = contest_workloads.requests(workload, n, rate, settings.seed, shape)
    variant = parse_entry(entry or CONFIGS[label], SIM_CONFIGS)
    variant.label = label
    result = simulate_variant(variant, replicas, specs, settings, shape)
    summary = result["summary"]
    ttfts = [r["ttft_s"] for r in result["records"] if r["status"] == 200]
    summary.update(ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else None,
                   rate_rps=rate, slo_attainment=summary["goodput_rps"]
                   * summary["makespan_s"] / len(specs))
    return {"summary": summary, "router": result["router"], "policies": result["policies"],
            "engine": {k: result["engine"][k] for k in ("num_blocks", "watermark")
                       if k in result["engine"]}}


def capacity(workload: str, replicas: int, settings, start: float, steps: int) -> dict:
    """CAPACITY_RULE for one workload: rate per replica -> power of two's TTFT p90."""
    tried: dict[float, dict] = {}

    def passes(per_replica: float) -> bool:
        rate = per_replica * replicas
        s = run_one(workload, replicas, run_requests(settings, replicas, rate), rate,
                    POWER_OF_TWO, settings)["summary"]
        tried[per_replica] = {"ttft_p90_s": s["ttft_p90_s"], "shed": s["shed"],
                              "requests": s["requests"], "wall_s": s["wall_s"]}
        return s["ttft_p90_s"] is not None and s["ttft_p90_s"] <= SLO_TTFT_S and not s["shed"]

    low = high = None
    rate = start
    for _ in range(12):
        if passes(rate):
            low, rate = rate, rate * 2
        else:
            high, rate = rate, rate / 2
        if low is not None and high is not None:
            break
    if low is None or high is None:
        raise RuntimeError(f"{workload}: no capacity bracket from {start} req/s per replica "
                           f"({tried})")
    for _ in range(steps):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if passes(middle) else (low, middle)
    return {"per_replica_rps": low, "replicas": replicas,
            "requests": tried[low]["requests"],
            "tried": {f"{rate:.4g}": figures for rate, figures in sorted(tried.items())}}


# --- targets -----------------------------------------------------------------------------
def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _check(cell: dict, measure: str, ours: str, against: str, key: str, bound: float,
           at_least: bool, theirs_value=None) -> dict:
    mine = cell[ours]["summary"][key]
    theirs = cell[against]["summary"][key] if theirs_value is None else theirs_value
    value = _ratio(mine, theirs)
    met = value is not None and (value >= bound if at_least else value <= bound)
    return {"measure": measure, "ours": ours, "against": against, "ours_value": mine,
            "theirs_value": theirs, "ratio": value,
            "bound": f"{'>=' if at_least else '<='} {bound}", "met": met}


def rivals(labels, ours: str) -> list[str]:
    """Whom `ours` is measured against: every peer but itself, and the default where ours
    is a peer. Blockserve's own variants (length rank, candidates) are nobody's rivals."""
    return [label for label in labels if label != ours
            and (label in PEERS or (label == OURS and ours in PEERS))]


def cell_targets(cell: dict, workload: str, load: float, ours: str = OURS) -> list[dict]:
    """The issue's targets on one (workload, size, load): `cell` maps a label to its run.
    Against "the best peer": the best of `rivals` on that measure. A ratio to a power of
    two recompute tax of 0 is not applicable (nothing to cut)."""
    peers = rivals(cell, ours)
    s = {label: cell[label]["summary"] for label in peers}

    def best(key, highest):
        known = [label for label in peers if s[label][key] is not None]
        return (max if highest else min)(known, key=lambda label: s[label][key])

    checks = []
    for measure, key, bound, at_least in (("goodput", "goodput_rps", 1.15, True),
                                          ("TTFT p90", "ttft_p90_s", 0.8, False),
                                          ("throughput", "output_tokens_per_s", 1.0, True)):
        checks.append(_check(cell, measure, ours, best(key, at_least), key, bound, at_least))
    if ours != POWER_OF_TWO:
        if s[POWER_OF_TWO]["recompute_tax"]:
            checks.append(_check(cell, "recompute tax", ours, POWER_OF_TWO,
                                 "recompute_tax", 0.5, False))
        checks.append(_check(cell, "ITL p99", ours, POWER_OF_TWO,
                             "token_itl_p99_s", 0.8, False))
    if workload == "llmd_shape" and ours != LLMD_PRECISE:
        checks.append(_check(cell, "llm-d shape: TTFT p90", ours,
                             LLMD_PRECISE, "ttft_p90_s", 0.7, False))
        checks.append(_check(cell, "llm-d shape: throughput", ours,
                             LLMD_PRECISE, "output_tokens_per_s", 1.05, True))
    if ours == OURS and load == 1.0 and LENGTH_RANK in cell and FCFS in cell:
        mean = _check(cell, LENGTH_RANK_TARGET, LENGTH_RANK, FCFS, "ttft_mean_s", 0.6, False)
        tail = _ratio(cell[LENGTH_RANK]["summary"]["ttft_p99_s"],
                      cell[FCFS]["summary"]["ttft_p99_s"])
        mean.update(p99_ratio=tail, met=mean["met"] and tail is not None and tail <= 1.2,
                    ours=OURS)
        checks.append(mean)
    return checks


def all_targets(results: dict, ours: str = OURS) -> list[dict]:
    return [{"workload": workload, "replicas": int(size), "load": float(load), **check}
            for workload, by_size in results.items() for size, by_load in by_size.items()
            for load, cell in by_load.items()
            for check in cell_targets(cell, workload, float(load), ours)]


def default_verdict(results: dict, candidates=()) -> dict:
    """NEW_DEFAULT_RULE over every peer and candidate run at every load, as ours in turn.
    A target the default meets and a configuration has not (power of two is not measured
    against itself) counts as one it misses."""
    def key(check):
        return (check["workload"], check["replicas"], check["load"], check["measure"])

    default = {key(c): c["met"] for c in all_targets(results, OURS)}
    verdict = {}
    for label in [*PEERS, *candidates, OURS]:
        mine = {key(c): c["met"] for c in all_targets(results, label)}
        met = sum(mine.values())
        lost = sum(was_met and not mine.get(k, False) for k, was_met in default.items())
        verdict[label] = {"met": met, "of": len(mine), "loses": lost,
                          "replaces_default": label != OURS and lost == 0
                          and met > sum(default.values())}
    return verdict


# --- report ------------------------------------------------------------------------------
def _cell_text(s: dict, key: str) -> str:
    value = s[key]
    text = "-" if value is None else f"{value:.2f}"
    return text + (f" ({s['shed']} shed)" if key == "goodput_rps" and s["shed"] else "")


def _ratio_text(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(results: dict, capacity_by: dict, checks: list[dict], verdict: dict,
             labels) -> list[str]:
    lines = []
    for workload, by_size in results.items():
        columns = [(size, load) for size, by_load in by_size.items() for load in by_load]
        rate = capacity_by[workload]["per_replica_rps"]
        for key, title in (("goodput_rps", "goodput, req/s"), ("ttft_p90_s", "TTFT p90, s")):
            lines += [f"\n**{workload}** ({contest_workloads.DESCRIPTIONS[workload]}; capacity "
                      f"{rate:.3g} req/s per replica): {title}\n",
                      "| router | " + " | ".join(f"x{size} at {float(load):g}x"
                                                 for size, load in columns) + " |",
                      "|---|" + "---:|" * len(columns)]
            for label in labels:
                cells = [by_size[size][load].get(label) for size, load in columns]
                if any(cells):
                    lines.append(f"| {label} | " + " | ".join(
                        _cell_text(c["summary"], key) if c else "" for c in cells) + " |")
    met = sum(c["met"] for c in checks)
    lines += [f"\nTargets, blockserve as ours: {met} of {len(checks)} met\n",
              "| workload | replicas | load | measure | against | ratio | target | met |",
              "|---|---:|---:|---|---|---:|---|---|"]
    lines += [f"| {c['workload']} | {c['replicas']} | {c['load']:g}x | {c['measure']} | "
              f"{c['against']} | {_ratio_text(c['ratio'])} | "
              f"{c['bound']} | {'met' if c['met'] else 'MISSED'} |" for c in checks]
    lines += ["\nEvery configuration as ours (its own targets; a target the default meets and it "
              "is not measured on counts as missed):\n",
              "| configuration | met | of | default's met targets it misses | replaces the default |",
              "|---|---:|---:|---:|---|"]
    lines += [f"| {label} | {v['met']} | {v['of']} | {v['loses']} | "
              f"{'yes' if v['replaces_default'] else 'no'} |" for label, v in verdict.items()]
    return lines


def plot(results: dict, out: str, labels) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({size for by_size in results.values() for size in by_size}, key=int)
    for key, title, name in (("ttft_p90_s", "TTFT p90 (s)", "ttft"),
                             ("goodput_rps", "goodput (req/s)", "goodput")):
        figure, axes = plt.subplots(len(results), len(sizes), squeeze=False,
                                    figsize=(5.5 * len(sizes), 3.2 * len(results)))
        for row, (workload, by_size) in zip(axes, results.items()):
            for axis, size in zip(row, sizes):
                by_load = by_size.get(size, {})
                for label in labels:
                    points = [(float(load), cell[label]["summary"][key])
                              for load, cell in by_load.items()
                              if label in cell and cell[label]["summary"][key] is not None]
                    if points:
                        axis.plot(*zip(*sorted(points)), marker="o", label=label,
                                  linewidth=2.5 if label == OURS else 1)
                axis.set_title(f"{workload}, {size} replicas", fontsize=9)
                axis.set_xlabel("load (x capacity)")
                axis.set_ylabel(title)
                if key == "ttft_p90_s":
                    axis.set_yscale("log")
        axes[0][0].legend(fontsize=6)
        figure.tight_layout()
        figure.savefig(f"{out}-{name}.png", dpi=70)
        plt.close(figure)


def report(results: dict, capacity_by: dict, candidates, configs, out: str
           ) -> tuple[list[dict], dict]:
    """The targets and the verdict: printed, and the tables written to OUT.md."""
    checks = all_targets(results)
    verdict = default_verdict(results, candidates)
    text = "\n".join(markdown(results, capacity_by, checks, verdict, configs))
    print(text)
    for check in checks:
        print(f"{'met   ' if check['met'] else 'MISSED'} {check['workload']} x{check['replicas']} "
              f"{check['load']:g}x {check['measure']} vs {check['against']}: "
              f"{_ratio_text(check['ratio'])} ({check['bound']})")
    Path(f"{out}.md").write_text(text + "\n")
    return checks, verdict


def rescore(path: str) -> None:
    """A finished run's targets and verdict recomputed by this code (after a fix to
    them), its JSON and .md rewritten; the runs themselves are not simulated again."""
    data = json.loads(Path(path).read_text())
    checks, verdict = report(data["results"], data["capacity"], data["args"]["candidates"],
                             data["configs"], path.removesuffix(".json"))
    data.update(targets=checks, default_verdict=verdict, rescored={
        **announce("contest --rescore"),
        "command": "python -m blockserve.bench.contest --rescore " + shlex.quote(path)})
    Path(path).write_text(json.dumps(data, indent=1))


# --- the command -------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sizing = parser.add_mutually_exclusive_group()
    sizing.add_argument("--requests-per-replica", type=int, default=REQUESTS_PER_REPLICA,
                        help="each run's requests = this x its replicas (a burst)")
    sizing.add_argument("--duration-s", type=float,
                        help="each run's requests = this many seconds of arrivals at its "
                             "rate (a steady state)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--loads", type=float, nargs="+", default=[0.8, 1.0, 1.2],
                        help="arrival rates as multiples of the measured capacity")
    parser.add_argument("--workloads", nargs="+", default=list(contest_workloads.WORKLOADS),
                        choices=list(contest_workloads.WORKLOADS))
    parser.add_argument("--preset", default="a100-llama3-8b")
    parser.add_argument("--capacity-start", type=float, default=2.0,
                        help="req/s per replica where the capacity search starts")
    parser.add_argument("--capacity-steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="simulations run at once")
    parser.add_argument("--out", default="docs/results/contest/contest")
    parser.add_argument("--candidates", nargs="*", default=[], metavar="ENTRY",
                        help="would-be defaults (bench/variants.py entries), judged by "
                             "NEW_DEFAULT_RULE against the same peers as the default")
    parser.add_argument("--rescore", metavar="JSON",
                        help="only recompute this finished run's targets and verdict")
    args = parser.parse_args()
    if args.rescore:
        return rescore(args.rescore)
    for entry in args.candidates:  # a typo fails here, not after the capacity search
        parse_entry(entry, SIM_CONFIGS)
    configs = {**CONFIGS, **{entry: entry for entry in args.candidates}}
    provenance = announce("contest")
    settings = run_settings(args.preset, args.seed, args.requests_per_replica, args.duration_s)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    started = time.time()

    def write(figures: dict) -> None:
        Path(f"{args.out}.json").write_text(json.dumps({
            "command": "python -m blockserve.bench.contest " + shlex.join(sys.argv[1:]),
            **provenance, "args": vars(args), "preset": args.preset, "simulated": True,
            "slo": {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S},
            "capacity_rule": CAPACITY_RULE, "new_default_rule": NEW_DEFAULT_RULE,
            "configs": configs, "workloads": {w: contest_workloads.DESCRIPTIONS[w]
                                              for w in args.workloads}, **figures}, indent=1))

    smallest = min(args.replicas)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {w: pool.submit(capacity, w, smallest, settings, args.capacity_start,
                                  args.capacity_steps)
                   for w in args.workloads}
        capacity_by = {w: future.result() for w, future in futures.items()}
        print(f"capacity ({time.time() - started:.0f} s): " + ", ".join(
            f"{w} {c['per_replica_rps']:.3g}" for w, c in capacity_by.items()), file=sys.stderr)
        tasks = [(w, size, load, label) for w in args.workloads for size in args.replicas
                 for load in args.loads for label in configs
                 if label not in QUEUE_VARIANTS or load == 1.0]
        tasks.sort(key=lambda t: -t[1])  # the largest clusters first: the pool ends evenly

        def submit(w, size, load, label):
            rate = cell_rate(capacity_by[w], size, load)
            return pool.submit(run_one, w, size, run_requests(settings, size, rate), rate,
                               label, settings, configs[label])

        futures = {submit(*task): task for task in tasks}
        results: dict = {w: {str(size): {str(load): {} for load in args.loads}
                             for size in args.replicas} for w in args.workloads}
        for done, future in enumerate(as_completed(futures), 1):
            w, size, load, label = futures[future]
            results[w][str(size)][str(load)][label] = future.result()
            print(f"[{done}/{len(tasks)}, {time.time() - started:.0f} s] {w} x{size} "
                  f"{load:g}x {label}", file=sys.stderr)
            if done % 10 == 0:  # a run cut short keeps what it measured
                write({"complete": False, "capacity": capacity_by, "results": results})
    checks, verdict = report(results, capacity_by, args.candidates, configs, args.out)
    write({"complete": True, "capacity": capacity_by, "results": results, "targets": checks,
           "default_verdict": verdict, "wall_s": time.time() - started})
    plot(results, args.out, configs)
    print(f"wrote {args.out}.json, .md, -ttft.png, -goodput.png "
          f"({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
