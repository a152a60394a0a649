"""Replica-side policy points of the block-aware scheduler (besides the queue order).

Each is one small class chosen by import path in the deployment config:

- admission gate: how many requests at the head of the ordered waiting queue vLLM may
  admit this step (`admit(waiting, book) -> int`);
- preemption victim: the order of the running list, whose LAST request vLLM preempts
  first when it runs out of blocks (`order_running(running) -> list | None`);
- block assignment: which cached blocks are evicted first when the pool hands out new
  blocks (`install(block_pool)`).

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


class LruBlockAssignment:
    """vLLM's behaviour: freed cached blocks are evicted least recently used first."""

    def install(self, block_pool: Any) -> None:
        return None


class ProtectSharedBlocks:
    """Frequency-aware eviction: cached blocks that many requests hit get a second chance.

    vLLM's pool evicts in pure LRU order, so one long scan can flush a hot system
    prompt. Each prefix-cache hit on a block earns it a credit (capped); when the pool is
    about to hand out a cached block that still has credit, the block is moved to the
    back of the eviction queue and its credit halves (CLOCK-style aging, so protection
    always runs out and allocation always succeeds).
    """

    def __init__(self, min_hits: int = 2, max_credit: int = 8):
        self.min_hits = min_hits
        self.max_credit = max_credit

    def install(self, block_pool: Any) -> None:
        policy = self
        credit: dict[int, int] = {}
        base = type(block_pool)

        class SharedBlockPool(base):  # type: ignore[misc, valid-type]
            def touch(self, blocks):
                for block in blocks:
                    if block.block_hash is not None:
                        credit[block.block_id] = min(policy.max_credit,
                                                     credit.get(block.block_id, 0) + 1)
                return super().touch(blocks)

            def get_new_blocks(self, num_blocks):
                policy.spare_protected(self.free_block_queue, num_blocks, credit)
                blocks = super().get_new_blocks(num_blocks)
                for block in blocks:  # a reused block starts over
                    credit.pop(block.block_id, None)
                return blocks

        block_pool.__class__ = SharedBlockPool
        block_pool.shared_block_credit = credit

    def spare_protected(self, queue: Any, num_blocks: int, credit: dict[int, int]) -> None:
        """Rotate protected cached blocks out of the next `num_blocks` to be evicted."""
        rotations_left = queue.num_free_blocks
        while rotations_left > 0:
            protected, block = [], queue.fake_free_list_head.next_free_block
            for _ in range(min(num_blocks, queue.num_free_blocks)):
                if block.block_hash is not None and credit.get(block.block_id, 0) >= self.min_hits:
                    protected.append(block)
                block = block.next_free_block
            if not protected:
                return
            for block in protected[:rotations_left]:
                queue.remove(block)
                queue.append(block)
                credit[block.block_id] //= 2
                rotations_left -= 1
