"""Policy benchmark: the same seeded workloads against several configurations, one run.

    python -m blockserve.bench.harness [--workloads pressure azure_code mooncake] [--configs ...]
                            [--length-mode unknown|known] [--also-known pressure]
                            [--requests N] [--seeds 0 1 2] [--out results/policy_bench]

Each configuration is deployed on the same replica settings (deploy/deploy.yaml), every
workload is replayed against it, and it is torn down before the next. `--length-mode`
(default unknown) decides what each request says about its output length
(bench/workloads.py); every request still ends at its true length. `--also-known W`
replays workload W once more with lengths known, on the same deployments, reported as
"W (known lengths)" (one start-up per configuration for both). `--seeds` replays each
workload once per seed (a different draw, or trace window, each); `--rounds R` deploys
every configuration R times, in A B B A order, each round replaying its share of the seeds;
a workload's numbers are then its seeds pooled (all requests; throughput and goodput over
the seeds' summed makespans) and each target also shows its range over the seeds, since
one run on a shared 2-core machine moves by tens of percent (docs/benchmarks.md). Prints absolute
numbers, ratios of our configuration (deploy.yaml as it is) against each other one and
issue 15's targets. A `--configs` entry is one of `CONFIGURATIONS`, or deploy.yaml with
overrides, written as the simulator's (bench/variants.py; `engine` keys are vLLM engine
arguments here): `"blockserve + router.placement=cache_aware(must_fit=false)"`. Writes `<out>.json` (everything measured, the length mode, each trace
workload's scaling, the command and the code and deploy.yaml it ran: bench/provenance.py), `<out>.md` (the tables) and `<out>-ttft.png` / `<out>-kv.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from tqdm import tqdm

from blockserve.bench import cpu_share, targets, traces
from blockserve.bench.client import replay
from blockserve.bench.cpu_speed import SpeedProbe
from blockserve.bench.provenance import announce
from blockserve.bench.report import (OURS, SLO_ITL_S, SLO_TTFT_S, absolute_table, markdown, plot,
                                     pooled, ratio_table, summarise, target_checks, target_table)
from blockserve.bench.variants import VLLM_SCHEDULING, parse_entry
from blockserve.bench.workloads import WORKLOADS, LengthMode, Lengths, end_token_id
from blockserve.protocol.registry import BASELINE_PLACEMENTS
from blockserve.tools.launch import load_config

# vLLM's own value of the scheduling settings deploy.yaml changes: its `watermark` is part
# of blockserve's configuration, so the memory-blind baselines run vLLM's default (0: off).
VLLM_ENGINE_DEFAULTS = {"watermark": 0.0}
# (router, replica scheduler) policies in place of deploy.yaml's, by short name
# (protocol/registry.py); the simulator runs the same sets.
# The policies before issue 15: leases of max_tokens and the reservation gate.
WORST_CASE = ({"placement": "best_fit", "queue_order": "fcfs", "output_predictor": "max_tokens"},
              {"queue_order": "router_order", "admission_gate": "reservation",
               "preemption": "cheapest_recompute", "block_eviction": "protect_shared"})
# Ray-Serve-style routers (the registry's baseline placements) in front of unmodified vLLM
# scheduling, labelled by short name: "round robin", "power of two", "least kv".
BASELINES = {name.replace("_", " "): ({"placement": name, "queue_order": "fcfs"}, VLLM_SCHEDULING)
             for name in BASELINE_PLACEMENTS}


def _engine() -> dict:
    return load_config()["applications"][0]["args"]["replica"]["engine_args"]


def vllm_watermark() -> float:
    """vLLM's `watermark` for the in-engine baseline, from the deployment, not tuned:
    one free block per sequence the engine may run (max_num_seqs / KV blocks), so every
    running sequence can grow a block before one must be preempted."""
    engine = _engine()
    return round(engine["max_num_seqs"] / engine["num_gpu_blocks_override"], 3)


CONFIGURATIONS = {
    OURS: lambda name: targets.blockserve(name),  # deploy/deploy.yaml as it is
    "blockserve worst case": lambda name: targets.blockserve(name, *WORST_CASE),
    "blockserve + vLLM scheduling": lambda name: targets.blockserve(name, None,
                                                                    VLLM_SCHEDULING),
    "blockserve + vLLM watermark": lambda name: targets.blockserve(
        name, None, VLLM_SCHEDULING, {"watermark": vllm_watermark()}),
    # deploy.yaml's default before cache-aware placement (docs/benchmarks.md): balanced
    # placement on the approximate index, vLLM's watermark 0.199
    "blockserve balanced, watermark": lambda name: targets.blockserve(
        name, {"placement": "balanced", "prefix_index": "approximate"}, None,
        {"watermark": vllm_watermark()}, {"publish_kv_events": False}),
    "blockserve via Serve handle": lambda name: targets.blockserve(
        name, {"transport": "serve_handle"}),
    # No core named in omp_threads_bind: neither the engines' OpenMP threads nor their
    # processes pinned (replica/cpu_binding.py), as a check of what pinning costs.
    "blockserve, engines unpinned": lambda name: targets.blockserve(
        name, replica_args={"omp_threads_bind": []}),
    "blockserve balanced": lambda name: targets.blockserve(
        name, {"placement": "balanced",
               "queue_order": {"cls": "shortest_demand", "kwargs": {"max_wait_s": 10}}}),
    **{label: (lambda name, policies=policies: targets.blockserve(name, *policies,
                                                                   VLLM_ENGINE_DEFAULTS))
       for label, policies in BASELINES.items()},
    "raw vLLM x2": lambda name: targets.raw_vllm(name, engine_args=VLLM_ENGINE_DEFAULTS),
    "Ray Serve LLM": lambda name: targets.ray_serve_llm(name),
    "Ray Serve LLM prefix": lambda name: targets.ray_serve_llm(
        name, targets.PREFIX_CACHE_AFFINITY),
}


def configuration(entry: str) -> Callable:
    """A `--configs` entry's deployment: a named configuration, or deploy.yaml with the
    entry's overrides (module docstring)."""
    if entry in CONFIGURATIONS:
        return CONFIGURATIONS[entry]
    router, scheduler, engine = overridden(entry)
    return lambda name: targets.blockserve(name, router, scheduler, engine)


