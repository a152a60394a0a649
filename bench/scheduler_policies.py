"""Replica scheduler policies on the real engine: one seeded memory-pressure workload,
every admission configuration, one run, ratios against vLLM's default scheduler.

    python -m blockserve.bench.scheduler_policies [--requests 64] [--length-mode unknown]
                                       [--out results/scheduler_policies.json]

One vLLM engine (the tiny model, the engine settings of deploy/deploy.yaml: 160 blocks of
32 tokens) is started per configuration, in this process, and fed the same requests,
arriving over `--arrival-s` seconds. In the `unknown` length mode (the default) each
request carries a loose `max_tokens` (what the context allows) and ends at its true
length (bench/workloads.py: `Lengths`). Compared:

- vLLM's default scheduler, and vLLM's own `watermark` (engine_args, verbatim): a share
  of the KV blocks kept free when admitting;
- the worst-case reservation gate: leases of max_tokens, as without a router;
- the predicted gate: the same gate on leases from deploy.yaml's
  `router.output_predictor` (router/predictors.py), which this script plays: it
  predicts each request's output from the lengths of those finished before it and
  passes the prediction as the router's hint; leases that run out are extended
  (replica/trajectory.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path

import yaml

from blockserve.bench.report import percentile
from blockserve.bench.workloads import (LengthMode, Lengths, RequestSpec, end_token_id,
                                        lognormal_lengths)
from blockserve.protocol.blocks import blocks_for
from blockserve.protocol.config import PolicyRef, ReplicaConfig, RouterConfig
from blockserve.protocol.hints import Hints
from blockserve.replica.engine_stats import EngineCounters, stat_logger_factory


def configurations(engine_args: dict) -> dict[str, tuple[dict, dict, bool]]:
    """name: (scheduler policies, engine_args overrides, hints from a predictor?).
    vLLM's watermark is set from the deployment, not tuned: one free block per sequence
    the engine may run, so every running sequence can grow a block before one must be
    preempted."""
    watermark = round(engine_args["max_num_seqs"] / engine_args["num_gpu_blocks_override"], 3)
    gate = {"admission_gate": "reservation", "preemption": "cheapest_recompute"}
    return {
        "vllm default": ({}, {}, False),
        f"vllm watermark {watermark}": ({}, {"watermark": watermark}, False),
        "worst-case reservation gate": (gate, {}, False),
        "predicted gate": (gate, {}, True),
        "predicted gate, headroom 0.05": (
            {**gate, "admission_gate": {"cls": "reservation", "kwargs": {"headroom": 0.05}}}, {},
            True),
    }


def workload(n: int, seed: int = 0, arrival_s: float = 4.0
             ) -> list[tuple[float, list[int], int]]:
    """(arrival, prompt, true output length): long-tailed, far more than 160 blocks."""
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        prompt, output = lognormal_lengths(rng, 5.0, 4.2)
        requests.append((rng.uniform(0, arrival_s),
                         [rng.randrange(10, 4000) for _ in range(prompt)], output))
    return sorted(requests, key=lambda r: r[0])


def sampling(prompt: list[int], output: int, lengths: Lengths, hints: Hints | None):
    """vLLM's SamplingParams for the request body fields of the length mode."""
    from vllm.sampling_params import SamplingParams

    fields = lengths.fields(RequestSpec(0.0, prompt, output))
    if "logit_bias" in fields:  # JSON keys are strings; SamplingParams takes token ids
        fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
    return SamplingParams(**fields, extra_args=hints.to_xargs() if hints else None)


