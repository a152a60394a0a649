"""Block-policy lab: one replica's vLLM scheduler and KV cache manager, no model, under
each block policy, on the same workloads; prints the results side by side.

    python -m blockserve.bench.block_lab [--workloads shared_prefix mooncake] [--requests 200]
        [--eviction my_module:MyEviction] [--out docs/results/block_lab]

Each run is `blockserve.tools.engine_less.EngineLessReplica` - vLLM's real Scheduler (our
block-aware subclass with the block policies installed as in a replica), KV cache
manager and block pool - with the engine shape of deploy/deploy.yaml. Requests arrive in
virtual time at the workload's arrival times; the workloads are scaled to the whole
deployment, so one replica gets every `replicas`-th second's share (arrival times x
replicas). A step takes the `--preset` step-time model's seconds (bench/step_time.py).
Output lengths are unknown to every policy: `max_tokens` is what the context allows and
the fabricated model ends each request at its true length (as the simulator does).

Per run: vLLM's own prefix-cache hit rate (hits / queries, its metrics' definition);
tokens recomputed (tokens computed beyond what an unlimited cache without preemption
would compute: cache misses on content seen before, and recompute after preemption);
preemptions; cached blocks evicted while still useful (a request that had not started
yet carries the block's prefix hash); simulated TTFT; wall time per step (the scheduler
with the policies, on this machine; every run goes through the adapter, which counts
evictions, so the rows compare the policies' own cost).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from blockserve.bench.report import percentile
from blockserve.bench.simulated_cluster import SIMULATED_STOP_ID
from blockserve.bench.step_time import PRESETS, StepTimeModel
from blockserve.bench.workloads import WORKLOADS, LengthMode, Lengths, RequestSpec
from blockserve.protocol.hints import Hints
from blockserve.protocol.registry import KINDS
from blockserve.replica.scheduler import BlockAwareScheduler
from blockserve.tools.engine_less import EngineLessReplica
from blockserve.tools.launch import EngineShape, replica_count


def built_in_configs(usable_blocks: int) -> dict[str, dict[str, Any]]:
    """The compared block policies: replica `scheduler` config sections; every built-in
    eviction policy of the registry (protocol/registry.py), by its short name."""
    evictions = KINDS["replica.scheduler.block_eviction"].names
    return {
        "vllm (LRU)": {},
        **{name: {"block_eviction": name} for name in evictions if name != "vllm"},
        "priority: output first": {"block_retention": {
            "cls": "priority", "kwargs": {"evict_output_first": True}}},
        "tenant_quota: 1/2 pool": {"block_budget": {
            "cls": "tenant_quota", "kwargs": {"default_quota": usable_blocks // 2}}},
    }


@dataclass
class RunResult:
    requests: int
    prefix_hit_rate: float
    tokens_recomputed: int
    preemptions: int
    evicted_while_useful: int
    cached_blocks_evicted: int
    ttft_p50_s: float
    ttft_p90_s: float
    makespan_s: float
    step_ms: float  # wall time per engine-less step (scheduler + policies), this machine


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
        decode = sum(1 for rid, n in record.scheduled.items()
                     if n == 1 and replica.requests[rid].num_output_tokens > 1)
        clock.now += step_time(sum(record.scheduled.values()) - decode, decode)
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
    return RunResult(len(specs), hits / queries if queries else 0.0, scheduled - ideal,
                     preemptions, useful[0], sched.block_policies.stats.cached_blocks_evicted,
                     percentile(waits, 0.5), percentile(waits, 0.9), clock.now,
                     1000 * wall / steps)


COLUMNS = [("prefix_hit_rate", "hit rate", "{:.3f}"), ("tokens_recomputed", "recomputed", "{}"),
           ("preemptions", "preempt", "{}"), ("evicted_while_useful", "evict useful", "{}"),
           ("ttft_p50_s", "TTFT p50 s", "{:.2f}"), ("ttft_p90_s", "TTFT p90 s", "{:.2f}"),
           ("step_ms", "step ms", "{:.2f}")]


def table(workload: str, runs: dict[str, RunResult]) -> str:
    width = max(len(name) for name in runs) + 2
    lines = [f"== {workload}", "policy".ljust(width) + "".join(f"{h:>14}" for _, h, _ in COLUMNS)]
    for name, run in runs.items():
        lines.append(name.ljust(width) + "".join(f"{fmt.format(getattr(run, key)):>14}"
                                                 for key, _, fmt in COLUMNS))
    return "\n".join(lines)


def plot(results: dict[str, dict[str, RunResult]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("prefix_hit_rate", "prefix-cache hit rate"), ("tokens_recomputed",
            "tokens recomputed"), ("ttft_p90_s", "simulated TTFT p90 (s)")]
    fig, axes = plt.subplots(len(results), len(keys), figsize=(4.5 * len(keys),
                                                              3.2 * len(results)), squeeze=False)
    for row, (workload, runs) in zip(axes, results.items()):
        for ax, (key, label) in zip(row, keys):
            ax.barh(list(runs), [getattr(r, key) for r in runs.values()], color="tab:blue")
            ax.set_title(f"{workload}: {label}", fontsize=9)
            ax.invert_yaxis()
            ax.tick_params(labelsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["shared_prefix", "mooncake"],
                        choices=sorted(WORKLOADS))
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", default="cpu-tiny", choices=sorted(PRESETS))
    parser.add_argument("--blocks", type=int, help="usable KV blocks (default: deploy.yaml's)")
    parser.add_argument("--workload-kwargs", type=json.loads, default={},
                        help='JSON keyword arguments for every workload, e.g. \'{"tenants": 16}\'')
    parser.add_argument("--eviction", nargs="*", default=[],
                        help="more eviction policies to compare, by import path")
    parser.add_argument("--only", nargs="*", help="compare only these configs (by name)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run each config this many times; step ms is the fastest")
    parser.add_argument("--out", default="docs/results/block_lab",
                        help="writes OUT.json and OUT.png")
    args = parser.parse_args()
    shape = EngineShape.of()
    if args.blocks:
        shape = replace(shape, num_blocks=args.blocks + 1)  # vLLM's null block
    replicas = replica_count()
    configs = built_in_configs(shape.usable_blocks)
    configs.update({path: {"block_eviction": path} for path in args.eviction})
    if args.only:
        configs = {name: configs[name] for name in args.only}
    results: dict[str, dict[str, RunResult]] = {}
    for workload in args.workloads:
        specs = WORKLOADS[workload](n=args.requests, seed=args.seed, **args.workload_kwargs)
        results[workload] = {}
        for name, config in configs.items():
            runs = [replay(specs, config, shape, PRESETS[args.preset], replicas)
                    for _ in range(args.repeats)]
            results[workload][name] = min(runs, key=lambda run: run.step_ms)
        print(table(workload, results[workload]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({
        "command": "python -m blockserve.bench.block_lab " + shlex.join(sys.argv[1:]),
        "engine": asdict(shape), "replicas_scaled_from": replicas, "preset": args.preset,
        "configs": configs,
        "results": {w: {n: asdict(r) for n, r in runs.items()} for w, runs in results.items()},
    }, indent=2))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