def overridden(entry: str) -> tuple[dict, dict, dict]:
    """deploy.yaml's (router, replica scheduler, engine overrides) with an `OURS + ...`
    entry's overrides applied."""
    variant = parse_entry(entry, CONFIGURATIONS)
    if variant.base not in (None, OURS):
        raise ValueError(f"{entry!r}: overrides apply to {OURS!r} only")
    args = load_config()["applications"][0]["args"]
    return (variant.applied("router", args["router"]),
            variant.applied("scheduler", args["replica"].get("scheduler", {})),
            variant.applied("engine", {}))


# Ray Serve LLM's PrefixCacheAffinityRouter never answers a token-id prompt.
NEEDS_TEXT_PROMPTS = {"Ray Serve LLM prefix"}


def deployment_lengths(mode: LengthMode) -> Lengths:
    """The length mode on deploy.yaml's context and the model's vocabulary."""
    replica = load_config()["applications"][0]["args"]["replica"]
    model = Path(os.path.expanduser(replica["model"]))
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    return Lengths(mode, int(replica["engine_args"]["max_model_len"]),
                   end_token_id(vocab_size))


def workload(name: str, n: int | None, seed: int) -> tuple[list, dict]:
    """A workload's requests and, for a trace, how it was scaled (bench/traces.py)."""
    kwargs = {"seed": seed} if n is None else {"n": n, "seed": seed}
    if name in traces.SCALED:
        scaled = traces.SCALED[name](**kwargs)
        return scaled.specs, scaled.scaling
    return WORKLOADS[name](**kwargs), {}


def known_label(workload: str) -> str:
    return f"{workload} (known lengths)"


