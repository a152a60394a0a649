"""Built-in admission gate, preemption order and step tokens (protocol/policies.py's
interfaces).

Chosen by short name in the replica's `scheduler` config (`admission_gate: reservation`,
`preemption: cheapest_recompute`, `step_tokens: itl_target`, `tpot_pace`); vLLM's own behaviour is
`vllm` for each.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from blockserve.protocol.policies import (AdmissionGate, PoolView, PreemptionOrder, RequestView,
                                          StepState, StepTokens)


class ReservationGate(AdmissionGate):
    """`reservation`: admit a request only if the replica's peak block use, with it,
    fits the pool less a `headroom` share of it.

    Each request is expected to grow to its lease (prompt + expected output: the
    router's prediction, else max_tokens, the worst case) one token per step and then
    free its blocks; the peak of all of them together (replica/trajectory.py) must stay
    within the limit. With worst-case leases admitted work is never preempted; with
    predicted ones some requests outgrow their lease and have it extended, and the
    headroom is the safety margin that keeps blocks for those extensions (vLLM
    preempts, by the preemption policy, only when the pool has none left). The pool is
    not left idle for blocks that finishing requests will have freed by the time the
    long ones need them. The head of the queue is admitted in order, and always when
    nothing runs.
    """

    def __init__(self, headroom: float = 0.0):
        if not 0 <= headroom < 1:
            raise ValueError("headroom is a share of the pool: 0 <= headroom < 1")
        self.headroom = headroom

    def may_admit(self, request: RequestView, admitted: Sequence[RequestView],
                  pool: PoolView) -> bool:
        limit = pool.usable_blocks - int(self.headroom * pool.usable_blocks)
        return (pool.peak_blocks([*admitted, request]) <= limit
                or (not admitted and pool.idle))


class CheapestRecompute(PreemptionOrder):
    """`cheapest_recompute`: preempt the request with the fewest computed tokens first
    (the least work lost); those with the most are also scheduled first."""

    def key(self, request: RequestView, now: float) -> Any:
        return -request.computed_tokens


class StepTimeFit:
    """Seconds per engine step, learned from the engine's own steps: least squares of
    seconds ~ base + per decode x decoding + per prefill token x prefill tokens + per
    context token x context tokens, each step weighing `0.5 ** (age / half_life_steps)`
    (an engine's costs stay put; its batches change)."""

    # Features in units that keep the normal equations well scaled.
    SCALE = (1.0, 100.0, 1000.0, 100_000.0)
    RIDGE = 1e-9

    def __init__(self, half_life_steps: float):
        self.decay = 0.5 ** (1 / half_life_steps)
        self.steps = 0
        self._xx = [[0.0] * 4 for _ in range(4)]
        self._xy = [0.0] * 4

    def _features(self, decoding: int, prefill: int, context: int) -> list[float]:
        return [value / scale for value, scale in zip((1, decoding, prefill, context),
                                                       self.SCALE)]

    def add(self, decoding: int, prefill: int, context: int, seconds: float) -> None:
        x = self._features(decoding, prefill, context)
        for i in range(4):
            self._xy[i] = self._xy[i] * self.decay + x[i] * seconds
            for j in range(4):
                self._xx[i][j] = self._xx[i][j] * self.decay + x[i] * x[j]
        self.steps += 1

    def coefficients(self) -> list[float] | None:
        """(base, per decode, per prefill token, per context token) in seconds, or None
        where the steps seen cannot tell them apart."""
        a = [row[:] + [y] for row, y in zip(self._xx, self._xy)]
        for i in range(4):
            a[i][i] += self.RIDGE
        for col in range(4):  # Gaussian elimination, partial pivoting
            pivot = max(range(col, 4), key=lambda r: abs(a[r][col]))
            if abs(a[pivot][col]) < 1e-12:
                return None
            a[col], a[pivot] = a[pivot], a[col]
            for r in range(col + 1, 4):
                factor = a[r][col] / a[col][col]
                for c in range(col, 5):
                    a[r][c] -= factor * a[col][c]
        solution = [0.0] * 4
        for r in range(3, -1, -1):
            solution[r] = (a[r][4] - sum(a[r][c] * solution[c] for c in range(r + 1, 4))) / a[r][r]
        return [value / scale for value, scale in zip(solution, self.SCALE)]


class ItlTarget(StepTokens):
    """`itl_target`: while requests are decoding, give each step the most tokens that
    its learned step time (`StepTimeFit`) says will take at most `seconds`.

    Every decoding request waits a whole step for its next token, so a step that also
    computes a long prompt chunk delays all of them: vLLM's budget on an H100 (8,192
    tokens) makes steps of a quarter second. A smaller budget spreads the prompt over
    more steps, which costs its own request some TTFT and keeps everyone's TPOT.
    `seconds` defaults to `STEP_SHARE` of `tpot_s`, the TPOT the service promises (the
    deployment's `slo.tpot_s`): below it, since the fit errs. Until the fit has seen
    `min_steps` steps, when nothing is decoding (no token waits on the step), or when
    the fit finds prompt tokens free, vLLM's budget stands. A step always gets
    room for every decode and `min_prefill_tokens` of prompt, so prompts progress.
    """

    STEP_SHARE = 0.8

    def __init__(self, seconds: float | None = None, min_steps: int = 32,
                 half_life_steps: float = 500.0, min_prefill_tokens: int = 256,
                 tpot_s: float = 0.05):
        if seconds is None:
            seconds = self.STEP_SHARE * tpot_s
        if seconds <= 0 or min_steps < 1 or half_life_steps <= 0 or min_prefill_tokens < 1:
            raise ValueError("seconds, tpot_s and half_life_steps must be > 0, min_steps "
                             "and min_prefill_tokens >= 1")
        self.seconds, self.tpot_s, self.min_steps = seconds, tpot_s, min_steps
        self.min_prefill_tokens = min_prefill_tokens
        self.fit = StepTimeFit(half_life_steps)

    def tokens(self, step: StepState) -> int:
        if step.decoding == 0 or self.fit.steps < self.min_steps:
            return step.max_tokens
        coefficients = self.fit.coefficients()
        if coefficients is None or coefficients[2] <= 0:
            return step.max_tokens
        # A small negative cost is the fit's error (decodes and context grow together).
        base, per_decode, per_prefill, per_context = (max(0.0, c) for c in coefficients)
        left = (self.step_seconds(step) - base - per_decode * step.decoding
                - per_context * step.context_tokens)
        prefill = max(self.min_prefill_tokens, math.floor(left / per_prefill))
        return min(step.max_tokens, step.decoding + prefill)

    def step_seconds(self, step: StepState) -> float:
        """How long this step may take."""
        return self.seconds

    def on_step(self, step: StepState, tokens: int, seconds: float) -> None:
        self.fit.add(step.decoding, max(0, tokens - step.decoding), step.context_tokens,
                     seconds)


class TpotPace(ItlTarget):
    """`tpot_pace`: `itl_target`, with steps as long as every decoding request's TPOT
    allows, up to `tpot_s`: a pace of `PACE_SHARE` x `tpot_s` plus the least time in
    hand among them.

    TPOT is a mean over a request's tokens, so a request whose tokens so far came
    faster than the pace has time in hand (pace x tokens since its first - seconds
    since its first), and a longer step spends it without breaking the promise. A
    fixed cap leaves that time unused, and with it prompt tokens that wait for their
    first token. A request that has just started has none, so under steady load steps
    last about the pace; one behind it gets steps of `seconds` (the floor) until it has
    caught up. The pace sits below `tpot_s` by the fit's error (`itl_target`'s 40 ms
    steps measured up to 45 ms, ITL p99), and no step is planned longer than `tpot_s`:
    without that bound, time in hand went to steps of up to vLLM's budget and ITL p99
    rose to that of vLLM's own steps (docs/benchmarks.md).
    """

    PACE_SHARE = 0.9

    def step_seconds(self, step: StepState) -> float:
        if not step.decode_pace:
            return self.seconds
        pace = self.PACE_SHARE * self.tpot_s
        in_hand = min(pace * tokens - seconds for tokens, seconds in step.decode_pace)
        return max(self.seconds, min(self.tpot_s, pace + in_hand))
