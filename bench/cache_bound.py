"""Issue 17's benchmark: workloads where the prefix cache is the bottleneck, routed by
vLLM's own KV cache events (the exact index) against the approximate index, Dynamo's
cost, power of two and Ray Serve LLM's PrefixCacheAffinityRouter, in one run.

    python -m blockserve.bench.cache_bound [--configs ...] [--workloads ...]
        [--seeds 0 1 2 3] [--rounds 2] [--out docs/results/cache_bound]

(`make bench-cache` runs it so.) `--seeds` replays each workload once per seed (another
draw, another trace window); `--rounds R` deploys every configuration R times in A B B A
order, each round with its share of the seeds; the seeds are pooled, and every target is
also checked on each seed (bench/harness.py does the same for issue 15's benchmark).
`cache-aware, approximate index, events published` is a diagnostic that only runs when
named: the approximate index while the replicas publish KV events nobody follows.

`blockserve (deploy.yaml)` is deploy/deploy.yaml exactly as it is (router and replica
policies, whatever it says at run time): our default configuration, the one issue 17's
targets are for. The report checks them for `cache-aware, exact index` too. Every other
configuration runs deploy.yaml's engines with vLLM's own scheduling and block eviction
in the replicas, so only routing differs. Lengths are unknown to the router
(bench/workloads.py's unknown mode); prompts go as text to every configuration (Ray
Serve LLM's prefix router answers no token-id prompt; harness.as_text cuts from its end
a prompt whose text tokenizes too long for the context, `text_prompts_cut` in the
JSON). The workloads (their working sets and scaling are recorded in the JSON):

- `tenants`: many tenants with long system prompts, popularity Zipf(1) (a few hot
  tenants): 12 x 640 tokens = 240 blocks of prefixes, more than one replica's 160
  blocks, less than the two replicas' 320; Poisson arrivals;
- `sessions`: multi-turn chats; each turn's prompt is the session's whole history plus
  a new message, so its prefix grows every turn (the replies in the history are fixed
  tokens, not the model's gibberish, so only earlier prompts can be cache hits);
  sessions start as a Poisson process, 6 per mean think time between turns;
- `mooncake`: a window of Mooncake's trace as bench/traces.py scales it (each 512-token
  hash block is one 32-token KV block).

Arrival rates follow bench/traces.py's step 5 for all three (`at_capacity`; never
picked from results): one factor on every arrival time makes the mean rate the
deployment's KV capacity in tokens / the workload's mean prompt + output tokens, so each
second brings as many tokens as the whole cache holds; gaps, think times included, keep
their shape.

Hit rate = prompt tokens vLLM served from its prefix cache (each response's
`usage.prompt_tokens_details.cached_tokens`) / prompt tokens; Ray Serve LLM does not
report it. Routing regret (blockserve only, from the router's metrics) = the sum over
requests of |predicted - reported| hit tokens / prompt tokens (router/regret.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

from blockserve.bench import targets, traces
from blockserve.bench.cache_bound_report import (CACHE_AWARE_EXACT, DEFAULT, checks, plot,
                                                 report)
from blockserve.bench.harness import (VLLM_SCHEDULING, as_text, deploy_in_rounds,
                                      deployment_lengths, run_workload)
from blockserve.bench.provenance import announce
from blockserve.bench.report import SLO_ITL_S, SLO_TTFT_S, percentile, pooled
from blockserve.bench.workloads import LengthMode, RequestSpec, random_tokens
from blockserve.router.demand import prefix_hashes

FCFS = "fcfs"
EVENTS_ONLY = "cache-aware, approximate index, events published"
CACHE_AWARE = "cache_aware"  # router/cache_placement.py, by short name (protocol/registry.py)
DYNAMO = "dynamo"


def _blockserve(router: dict, exact: bool, publish: bool | None = None):
    """deploy.yaml's engines with vLLM's scheduling, this routing and prefix index. The
    index and the replicas' KV events (published where the index is exact, unless
    `publish` says) are said outright either way: deploy.yaml's own choice must not
    carry into a configuration named for the other index."""
    return functools.partial(
        targets.blockserve, router={"queue_order": FCFS, **router,
                                    "prefix_index": "exact" if exact else "approximate"},
        scheduler=VLLM_SCHEDULING,
        replica_args={"publish_kv_events": exact if publish is None else publish})


CONFIGURATIONS = {
    # deploy.yaml as it is: its config validation makes an exact index publish KV events
    DEFAULT: lambda name: targets.blockserve(name),
    CACHE_AWARE_EXACT: _blockserve({"placement": CACHE_AWARE}, exact=True),
    "cache-aware, approximate index": _blockserve({"placement": CACHE_AWARE}, exact=False),
    "Dynamo cost, exact index": _blockserve({"placement": DYNAMO}, exact=True),
    "power of two": _blockserve(
        {"placement": "power_of_two"}, exact=False),
    "Ray Serve LLM prefix": lambda name: targets.ray_serve_llm(name,
                                                               targets.PREFIX_CACHE_AFFINITY),
    "Ray Serve LLM KV-aware": lambda name: kv_aware_peer(name),
    # A diagnostic, not run by default: what publishing KV events costs the engines
    EVENTS_ONLY: _blockserve({"placement": CACHE_AWARE}, exact=False, publish=True),
}
KV_AWARE = "ray.serve.llm.request_router:KVAwareRouter"
# A folder holding ai-dynamo's `dynamo` package, which Ray Serve LLM's KVAwareRouter
# imports. `pip install ai-dynamo` fails here: it needs `aisimulate`, a placeholder that
# downloads its wheel from pypi.nvidia.com, unreachable from this machine; installed with
# `pip install --no-deps --target DIR ai-dynamo ai-dynamo-runtime`, it imports and runs.
DYNAMO_SITE = "BLOCKSERVE_DYNAMO_SITE"


@contextlib.contextmanager
def kv_aware_peer(name: str):
    """Ray Serve LLM with KVAwareRouter (Dynamo's selection service), `dynamo` from
    $BLOCKSERVE_DYNAMO_SITE on the Ray workers' path."""
    site = os.environ.get(DYNAMO_SITE)
    if not site:
        raise RuntimeError(f"set {DYNAMO_SITE} to a folder holding ai-dynamo's dynamo package")
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [site, previous]))
    try:
        with targets.ray_serve_llm(name, KV_AWARE) as target:
            yield target
    finally:
        if previous is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = previous
