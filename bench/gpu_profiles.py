"""Whole-model GPU step times composed from measured per-operator profiles
(data/gpu-profiles/, its README names the sources), by vidur's rule:

    step = emb + layers x (linear ops(num_tokens) + attention + kv_cache_save)

vidur's mlp.csv times one layer's linear operators at each batch size in tokens; its
attention.csv times one layer's prefill attention (one request, chunk N, no context
before it) and decode attention (batch b, K tokens of context each). Each composed row is
a `ProfileRow`: the step as a `StepBatch` and its measured seconds. The preset fitter
(bench/gpu_presets.py) fits step-time models to these rows.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from blockserve.bench.step_time import StepBatch
from blockserve.tools.vidur_format import LINEAR_OPS

PROFILE_DIR = Path(__file__).resolve().parents[1] / "data" / "gpu-profiles"
A100_LLAMA3_8B_MLP = PROFILE_DIR / "vidur_a100_Meta-Llama-3-8B_mlp.csv"
A100_LLAMA3_8B_ATTENTION = PROFILE_DIR / "vidur_a100_Meta-Llama-3-8B_attention_extract.csv"
H100_LLAMA2_7B_MLP = PROFILE_DIR / "vidur_h100_Llama-2-7b-hf_mlp.csv"
SPLITWISE = PROFILE_DIR / "splitwise_perf_model.csv"

MS = 1e-3


@dataclass(frozen=True)
class ProfileRow:
    batch: StepBatch
    seconds: float
    phase: str  # "prefill" or "decode"


@dataclass(frozen=True)
class LinearOps:
    """Per batch size in tokens: one layer's linear ops and the embedding, ms (TP1)."""

    layer_ms: dict[int, float]
    emb_ms: dict[int, float]

    @classmethod
    def read(cls, path: Path) -> "LinearOps":
        layer, emb = defaultdict(list), defaultdict(list)
        with open(path) as file:
            for row in csv.DictReader(file):
                if int(row["num_tensor_parallel_workers"]) != 1:
                    continue
                tokens = int(row["num_tokens"])
                layer[tokens].append(sum(float(row[f"time_stats.{op}.median"])
                                         for op in LINEAR_OPS))
                emb[tokens].append(float(row["time_stats.emb.median"]))
        # Some sizes were profiled twice: their median.
        return cls({n: statistics.median(v) for n, v in layer.items()},
                   {n: statistics.median(v) for n, v in emb.items()})

    def step_ms(self, tokens: int, layers: int) -> float:
        return self.emb_ms[tokens] + layers * self.layer_ms[tokens]


@dataclass(frozen=True)
class Attention:
    """One layer's attention and KV-cache write, ms: prefill by chunk length (no context
    before it), decode by (batch, context per request)."""

    prefill_ms: dict[int, tuple[float, float]]  # chunk -> (attention, kv save)
    decode_ms: dict[tuple[int, int], tuple[float, float]]  # (batch, context) -> same

    @classmethod
    def read(cls, path: Path) -> "Attention":
        prefill, decode = {}, {}
        with open(path) as file:
            for row in csv.DictReader(file):
                save = float(row["attn_kv_cache_save_median_ms"])
                if row["phase"] == "prefill":
                    prefill[int(row["prefill_tokens"])] = (
                        float(row["attn_prefill_median_ms"]), save)
                else:
                    decode[(int(row["batch_size"]), int(row["kv_cache_size"]))] = (
                        float(row["attn_decode_median_ms"]), save)
        return cls(prefill, decode)

    def scaled(self, prefill: float, decode: float, save: float) -> "Attention":
        """This profile on another GPU or model: prefill attention (compute-bound) times
        `prefill`, decode attention (memory-bound) times `decode`, KV writes times `save`."""
        return Attention(
            {n: (a * prefill, s * save) for n, (a, s) in self.prefill_ms.items()},
            {k: (a * decode, s * save) for k, (a, s) in self.decode_ms.items()})

    def save_per_token_s(self) -> float:
        """One layer's KV write per prefill token, s, at the longest profiled chunk."""
        chunk = max(self.prefill_ms)
        return self.prefill_ms[chunk][1] / chunk * MS

    def prefill_at(self, chunk: int) -> float:
        """Attention + KV save of one prefill chunk, ms: interpolated log-log between
        the profiled chunk lengths (vidur's profile has 9 of them, 32..16384)."""
        sizes = sorted(self.prefill_ms)
        if not sizes[0] <= chunk <= sizes[-1]:
            raise ValueError(f"chunk {chunk} outside the profiled {sizes[0]}..{sizes[-1]}")
        upper = next(n for n in sizes if n >= chunk)
        lower = max(n for n in sizes if n <= chunk)
        total = {n: sum(self.prefill_ms[n]) for n in (lower, upper)}
        if lower == upper:
            return total[lower]
        weight = math.log(chunk / lower) / math.log(upper / lower)
        return math.exp((1 - weight) * math.log(total[lower]) + weight * math.log(total[upper]))


def compose(linear: LinearOps, attention: Attention, layers: int) -> list[ProfileRow]:
    """Whole-model steps by vidur's rule: a prefill row for every profiled linear-ops
    size inside the attention profile's chunk range, a decode row for every profiled
    (batch, context) whose batch size the linear ops have too."""
    sizes = sorted(attention.prefill_ms)
    rows = [ProfileRow(StepBatch(prefill=((n, 0),)),
                       (linear.step_ms(n, layers) + layers * attention.prefill_at(n)) * MS,
                       "prefill")
            for n in sorted(linear.layer_ms) if sizes[0] <= n <= sizes[-1]]
    rows += [ProfileRow(StepBatch(decode_contexts=(context,) * batch),
                        (linear.step_ms(batch, layers) + layers * sum(ms)) * MS, "decode")
             for (batch, context), ms in sorted(attention.decode_ms.items())
             if batch in linear.layer_ms]
    return rows


def splitwise_rows(path: Path, model: str, hardware: str, tensor_parallel: int
                   ) -> list[ProfileRow]:
    """Splitwise's end-to-end runs as steps, medians over repeats: prompt_time is one
    step prefilling `batch` prompts; token_time one decode step of `batch` requests,
    each at its mean context over the run (prompt + half the generated tokens)."""
    groups = defaultdict(list)
    with open(path) as file:
        for row in csv.DictReader(file):
            if (row["model"], row["hardware"], int(row["tensor_parallel"])) == \
                    (model, hardware, tensor_parallel):
                key = (int(row["prompt_size"]), int(row["batch_size"]), int(row["token_size"]))
                groups[key].append((float(row["prompt_time"]), float(row["token_time"])))
    rows = []
    for (prompt, batch, generated), times in sorted(groups.items()):
        prompt_ms = statistics.median(t for t, _ in times)
        token_ms = statistics.median(t for _, t in times)
        rows.append(ProfileRow(StepBatch(prefill=((prompt, 0),) * batch), prompt_ms * MS,
                               "prefill"))
        rows.append(ProfileRow(StepBatch(decode_contexts=(prompt + generated // 2,) * batch),
                               token_ms * MS, "decode"))
    return rows