def as_text(specs: list, cut: list[int] | None = None) -> list:
    """The same prompts as text, for every configuration of a run (NEEDS_TEXT_PROMPTS),
    with their length as the server counts it (the unknown mode's cap depends on it).
    Decoded ids can tokenize again into more tokens than the context leaves for the
    output (max_model_len - output tokens): such a prompt loses ids from its end (its
    leading, shared, blocks stay) and is decoded again until it fits; its index is
    appended to `cut`."""
    from transformers import AutoTokenizer

    replica = load_config()["applications"][0]["args"]["replica"]
    tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(replica["model"]))
    max_model_len = int(replica["engine_args"]["max_model_len"])
    texts = []
    for index, spec in enumerate(specs):
        ids, budget = list(spec.prompt), max_model_len - spec.output_tokens
        while True:
            text = tokenizer.decode(ids)
            length = len(tokenizer(text)["input_ids"])
            if length <= budget:
                break
            ids = ids[:len(ids) - (length - budget)]  # at least one id less each time
        if len(ids) < len(spec.prompt) and cut is not None:
            cut.append(index)
        texts.append(dataclasses.replace(spec, prompt=text, text_prompt_tokens=length))
    return texts


def length_check(specs: list, records: list) -> dict:
    """How well requests ended at their true length (the unknown mode's mechanism)."""
    ok = [(r.output_tokens, s.output_tokens) for r, s in zip(records, specs) if r.status == 200]
    return {"ok": len(ok), "exact": sum(got == true for got, true in ok),
            "max_over": max((got - true for got, true in ok), default=0),
            "max_under": max((true - got for got, true in ok), default=0)}


def engines_idle(samples: list[dict]) -> dict | None:
    """While requests waited in blockserve's router: how often an engine had none waiting
    (it starts new work only when the router sends it), and its free blocks then. None
    where the router never held a request (the peers dispatch at once)."""
    held = [s for s in samples if s["router_queue"] > 0]
    engines = [(s["engine_waiting"][replica], s["free_blocks"].get(replica, 0.0))
               for s in held for replica in s["engine_waiting"]]
    if not engines:
        return None
    idle_free = [free for waiting, free in engines if waiting == 0]
    return {"samples": len(held), "engine_samples": len(engines),
            "idle_share": len(idle_free) / len(engines),
            "free_blocks_median_when_idle": statistics.median(idle_free) if idle_free else None}


def engine_load(samples: list[dict]) -> dict | None:
    """The engines' batches while they had work: requests running and waiting per engine
    (means over the samples in which an engine had any), and the share of the samples
    with a request running in which the router held requests. Output tokens per second
    over the requests running gives each one's decode rate, so a slower step shows apart
    from a smaller batch."""
    busy = [(s["engine_running"].get(replica, 0.0), waiting)
            for s in samples for replica, waiting in s["engine_waiting"].items()
            if s["engine_running"].get(replica, 0.0) + waiting > 0]
    if not busy:
        return None
    running = [s for s in samples if any(s["engine_running"].values())]
    return {"engine_samples": len(busy),
            "running_mean": statistics.fmean(r for r, _ in busy),
            "waiting_mean": statistics.fmean(w for _, w in busy),
            "router_held_share": (sum(s["router_queue"] > 0 for s in running) / len(running)
                                  if running else 0.0)}