REGRET_COUNTERS = ("prompt", "predicted_hit", "reported_hit", "regret")
ADMISSION_WAIT = "blockserve_admission_wait_seconds"  # time queued at the router


def tenants(n: int = 180, count: int = 12, prefix_tokens: int = 640, rate: float = 6.0,
            seed: int = 0) -> list[RequestSpec]:
    """Tenants' requests share their tenant's long system prompt (module docstring),
    arriving at `rate` per second until `at_capacity` sets the benchmark's rate."""
    rng = random.Random(seed)
    prefixes = [random_tokens(rng, prefix_tokens) for _ in range(count)]
    weights = [1 / (rank + 1) for rank in range(count)]
    t, specs = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        tenant = rng.choices(range(count), weights)[0]
        specs.append(RequestSpec(t, prefixes[tenant] + random_tokens(rng, rng.randint(32, 96)),
                                 rng.randint(16, 64), f"tenant-{tenant}"))
    return specs


def sessions(n: int = 96, turns: int = 6, rate: float = 2.0, think_s: float = 3.0,
             seed: int = 0, max_model_len: int = 1024) -> list[RequestSpec]:
    """Chats whose prompt is the growing history (module docstring): n // turns sessions
    starting at `rate` per second, a turn every `think_s` seconds on average, until
    `at_capacity` scales both by one factor."""
    rng = random.Random(seed)
    specs, start = [], 0.0
    for session in range(n // turns):
        start += rng.expovariate(rate)
        history, t = random_tokens(rng, 192), start
        for _ in range(turns):
            output = rng.randint(16, 48)
            history = history + random_tokens(rng, rng.randint(32, 96))  # the user's message
            if len(history) + output >= max_model_len:
                break
            specs.append(RequestSpec(t, list(history), output, f"session-{session}"))
            history = history + random_tokens(rng, output)  # the reply, as the client keeps it
            t += rng.expovariate(1 / think_s)
    return sorted(specs, key=lambda s: s.arrival_s)


def mooncake(n: int = 150, seed: int = 0, capacity: traces.Capacity | None = None
             ) -> tuple[list[RequestSpec], dict]:
    scaled = traces.mooncake(n, seed, capacity)
    return scaled.specs, scaled.scaling


RULE = "mean rate = capacity_kv_tokens / mean_request_tokens (bench/traces.py step 5)"


def at_capacity(specs: list[RequestSpec], capacity: traces.Capacity
                ) -> tuple[list[RequestSpec], dict]:
    """bench/traces.py's step 5 on a generated workload: arrival times relative to the
    first, times one factor so that the mean rate, (n - 1) / span, is the KV capacity
    in tokens / the mean prompt + output tokens; gaps keep their shape."""
    fit = traces.fit_rate([s.arrival_s for s in specs],
                          [len(s.prompt) + s.output_tokens for s in specs], capacity)
    scaled = [dataclasses.replace(s, arrival_s=arrival) for s, arrival in zip(specs, fit.arrivals)]
    return scaled, {"rule": RULE, "capacity_kv_tokens": capacity.kv_tokens,
                    "mean_request_tokens": fit.mean_request_tokens, "rate_rps": fit.rate_rps,
                    "generated_rate_rps": fit.source_rate_rps, "time_scale": fit.time_scale}


def session_shape(specs: list[RequestSpec]) -> dict:
    """How often sessions (a spec's `tenant`) start, and the mean think time."""
    turns: dict[str, list[float]] = {}
    for spec in specs:
        turns.setdefault(spec.tenant, []).append(spec.arrival_s)
    starts = sorted(times[0] for times in turns.values())
    thinks = [b - a for times in turns.values() for a, b in zip(times, times[1:])]
    return {"sessions": len(turns),
            "session_start_rate": (len(starts) - 1) / (starts[-1] - starts[0]),
            "think_s_mean": statistics.fmean(thinks)}


def scaled_workload(name: str, seed: int, capacity: traces.Capacity
                    ) -> tuple[list[RequestSpec], dict]:
    """A workload's requests at the capacity rule's rate, and how they were scaled."""
    if name == "mooncake":
        return mooncake(seed=seed, capacity=capacity)
    if name == "tenants":
        return at_capacity(tenants(seed=seed), capacity)
    specs, scaling = at_capacity(sessions(seed=seed, max_model_len=capacity.max_model_len),
                                 capacity)
    return specs, {**scaling, **session_shape(specs)}


def working_set(specs: list[RequestSpec], capacity: traces.Capacity) -> dict:
    """Distinct prompt blocks (as prefixes: a block's hash chains the ones before it)
    and those more than one request shares, against the cache's blocks; and the hit
    rate's ceiling: the share of prompt tokens one cache that never evicts could serve
    (every leading block some earlier request computed, but never a prompt's last
    token, as vLLM counts them), which no routing can beat."""
    seen: dict[int, int] = {}
    hit_tokens = prompt_tokens = 0
    size = capacity.block_size
    for spec in specs:
        hashes = prefix_hashes(spec.prompt, size)
        cached = next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
        hit_tokens += min(cached, (len(spec.prompt) - 1) // size) * size
        prompt_tokens += len(spec.prompt)
        for block_hash in hashes:
            seen[block_hash] = seen.get(block_hash, 0) + 1
    return {"requests": len(specs), "distinct_prompt_blocks": len(seen),
            "shared_prompt_blocks": sum(1 for c in seen.values() if c > 1),
            "hit_rate_ceiling": hit_tokens / prompt_tokens,
            "blocks_per_replica": capacity.blocks_per_replica, "replicas": capacity.replicas,
            "span_s": round(specs[-1].arrival_s, 1)}


def _router_counters(target) -> dict[str, float] | None:
    """Routing regret's counters and the admission wait's sum and count, now."""
    if "router" not in target.notes:  # not blockserve: no router metrics
        return None
    text = targets._scrape(target.base_urls[0])
    counters = {kind: sum(targets._samples(text, f"blockserve_prefix_{kind}_tokens_total")
                          .values()) for kind in REGRET_COUNTERS}
    for part in ("sum", "count"):
        counters[f"wait_{part}"] = sum(targets._samples(text, f"{ADMISSION_WAIT}_{part}")
                                       .values())
    return counters


def kv_event_stats(target) -> dict | None:
    """The router's KV event streams (batches, gaps, lost batches, delay), if it has any."""
    if "router" not in target.notes:
        return None
    state = targets.http.get(f"{target.base_urls[0]}/admin/state",
                             headers={"Authorization": f"Bearer {targets.API_KEY}"}).json()
    return state.get("kv_events")


def counter_delta(before: dict | None, after: dict | None) -> dict | None:
    return None if before is None or after is None else {k: after[k] - before[k] for k in after}


def cache_metrics(records: list[dict], delta: dict | None) -> dict:
    """Hit rate and p90 TTFT from the records; admission wait and routing regret from
    the router counters' change over them (`delta`, None where there is no router)."""
    ok = [r for r in records if r["status"] == 200]
    reported = [r for r in ok if r.get("cached_tokens") is not None and r["prompt_tokens"]]
    prompt = sum(r["prompt_tokens"] for r in reported)
    metrics = {"ttft_p90_s": percentile([r["ttft_s"] for r in ok], 0.9),
               "hit_rate": sum(r["cached_tokens"] for r in reported) / prompt if prompt
               else None}
    if delta is not None:
        if delta["wait_count"]:  # why a TTFT is long: queued at the router, or at the engine
            metrics["admission_wait_mean_s"] = delta["wait_sum"] / delta["wait_count"]
        if delta["prompt"]:
            metrics.update({"predicted_hit_rate": delta["predicted_hit"] / delta["prompt"],
                            "router_hit_rate": delta["reported_hit"] / delta["prompt"],
                            "regret": delta["regret"] / delta["prompt"]})
    return metrics


def pooled_run(runs: list[dict]) -> dict:
    """A workload's seeds as one run (report.pooled), its cache metrics over all of
    their requests and summed counters; each seed keeps its own."""
    deltas = [run["router_counters"] for run in runs]
    total = None if None in deltas else {k: sum(d[k] for d in deltas) for k in deltas[0]}
    result = pooled(runs, SLO_TTFT_S, SLO_ITL_S)
    result["cache"] = cache_metrics(result["records"], total)
    result["wall_s"] = sum(run["wall_s"] for run in runs)
    for entry, run in zip(result["seeds"], runs):
        entry.update(cache=run["cache"], kv_events=run["kv_events"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGURATIONS),
                        default=[c for c in CONFIGURATIONS if c != EVENTS_ONLY])
    parser.add_argument("--workloads", nargs="+", default=["tenants", "sessions", "mooncake"],
                        choices=["tenants", "sessions", "mooncake"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="replay each workload once per seed (another draw or window)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="deploy every configuration this many times, the seeds split "
                             "among the rounds, every other round in reverse order")
    parser.add_argument("--out", default="results/cache_bound")
    args = parser.parse_args()
    provenance = announce("cache_bound")
    args.slo_ttft, args.slo_itl = SLO_TTFT_S, SLO_ITL_S  # for the harness's summary
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    lengths = deployment_lengths(LengthMode.UNKNOWN)
    capacity = traces.Capacity.of_deployment()
    workloads: dict = {w: {} for w in args.workloads}  # per workload, per seed
    specs = {}
    for seed in args.seeds:
        for w in args.workloads:
            token_specs, scaling = scaled_workload(w, seed, capacity)
            cut: list[int] = []
            specs[w, seed] = as_text(token_specs, cut)
            workloads[w][str(seed)] = {"working_set": working_set(token_specs, capacity),
                                       "scaling": {**scaling, "text_prompts_cut": len(cut)}}

    def replay_seed(target, seed: int):
        for workload in args.workloads:
            progress.set_postfix_str(f"{target.name}: {workload}, seed {seed}")
            before, started = _router_counters(target), time.time()
            run = run_workload(target, specs[workload, seed], lengths, args, progress)
            run["router_counters"] = counter_delta(before, _router_counters(target))
            run["cache"] = cache_metrics(run["records"], run["router_counters"])
            run.update(seed=seed, wall_s=time.time() - started,
                       kv_events=kv_event_stats(target))  # per stream, so far
            yield workload, run

    with tqdm(total=len(args.configs) * sum(map(len, specs.values())), unit="req") as progress:
        for results in deploy_in_rounds(CONFIGURATIONS, args.configs, args.seeds, args.rounds,
                                        replay_seed, pooled_run, progress):
            write(args, workloads, results, provenance)
    print(report(results, args.workloads))
    plot(results, args.workloads, args.out)


def write(args, workloads: dict, results: dict, provenance: dict) -> None:
    """`<out>.json`, with the command and bench/provenance.py's code and deploy.yaml."""
    Path(f"{args.out}.json").write_text(json.dumps(
        {"command": "python -m blockserve.bench.cache_bound " + shlex.join(sys.argv[1:]),
         **provenance, "args": vars(args), "ours": DEFAULT, "workloads": workloads,
         "targets": checks(results, list(workloads)), "results": results,
         "report": report(results, list(workloads))}, indent=1))


if __name__ == "__main__":
    main()
