"""The contest's workloads (bench/contest.py): each a seeded function of (requests,
arrival rate), so every router sees the same requests at every load.

- `azure_code`, `mooncake`: the first N requests of ../shared/data/traces' Azure 2023 code
  trace and Mooncake trace (bench/trace_files.py: Mooncake's hash ids are shared blocks),
  their arrival gaps (bursts kept) compressed to the rate asked.
- `llmd_shape`: llm-d's precise-prefix benchmark data (inference-perf `shared_prefix`,
  bench/reproductions.py): 150 groups, each a 6,000-token prefix and 5 users' questions,
  the 750 prompts cycled in one shuffled order, Poisson arrivals. Questions are 1,190
  tokens, not 1,200, so that prompt + output fits the preset's 8,192-token context.
- `sharegpt` (Poisson arrivals) and `arxiv` (bursty: Gamma gaps of shape 0.25, a
  coefficient of variation of 2): the length mixes vidur and sarathi-serve publish.

`OUTPUT_SCALE` multiplies the output lengths of the three long-output workloads: the
simulator's cost is per output token, and at their traced lengths the contest would not
fit its time budget. Prompts keep their traced lengths everywhere.
"""

from __future__ import annotations

import functools
import random
from dataclasses import replace
from pathlib import Path
from typing import Callable

from blockserve.bench.reproductions import Stage, shared_prefix_dataset
from blockserve.bench.request_spec import RequestSpec
from blockserve.bench.trace_files import Scaling, read_trace
from blockserve.bench.traces import trace_dir
from blockserve.tools.launch import EngineShape

OUTPUT_SCALE = 0.25
GAMMA_SHAPE = 0.25
FILES = {"azure_code": "azure_llm_2023_code.csv",
         "mooncake": "mooncake_synthetic_trace.jsonl",
         "sharegpt": "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
         "arxiv": "vidur_arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"}


@functools.lru_cache(maxsize=8)
def _trace(name: str, n: int, max_model_len: int, block_size: int, seed: int
           ) -> tuple[RequestSpec, ...]:
    """The first `n` requests of a trace file as it states them (rate 1 where it has no
    arrival times: the arrivals are redrawn at the asked rate)."""
    path = Path(trace_dir()) / FILES[name]
    return tuple(read_trace(path, Scaling(max_requests=n, seed=seed), max_model_len,
                            block_size).specs)


def _at_rate(specs, rate: float) -> list[RequestSpec]:
    """The trace's own gaps, compressed so the mean rate is `rate`."""
    span = specs[-1].arrival_s - specs[0].arrival_s
    factor = span / (len(specs) - 1) * rate if span > 0 and len(specs) > 1 else 1.0
    return [replace(s, arrival_s=(s.arrival_s - specs[0].arrival_s) / factor) for s in specs]


def _redrawn(specs, gaps: Callable[[random.Random], float], seed: int, output_scale: float
             ) -> list[RequestSpec]:
    rng, t, out = random.Random(seed), 0.0, []
    for spec in specs:
        out.append(replace(spec, arrival_s=t,
                           output_tokens=max(1, round(spec.output_tokens * output_scale))))
        t += gaps(rng)
    return out


def traced(name: str, n: int, rate: float, seed: int, shape: EngineShape
           ) -> list[RequestSpec]:
    return _at_rate(_trace(name, n, shape.max_model_len, shape.block_size, seed), rate)


def poisson_mix(name: str, n: int, rate: float, seed: int, shape: EngineShape
                ) -> list[RequestSpec]:
    return _redrawn(_trace(name, n, shape.max_model_len, shape.block_size, seed),
                    lambda rng: rng.expovariate(rate), seed, OUTPUT_SCALE)


def gamma_mix(name: str, n: int, rate: float, seed: int, shape: EngineShape
              ) -> list[RequestSpec]:
    return _redrawn(_trace(name, n, shape.max_model_len, shape.block_size, seed),
                    lambda rng: rng.gammavariate(GAMMA_SHAPE, 1 / (GAMMA_SHAPE * rate)), seed,
                    OUTPUT_SCALE)


def llmd_shape(name: str, n: int, rate: float, seed: int, shape: EngineShape
               ) -> list[RequestSpec]:
    output = round(1000 * OUTPUT_SCALE)
    longest = 6000 + 1190 + output
    if longest > shape.max_model_len:  # every request would be a 400
        raise ValueError(f"llmd_shape needs max_model_len >= {longest}; "
                         f"this preset's is {shape.max_model_len}")
    specs = shared_prefix_dataset(150, 5, 6000, 1190, output, (Stage(rate, 2 * n / rate),),
                                  seed)
    return specs[:n]


WORKLOADS: dict[str, Callable[..., list[RequestSpec]]] = {
    "azure_code": traced, "mooncake": traced, "llmd_shape": llmd_shape,
    "sharegpt": poisson_mix, "arxiv": gamma_mix}
DESCRIPTIONS = {
    "azure_code": "Azure 2023 code trace, first N requests, traced gaps compressed",
    "mooncake": "Mooncake trace (shared hash blocks), first N requests, traced gaps compressed",
    "llmd_shape": f"llm-d shared_prefix: 150 groups x 5 users, 6,000 + 1,190 prompt tokens, "
                  f"output {round(1000 * OUTPUT_SCALE)} (1,000 x {OUTPUT_SCALE}), Poisson",
    "sharegpt": f"ShareGPT lengths, outputs x {OUTPUT_SCALE}, Poisson arrivals",
    "arxiv": f"arXiv summarization lengths, outputs x {OUTPUT_SCALE}, Gamma arrivals "
             f"(shape {GAMMA_SHAPE}, CV 2)"}


def requests(name: str, n: int, rate: float, seed: int, shape: EngineShape
             ) -> list[RequestSpec]:
    """Workload `name`'s `n` requests at `rate` arrivals per second."""
    if rate <= 0 or n < 2:
        raise ValueError("a contest run needs a positive rate and at least 2 requests")
    return WORKLOADS[name](name, n, rate, seed, shape)
