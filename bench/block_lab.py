"""Block-policy lab: one replica's vLLM scheduler and KV cache manager, no model, under
each block policy, on the same workloads; prints the results side by side.

    python -m blockserve.bench.block_lab [--workloads shared_prefix mooncake my.jsonl] \
        [--requests 200] [--workload-kwargs cross_tenant:tenants=16] \
        [--configs s3fifo "scheduler.block_eviction=my_module:MyEviction(keep=4)"] \
        [--sweep scheduler.block_eviction.keep=1,2,4] [--out docs/results/block_lab]

Each run is `blockserve.tools.engine_less.EngineLessReplica` - vLLM's real Scheduler (our
block-aware subclass with the block policies installed as in a replica), KV cache
manager and block pool - with the engine shape of deploy/deploy.yaml. Requests arrive in
virtual time at the workload's arrival times; the workloads are scaled to the whole
deployment, so one replica gets every `replicas`-th second's share (arrival times x
replicas). A step takes the `--preset` step-time model's seconds (bench/step_time.py).
Output lengths are unknown to every policy: `max_tokens` is what the context allows and
the fabricated model ends each request at its true length (as the simulator does).

`--workloads` are built-in workloads (bench/workloads.py; `--workload-kwargs NAME:KEY=VALUE`
gives one of them options) or trace and workload files (bench/trace_files.py: Azure CSV,
length-only CSV, Mooncake JSONL, this project's workload JSONL; `--rate-scale`,
`--length-scale`, `--max-requests`). `--configs` entries are the built-in configurations
by name or overrides of vLLM's own scheduling (every field named: VLLM_SCHEDULING) and of
the engine shape, with kwargs (bench/variants.py); `--sweep` runs each once per value of
one setting. Without `--configs`, every built-in configuration runs (and `--eviction`'s).

Per run: vLLM's own prefix-cache hit rate (hits / queries, its metrics' definition); tokens
recomputed (tokens computed beyond what an unlimited cache without preemption would compute:
cache misses on content seen before, and recompute after preemption); the recompute tax
(vLLM RFC #54644: tokens computed again after a preemption / all computed tokens,
bench/step_costs.py); preemptions; cached blocks evicted while still useful (a request that
had not started yet carries the block's prefix hash); simulated TTFT and output throughput;
the exceptions its policies raised (each answered by vLLM's behaviour,
replica/policy_errors.py); the block policies each ran; wall time per step (the scheduler
with the policies, on this machine; every run goes through the adapter, which counts
evictions, so the rows compare the policies' own cost).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import textwrap
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from blockserve.bench.provenance import announce
from blockserve.bench.report import percentile
from blockserve.bench.simulated_cluster import SIMULATED_STOP_ID
from blockserve.bench.step_costs import StepCosts
from blockserve.bench.step_time import PRESETS, StepTimeModel
from blockserve.bench.trace_files import Scaling, load_workload
from blockserve.bench.variants import (VLLM_SCHEDULING, scheduler_policies, variants,
                                      workload_kwargs)
from blockserve.bench.workloads import WORKLOADS, LengthMode, Lengths, RequestSpec
from blockserve.protocol.config import SchedulerConfig
from blockserve.protocol.hints import Hints
from blockserve.protocol.registry import KINDS
from blockserve.replica.scheduler import BlockAwareScheduler
from blockserve.tools.engine_less import EngineLessReplica
from blockserve.tools.launch import EngineShape, replica_count


def built_in_configs(usable_blocks: int) -> dict[str, dict[str, Any]]:
    """The compared block policies: replica `scheduler` config sections, each vLLM's own
    scheduling with one change; every built-in eviction policy of the registry
    (protocol/registry.py), by its short name."""
    evictions = KINDS["replica.scheduler.block_eviction"].names
    changes = {
        "vllm (LRU)": {},
        **{name: {"block_eviction": name} for name in evictions if name != "vllm"},
        "priority: output first": {"block_retention": {
            "cls": "priority", "kwargs": {"evict_output_first": True}}},
        "tenant_quota: 1/2 pool": {"block_budget": {
            "cls": "tenant_quota", "kwargs": {"default_quota": usable_blocks // 2}}},
    }
    return {name: {**VLLM_SCHEDULING, **change} for name, change in changes.items()}


@dataclass
class RunResult:
    requests: int
    prefix_hit_rate: float
    tokens_recomputed: int
    recompute_tax: float
    preemptions: int
    evicted_while_useful: int
    cached_blocks_evicted: int
    ttft_p50_s: float
    ttft_p90_s: float
    output_tokens_per_s: float
    makespan_s: float
    step_ms: float  # wall time per engine-less step (scheduler + policies), this machine
    policy_errors: int  # exceptions a policy raised; vLLM's answer stood for each


class _Clock:
    now = 0.0


def compulsory_tokens(prompts: list[list[int]], hashes: list[list[bytes]],
                      block_size: int) -> int:
    """Prompt tokens an unlimited cache must still compute: vLLM hits whole blocks seen
    before, at most up to the prompt's last token (which it always computes)."""
    seen: set[bytes] = set()
    total = 0
    for prompt, prompt_hashes in zip(prompts, hashes):
        hit = 0
        while hit < len(prompt_hashes) and prompt_hashes[hit] in seen:
            hit += 1
        total += len(prompt) - min(hit, (len(prompt) - 1) // block_size) * block_size
        seen.update(prompt_hashes)
    return total


def replay(specs: list[RequestSpec], scheduler: dict[str, Any], shape: EngineShape,
           step_time: StepTimeModel, time_scale: float, lengths: Lengths | None = None
           ) -> RunResult:
    """One workload through one engine-less replica under one block-policy config
    (output lengths unknown to the policies unless `lengths` says otherwise)."""
    clock = _Clock()
    lengths = lengths or Lengths(LengthMode.UNKNOWN, shape.max_model_len, SIMULATED_STOP_ID)
    true_length = {f"r{i}": spec.output_tokens for i, spec in enumerate(specs)}

    def model(request) -> int:  # ends each request at its true length
        if request.num_output_tokens + 1 >= true_length[request.request_id]:
            return SIMULATED_STOP_ID
        return 1 + request.num_output_tokens % 3000

    replica = EngineLessReplica(shape.model, BlockAwareScheduler, **shape.engine_less_kwargs(),
                                scheduler=scheduler, sample=model, clock=lambda: clock.now)
    sched = replica.scheduler
    prompts = [list(spec.prompt) for spec in specs]
    hashes = [replica.block_hashes(p) for p in prompts]
    not_started: Counter[bytes] = Counter(h for hs in hashes for h in hs)
    useful = [0]

    def on_evict(block_hash: bytes) -> None:
        useful[0] += not_started[block_hash] > 0

    sched.block_policies.observe(on_evict)
    arrivals = [spec.arrival_s * time_scale for spec in specs]
    started: set[str] = set()
    ttft: dict[str, float] = {}
    queries = hits = preemptions = scheduled = steps = 0
    costs = StepCosts()
    wall = 0.0
    index = 0
    while index < len(specs) or sched.has_unfinished_requests():
        while index < len(specs) and arrivals[index] <= clock.now:
            spec, fields = specs[index], lengths.fields(specs[index])
            replica.add(f"r{index}", prompts[index], fields.pop("max_tokens"),
                        hints=Hints(tenant=spec.tenant), arrival=arrivals[index], **fields)
            index += 1
        if not sched.has_unfinished_requests():
            clock.now = arrivals[index]
            continue
        started_at = time.perf_counter()
        record = replica.step()
        wall += time.perf_counter() - started_at
        steps += 1
        clock.now += step_time(costs.batch(
            record.scheduled, record.computed_before,
            lambda request_id: replica.requests[request_id].num_prompt_tokens))
        for rid in record.scheduled:
            if rid not in started:
                started.add(rid)
                not_started.subtract(hashes[int(rid[1:])])
            if rid not in ttft and replica.requests[rid].num_output_tokens:
                ttft[rid] = clock.now - arrivals[int(rid[1:])]
        queries += record.prefix_queries
        hits += record.prefix_hits
        preemptions += len(record.preempted)
        scheduled += sum(record.scheduled.values())
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == shape.usable_blocks, "blocks leaked"
    assert all(replica.requests[r].num_output_tokens == n for r, n in true_length.items())
    ideal = (compulsory_tokens(prompts, hashes, shape.block_size)
             + sum(n - 1 for n in true_length.values()))
    waits = list(ttft.values())
    makespan = clock.now - arrivals[0]
    return RunResult(len(specs), hits / queries if queries else 0.0, scheduled - ideal,
                     costs.recompute_tax, preemptions, useful[0],
                     sched.block_policies.stats.cached_blocks_evicted,
                     percentile(waits, 0.5), percentile(waits, 0.9),
                     sum(true_length.values()) / makespan if makespan else 0.0, clock.now,
                     1000 * wall / steps, sum(sched.policy_errors.counts.values()))


COLUMNS = [("prefix_hit_rate", "hit rate", "{:.3f}"), ("tokens_recomputed", "recomputed", "{}"),
           ("recompute_tax", "recompute tax", "{:.3f}"), ("preemptions", "preempt", "{}"),
           ("evicted_while_useful", "evict useful", "{}"),
           ("ttft_p50_s", "TTFT p50 s", "{:.2f}"), ("ttft_p90_s", "TTFT p90 s", "{:.2f}"),
           ("output_tokens_per_s", "tok/s", "{:.0f}"), ("step_ms", "step ms", "{:.2f}"),
           ("policy_errors", "policy errors", "{}")]


def table(workload: str, runs: dict[str, RunResult], policies: dict[str, dict]) -> str:
    width = max(len(name) for name in runs) + 2
    lines = [f"== {workload}", "policy".ljust(width) + "".join(f"{h:>14}" for _, h, _ in COLUMNS)]
    for name, run in runs.items():
        lines.append(name.ljust(width) + "".join(f"{fmt.format(getattr(run, key)):>14}"
                                                 for key, _, fmt in COLUMNS))
    lines += [f"  {name}: " + ", ".join(f"{k} {v}" for k, v in policies[name].items())
              for name in runs]
    return "\n".join(lines)


def lab_configs(args, shape: EngineShape) -> dict[str, tuple[dict, EngineShape]]:
    """label -> (scheduler section, engine shape): `--configs`/`--sweep` entries, else the
    built-in configurations (and `--eviction`'s, filtered by `--only`)."""
    named = built_in_configs(shape.usable_blocks)
    named.update({path: {**VLLM_SCHEDULING, "block_eviction": path} for path in args.eviction})
    if args.configs:
        chosen = variants(args.configs, named, args.sweep)
    else:
        names = args.only or list(named)
        chosen = variants(names, named, args.sweep)
    configs = {}
    for variant in chosen:
        if variant.overrides["router"]:
            raise ValueError(f"{variant.label}: the lab runs one replica and no router")
        scheduler = variant.applied("scheduler", named[variant.base if variant.base
                                                       else "vllm (LRU)"])
        SchedulerConfig.model_validate(scheduler)
        configs[variant.label] = (scheduler, replace(shape, **variant.applied("engine", {})))
    return configs


def plot(results: dict[str, dict[str, RunResult]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("prefix_hit_rate", "prefix-cache hit rate"), ("tokens_recomputed",
            "tokens recomputed"), ("ttft_p90_s", "simulated TTFT p90 (s)")]
    fig, axes = plt.subplots(len(results), len(keys), figsize=(4.5 * len(keys) + 2.5,
                                                              3.2 * len(results)), squeeze=False)
    for row, (workload, runs) in zip(axes, results.items()):
        for column, (ax, (key, label)) in enumerate(zip(row, keys)):
            ax.barh(range(len(runs)), [getattr(r, key) for r in runs.values()], color="tab:blue")
            # Labels (a --configs entry can be long) once per row, wrapped.
            ax.set_yticks(range(len(runs)), [textwrap.fill(name, 44) for name in runs]
                          if column == 0 else [])
            ax.set_title(f"{workload}: {label}", fontsize=9)
            ax.invert_yaxis()
            ax.tick_params(labelsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["shared_prefix", "mooncake"],
                        help=f"built-in ({', '.join(sorted(WORKLOADS))}) or trace/workload files")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", default="cpu-tiny", choices=sorted(PRESETS))
    parser.add_argument("--blocks", type=int, help="usable KV blocks (default: deploy.yaml's)")
    parser.add_argument("--workload-kwargs", nargs="+", default=[], metavar="NAME:KEY=VALUE",
                        help="options of one workload (cross_tenant:tenants=16,shared_prefixes=2)"
                             "; a JSON object gives them to every workload")
    parser.add_argument("--rate-scale", type=float, default=1.0,
                        help="trace files: arrivals this many times as fast")
    parser.add_argument("--length-scale", type=float, default=1.0,
                        help="trace files: prompt and output lengths times this")
    parser.add_argument("--max-requests", type=int,
                        help="trace files: at most this many (default: --requests)")
    parser.add_argument("--configs", nargs="+", metavar="ENTRY",
                        help="configurations by name or overrides SECTION.KEY=VALUE,... "
                             "(bench/variants.py); default: every built-in one")
    parser.add_argument("--sweep", metavar="SECTION.KEY=V1,V2",
                        help="run every configuration once per value of one setting")
    parser.add_argument("--eviction", nargs="*", default=[],
                        help="more eviction policies to compare, by import path")
    parser.add_argument("--only", nargs="*", help="compare only these configs (by name)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run each config this many times; step ms is the fastest")
    parser.add_argument("--out", default="docs/results/block_lab",
                        help="writes OUT.json and OUT.png")
    args = parser.parse_args()
    provenance = announce("block lab")
    shape = EngineShape.of()
    if args.blocks:
        shape = replace(shape, num_blocks=args.blocks + 1)  # vLLM's null block
    replicas = replica_count()
    try:
        configs = lab_configs(args, shape)
        options = workload_kwargs(args.workload_kwargs, args.workloads)
        scaling = Scaling(args.rate_scale, args.length_scale, args.max_requests)
        workloads = {w: load_workload(w, args.requests, args.seed, options[w], scaling,
                                      shape.max_model_len, shape.block_size)
                     for w in args.workloads}
    except (ValueError, KeyError) as error:
        parser.error(str(error))
    policies = {name: scheduler_policies(scheduler) for name, (scheduler, _) in configs.items()}
    results: dict[str, dict[str, RunResult]] = {}
    for workload, replayed in workloads.items():
        results[workload] = {}
        for name, (config, config_shape) in configs.items():
            runs = [replay(replayed.specs, config, config_shape, PRESETS[args.preset],
                           replicas) for _ in range(args.repeats)]
            results[workload][name] = min(runs, key=lambda run: run.step_ms)
        print(table(workload, results[workload], policies), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({
        "command": "python -m blockserve.bench.block_lab " + shlex.join(sys.argv[1:]),
        **provenance, "engine": asdict(shape), "replicas_scaled_from": replicas,
        "preset": args.preset, "workloads": {w: r.scaling for w, r in workloads.items()},
        "configs": {name: {"scheduler": scheduler, "engine": asdict(config_shape),
                           "block_policies": policies[name]}
                    for name, (scheduler, config_shape) in configs.items()},
        "results": {w: {n: asdict(r) for n, r in runs.items()} for w, runs in results.items()},
    }, indent=2))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
