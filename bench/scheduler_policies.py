"""Replica scheduler policies on the real engine: one seeded memory-pressure workload,
every gate/order/victim combination, one run, ratios against vLLM's default scheduler.

    python -m bench.scheduler_policies [--requests 64] [--out results/scheduler_policies.json]

One vLLM engine (the tiny model, the engine settings of deploy/deploy.yaml: 160 blocks of
32 tokens) is started per configuration, in this process, and fed the same requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

import yaml

from controller.config import ReplicaConfig
from replica.engine_stats import EngineCounters, stat_logger_factory

CONFIGS = {
    "vllm default": {},
    "reservation gate": {"admission_gate": "replica.policies:ReservationGate"},
    "reservation gate + shortest demand": {
        "admission_gate": "replica.policies:ReservationGate",
        "queue_order": {"cls": "router.ordering:ShortestDemandFirst",
                        "kwargs": {"max_wait_s": 10}}},
    "cheapest recompute": {"preemption": "replica.policies:CheapestRecompute"},
    "shortest demand + cheapest recompute": {
        "queue_order": "router.ordering:ShortestDemandFirst",
        "preemption": "replica.policies:CheapestRecompute"},
}


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Long-tailed prompts and outputs; together far more than 160 blocks."""
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        prompt = min(700, int(rng.lognormvariate(5.0, 0.6)) + 16)
        output = min(1000 - prompt, int(rng.lognormvariate(4.2, 0.7)) + 8)
        requests.append(([rng.randrange(10, 4000) for _ in range(prompt)], output))
    return requests


async def run_one(replica: ReplicaConfig, requests) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    counters = EngineCounters()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**replica.engine_kwargs(None)),
                                       stat_loggers=[stat_logger_factory(counters)])
    try:
        ttfts, tokens = [], 0
        started = time.perf_counter()

        async def one(index: int, prompt: list[int], output: int) -> None:
            nonlocal tokens
            params = SamplingParams(max_tokens=output, ignore_eos=True)
            first = None
            async for result in engine.generate({"prompt_token_ids": prompt}, params,
                                                f"req-{index}"):
                if first is None and result.outputs[0].token_ids:
                    first = time.perf_counter() - started
            ttfts.append(first)
            tokens += output

        await asyncio.gather(*(one(i, p, o) for i, (p, o) in enumerate(requests)))
        elapsed = time.perf_counter() - started
    finally:
        engine.shutdown()
    ttfts.sort()
    return {"preemptions": counters.vllm_preemptions_total,
            "output_tokens_per_s": tokens / elapsed, "elapsed_s": elapsed,
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--config", default="deploy/deploy.yaml")
    parser.add_argument("--out", default="results/scheduler_policies.json")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    deploy = yaml.safe_load(Path(args.config).read_text())
    replica_args = deploy["applications"][0]["args"]["replica"]
    requests = workload(args.requests)
    print(f"{len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens, "
          f"{sum(o for _, o in requests)} output tokens")
    results = {}
    for name, scheduler in CONFIGS.items():
        replica = ReplicaConfig.model_validate({**replica_args, "scheduler": scheduler})
        results[name] = asyncio.run(run_one(replica, requests))
        print(f"  {name}: {results[name]}", flush=True)
    base = results["vllm default"]
    print(f"\n{'configuration':<40}{'preempt':>8}{'tok/s':>8}{'ratio':>7}"
          f"{'TTFT p50':>9}{'ratio':>7}{'TTFT p99':>9}{'ratio':>7}")
    for name, r in results.items():
        print(f"{name:<40}{r['preemptions']:>8}{r['output_tokens_per_s']:>8.0f}"
              f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:>6.2f}x"
              f"{r['ttft_p50_s']:>9.2f}{r['ttft_p50_s'] / base['ttft_p50_s']:>6.2f}x"
              f"{r['ttft_p99_s']:>9.2f}{r['ttft_p99_s'] / base['ttft_p99_s']:>6.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"requests": len(requests), "results": results},
                                         indent=2))


if __name__ == "__main__":
    main()
