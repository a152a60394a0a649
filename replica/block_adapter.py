"""The one place blockserve reaches into vLLM's KV-cache internals for block policies.

The block policies of protocol/policies.py act at four points of vLLM v1 (see
docs/block-policies.md for the whole flow):

- `BlockPool.get_new_blocks` pops blocks from the front of `FreeKVCacheBlockQueue`;
  first the eviction policy may spare cached blocks at the front (each moves to the
  back), at most one pass over the free blocks per call, so the call gets its blocks
  whenever vLLM's would;
- `BlockPool.free_blocks` appends freed cached blocks to the back of the queue; the
  retention policy may move each to the front instead;
- `BlockPool.touch` takes a prefix-cache hit out of the queue; the hit is counted;
- `KVCacheManager.allocate_slots` for a waiting request asks the budget first; a
  refusal returns None, vLLM's own "no blocks" answer, so the request waits.

The pool and the manager are shared by the coordinator, every single-type manager and
(through `KVCacheBlock.pool`) every block, so they are not replaced: their class is set
to a subclass defined here that overrides only those methods. With vLLM's defaults and
no observer nothing is installed and vLLM runs untouched. A policy that raises gets
vLLM's answer for that call (replica/policy_errors.py): reuse the block, send it to the
back, admit the request, drop the notification.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from vllm.logger import init_logger
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_block_hash
from vllm.v1.request import Request, RequestStatus

from blockserve.protocol.policies import BlockPolicies, RequestView
from blockserve.replica.policy_errors import PolicyErrors

_ADMITTING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
# Under vLLM's logger, so the line lands in the engine's log beside vLLM's own.
logger = init_logger("vllm.blockserve.block_policies")


class _BlockRecord:
    """What the adapter knows about one block: a `BlockView` for the policies."""

    __slots__ = ("_block", "hits", "spared", "is_prompt", "request_id", "tenant", "priority",
                 "last_used", "position", "tenants")

    def __init__(self, block: KVCacheBlock):
        self._block = block
        self.hits = self.spared = self.priority = self.position = 0
        self.is_prompt = False
        self.request_id, self.tenant, self.last_used = "", "", 0.0
        self.tenants: set[str] = set()  # of the requests that hit it since it was cached

    @property
    def block_id(self) -> int:
        return self._block.block_id

    @property
    def prefix_hash(self) -> bytes | None:
        key = self._block.block_hash
        return None if key is None else get_block_hash(key)


class _Records(dict):
    """Each block's record by block id, made when a policy first asks for it: a GPU's
    pool has tens of thousands of blocks, and a simulated cluster many pools."""

    def __init__(self, blocks: list[KVCacheBlock]):
        super().__init__()
        self._blocks = blocks

    def __missing__(self, block_id: int) -> _BlockRecord:
        record = self[block_id] = _BlockRecord(self._blocks[block_id])
        return record


@dataclass
class BlockPolicyStats:
    """Counters of what the block policies did, since start-up."""

    cached_blocks_evicted: int = 0  # reused blocks whose cached content was dropped
    blocks_spared: int = 0  # eviction policy answered no
    blocks_sent_first: int = 0  # retention policy answered no
    prefix_hit_blocks: int = 0
    admissions_refused: int = 0  # budget answered no (counted once per step asked)


class BlockPolicyAdapter:
    """Installs `policies` on one scheduler's KV cache manager and keeps their counts.

    With vLLM's three defaults it installs nothing, unless `observe` asks for evictions.
    """

    def __init__(self, manager: KVCacheManager, policies: BlockPolicies,
                 clock: Callable[[], float], view: Callable[[Request], RequestView],
                 errors: PolicyErrors):
        """`view`: the scheduler's view of a request, the one every policy sees;
        `errors`: where the policies' exceptions are counted."""
        self.policies = policies
        self.errors = errors
        self.clock = clock
        self.view = view
        self.on_evict: Callable[[bytes], None] | None = None
        self.stats = BlockPolicyStats()
        self.active = False
        self._manager = manager
        self._pool = manager.block_pool
        # The waiting request being allocated, and its view once a policy has asked for it:
        # most allocations hit no cached block and meet vLLM's budget, which need none.
        self._allocating: Request | None = None
        self._allocating_view: RequestView | None = None
        self._reservations: dict[str, tuple[str, int]] = {}  # request id -> tenant, blocks
        self._reserved_by_tenant: dict[str, int] = {}
        self.records: dict[int, _BlockRecord] = {}
        if not policies.keep_vllm_behaviour:
            self._install()
        logger.info("block policies: eviction %s, retention %s, budget %s (%s)",
                    *(type(p).__name__ for p in (policies.eviction, policies.retention,
                                                 policies.budget)),
                    "installed" if self.active else "vLLM's own, nothing installed")

    def observe(self, on_evict: Callable[[bytes], None]) -> None:
        """Call `on_evict` with the prefix hash of every evicted cached block (the lab's)."""
        self.on_evict = on_evict
        if not self.active:
            self._install()

    def _install(self) -> None:
        for obj, base, policy_cls in ((self._pool, BlockPool, _PolicyBlockPool),
                                      (self._manager, KVCacheManager, _PolicyKVCacheManager)):
            if type(obj) is not base:
                raise TypeError(f"block policies wrap vLLM's {base.__name__}; this engine "
                                f"uses {type(obj).__name__}")
            obj.__class__ = policy_cls
            obj._blockserve = self  # type: ignore[union-attr]
        self.records = _Records(self._pool.blocks)
        self.active = True

    # --- BlockUsage, for budgets --------------------------------------------------
    @property
    def usable_blocks(self) -> int:
        return self._pool.num_gpu_blocks - 1  # block 0 is vLLM's null block

    def free_blocks(self) -> int:
        return self._pool.get_num_free_blocks()

    def reserved(self, tenant: str) -> int:
        return self._reserved_by_tenant.get(tenant, 0)

    # --- hooks, called by the subclasses below ----------------------------------------
    def begin_allocation(self, request: Request) -> bool:
        """A waiting request is about to take its first blocks: whether the budget lets
        it (if not, it waits). Every call is followed by `end_allocation`."""
        self._allocating, self._allocating_view = request, None
        budget = self.policies.budget
        if budget.keeps_vllm_behaviour or not self._reservations:
            return True
        try:
            admit = budget.may_admit(self.allocating_view(), self)
        except Exception as exc:  # vLLM's answer: allocate
            self.errors.caught("block_budget", exc)
            return True
        if not admit:
            self.stats.admissions_refused += 1
        return admit

    def allocating_view(self) -> RequestView | None:
        """The view of the waiting request being allocated, made when first asked for."""
        if self._allocating_view is None and self._allocating is not None:
            self._allocating_view = self.view(self._allocating)
        return self._allocating_view

    def end_allocation(self, allocated: bool) -> None:
        """After `begin_allocation`: a request that got its blocks holds a reservation of
        its most blocks, for budgets (vLLM's needs none)."""
        if allocated and not self.policies.budget.keeps_vllm_behaviour:
            view = self.allocating_view()
            self._release(view.request_id)
            self._reservations[view.request_id] = (view.tenant, view.max_blocks)
            self._reserved_by_tenant[view.tenant] = self.reserved(view.tenant) + view.max_blocks
        self._allocating = self._allocating_view = None

    def label(self, request: Request) -> None:
        """Mark a request's blocks with it, before it frees them."""
        view, now = self.view(request), self.clock()
        blocks_per_group = self._manager.coordinator.get_blocks(request.request_id)
        for manager, blocks in zip(self._manager.coordinator.single_type_managers,
                                   blocks_per_group):
            prompt_only = request.num_prompt_tokens // manager.block_size
            for index, block in enumerate(blocks):
                record = self.records[block.block_id]
                record.position = index
                record.is_prompt = index < prompt_only
                record.request_id, record.tenant, record.priority = \
                    view.request_id, view.tenant, view.priority
                record.last_used = now
        self._release(request.request_id)

    def _release(self, request_id: str) -> None:
        tenant, blocks = self._reservations.pop(request_id, ("", 0))
        if blocks:
            self._reserved_by_tenant[tenant] -= blocks

    def touched(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A waiting request's prefix hit: vLLM touches its hit blocks in block order,
        from its first, before it takes the request's new blocks."""
        eviction, now = self.policies.eviction, self.clock()
        for position, block in enumerate(blocks):
            if block.block_hash is None:
                continue
            request = self.allocating_view()
            record = self.records[block.block_id]
            record.hits += 1
            record.last_used = now
            self.stats.prefix_hit_blocks += 1
            if request is not None:
                record.position = position
                record.tenants.add(request.tenant)
                if not eviction.keeps_vllm_behaviour:
                    try:
                        eviction.on_hit(record, request)
                    except Exception as exc:
                        self.errors.caught("block_eviction", exc)

    def spare_and_evict(self, num_blocks: int) -> None:
        """Before the pool pops `num_blocks`: let the eviction policy spare cached blocks
        at the front, then tell it about the cached blocks that will be evicted."""
        queue, eviction = self._pool.free_block_queue, self.policies.eviction
        tail = queue.fake_free_list_tail
        if not eviction.keeps_vllm_behaviour:
            now, spares_left, taken = self.clock(), queue.num_free_blocks, 0
            last_taken = queue.fake_free_list_head
            while taken < num_blocks and spares_left > 0:
                block = last_taken.next_free_block
                if block is tail:
                    break
                record = self.records[block.block_id]
                if block.block_hash is not None and not self._may_evict(record, now):
                    queue.remove(block)  # spared: to the back, asked again after the rest
                    queue.append(block)
                    record.spared += 1
                    self.stats.blocks_spared += 1
                    spares_left -= 1
                else:
                    taken += 1
                    last_taken = block
        block = queue.fake_free_list_head.next_free_block
        for _ in range(num_blocks):
            record = self.records[block.block_id]
            if block.block_hash is not None:
                self.stats.cached_blocks_evicted += 1
                try:
                    eviction.on_evict(record)
                except Exception as exc:
                    self.errors.caught("block_eviction", exc)
                if self.on_evict is not None:
                    self.on_evict(get_block_hash(block.block_hash))
            record.hits = record.spared = 0
            if record.tenants:
                record.tenants = set()
            block = block.next_free_block

    def _may_evict(self, record: _BlockRecord, now: float) -> bool:
        try:
            return self.policies.eviction.may_evict(record, now)
        except Exception as exc:  # vLLM's answer: reuse it
            self.errors.caught("block_eviction", exc)
            return True

    def freed(self, blocks: list[KVCacheBlock]) -> None:
        """After the pool put `blocks` back: tell the eviction policy, and move the
        cached ones the retention policy does not retain to the front."""
        eviction, retention = self.policies.eviction, self.policies.retention
        first: list[KVCacheBlock] = []
        for block in blocks:
            if block.ref_cnt or block.block_hash is None or block.pool not in (None, self._pool):
                continue
            record = self.records[block.block_id]
            try:
                eviction.on_free(record)
            except Exception as exc:
                self.errors.caught("block_eviction", exc)
            if not retention.keeps_vllm_behaviour and not self._retain(record):
                first.append(block)
        if first:
            queue = self._pool.free_block_queue
            for block in first:
                queue.remove(block)
            queue.prepend_n(first)
            self.stats.blocks_sent_first += len(first)


    def _retain(self, record: _BlockRecord) -> bool:
        try:
            return self.policies.retention.retain(record)
        except Exception as exc:  # vLLM's answer: the back of the order
            self.errors.caught("block_retention", exc)
            return True


class _PolicyBlockPool(BlockPool):
    """vLLM's BlockPool with the adapter's hooks (installed by class assignment)."""

    _blockserve: BlockPolicyAdapter

    def touch(self, blocks: Any) -> None:
        if self.enable_caching:
            self._blockserve.touched(blocks)
        super().touch(blocks)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if self.enable_caching and 0 < num_blocks <= self.get_num_free_blocks():
            self._blockserve.spare_and_evict(num_blocks)
        return super().get_new_blocks(num_blocks)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(ordered_blocks)
        super().free_blocks(blocks)
        if self.enable_caching:
            self._blockserve.freed(blocks)


class _PolicyKVCacheManager(KVCacheManager):
    """vLLM's KVCacheManager with the budget and request labels (class assignment)."""

    _blockserve: BlockPolicyAdapter

    def allocate_slots(self, request: Request, *args: Any, **kwargs: Any
                       ) -> KVCacheBlocks | None:
        if request.status not in _ADMITTING:
            return super().allocate_slots(request, *args, **kwargs)
        adapter, blocks = self._blockserve, None
        try:
            if adapter.begin_allocation(request):
                blocks = super().allocate_slots(request, *args, **kwargs)
        finally:
            adapter.end_allocation(blocks is not None)
        return blocks

    def free(self, request: Request) -> None:
        self._blockserve.label(request)
        super().free(request)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        self._blockserve.label(request)
        return super().pop_blocks_for_free(request)
