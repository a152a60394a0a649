"""Any trace or workload file as simulator and lab requests, scaled as the command line says.

Formats, told apart by their columns (`read_trace`):
- Azure CSV (`TIMESTAMP, ContextTokens, GeneratedTokens`): arrival stamps and lengths;
  prompts are random ids from a generator seeded by `seed` (the trace says nothing about
  shared content).
- length-only CSV (`num_prefill_tokens, num_decode_tokens`, as vidur and sarathi-serve
  publish ShareGPT and arXiv): no arrival times, so Poisson arrivals at `rate`.
- Mooncake JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids`): each hash
  id stands for one deterministic block of `hash_block_tokens` ids, drawn from a generator
  seeded by the id alone, so requests that list the same ids share those blocks.
- workload JSONL (this project's own, one request a line): `arrival_s`, `output_tokens`,
  either `prompt` (token ids) or `block_hashes` (ids as Mooncake's, with an optional
  `prompt_tokens` to cut them to), and optional `tenant` and `session`.

`Scaling` is what the command line states, applied in this order and recorded: the first
`max_requests` requests from `start`; arrival gaps divided by `rate_scale`; prompt and
output lengths times `length_scale` (hash blocks too: `hash_block_tokens` is 512 x it,
rounded to whole KV blocks); then lengths fitted to the engine's context (an output at
most half of it, a prompt cut to what the output leaves, its leading blocks kept), each
cut counted. Output lengths stay the simulated model's secret (the length mode decides
what requests say).
"""

from __future__ import annotations

import csv
import json
import random
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from blockserve.bench.traces import MOONCAKE_BLOCK_TOKENS, read_azure, read_lengths
from blockserve.bench.request_spec import VOCAB, RequestSpec
from blockserve.protocol.blocks import ceil_div

VOCAB_IDS = list(VOCAB)  # shared int objects: a long prompt costs one pointer per token


@dataclass(frozen=True)
class Scaling:
    """How a trace is replayed (module docstring); every field is stated on the command line."""

    rate_scale: float = 1.0  # arrivals this many times as fast (gaps / rate_scale)
    length_scale: float = 1.0  # prompt and output tokens times this
    max_requests: int | None = None
    start: int = 0  # the first request replayed
    rate: float = 1.0  # Poisson arrivals per second, for traces without timestamps
    seed: int = 0  # prompt ids of traces without content; Poisson gaps

    def __post_init__(self) -> None:
        if self.rate_scale <= 0 or self.length_scale <= 0 or self.rate <= 0:
            raise ValueError("--rate-scale, --length-scale and --rate must be positive")


@dataclass
class Row:
    """One request as a trace states it, before scaling."""

    arrival_s: float | None
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    hash_source_tokens: int | None = None  # Mooncake's 512 (scaled); None: one KV block each
    prompt: list[int] | None = None
    tenant: str = "default"
    session: str | None = None


def _csv_rows(path: Path) -> list[Row]:
    with open(path, newline="") as file:
        header = next(csv.reader(file))
    if "TIMESTAMP" in header:
        return [Row(r.arrival_s, r.input_tokens, r.output_tokens) for r in read_azure(path)]
    if {"num_prefill_tokens", "num_decode_tokens"} <= set(header):  # no arrival times
        return [Row(None, r.input_tokens, r.output_tokens) for r in read_lengths(path)]
    raise ValueError(f"{path}: unknown CSV columns {header}; expected Azure's "
                     "(TIMESTAMP, ContextTokens, GeneratedTokens) or a length-only trace's "
                     "(num_prefill_tokens, num_decode_tokens)")


def _jsonl_row(line: int, row: dict) -> Row:
    if "input_length" in row:  # Mooncake
        return Row(row["timestamp"] / 1000, int(row["input_length"]), int(row["output_length"]),
                   tuple(row.get("hash_ids", ())), MOONCAKE_BLOCK_TOKENS)
    try:
        prompt = row.get("prompt")
        hashes = tuple(row.get("block_hashes", ()))
        if (prompt is None) == (not hashes):
            raise ValueError("give either prompt (token ids) or block_hashes")
        return Row(float(row["arrival_s"]),
                   len(prompt) if prompt is not None else int(row.get("prompt_tokens", 0)),
                   int(row["output_tokens"]), hashes, None,
                   [int(t) for t in prompt] if prompt is not None else None,
                   str(row.get("tenant", "default")), row.get("session"))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"line {line}: not a Mooncake or workload-file request "
                         f"({error!r}); module bench/trace_files.py names the fields") from error


def _jsonl_rows(path: Path) -> list[Row]:
    with open(path) as file:
        return [_jsonl_row(n, json.loads(line)) for n, line in enumerate(file, 1) if line.strip()]


def rows_of(path: Path) -> list[Row]:
    """A trace file's requests as it states them (its format told by its columns)."""
    path = Path(path)
    rows = _csv_rows(path) if path.suffix == ".csv" else _jsonl_rows(path)
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows


def hash_block_ids(hash_id: int, tokens: int) -> list[int]:
    """The token ids one hash id stands for: the same in every request that lists it."""
    return random.Random(f"hash-block-{hash_id}").choices(VOCAB_IDS, k=tokens)


