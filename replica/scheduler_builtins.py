"""Built-in admission gate and preemption order (protocol/policies.py's interfaces).

Chosen by short name in the replica's `scheduler` config (`admission_gate: reservation`,
`preemption: cheapest_recompute`); vLLM's own behaviour is `vllm` for both.
"""

from __future__ import annotations

from typing import Any, Sequence

from blockserve.protocol.policies import AdmissionGate, PoolView, PreemptionOrder, RequestView


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
