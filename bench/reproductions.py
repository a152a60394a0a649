"""Three published GPU results, reproduced in the simulator (issue 25, section 3).

    python -m blockserve.bench.reproductions watermark --out docs/results/repro_watermark
    python -m blockserve.bench.reproductions recompute --out docs/results/repro_recompute
    python -m blockserve.bench.reproductions llmd --out docs/results/repro_llmd

Each reproduction runs the published workload's shape (sizes, lengths, arrivals, as the
source states them; what it does not state is a stated assumption) on a step-time preset
fitted to measured GPU profiles, never to the published figures, and writes PREFIX.json:
for every configuration its published figures beside the simulated ones (each labelled
with the preset), the checks the issue sets and whether each holds. A miss stays a miss.

- `watermark`: vLLM PR #44594, Qwen2.5-7B on one GB200, 450 random prompts (input ~1,000,
  output ~5,000, range ratio 0.2, ignore_eos), 128 concurrent (closed loop), prefix
  caching off, KV 299,584 tokens, max_model_len 8192, max_num_seqs 256; watermark 0 vs 0.05.
- `recompute`: vLLM RFC #54644, online serving of a 7B model under KV pressure, 800
  heterogeneous prompts (range ratio 0.5); vLLM's victim vs `cheapest_recompute`.
- `llmd`: llm-d's precise prefix scheduling benchmark (8 pods of Qwen-32B at TP2, 150
  customers x (6,000-token prefix + 5 users' 1,200-token questions), Poisson 3 -> 60 QPS);
  random / load / approximate / precise routers mapped onto in-tree placements.

The simulated cluster is bench/simulated_cluster.py; a closed loop (a new request as each
one ends, as `vllm bench serve --max-concurrency` sends them) is `ClosedLoopCluster`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import math
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from blockserve.bench import gpu_presets
from blockserve.bench.simulated_cluster import SimulatedCluster
from blockserve.bench.simulator import MODELLED_ROUTER, SIM_CONFIGS, resolve
from blockserve.bench.step_time import PRESETS
from blockserve.bench.variants import Variant, parse_entry
from blockserve.bench.workloads import LengthMode, RequestSpec, random_tokens
from blockserve.tools.launch import EngineShape

SLO_TTFT_S, SLO_ITL_S = 2.0, 0.1  # the simulator's default goodput SLOs


# --- workloads ---------------------------------------------------------------------------
def random_dataset_length(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length as vLLM's random dataset draws it: uniform in [mean (1 - r), mean (1 + r)]."""
    return rng.randint(max(1, math.floor(mean * (1 - range_ratio))),
                       math.ceil(mean * (1 + range_ratio)))


def random_dataset(n: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                   rate: float = math.inf) -> list[RequestSpec]:
    """`vllm bench serve --dataset-name random`: random prompts (they share nothing),
    Poisson arrivals at `rate` (inf: all at once, vLLM bench's default)."""
    rng = random.Random(seed)
    t, specs = 0.0, []
    for _ in range(n):
        if math.isfinite(rate):
            t += rng.expovariate(rate)
        prompt = random_tokens(rng, random_dataset_length(rng, input_len, range_ratio))
        specs.append(RequestSpec(t, prompt, random_dataset_length(rng, output_len, range_ratio)))
    return specs


@dataclass(frozen=True)
class Stage:
    rate: float  # requests per second, Poisson
    duration_s: float


# llm-d's shared_prefix benchmark ramp (inference-perf stages, 3 -> 60 QPS): the stages of
# the llm-d guide that publishes this workload's config (llm-d/llm-d guides/optimized-baseline,
# same data section: 150 groups x 5 prompts, 6,000 + 1,200 tokens, output 1,000), without
# its 15-QPS warm-up stage; the 73-capacity report's own stage list is not public here.
LLMD_STAGES = tuple(Stage(rate, duration) for rate, duration in (
    (3, 20), (10, 20), (15, 20), (20, 38), (22, 34), (25, 30), (30, 25), (35, 21),
    (40, 38), (43, 36), (46, 33), (49, 30), (52, 29), (55, 27), (57, 26), (60, 25)))