async def run_one(replica: ReplicaConfig, requests, lengths: Lengths,
                  predictor_ref: PolicyRef | None) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    counters = EngineCounters()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**replica.engine_kwargs(None)),
                                       stat_loggers=[stat_logger_factory(counters.record)])
    predictor = predictor_ref.build() if predictor_ref is not None else None  # fresh per run
    block_size = replica.engine_args.get("block_size", 16)
    try:
        ttfts, tokens = [], 0
        started = time.perf_counter()

        async def one(index: int, arrival: float, prompt: list[int], output: int) -> None:
            nonlocal tokens
            await asyncio.sleep(max(0.0, arrival - (time.perf_counter() - started)))
            sent, first, hints = time.perf_counter(), None, None
            if predictor is not None:
                cap = replica.engine_args["max_model_len"] - len(prompt)
                expected = predictor.predict(len(prompt), cap if lengths.mode is
                                             LengthMode.UNKNOWN else output, cap)
                hints = Hints(demand_blocks=blocks_for(len(prompt) + expected, block_size),
                              expected_output=expected)
            params = sampling(prompt, output, lengths, hints)
            generated = 0
            async for result in engine.generate({"prompt_token_ids": prompt}, params,
                                                f"req-{index}"):
                generated = len(result.outputs[0].token_ids)
                if first is None and generated:
                    first = time.perf_counter() - sent
            ttfts.append(first)
            tokens += generated
            if predictor is not None:
                predictor.observe(len(prompt), "default", generated)

        await asyncio.gather(*(one(i, *r) for i, r in enumerate(requests)))
        elapsed = time.perf_counter() - started
    finally:
        engine.shutdown()
    return {"preemptions": counters.vllm_preemptions_total,
            "output_tokens_per_s": tokens / elapsed, "elapsed_s": elapsed,
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--arrival-s", type=float, default=4.0,
                        help="requests arrive uniformly over this many seconds")
    parser.add_argument("--length-mode", choices=[m.value for m in LengthMode],
                        default=LengthMode.UNKNOWN.value)
    parser.add_argument("--configs", nargs="+", help="default: every configuration")
    parser.add_argument("--config", default="deploy/deploy.yaml")
    parser.add_argument("--out", default="results/scheduler_policies.json")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    deploy = yaml.safe_load(Path(args.config).read_text())
    replica_args = deploy["applications"][0]["args"]["replica"]
    # The deployment's own predictor (router.output_predictor), as the router runs it.
    predictor = RouterConfig.model_validate(
        {k: v for k, v in deploy["applications"][0]["args"].get("router", {}).items()
         if k == "output_predictor"}).output_predictor
    model_config = Path(os.path.expanduser(replica_args["model"])) / "config.json"
    vocab_size = json.loads(model_config.read_text())["vocab_size"]
    mode = LengthMode(args.length_mode)
    lengths = Lengths(mode, replica_args["engine_args"]["max_model_len"], end_token_id(vocab_size))
    requests = workload(args.requests, arrival_s=args.arrival_s)
    print(f"{len(requests)} requests over {args.arrival_s:g} s, {mode.value} lengths, "
          f"{sum(len(p) for _, p, _ in requests)} prompt tokens, "
          f"{sum(o for _, _, o in requests)} output tokens")
    configs = configurations(replica_args["engine_args"])
    unknown = set(args.configs or ()) - set(configs)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; choose from {list(configs)}")
    results = {}
    for name in args.configs or configs:
        scheduler, engine_args, predicted = configs[name]
        replica = ReplicaConfig.model_validate({
            **replica_args, "scheduler": scheduler,
            "engine_args": {**replica_args.get("engine_args", {}), **engine_args}})
        results[name] = asyncio.run(run_one(replica, requests, lengths,
                                            predictor if predicted else None))
        print(f"  {name}: {results[name]}", flush=True)
    base = results.get("vllm default") or next(iter(results.values()))
    print(f"\n{'configuration':<32}{'preempt':>8}{'tok/s':>8}{'ratio':>7}"
          f"{'TTFT p50':>9}{'ratio':>7}{'TTFT p99':>9}{'ratio':>7}")
    for name, r in results.items():
        print(f"{name:<32}{r['preemptions']:>8}{r['output_tokens_per_s']:>8.0f}"
              f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:>6.2f}x"
              f"{r['ttft_p50_s']:>9.2f}{r['ttft_p50_s'] / base['ttft_p50_s']:>6.2f}x"
              f"{r['ttft_p99_s']:>9.2f}{r['ttft_p99_s'] / base['ttft_p99_s']:>6.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "requests": len(requests),
                                          "results": results}, indent=2))


if __name__ == "__main__":
    main()
