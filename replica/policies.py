"""Replica-side policy points of the block-aware scheduler (besides the queue order).

Each is one small class chosen by import path in the deployment config:

- admission gate: how many requests at the head of the ordered waiting queue vLLM may
  admit this step (`admit(waiting, book) -> int`);
- preemption victim: the order of the running list, whose LAST request vLLM preempts
  first when it runs out of blocks (`order_running(running) -> list | None`).

The block policies (eviction, retention, budget) are in replica/block_policies.py.

`book` is the scheduler's `BlockBook` (replica/scheduler.py): block arithmetic over
vLLM's real KV cache manager. Requests are vLLM `Request` objects.
"""

from __future__ import annotations

from typing import Any, Sequence


class VllmDefaultGate:
    """vLLM's behaviour: every waiting request may be tried; allocation decides."""

    def admit(self, waiting: Sequence[Any], book: Any) -> int:
        return len(waiting)


class ReservationGate:
    """Admit a request only if the replica's peak block use, with it, fits the pool
    less a `headroom` share of it.

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

    def admit(self, waiting: Sequence[Any], book: Any) -> int:
        limit = book.usable_blocks - int(self.headroom * book.usable_blocks)
        admitted = 0
        while admitted < len(waiting) and (
                book.peak_blocks(waiting[:admitted + 1]) <= limit
                or (admitted == 0 and book.idle)):
            admitted += 1
        return admitted


class VllmDefaultVictim:
    """vLLM's behaviour: the most recently admitted running request is preempted first."""

    def order_running(self, running: list[Any]) -> list[Any] | None:
        return None


class CheapestRecompute:
    """Preempt the request with the fewest computed tokens first (least work lost).

    vLLM preempts from the end of the running list, so the list is kept sorted by
    computed tokens, most first; requests at the front are also scheduled first.
    """

    def order_running(self, running: list[Any]) -> list[Any] | None:
        return sorted(running, key=lambda r: -r.num_computed_tokens)
