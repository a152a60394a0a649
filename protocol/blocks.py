"""KV blocks: the words blockserve uses for them, one meaning each, and the one helper
(`BlockStates`) that derives them for the metrics, `/admin/state`, `blockserve status`
and the dashboard.

A replica's blocks, in vLLM's words (vllm/v1/core/block_pool.py):

    total        the replica's usable KV blocks: vLLM's `num_gpu_blocks` less its null block
    held         referenced by at least one request (`ref_cnt > 0`); vLLM's
                 `kv_cache_usage` is held / total
    free         in vLLM's free block queue (`BlockPool.get_num_free_blocks`): no request
                 references it. A free block is cached or empty:
    cached       free and still in vLLM's prefix cache (it has a block hash): a prefix hit
                 takes it back without recomputing it; reusing it for new work evicts it
    empty        free, with nothing cached

held + cached + empty = total: these three (`STATES`) are the block states.

What the replica's work will still need (replica/scheduler.py, replica/trajectory.py):

    growth       further blocks the running requests will take before their common peak:
                 held + growth is that peak
    waiting      new blocks the requests in the engine's waiting queue need to start
    committed    held + growth + waiting

What the router adds (router/ledger.py):

    demand       the blocks one request needs over its life (router/demand.py): its prompt
                 and expected output; the request carries it to the replica as a hint
    reserved     the demand of the requests the router dispatched to the replica that have
                 not finished (the ledger's reservations)
    unreflected  the part of reserved that the replica's last snapshot cannot include yet
                 (dispatched after it was taken, or not yet acknowledged)
    available    total - committed - unreflected: what placement may still give to new
                 work; cached blocks count, as vLLM evicts them for new work. Negative when
                 the replica is over-committed.
"""

from __future__ import annotations

from typing import NamedTuple

from blockserve.protocol.snapshot import BlockSnapshot

STATES = {
    "held": "referenced by a request",
    "cached": "free, prefix still cached (evictable)",
    "empty": "free, nothing cached",
}


def ceil_div(numerator: int, denominator: int) -> int:
    """numerator / denominator rounded up: whole blocks, steps, rows."""
    return -(-numerator // denominator)


def blocks_for(tokens: int, block_size: int) -> int:
    """The KV blocks that hold `tokens` tokens (none for none)."""
    return ceil_div(max(tokens, 0), block_size)


class BlockStates(NamedTuple):
    """One replica's blocks in the words above; built by `of`, never by hand. A named
    tuple, not a frozen dataclass: the ledger builds one per reservation change, and a
    tuple is built in a third of the time."""

    total: int
    held: int
    cached: int
    empty: int
    growth: int
    waiting: int
    reserved: int
    unreflected: int

    @classmethod
    def of(cls, snapshot: BlockSnapshot, reserved: int = 0, unreflected: int = 0
           ) -> "BlockStates":
        """From a replica's snapshot and, at the router, its ledger's reservations."""
        return cls(snapshot.total_blocks, snapshot.held_blocks, snapshot.cached_blocks,
                   snapshot.free_blocks - snapshot.cached_blocks, snapshot.growth_blocks,
                   snapshot.waiting_blocks, reserved, unreflected)

    @property
    def free(self) -> int:
        return self.cached + self.empty

    @property
    def committed(self) -> int:
        return self.held + self.growth + self.waiting

    @property
    def available(self) -> int:
        return self.total - self.committed - self.unreflected

    @property
    def usage(self) -> float:
        """vLLM's kv_cache_usage: held / total."""
        return self.held / self.total if self.total else 0.0

    def by_state(self) -> dict[str, int]:
        """The block states, which sum to total."""
        return {state: getattr(self, state) for state in STATES}

    def to_dict(self) -> dict[str, int]:
        return {**self._asdict(), "free": self.free, "committed": self.committed,
                "available": self.available}
