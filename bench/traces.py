"""Real traces as harness workloads, scaled to the deployment in deploy/deploy.yaml.

Files (copies of public traces; ../shared/data/README.md and data/traces/README.md say
where from): `azure_llm_2023_code.csv` (Azure 2023 code service: arrival time, context
and generated tokens), `mooncake_synthetic_trace.jsonl` (Mooncake: arrival ms, input
and output lengths, `hash_ids` = the prompt as a chain of 512-token blocks) and
`sharegpt_8k_filtered_stats_llama2_tokenizer.csv` (ShareGPT conversations: prompt and
output lengths only, so its arrivals are a seeded Poisson process before step 5). They are
read from $BLOCKSERVE_TRACES_DIR, else ../shared/data/traces next to the checkout, else
the repository's data/traces.

Every transformation, chosen from the deployment's capacity and the trace's own shape
(never from benchmark results):
1. Slice: a window of n consecutive requests starting at a seeded offset
   (`random.Random(seed).randrange(len(trace) - n + 1)`), arrival order kept.
2. Output lengths: as in the trace (they are what decode costs and what a length
   predictor must learn), at most half the context: min(L, max_model_len // 2), at least 1.
3. Prompt lengths, Azure and ShareGPT: scaled by max_model_len / the trace's context (the
   smallest power of two >= its longest prompt: 8,192 for both), so a request fills as
   much of our context as it filled the service's. Mooncake: each 512-token hash block
   becomes one KV block of `block_size` tokens (ceil(input * block_size / 512) tokens),
   so shared hash ids become shared KV blocks. Then, both: cut to max_model_len - L
   (Mooncake's prompts keep their leading, shared, blocks). Counted as `prompts_cut`.
4. Prompt tokens: Azure and ShareGPT, random ids from a generator seeded by `seed` (the
   traces say nothing about shared content). Mooncake, the concatenation of one
   deterministic block per hash id, each drawn from a generator seeded by the id alone.
5. Arrival times: relative to the window's first request, compressed by one factor so
   the window's mean rate is the deployment's KV capacity (replicas x usable blocks x
   block_size tokens) divided by the window's mean prompt + output tokens: each second
   brings as many tokens as the whole cache holds. Gaps keep their shape (bursts stay).
`TraceWorkload.scaling` records each number; the harness writes it into its results.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
import statistics
from dataclasses import dataclass
from typing import NamedTuple
from datetime import datetime
from pathlib import Path

from blockserve.bench.request_spec import RequestSpec, random_tokens
from blockserve.protocol.blocks import blocks_for, ceil_div
from blockserve.tools.launch import EngineShape, replica_count

REPO = Path(__file__).resolve().parents[1]
MOONCAKE_BLOCK_TOKENS = 512  # the trace's hash block (../shared/data/README.md)


def trace_dir() -> Path:
    """Where the trace files are read from (module docstring)."""
    if os.environ.get("BLOCKSERVE_TRACES_DIR"):
        return Path(os.environ["BLOCKSERVE_TRACES_DIR"])
    shared = REPO.parent / "shared" / "data" / "traces"
    return shared if shared.is_dir() else REPO / "data" / "traces"


@dataclass(frozen=True)
class Capacity:
    """What the deployment holds: the scale every trace is fitted to."""

    max_model_len: int
    block_size: int
    blocks_per_replica: int
    replicas: int

    @property
    def kv_tokens(self) -> int:
        return self.replicas * self.blocks_per_replica * self.block_size

    @classmethod
    def of_deployment(cls, config: dict | None = None) -> "Capacity":
        """deploy/deploy.yaml's (or `config`'s) engine shape, on all its replicas."""
        shape = EngineShape.of(config)
        return cls(shape.max_model_len, shape.block_size, shape.usable_blocks,
                   replica_count(config))


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class TraceWorkload:
    specs: list[RequestSpec]
    scaling: dict


def _azure_time(stamp: str) -> float:
    whole, _, fraction = stamp.partition(".")  # 7 fractional digits: beyond %f
    return datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp() + float(f"0.{fraction or 0}")


def read_azure(path: Path) -> list[TraceRequest]:
    with open(path, newline="") as file:
        return [TraceRequest(_azure_time(row["TIMESTAMP"]), int(row["ContextTokens"]),
                             int(row["GeneratedTokens"])) for row in csv.DictReader(file)]


def read_mooncake(path: Path) -> list[TraceRequest]:
    with open(path) as file:
        rows = [json.loads(line) for line in file if line.strip()]
    return [TraceRequest(row["timestamp"] / 1000, row["input_length"], row["output_length"],
                         tuple(row["hash_ids"])) for row in rows]


def window(trace: list[TraceRequest], n: int, seed: int) -> tuple[int, list[TraceRequest]]:
    if not 2 <= n <= len(trace):
        raise ValueError(f"a trace window needs 2..{len(trace)} requests, not {n}")
    offset = random.Random(seed).randrange(len(trace) - n + 1)
    return offset, trace[offset:offset + n]


def hash_block(hash_id: int, block_size: int) -> list[int]:
    """The token ids one Mooncake hash id stands for: the same for every request."""
    rng = random.Random(f"mooncake-block-{hash_id}")
    return random_tokens(rng, block_size)


def _fit(prompt: int, output: int, max_model_len: int) -> tuple[int, int]:
    output = max(1, min(output, max_model_len // 2))
    return max(1, min(prompt, max_model_len - output)), output


class RateFit(NamedTuple):
    """Step 5 of the module docstring on one timeline."""

    arrivals: list[float]  # relative to the first, times time_scale
    mean_request_tokens: float
    rate_rps: float  # the capacity rule's mean rate
    source_rate_rps: float  # the timeline's own mean rate
    time_scale: float


def fit_rate(arrivals: list[float], request_tokens: list[int], capacity: Capacity) -> RateFit:
    """Arrival times compressed by one factor so that the mean rate is the deployment's
    KV capacity in tokens / the mean prompt + output tokens; gaps keep their shape."""
    mean_tokens = statistics.fmean(request_tokens)
    rate = capacity.kv_tokens / mean_tokens
    start, span = arrivals[0], arrivals[-1] - arrivals[0]
    source_rate = (len(arrivals) - 1) / span if span > 0 else math.inf
    time_scale = source_rate / rate if span > 0 else 0.0
    return RateFit([(a - start) * time_scale for a in arrivals], mean_tokens, rate,
                   source_rate, time_scale)


def _scaled(name: str, path: Path, offset: int, picked: list[TraceRequest],
            lengths: list[tuple[int, int]], prompts: list[list[int]], capacity: Capacity,
            **scaling) -> TraceWorkload:
    """Step 5 of the module docstring (arrival times), and the record of every step."""
    fit = fit_rate([r.arrival_s for r in picked], [p + o for p, o in lengths], capacity)
    specs = [RequestSpec(arrival, prompt, output)
             for arrival, prompt, (_, output) in zip(fit.arrivals, prompts, lengths)]
    return TraceWorkload(specs, {
        "workload": name, "trace": path.name, "window": [offset, offset + len(picked)],
        "capacity_kv_tokens": capacity.kv_tokens, "max_model_len": capacity.max_model_len,
        "trace_rate_rps": fit.source_rate_rps, "rate_rps": fit.rate_rps,
        "time_scale": fit.time_scale,
        "output_cap": capacity.max_model_len // 2,
        "outputs_capped": sum(r.output_tokens > o for r, (_, o) in zip(picked, lengths)),
        "prompt_p50": statistics.median(p for p, _ in lengths),
        "output_p50": statistics.median(o for _, o in lengths), **scaling})


def read_lengths(path: Path) -> list[TraceRequest]:
    """A length-only trace (vidur's and sarathi-serve's `num_prefill_tokens`,
    `num_decode_tokens`), arriving as a Poisson process of rate 1 (step 5 rescales it),
    its gaps seeded by the file's name alone so that every seed's window is one timeline."""
    rng, arrival, trace = random.Random(path.name), 0.0, []
    with open(path, newline="") as file:
        for row in csv.DictReader(file):
            trace.append(TraceRequest(arrival, int(row["num_prefill_tokens"]),
                                      int(row["num_decode_tokens"])))
            arrival += rng.expovariate(1.0)
    return trace


def _context_scaled(name: str, path: Path, trace: list[TraceRequest], n: int, seed: int,
                    capacity: Capacity) -> TraceWorkload:
    """Steps 1-5 for a trace without prompt content (Azure, ShareGPT)."""
    source_context = 1 << (max(r.input_tokens for r in trace) - 1).bit_length()
    prompt_scale = capacity.max_model_len / source_context
    offset, picked = window(trace, n, seed)
    lengths = [_fit(round(r.input_tokens * prompt_scale), r.output_tokens,
                    capacity.max_model_len) for r in picked]
    rng = random.Random(seed)
    prompts = [random_tokens(rng, p) for p, _ in lengths]
    cut = sum(round(r.input_tokens * prompt_scale) > p for r, (p, _) in zip(picked, lengths))
    return _scaled(name, path, offset, picked, lengths, prompts, capacity,
                   source_context=source_context, prompt_scale=prompt_scale, prompts_cut=cut)


def azure_code(n: int = 300, seed: int = 0, capacity: Capacity | None = None,
               path: Path | None = None) -> TraceWorkload:
    path = path or trace_dir() / "azure_llm_2023_code.csv"
    return _context_scaled("azure_code", path, read_azure(path), n, seed,
                           capacity or Capacity.of_deployment())


def sharegpt(n: int = 300, seed: int = 0, capacity: Capacity | None = None,
             path: Path | None = None) -> TraceWorkload:
    """Conversations: long answers, where a router that holds requests back waits most."""
    path = path or trace_dir() / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
    return _context_scaled("sharegpt", path, read_lengths(path), n, seed,
                           capacity or Capacity.of_deployment())


def mooncake(n: int = 300, seed: int = 0, capacity: Capacity | None = None,
             path: Path | None = None) -> TraceWorkload:
    capacity = capacity or Capacity.of_deployment()
    path = path or trace_dir() / "mooncake_synthetic_trace.jsonl"
    offset, picked = window(read_mooncake(path), n, seed)
    block = capacity.block_size
    wanted = [ceil_div(r.input_tokens * block, MOONCAKE_BLOCK_TOKENS) for r in picked]
    lengths = [_fit(w, r.output_tokens, capacity.max_model_len)
               for w, r in zip(wanted, picked)]
    prompts = []
    for request, (prompt, _) in zip(picked, lengths):
        tokens = [t for hash_id in request.hash_ids[:blocks_for(prompt, block)]
                  for t in hash_block(hash_id, block)]
        prompts.append(tokens[:prompt])
    return _scaled("mooncake", path, offset, picked, lengths, prompts, capacity,
                   tokens_per_hash_block=block,
                   prompts_cut=sum(w > p for w, (p, _) in zip(wanted, lengths)))


# harness workload name -> reader
SCALED = {"azure_code": azure_code, "mooncake": mooncake, "sharegpt": sharegpt}