def run_workload(target, specs, lengths: Lengths, args, progress) -> dict:
    usage_trace, queue_trace, stop = [], [], threading.Event()

    def sample() -> None:
        started = time.time()
        while not stop.is_set():
            try:
                if target.replica_state is not None:  # usage and queues, one scrape
                    state = target.replica_state()
                    usage = state["kv_usage"]
                    queue_trace.append(state)
                else:
                    usage = target.kv_usage()
                usage_trace.append((time.time() - started, usage))
            except Exception:  # a scrape during shutdown: skip the point
                pass
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    before = target.preemptions()
    counters = target.router_counters() if target.router_counters else None
    sampler.start()
    cpu_before, started = cpu_share.cpu_times(), time.monotonic()
    with SpeedProbe() as speed:
        records, makespan = asyncio.run(replay(specs, target.base_urls, targets.API_KEY,
                                               target.model, progress, lengths))
    cpu_cores = cpu_share.cores(cpu_before, cpu_share.cpu_times(), time.monotonic() - started)
    stop.set()
    sampler.join()
    time.sleep(1.0)  # let the last snapshots arrive
    summary = summarise(records, makespan, target.preemptions() - before, args.slo_ttft,
                        args.slo_itl)
    result = {"summary": summary, "length_check": length_check(specs, records),
              "records": [r.to_dict() for r in records], "kv_usage": usage_trace,
              "cpu_cores": cpu_cores, "cpu_speed": speed.summary()}
    if counters is not None:
        result["router"] = targets.counters_since(counters, target.router_counters())
    if target.replica_state is not None:
        result["engines_idle"] = engines_idle(queue_trace)
        result["engine_load"] = engine_load(queue_trace)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["pressure", "azure_code", "mooncake"],
                        choices=sorted(WORKLOADS))
    parser.add_argument("--configs", nargs="+", metavar="CONFIG",
                        default=[c for c in CONFIGURATIONS if c not in NEEDS_TEXT_PROMPTS],
                        help=f"{', '.join(CONFIGURATIONS)}, or {OURS} + overrides "
                             "(module docstring)")
    parser.add_argument("--length-mode", choices=[m.value for m in LengthMode],
                        default=LengthMode.UNKNOWN.value,
                        help="what requests say about their output length (bench/workloads.py)")
    parser.add_argument("--also-known", nargs="+", default=[], choices=sorted(WORKLOADS),
                        metavar="WORKLOAD",
                        help="also replay these workloads with lengths known")
    parser.add_argument("--requests", type=int,
                        help="requests per workload (default: each workload's own size)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="replay each workload once per seed (default: 0)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="deploy every configuration this many times, the seeds split "
                             "among the rounds, every other round in reverse order")
    parser.add_argument("--slo-ttft", type=float, default=SLO_TTFT_S, help="goodput SLO, seconds")
    parser.add_argument("--slo-itl", type=float, default=SLO_ITL_S, help="goodput SLO, seconds")
    parser.add_argument("--text-prompts", action="store_true",
                        help="send prompts as text (needed by Ray Serve LLM's prefix router)")
    parser.add_argument("--out", default="results/policy_bench")
    args = parser.parse_args()
    try:
        chosen = {entry: configuration(entry) for entry in args.configs}
    except ValueError as exc:
        parser.error(str(exc))
    provenance = announce("harness")
    if NEEDS_TEXT_PROMPTS & set(args.configs) and not args.text_prompts:
        parser.error(f"{sorted(NEEDS_TEXT_PROMPTS & set(args.configs))} never answers "
                     "token-id prompts: add --text-prompts")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    lengths = deployment_lengths(LengthMode(args.length_mode))
    known = deployment_lengths(LengthMode.KNOWN)
    built = {(w, seed): workload(w, args.requests, seed) for seed in args.seeds
             for w in dict.fromkeys(args.workloads + args.also_known)}
    specs = {key: s for key, (s, _) in built.items()}
    if args.text_prompts:
        specs = {key: as_text(s) for key, s in specs.items()}
    # label -> (requests by seed, mode)
    runs = {w: ({seed: specs[w, seed] for seed in args.seeds}, lengths) for w in args.workloads}
    runs.update({known_label(w): ({seed: specs[w, seed] for seed in args.seeds}, known)
                 for w in args.also_known})
    total = len(args.configs) * sum(len(s) for by_seed, _ in runs.values()
                                    for s in by_seed.values())

    def replay_seed(target, seed: int):
        for label, (by_seed, run_lengths) in runs.items():
            progress.set_postfix_str(f"{target.name}: {label}, seed {seed}")
            started = time.time()
            run = run_workload(target, by_seed[seed], run_lengths, args, progress)
            yield label, {**run, "seed": seed, "wall_s": time.time() - started}

    with tqdm(total=total, desc="requests", unit="req") as progress:
        for results in deploy_in_rounds(
                chosen, args.configs, args.seeds, args.rounds, replay_seed,
                lambda seed_runs: pooled(seed_runs, args.slo_ttft, args.slo_itl), progress):
            # after each deployment
            report = write(args, lengths, built, runs, results, provenance)
    print(report)
    plot(results, list(runs), args.out)
    print(f"\nwrote {args.out}.json, {args.out}.md, {args.out}-ttft.png, {args.out}-kv.png")