def shared_prefix_dataset(groups: int, prompts_per_group: int, system_prompt_len: int,
                          question_len: int, output_len: int, stages, seed: int,
                          rate_scale: float = 1.0, time_scale: float = 1.0
                          ) -> list[RequestSpec]:
    """inference-perf's `shared_prefix` data: `groups` system prompts, each with
    `prompts_per_group` fixed questions; the groups x prompts prompts are shuffled once and
    sent in that order, round and round, at Poisson arrivals stage by stage (each stage's
    rate x `rate_scale`, its duration x `time_scale`)."""
    rng = random.Random(seed)
    prompts = []
    for group in range(groups):
        prefix = random_tokens(rng, system_prompt_len)
        prompts += [(f"group-{group}", prefix + random_tokens(rng, question_len))
                    for _ in range(prompts_per_group)]
    rng.shuffle(prompts)
    t, start, specs = 0.0, 0.0, []
    for stage in stages:
        end = start + stage.duration_s * time_scale
        while True:
            t += rng.expovariate(stage.rate * rate_scale)
            if t >= end:
                t = end
                break
            tenant, prompt = prompts[len(specs) % len(prompts)]
            specs.append(RequestSpec(t, prompt, output_len, tenant))
        start = end
    return specs


# --- a closed loop -----------------------------------------------------------------------
class ClosedLoopCluster(SimulatedCluster):
    """`concurrency` requests in flight from time 0; each request that ends (answered,
    rejected or expired) lets the next one in at once, as a benchmark client with
    `--max-concurrency` sends them. Arrival times in the specs are ignored."""

    def __init__(self, *args, concurrency: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.concurrency = concurrency
        self._backlog: collections.deque = collections.deque()

    async def run(self, specs: list[RequestSpec], progress=None):
        self._backlog = collections.deque(enumerate(specs))
        first = [self._backlog.popleft()[1] for _ in range(min(self.concurrency, len(specs)))]
        return await super().run(first, progress)

    def _let_in(self, ended: int) -> int:
        for _ in range(min(ended, len(self._backlog))):
            self.schedule(self.now, "arrive", self._backlog.popleft())
        return ended

    def _on_arrive(self, payload) -> int:
        return self._let_in(super()._on_arrive(payload))

    def _on_step_done(self, payload) -> int:
        return self._let_in(super()._on_step_done(payload))

    def _expire_queue(self) -> int:
        return self._let_in(super()._expire_queue())


# --- configurations and reproductions ----------------------------------------------------
def configuration(label: str, entry: str) -> Variant:
    """A simulator configuration (`--configs` syntax, bench/variants.py: a named one, its
    overrides), under a short label."""
    variant = parse_entry(entry, SIM_CONFIGS)
    variant.label = label
    return variant


@dataclass(frozen=True)
class Run:
    """What one reproduction runs: a workload on a cluster, each configuration in turn."""

    specs: list[RequestSpec]
    shape: EngineShape
    replicas: int
    variants: tuple[Variant, ...]
    concurrency: int | None = None  # a closed loop of this many; None: the specs' arrivals
    length_mode: LengthMode = LengthMode.KNOWN  # the published clients sent max_tokens
    setup: dict = field(default_factory=dict)  # every number of the workload, for the JSON


def make_cluster(run: Run, variant: Variant, preset: str) -> SimulatedCluster:
    """The simulated cluster of one configuration of a run, on `preset`'s step times."""
    router, scheduler, shape = resolve(variant, run.shape)
    kwargs = dict(scheduler=scheduler, step_time=PRESETS[preset], length_mode=run.length_mode,
                  **{MODELLED_ROUTER[key]: value for key, value in router.items()})
    if run.concurrency:
        return ClosedLoopCluster(run.replicas, shape, concurrency=run.concurrency, **kwargs)
    return SimulatedCluster(run.replicas, shape, **kwargs)


def simulate_variant(run: Run, variant: Variant, preset: str) -> dict:
    """One configuration's figures (SimulatedCluster.figures), with its wall time."""
    cluster = make_cluster(run, variant, preset)
    wall = time.perf_counter()
    flights = asyncio.run(cluster.run(run.specs))
    figures = cluster.figures(flights, SLO_TTFT_S, SLO_ITL_S)
    ttfts = [f.first_token - f.arrival for f in flights if f.first_token is not None]
    figures.update(preset=preset, wall_s=time.perf_counter() - wall,
                   ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else None,
                   recomputed_tokens_per_preemption=figures["recomputed_tokens"]
                   / figures["preemptions"] if figures["preemptions"] else None)
    return figures


@dataclass(frozen=True)
class Check:
    """One target of the issue, judged on the simulated figures by variant label."""

    description: str
    holds: Callable[[dict[str, dict]], bool]


@dataclass(frozen=True)
class Reproduction:
    """A published result and how to simulate it (`build` makes the `Run` at a scale)."""

    source: str
    published: dict[str, dict[str, float]]  # variant label -> figure -> published value
    preset: str  # the step-time preset the issue names (fitted to profiles, not to these)
    build: Callable[[argparse.Namespace], Run]
    checks: tuple[Check, ...]
    base: str  # the configuration the others are compared with
    relative: tuple[str, ...]  # figures also given as a ratio to the base's
    notes: tuple[str, ...] = ()  # where and why the simulation differs from the source


def moves_as_published(published: dict, before: str, after: str, figure: str) -> Check:
    """The simulated figure changes from `before` to `after` in the published direction."""
    sign = math.copysign(1, published[after][figure] - published[before][figure])
    return Check(f"{figure} moves as published ({before} -> {after}: "
                 f"{'up' if sign > 0 else 'down'})",
                 lambda sim: (sim[after][figure] - sim[before][figure]) * sign > 0)


def ordered(labels: tuple[str, ...], figure: str, descending: bool) -> Check:
    """The variants' simulated figure in the published order."""
    relation = " > " if descending else " < "
    def holds(sim):
        values = [sim[label][figure] for label in labels]
        pairs = zip(values, values[1:])
        return all(a > b if descending else a < b for a, b in pairs)
    return Check(f"{figure}: {relation.join(labels)}", holds)


def ratio_within(figure: str, mine: str, base: str, published: float, tolerance: float
                 ) -> Check:
    return Check(f"{figure} {mine} / {base} within {tolerance:.0%} of the published "
                 f"{published:.2f}x",
                 lambda sim: abs(sim[mine][figure] / sim[base][figure] / published - 1)
                 <= tolerance)


def with_ratios(figures: dict[str, dict], base: str, relative: tuple[str, ...]) -> dict:
    """Each configuration's figures with, for every `relative` figure both it and `base`
    have as a number, `"FIGURE / BASE"`: its ratio to the base's (kept where given)."""
    numbers = {key: value for key, value in figures[base].items()
               if isinstance(value, (int, float)) and value}
    return {label: {**{f"{key} / {base}": values[key] / numbers[key] for key in relative
                       if label != base and key in numbers
                       and isinstance(values.get(key), (int, float))},
                    **values}
            for label, values in figures.items()}


def engine_shape(preset: str, kv_tokens: int | None = None, **fields) -> EngineShape:
    """The replica vLLM builds for `preset`'s model on its GPUs (bench/gpu_presets.py),
    with the published KV cache of `kv_tokens` (None: the preset's own) and the engine
    arguments the source states (`fields`)."""
    shape = gpu_presets.engine_shape(preset, fields.get("max_model_len"))
    if kv_tokens is not None:
        fields["num_blocks"] = kv_tokens // shape.block_size + 1  # and vLLM's null block
    return dataclasses.replace(shape, **fields)


def _engine_setup(shape: EngineShape) -> dict:
    """The engine arguments a run's JSON records."""
    return {"kv_tokens": shape.usable_blocks * shape.block_size, "block_size": shape.block_size,
            "max_model_len": shape.max_model_len, "max_num_seqs": shape.max_num_seqs,
            "max_num_batched_tokens": shape.max_num_batched_tokens,
            "enable_chunked_prefill": True, "enable_prefix_caching": shape.enable_prefix_caching}


# --- a. vLLM PR #44594: the watermark ------------------------------------------------------
WATERMARK_URL = "https://github.com/vllm-project/vllm/pull/44594"


def watermark_run(args) -> Run:
    # The PR's engine: --max-model-len 8192 --max-num-seqs 256, chunked prefill, prefix
    # caching off; its batch token budget is vLLM's default on a >= 70 GiB GPU other than
    # A100 (GB200: 8192).
    shape = engine_shape(WATERMARK.preset, args.kv_tokens, max_model_len=8192,
                         max_num_seqs=256, max_num_batched_tokens=8192,
                         enable_prefix_caching=False)
    specs = random_dataset(args.prompts, args.input_len, args.output_len, 0.2, args.seed)
    # vLLM's own scheduling behind a pass-through router (one replica); the approximate
    # prefix index, which costs nothing to keep (these prompts share nothing).
    plain = "round robin + router.prefix_index=approximate"
    return Run(specs, shape, 1, (configuration("watermark 0", plain),
                                 configuration("watermark 0.05", f"{plain}, engine.watermark=0.05")),
               concurrency=args.concurrency,
               setup={"prompts": args.prompts, "input_len": args.input_len,
                      "output_len": args.output_len, "random_range_ratio": 0.2,
                      "concurrency": args.concurrency, "kv_tokens": args.kv_tokens,
                      "engine": _engine_setup(shape)})


WATERMARK_PUBLISHED = {
    "watermark 0": {"preemptions": 1065, "output_tokens_per_s": 11582, "ttft_p50_s": 6.56,
                    "ttft_p99_s": 25.51, "token_itl_p99_s": 0.04062, "e2e_p50_s": 51.6},
    "watermark 0.05": {"preemptions": 187, "output_tokens_per_s": 12167, "ttft_p50_s": 11.20,
                       "ttft_p99_s": 28.94, "token_itl_p99_s": 0.01770, "e2e_p50_s": 47.9},
}
WATERMARK = Reproduction(
    source=f"{WATERMARK_URL} (Qwen2.5-7B-Instruct, TP1, one GB200; vllm bench serve, random "
           "dataset, 450 prompts, --max-concurrency 128, --ignore-eos, prefix caching off)",
    published=WATERMARK_PUBLISHED, preset="a100-llama3-8b", build=watermark_run,
    base="watermark 0", relative=("preemptions", "output_tokens_per_s", "token_itl_p99_s",
                                  "ttft_p50_s"),
    checks=(*(moves_as_published(WATERMARK_PUBLISHED, "watermark 0", "watermark 0.05", figure)
              for figure in ("preemptions", "output_tokens_per_s", "token_itl_p99_s", "ttft_p50_s")),
            Check("preemptions fall at least 3x",
                  lambda sim: 0 < sim["watermark 0"]["preemptions"]
                  >= 3 * sim["watermark 0.05"]["preemptions"])),
    notes=("The model is an 8B Llama on the a100-llama3-8b preset, not Qwen2.5-7B on a GB200: "
           "the issue names this preset; no GB200 profile exists here. The KV cache is the "
           "published 299,584 tokens, not the A100's.",
           "Prefix caching is off, as published: a resumed request recomputes all it had "
           "computed.",
           "token_itl_p99_s is over every inter-token gap, as vllm bench's ITL."))


# --- b. vLLM RFC #54644: the recompute tax -------------------------------------------------
RECOMPUTE_URL = "https://github.com/vllm-project/vllm/issues/54644"


def recompute_run(args) -> Run:
    # The RFC does not say; vLLM's default is on. Off (--prefix-caching 0) shows what a
    # resumed request's hits on its own freed blocks do to the victims' difference.
    shape = engine_shape(RECOMPUTE.preset, args.kv_tokens,
                         enable_prefix_caching=bool(args.prefix_caching))
    specs = random_dataset(args.prompts, args.input_len, args.output_len, 0.5, args.seed,
                           rate=args.rate)
    plain = "round robin + router.prefix_index=approximate"
    return Run(specs, shape, 1, (
        configuration("vllm victim", plain),
        configuration("cheapest_recompute", f"{plain}, scheduler.preemption=cheapest_recompute")),
        setup={"prompts": args.prompts, "input_len": args.input_len,
               "output_len": args.output_len, "random_range_ratio": 0.5,
               "request_rate": args.rate, "engine": _engine_setup(shape)})


RECOMPUTE = Reproduction(
    source=f"{RECOMPUTE_URL} (online serving of a 7B model, 800 prompts, "
           "--random-range-ratio 0.5, under KV pressure; least-computed-first victim)",
    # The tax as a band; least-computed-first's cut of it as the band of the ratio (24-30%
    # less: 0.70-0.76x; per preemption 35-41% less), throughput "unchanged".
    published={"vllm victim": {"recompute_tax": (0.10, 0.23)},
               "cheapest_recompute": {"recompute_tax / vllm victim": (0.70, 0.76),
                                      "recomputed_tokens_per_preemption / vllm victim":
                                          (0.59, 0.65),
                                      "output_tokens_per_s / vllm victim": 1.0}},
    preset="h100-llama2-7b", build=recompute_run, base="vllm victim",
    relative=("recompute_tax", "recomputed_tokens_per_preemption", "output_tokens_per_s",
              "preemptions", "ttft_p90_s"),
    checks=(Check("vLLM's victim: recompute tax in the published 10-23%",
                  lambda sim: 0.10 <= sim["vllm victim"]["recompute_tax"] <= 0.23),
            Check("cheapest_recompute cuts the tax by at least 20%",
                  lambda sim: sim["cheapest_recompute"]["recompute_tax / vllm victim"] <= 0.8),
            Check("at output throughput within 2%",
                  lambda sim: abs(sim["cheapest_recompute"]["output_tokens_per_s / vllm victim"]
                                  - 1) <= 0.02)),
    notes=("The RFC states neither the prompt and output lengths nor the rate or KV size; "
           "those not stated are vllm bench serve's defaults (input 1,024, output 128, "
           "request rate inf: every prompt at once) and the KV cache is capped so that "
           "preemption happens (the RFC's own runs cap KV, e.g. '0.05x KV').",
           "The in-tree cheapest_recompute also schedules the most-computed requests first "
           "(replica/scheduler_builtins.py); the RFC's LCF changes only the victim."))


# --- c. llm-d precise prefix scheduling ----------------------------------------------------
LLMD_URL = ("https://llm-d.ai/blog/kvcache-wins-you-can-see (2025-09-24, appendix A); "
            "llm-d-kv-cache-manager benchmarking/73-capacity")
LLMD_PODS, LLMD_GROUPS, LLMD_KV_TOKENS = 8, 150, 307_328
NO_TIMEOUT_S = 86_400  # a router queue timeout no run reaches


def llmd_run(args) -> Run:
    """The published cluster scaled to `args.pods` pods: customers and every stage's rate
    scaled by pods / 8, so the load per pod and the prefixes' share of the cluster's KV
    (73%) stay as published. `args.length_scale` < 1 is a reduced version for tests:
    every length and the KV cache times it, every rate over it (about the same tokens
    per second and requests in flight), and `args.time_scale` shortens every stage."""
    scale, lengths = args.pods / LLMD_PODS, args.length_scale
    groups = max(1, round(LLMD_GROUPS * scale))
    prefix, question, output = (round(n * lengths) for n in (6000, 1200, 1000))
    kv_tokens = round(args.kv_tokens * lengths)
    shape = engine_shape(LLMD.preset, kv_tokens)
    specs = shared_prefix_dataset(groups, 5, prefix, question, output, LLMD_STAGES, args.seed,
                                  rate_scale=scale / lengths, time_scale=args.time_scale)
    # llm-d's routers send every request on at once; blockserve's router queue would shed
    # the ones it held past its timeout (60 s), which leaves only survivors' TTFTs to
    # compare. Here the timeout outlasts any run, so no configuration sheds. llm-d runs
    # stock vLLM, so queues are FCFS and steps vLLM's own (deploy.yaml's SLO policies
    # since 2026-12-06 are not what it ran).
    cache_aware = ("blockserve + router.placement=cache_aware, router.queue_order=fcfs, "
                   "scheduler.queue_order=fcfs, scheduler.step_tokens=vllm, "
                   f"router.queue_timeout_s={NO_TIMEOUT_S}, router.prefix_index=")
    return Run(specs, shape, args.pods, (
        configuration("precise", cache_aware + "exact"),
        configuration("approximate", cache_aware + "approximate"),
        configuration("load", "least kv"), configuration("random", "power of two")),
        setup={"pods": args.pods, "customers": groups, "users_per_customer": 5,
               "prefix_tokens": prefix, "question_tokens": question, "output_tokens": output,
               "stages": [dataclasses.asdict(s) for s in LLMD_STAGES],
               "rate_scale": scale / lengths, "time_scale": args.time_scale,
               "prefix_share_of_cluster_kv": groups * (prefix + 5 * question)
               / (args.pods * kv_tokens),
               "engine": _engine_setup(shape)})


LLMD_PUBLISHED = {
    "precise": {"output_tokens_per_s": 8730.0, "ttft_p90_s": 0.542, "ttft_mean_s": 0.298},
    "approximate": {"output_tokens_per_s": 6944.4, "ttft_p90_s": 31.083, "ttft_mean_s": 13.316},
    "load": {"output_tokens_per_s": 4428.7, "ttft_p90_s": 94.865, "ttft_mean_s": 46.987},
    "random": {"output_tokens_per_s": 4428.7, "ttft_p90_s": 92.551, "ttft_mean_s": 45.281},
}
LLMD = Reproduction(
    source=f"{LLMD_URL} (8 pods of Qwen-32B on 2 H100 each, 307,328 KV tokens per pod; "
           "inference-perf shared_prefix: 150 groups x 5 prompts, 6,000 + 1,200 tokens, "
           "output 1,000, ignore_eos; Poisson 3 -> 60 QPS)",
    published=LLMD_PUBLISHED, preset="h100x2-qwen3-32b", build=llmd_run, base="random",
    relative=("output_tokens_per_s", "ttft_p90_s", "ttft_mean_s"),
    checks=(ordered(("precise", "approximate", "random"), "output_tokens_per_s", True),
            ordered(("precise", "approximate", "random"), "ttft_p90_s", False),
            ratio_within("output_tokens_per_s", "precise", "random", 8730.0 / 4428.7, 0.25),
            ratio_within("output_tokens_per_s", "approximate", "random", 6944.4 / 4428.7, 0.25),
            ratio_within("output_tokens_per_s", "load", "random", 1.0, 0.25),
            Check("no configuration sheds a request (the published runs answered all)",
                  lambda sim: all(figures["shed"] == 0 for figures in sim.values()))),
    notes=("Routers, mapped onto in-tree placements: precise = cache_aware on the exact "
           "prefix index (vLLM's KV events); approximate = cache_aware on the approximate "
           "index (routing history); load = least_kv (KV usage, then requests in flight: "
           "llm-d's queue + KV-utilisation scorers without its queue-depth weight); random "
           "= power_of_two. cache_aware also holds a request in the router's queue until "
           "a replica has the blocks for it (blockserve's admission), which llm-d does not; "
           "its queue timeout is set beyond the run so that, as in the published runs, "
           "no request is shed (at the default 60 s an 8-pod run shed about half).",
           "Output lengths are inference-perf's output_len 1,000 with ignore_eos, as the "
           "llm-d guide's config of the same data section states; the 73-capacity report "
           "itself is not available here, nor its stage durations (LLMD_STAGES).",
           "Throughput is the whole run's output tokens over its makespan; the published "
           "figure is inference-perf's summary across its stages."))

REPRODUCTIONS = {"watermark": WATERMARK, "recompute": RECOMPUTE, "llmd": LLMD}


# --- the harness -------------------------------------------------------------------------
def compare(repro: Reproduction, simulated: dict[str, dict], preset: str) -> dict:
    """Per configuration and published figure (and its ratio to the base's): the
    published value (a [low, high] band where the source gives one) beside the
    simulated one."""
    label = f"simulated ({preset})"
    published = with_ratios(repro.published, repro.base, repro.relative)
    return {variant: {figure: {"published": value, label: simulated[variant].get(figure)}
                      for figure, value in figures.items()}
            for variant, figures in published.items()}


def judge(repro: Reproduction, simulated: dict[str, dict]) -> list[dict]:
    results = []
    for check in repro.checks:
        try:
            holds = bool(check.holds(simulated))
        except (KeyError, TypeError, ZeroDivisionError):  # a figure the run could not measure
            holds = False
        results.append({"target": check.description, "met": holds})
    return results


def reproduce(name: str, args) -> dict:
    repro = REPRODUCTIONS[name]
    preset = args.preset or repro.preset
    run = repro.build(args)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:  # runs share nothing
        futures = {v.label: pool.submit(simulate_variant, run, v, preset) for v in run.variants}
        simulated = with_ratios({label: future.result() for label, future in futures.items()},
                                repro.base, repro.relative)
    return {"reproduction": name, "source": repro.source, "preset": preset,
            "figures_are": f"simulated on the {preset} step-time preset unless 'published'",
            "setup": {**run.setup, "replicas": run.replicas, "requests": len(run.specs),
                      "length_mode": run.length_mode.value},
            "comparison": compare(repro, simulated, preset), "simulated": simulated,
            "targets": judge(repro, simulated), "notes": list(repro.notes)}


def table(result: dict) -> list[str]:
    """The docs' markdown table: published against simulated, per variant and figure."""
    sim = f"simulated ({result['preset']})"
    lines = [f"| configuration | figure | published | {sim} |", "|---|---|---:|---:|"]
    for variant, figures in result["comparison"].items():
        for figure, values in figures.items():
            value, published = values[sim], values["published"]
            published = ("-".join(f"{v:.4g}" for v in published)
                         if isinstance(published, (list, tuple)) else f"{published:.4g}")
            lines.append(f"| {variant} | {figure} | {published} | "
                         f"{'-' if value is None else format(value, '.4g')} |")
    lines += ["", "Shed (429/503): " + ", ".join(
        f"{variant} {figures.get('shed', 0)}" for variant, figures in result["simulated"].items()),
              "", *(f"- {'met' if t['met'] else 'MISSED'}: {t['target']}"
                    for t in result["targets"])]
    return lines


DEFAULTS = {
    "watermark": dict(prompts=450, input_len=1000, output_len=5000, concurrency=128,
                      kv_tokens=299_584),
    "recompute": dict(prompts=800, input_len=1024, output_len=128, rate=math.inf,
                      kv_tokens=None, prefix_caching=1),
    "llmd": dict(pods=2, time_scale=1.0, length_scale=1.0, kv_tokens=LLMD_KV_TOKENS),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="name", required=True)
    for name, defaults in DEFAULTS.items():
        p = sub.add_parser(name, help=REPRODUCTIONS[name].source)
        for key, value in defaults.items():
            p.add_argument(f"--{key.replace('_', '-')}", type=int if value is None else type(value),
                           default=value)
        p.add_argument("--preset", choices=list(PRESETS),
                       help=f"step-time preset (default {REPRODUCTIONS[name].preset})")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--jobs", type=int, default=1,
                       help="configurations simulated at once, one process each")
        p.add_argument("--out", default=f"results/repro_{name}")
    args = parser.parse_args(argv)
    started = time.time()
    result = reproduce(args.name, args)
    result["command"] = "python -m blockserve.bench.reproductions " + " ".join(
        argv if argv is not None else __import__("sys").argv[1:])
    result["wall_s"] = time.time() - started
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=1))
    print("\n".join(table(result)))


if __name__ == "__main__":
    main()