def hash_block_tokens(source_tokens: int | None, length_scale: float, block_size: int) -> int:
    """Tokens per hash id: a workload file's id is one KV block; Mooncake's 512 tokens
    are scaled by `length_scale` and rounded to whole KV blocks, at least one."""
    if source_tokens is None:
        return block_size
    return max(1, round(source_tokens * length_scale / block_size)) * block_size


class _Prompts:
    """Token ids for rows that carry none: shared hash blocks, else seeded random ids."""

    def __init__(self, seed: int, length_scale: float, block_size: int):
        self.rng, self.blocks = random.Random(seed), {}
        self.length_scale, self.block_size = length_scale, block_size

    def block_tokens(self, row: Row) -> int:
        return hash_block_tokens(row.hash_source_tokens, self.length_scale, self.block_size)

    def length(self, row: Row) -> int:
        """A row's prompt tokens after scaling; a hash list without a length: all its blocks."""
        if row.prompt is None and row.hash_ids and not row.prompt_tokens:
            return len(row.hash_ids) * self.block_tokens(row)
        scale = 1.0 if row.prompt is not None else self.length_scale
        return max(1, round(row.prompt_tokens * scale))

    def of(self, row: Row, n: int) -> list[int]:
        if row.prompt is not None:
            return row.prompt[:n]
        size, tokens = self.block_tokens(row), []
        for hash_id in row.hash_ids[:ceil_div(n, size)]:
            if (hash_id, size) not in self.blocks:
                self.blocks[hash_id, size] = hash_block_ids(hash_id, size)
            tokens += self.blocks[hash_id, size]
        tokens = tokens[:n]
        return tokens + self.rng.choices(VOCAB_IDS, k=n - len(tokens))


@dataclass(frozen=True)
class TraceReplay:
    specs: list[RequestSpec]
    scaling: dict  # what was done, for the results file


def read_trace(path: str | Path, scaling: Scaling, max_model_len: int, block_size: int
               ) -> TraceReplay:
    """The file's requests as `RequestSpec`s, scaled as `scaling` says (module docstring)."""
    rows = rows_of(path)
    end = None if scaling.max_requests is None else scaling.start + scaling.max_requests
    rows = rows[scaling.start:end]
    if not rows:
        raise ValueError(f"{path}: no requests from {scaling.start}")
    if rows[0].arrival_s is None:
        rng, t, arrivals = random.Random(scaling.seed), 0.0, []
        for _ in rows:
            arrivals.append(t)
            t += rng.expovariate(scaling.rate)
    else:
        first = rows[0].arrival_s
        arrivals = [(r.arrival_s - first) / scaling.rate_scale for r in rows]
    prompts = _Prompts(scaling.seed, scaling.length_scale, block_size)
    specs, prompts_cut, outputs_capped = [], 0, 0
    for arrival, row in zip(arrivals, rows):
        output = max(1, round(row.output_tokens * scaling.length_scale))
        prompt = prompts.length(row)
        outputs_capped += output > max_model_len // 2
        output = min(output, max_model_len // 2)
        prompts_cut += prompt > max_model_len - output
        prompt = min(prompt, max_model_len - output)
        specs.append(RequestSpec(arrival, prompts.of(row, prompt), output, row.tenant,
                                 session=row.session))
    span = specs[-1].arrival_s - specs[0].arrival_s
    return TraceReplay(specs, {
        "trace": str(path), **asdict(scaling), "requests": len(specs),
        "rate_rps": (len(specs) - 1) / span if span > 0 else None,
        "hash_block_tokens": sorted({prompts.block_tokens(r) for r in rows if r.hash_ids}),
        "max_model_len": max_model_len, "prompts_cut": prompts_cut,
        "outputs_capped": outputs_capped,
        "prompt_p50": statistics.median(len(s.prompt) for s in specs),
        "output_p50": statistics.median(s.output_tokens for s in specs),
        "tenants": len({s.tenant for s in specs})})


def is_trace_file(source: str) -> bool:
    return source.endswith((".csv", ".jsonl")) or Path(source).is_file()


def load_workload(source: str, n: int | None, seed: int, kwargs: dict, scaling: Scaling,
                  max_model_len: int, block_size: int) -> TraceReplay:
    """A built-in workload by name (bench/workloads.py, `n` requests or its own size,
    `kwargs` its options), or any trace or workload file, scaled by `scaling`."""
    from blockserve.bench.workloads import WORKLOADS

    if is_trace_file(source):
        if kwargs:
            raise ValueError(f"{source}: a trace file takes --rate-scale, --length-scale and "
                             f"--max-requests, not keyword arguments {kwargs}")
        cap = scaling.max_requests if scaling.max_requests is not None else n
        return read_trace(source, replace(scaling, max_requests=cap, seed=seed),
                          max_model_len, block_size)
    if source not in WORKLOADS:
        raise ValueError(f"{source!r} is neither a trace file nor a workload "
                         f"({', '.join(sorted(WORKLOADS))})")
    options = {**({} if n is None else {"n": n}), "seed": seed, **kwargs}
    specs = WORKLOADS[source](**options)
    return TraceReplay(specs, {"workload": source, **options, "requests": len(specs)})