def schedule(configs: list[str], seeds: list[int], rounds: int) -> list[tuple[str, list[int]]]:
    """(configuration, its seeds) per deployment: round r replays seeds[r::rounds], every
    other round in the reverse order of configurations, so that a configuration's runs
    are spread over the benchmark's time as much as any other's (A B B A ...) and a slow
    spell of the machine does not land on one configuration only."""
    return [(name, seeds[r::rounds]) for r in range(rounds) if seeds[r::rounds]
            for name in (configs if r % 2 == 0 else configs[::-1])]


def deploy_in_rounds(configurations: dict, names: list[str], seeds: list[int], rounds: int,
                     replay_seed: Callable, pool: Callable, progress) -> Iterator[dict]:
    """Deploy each named configuration as `schedule` says, and yield the results so far
    after every deployment. On a deployment, `replay_seed(target, seed)` yields
    (label, run) for each of its round's seeds; a configuration's runs of a label, over
    all its deployments so far, are `pool`ed into results[name][label]. One that fails
    is recorded as failed and not deployed again: it does not end the benchmark."""
    results: dict = {}
    seed_runs: dict[str, dict[str, list[dict]]] = {name: {} for name in names}
    for name, round_seeds in schedule(names, seeds, rounds):
        if "failed" in results.get(name, {}):
            continue
        progress.set_postfix_str(f"starting {name}")
        try:
            with configurations[name](name) as target:
                results.setdefault(name, {"startup_s": target.startup_s, "notes": target.notes})
                for seed in round_seeds:  # every workload once, then again: a round a seed
                    for label, run in replay_seed(target, seed):
                        seed_runs[name].setdefault(label, []).append(run)
            for label, runs in seed_runs[name].items():
                results[name][label] = pool(runs)
        except Exception as exc:
            print(f"\n{name} failed: {exc!r}")
            results[name] = {"failed": repr(exc)}
        yield results


def write(args, lengths: Lengths, built: dict, runs: dict, results: dict,
          provenance: dict) -> str:
    """`<out>.json` (with the command and bench/provenance.py's code and deploy.yaml) and
    `<out>.md` of the configurations measured so far; the report."""
    lines = [f"length mode: {lengths.mode.value}; workloads: "
             f"{', '.join(f'{w} ({sum(map(len, s.values()))} requests)' for w, (s, _) in runs.items())}"
             f" over seeds {args.seeds}; "
             f"goodput SLO: TTFT <= {args.slo_ttft}s and ITL <= {args.slo_itl}s"]
    checks = []
    for label in runs:
        # issue 15's targets are for the main length mode
        checks_of_w = target_checks(results, label) if label in args.workloads else []
        checks += checks_of_w
        lines += absolute_table(results, label) + ratio_table(results, label)
        lines += target_table(checks_of_w)
    report = "\n".join(lines)
    Path(f"{args.out}.json").write_text(json.dumps(
        {"command": "python -m blockserve.bench.harness " + shlex.join(sys.argv[1:]),
         **provenance, "args": vars(args), "lengths": dataclasses.asdict(lengths),
         "workloads": {f"{w} (seed {seed})": {"requests": len(s), "scaling": scaling}
                       for (w, seed), (s, scaling) in built.items()},
         "targets": checks, "results": results, "report": report}, indent=1))
    Path(f"{args.out}.md").write_text(markdown(results, list(runs), checks))
    return report


if __name__ == "__main__":
    main()
