"""Policy benchmark: the same seeded workloads against several configurations, one run.

    python -m bench.harness [--workloads pressure shared_prefix] [--configs ...]
                            [--out results/policy_bench]

Each configuration is deployed on the same replica settings (deploy/deploy.yaml), every
workload is replayed against it, and it is torn down before the next. Prints a table of
ratios of our configuration against each baseline and writes `<out>.json` (everything
measured) and `<out>-ttft.png` / `<out>-kv.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import statistics
import threading
import time
from pathlib import Path

from tqdm import tqdm

from bench import targets
from bench.client import replay
from bench.workloads import WORKLOADS
from controller.launch import load_config

OURS = "blockserve"
OUR_SCHEDULER = {"queue_order": "router.ordering:RouterOrder",
                 "admission_gate": "replica.policies:ReservationGate",
                 "preemption": "replica.policies:CheapestRecompute",
                 "block_assignment": "replica.policies:ProtectSharedBlocks"}
FCFS = "router.ordering:FirstComeFirstServed"
SLO_TTFT_S, SLO_ITL_S = 2.0, 0.1  # goodput counts requests within both


def _baseline(placement: str):
    """A Ray-Serve-style router in front of unmodified vLLM scheduling."""
    return lambda name: targets.blockserve(
        name, {"placement": f"router.placement:{placement}", "queue_order": FCFS}, {})


CONFIGURATIONS = {
    OURS: lambda name: targets.blockserve(
        name, {"placement": "router.placement:BestFitBlocks", "queue_order": FCFS},
        OUR_SCHEDULER),
    "blockserve via Serve handle": lambda name: targets.blockserve(
        name, {"placement": "router.placement:BestFitBlocks", "queue_order": FCFS,
               "transport": "serve_handle"}, OUR_SCHEDULER),
    "blockserve balanced": lambda name: targets.blockserve(
        name, {"placement": "router.placement:BalancedBlocks",
               "queue_order": {"cls": "router.ordering:ShortestDemandFirst",
                               "kwargs": {"max_wait_s": 10}}}, OUR_SCHEDULER),
    "round robin": _baseline("RoundRobin"),
    "power of two": _baseline("PowerOfTwoChoices"),
    "least KV usage": _baseline("LeastKvUsage"),
    "raw vLLM x2": lambda name: targets.raw_vllm(name),
    "Ray Serve LLM": lambda name: targets.ray_serve_llm(name),
    "Ray Serve LLM prefix": lambda name: targets.ray_serve_llm(
        name, targets.PREFIX_CACHE_AFFINITY),
}


# Ray Serve LLM's PrefixCacheAffinityRouter never answers a token-id prompt.
NEEDS_TEXT_PROMPTS = {"Ray Serve LLM prefix"}


def percentile(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


def summarise(records, makespan: float, preemptions: float, slo_ttft_s: float,
              slo_itl_s: float) -> dict:
    ok = [r for r in records if r.status == 200]
    good = [r for r in ok if r.ttft_s is not None and r.ttft_s <= slo_ttft_s
            and (r.itl_s is None or r.itl_s <= slo_itl_s)]
    return {
        "requests": len(records), "ok": len(ok),
        "rejected_429": sum(r.status == 429 for r in records),
        "errors": sum(r.status not in (200, 429) for r in records),
        "makespan_s": makespan,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / makespan,
        "goodput_rps": len(good) / makespan,
        "preemptions": preemptions,
        **{f"{metric}_p{int(q * 100)}_s": percentile([getattr(r, f"{metric}_s") for r in ok], q)
           for metric in ("ttft", "itl", "e2e") for q in (0.5, 0.99)},
    }


def as_text(specs: list) -> list:
    """The same prompts as text, for every configuration of a run (NEEDS_TEXT_PROMPTS)."""
    from transformers import AutoTokenizer

    model = load_config()["applications"][0]["args"]["replica"]["model"]
    tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(model))
    return [dataclasses.replace(spec, prompt=tokenizer.decode(spec.prompt)) for spec in specs]


def run_workload(target, specs, args, progress) -> dict:
    usage_trace, stop = [], threading.Event()

    def sample() -> None:
        started = time.time()
        while not stop.is_set():
            try:
                usage_trace.append((time.time() - started, target.kv_usage()))
            except Exception:  # a scrape during shutdown: skip the point
                pass
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    before = target.preemptions()
    sampler.start()
    records, makespan = asyncio.run(replay(specs, target.base_urls, targets.API_KEY,
                                           target.model, progress))
    stop.set()
    sampler.join()
    time.sleep(1.0)  # let the last snapshots arrive
    summary = summarise(records, makespan, target.preemptions() - before, args.slo_ttft,
                        args.slo_itl)
    return {"summary": summary, "records": [r.to_dict() for r in records],
            "kv_usage": usage_trace}


def ratio_table(results: dict, workload: str) -> list[str]:
    ours = results.get(OURS, {}).get(workload)
    if ours is None:
        return []
    rows = [f"\n{workload}: {OURS} vs each configuration (ratio = ours / theirs)",
            f"{'vs':<22}{'p99 TTFT':>10}{'p50 TTFT':>10}{'preempt':>10}{'tok/s':>8}"
            f"{'goodput':>9}"]
    mine = ours["summary"]
    for name, by_workload in results.items():
        if name == OURS or workload not in by_workload:
            continue
        theirs = by_workload[workload]["summary"]

        def ratio(key: str) -> str:
            a, b = mine[key], theirs[key]
            if a is None or b is None or math.isnan(a) or math.isnan(b):
                return "-"
            if b == 0:
                return "0/0" if a == 0 else "inf"
            return f"{a / b:.2f}x"

        rows.append(f"{name:<22}{ratio('ttft_p99_s'):>10}{ratio('ttft_p50_s'):>10}"
                    f"{ratio('preemptions'):>10}{ratio('output_tokens_per_s'):>8}"
                    f"{ratio('goodput_rps'):>9}")
    return rows


def absolute_table(results: dict, workload: str) -> list[str]:
    rows = [f"\n{workload}: absolute",
            f"{'configuration':<22}{'ok':>5}{'429':>5}{'err':>5}{'tok/s':>8}{'TTFT p50':>10}"
            f"{'TTFT p99':>10}{'ITL p50':>9}{'preempt':>9}{'goodput':>9}"]
    for name, by_workload in results.items():
        if workload not in by_workload:
            continue
        s = by_workload[workload]["summary"]
        rows.append(f"{name:<22}{s['ok']:>5}{s['rejected_429']:>5}{s['errors']:>5}"
                    f"{s['output_tokens_per_s']:>8.0f}{s['ttft_p50_s'] or 0:>10.2f}"
                    f"{s['ttft_p99_s'] or 0:>10.2f}{s['itl_p50_s'] or 0:>9.3f}"
                    f"{s['preemptions']:>9.0f}{s['goodput_rps']:>9.2f}")
    return rows


def plot(results: dict, workloads: list[str], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for axis, workload in zip(axes[0], workloads):
        for name, by_workload in results.items():
            if workload in by_workload:
                ttfts = sorted(r["ttft_s"] for r in by_workload[workload]["records"]
                               if r["ttft_s"] is not None)
                axis.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=name)
        axis.set_title(f"TTFT CDF: {workload}")
        axis.set_xlabel("seconds")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(f"{out}-ttft.png", dpi=80)
    names = [n for n in results if workloads[0] in results[n]  # peers export no KV usage
             and any(usage for _, usage in results[n][workloads[0]]["kv_usage"])]
    if not names:
        return
    figure, axes = plt.subplots(len(names), 1, figsize=(9, 2.2 * len(names)), squeeze=False)
    for axis, name in zip(axes[:, 0], names):
        trace = results[name][workloads[0]]["kv_usage"]
        for replica in sorted({r for _, usage in trace for r in usage}):
            axis.plot([t for t, _ in trace], [u.get(replica, 0) for _, u in trace], label=replica)
        axis.set_ylim(0, 1.05)
        axis.set_title(f"{name}: KV usage per replica ({workloads[0]})", fontsize=9)
        axis.legend(fontsize=6, loc="upper right")
    axes[-1, 0].set_xlabel("seconds")
    figure.tight_layout()
    figure.savefig(f"{out}-kv.png", dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["pressure", "shared_prefix"],
                        choices=sorted(WORKLOADS))
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGURATIONS),
                        default=[c for c in CONFIGURATIONS if c not in NEEDS_TEXT_PROMPTS])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft", type=float, default=SLO_TTFT_S, help="goodput SLO, seconds")
    parser.add_argument("--slo-itl", type=float, default=SLO_ITL_S, help="goodput SLO, seconds")
    parser.add_argument("--text-prompts", action="store_true",
                        help="send prompts as text (needed by Ray Serve LLM's prefix router)")
    parser.add_argument("--out", default="results/policy_bench")
    args = parser.parse_args()
    if NEEDS_TEXT_PROMPTS & set(args.configs) and not args.text_prompts:
        parser.error(f"{sorted(NEEDS_TEXT_PROMPTS & set(args.configs))} never answers "
                     "token-id prompts: add --text-prompts")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    specs = {w: WORKLOADS[w](n=args.requests, seed=args.seed) for w in args.workloads}
    if args.text_prompts:
        specs = {w: as_text(s) for w, s in specs.items()}
    results: dict = {}
    total = len(args.configs) * sum(len(s) for s in specs.values())
    with tqdm(total=total, desc="requests", unit="req") as progress:
        for name in args.configs:
            progress.set_postfix_str(f"starting {name}")
            with CONFIGURATIONS[name](name) as target:
                results[name] = {"startup_s": target.startup_s, "notes": target.notes}
                for workload, workload_specs in specs.items():
                    progress.set_postfix_str(f"{name}: {workload}")
                    results[name][workload] = run_workload(target, workload_specs, args,
                                                           progress)
    lines = [f"workloads: {', '.join(f'{w} ({len(s)} requests)' for w, s in specs.items())}; "
             f"goodput SLO: TTFT <= {args.slo_ttft}s and ITL <= {args.slo_itl}s"]
    for workload in args.workloads:
        lines += absolute_table(results, workload) + ratio_table(results, workload)
    report = "\n".join(lines)
    print(report)
    Path(f"{args.out}.json").write_text(json.dumps(
        {"args": vars(args), "results": results, "report": report}, indent=1))
    plot(results, args.workloads, args.out)
    print(f"\nwrote {args.out}.json, {args.out}-ttft.png, {args.out}-kv.png")


if __name__ == "__main__":
    main()
