"""Fit the simulator's step-time model to the real CPU engine.

    python -m blockserve.bench.fit_step_time [--out results/step_time_fit.json]

Runs the tiny model on as many real vLLM engines as deploy/deploy.yaml deploys, at once,
each with the deployment's engine settings and pinned to its `omp_threads_bind` cores as
the replica pins it (so the engines contend for the machine as deployed), drives each
through a mixed workload, timestamps every engine step with a stat logger, and fits
    step seconds = base + a * prompt tokens + b * decode tokens
by least squares. Prints the coefficients and the fit's error, for bench/step_time.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path

import numpy as np

from blockserve.protocol.config import ReplicaConfig
from blockserve.replica.cpu_binding import engine_processes_on
from blockserve.replica.engine_stats import stat_logger_factory
from blockserve.tools.launch import load_config, replica_count


class StepRecorder:
    """Timestamps each engine step's token counts (a vLLM stat logger's record)."""

    def __init__(self):
        self.steps: list[tuple[float, int, int]] = []

    def record(self, scheduler_stats, iteration_stats) -> None:
        if iteration_stats is not None:
            self.steps.append((time.perf_counter(), iteration_stats.num_prompt_tokens,
                               iteration_stats.num_generation_tokens))


async def drive(engine, recorder_seed: int, requests: int) -> None:
    from vllm.sampling_params import SamplingParams

    rng = random.Random(recorder_seed)

    async def one(i: int) -> None:
        await asyncio.sleep(rng.uniform(0, 8))
        prompt = [rng.randrange(10, 4000) for _ in range(rng.randint(16, 600))]
        params = SamplingParams(max_tokens=rng.randint(8, 300), ignore_eos=True)
        async for _ in engine.generate({"prompt_token_ids": prompt}, params,
                                       f"e{recorder_seed}-{i}"):
            pass

    await asyncio.gather(*(one(i) for i in range(requests)))


async def collect(replica: ReplicaConfig, engines: int, requests: int
                  ) -> list[list[tuple[float, int, int]]]:
    """Step records of `engines` engines driven at once, one list per engine."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    binds = replica.omp_threads_bind or ["nobind"]
    recorders, started = [StepRecorder() for _ in range(engines)], []
    try:
        for rank, recorder in enumerate(recorders):
            bind = binds[rank % len(binds)]
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
            with engine_processes_on(bind):
                started.append(AsyncLLM.from_engine_args(
                    AsyncEngineArgs(**replica.engine_kwargs(None)),
                    stat_loggers=[stat_logger_factory(recorder.record)]))
        await asyncio.gather(*(drive(engine, rank, requests)
                               for rank, engine in enumerate(started)))
    finally:
        for engine in started:
            engine.shutdown()
    return [recorder.steps for recorder in recorders]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=120, help="per engine")
    parser.add_argument("--out", default="results/step_time_fit.json")
    args = parser.parse_args()
    config = load_config()
    replica = ReplicaConfig.model_validate(config["applications"][0]["args"]["replica"])
    engines = replica_count(config)
    # A step's duration is the gap to the previous output; idle gaps are not steps.
    rows = [(t1 - t0, prompt, decode)
            for steps in asyncio.run(collect(replica, engines, args.requests))
            for (t0, _, _), (t1, prompt, decode) in zip(steps, steps[1:]) if t1 - t0 < 0.5]
    durations = np.array([r[0] for r in rows])
    features = np.array([[1.0, r[1], r[2]] for r in rows])
    coefficients, *_ = np.linalg.lstsq(features, durations, rcond=None)
    predicted = features @ coefficients
    error = np.abs(predicted - durations) / np.maximum(durations, 1e-4)
    result = {"engines": engines, "base_s": coefficients[0], "per_prefill_token_s": coefficients[1],
              "per_decode_token_s": coefficients[2], "steps": len(rows),
              "median_abs_relative_error": float(np.median(error)),
              "total_time_error": float(abs(predicted.sum() - durations.sum()) / durations.sum())}
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
