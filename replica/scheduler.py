"""The block-aware vLLM scheduler that runs inside every replica.

vLLM builds it in the EngineCore process from `scheduler_cls`. It does not re-implement
vLLM's `schedule()`; around each call it
  1. orders the waiting queue (queue order policy),
  2. holds back the waiting requests the admission gate refuses this step,
  3. orders the running list so vLLM's preemption picks the preemption order's victim,
  4. sets the step's token budget (step tokens policy) and times the step,
and after each step publishes a `BlockSnapshot` to shared memory. It is the adapter of
those four policies (protocol/policies.py): they see `RequestView`s, `StepState`s and
the `PoolView` this module's `BlockBook` gives, never vLLM's objects. A policy that raises leaves vLLM's
order or answer for that call (replica/policy_errors.py).

`BlockAwareScheduler` (plain `Scheduler`, CPU) and `AsyncBlockAwareScheduler`
(`AsyncScheduler`, vLLM's async scheduling on GPU) share all of this code.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from typing import Any, Callable, Sequence

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from blockserve.protocol.blocks import blocks_for, ceil_div
from blockserve.protocol.config import ADDITIONAL_CONFIG_KEY, SchedulerConfig, checked
from blockserve.protocol.hints import Hints
from blockserve.protocol.policies import BlockPolicies, RequestView, StepState
from blockserve.protocol.snapshot import SCHEDULER_POLICIES, BlockSnapshot, SnapshotChannel
from blockserve.replica.block_adapter import BlockPolicyAdapter
from blockserve.replica.cached_free import CachedFreeCount
from blockserve.replica.held_prefix import HeldPrefixes
from blockserve.replica.policy_errors import PolicyErrors
from blockserve.replica.trajectory import Trajectory, extended_lease, peak_blocks
from blockserve.replica.watchdog import die_with

# The cached-free count is refreshed this often (and whenever nothing runs): with a KV
# connector it walks the free list, O(blocks) (replica/cached_free.py).
CACHED_COUNT_INTERVAL_S = 0.05


# Each request's hints, parsed once: the snapshot reads them for every request each step.
_PARSED_HINTS: weakref.WeakKeyDictionary[Request, Hints] = weakref.WeakKeyDictionary()


def _hints(request: Request) -> Hints:
    """The router's hints a request carries (protocol/hints.py); defaults without them."""
    hints = _PARSED_HINTS.get(request)
    if hints is None:
        hints = _PARSED_HINTS[request] = Hints.from_extra_args(
            request.sampling_params.extra_args if request.sampling_params else None)
    return hints


class BlockBook:
    """Block arithmetic over vLLM's real KV cache manager, for snapshots and, as the
    admission gate's `PoolView` (protocol/policies.py), for the gate."""

    def __init__(self, scheduler: Scheduler):
        self._scheduler = scheduler
        self._manager = scheduler.kv_cache_manager
        self._pool = scheduler.kv_cache_manager.block_pool
        self.block_size = scheduler.block_size
        self.usable_blocks = self._pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
        self.cached_free = CachedFreeCount(self._pool,
                                           kv_connector=scheduler.connector is not None)
        self.held_prefixes = HeldPrefixes(self._pool, self.cached_free,
                                          lambda request: len(self._held_prefix(request)))

    def free_blocks(self) -> int:
        return self._pool.get_num_free_blocks()

    def held_blocks(self) -> int:
        return self.usable_blocks - self.free_blocks()

    def allocated(self, request: Request) -> int:
        return len(self._manager.coordinator.get_blocks(request.request_id)[0])

    def expected_tokens(self, request: Request) -> int:
        """Tokens the request is expected to reach: its lease, prompt + the router's
        expected output, else max_tokens (or the router's demand hint, where that is
        larger), extended once the request outgrows it (replica/trajectory.py)."""
        hints = _hints(request)
        output = hints.expected_output if hints.expected_output is not None \
            else request.max_tokens or 0
        tokens = request.num_prompt_tokens + output
        if hints.demand_blocks is not None and \
                hints.demand_blocks > blocks_for(tokens, self.block_size):
            tokens = hints.demand_blocks * self.block_size
        return extended_lease(tokens, request.num_prompt_tokens, request.num_tokens,
                              request.num_prompt_tokens + (request.max_tokens or 0),
                              self.block_size)

    @property
    def idle(self) -> bool:
        """No request is running (a gate must then admit the head, whatever it needs)."""
        return not self._scheduler.running

    def demand(self, request: Request) -> int:
        """Blocks the request needs in total (at least what it already holds)."""
        return max(blocks_for(self.expected_tokens(request), self.block_size),
                   blocks_for(request.num_tokens, self.block_size))

    def need(self, request: Request) -> int:
        """New blocks admitting a waiting request would take (prefix blocks held by
        others are shared, not taken)."""
        held = self.held_prefixes.length(request) \
            if self._pool.enable_caching and not request.num_computed_tokens else 0
        return max(0, self.demand(request) - held - self.allocated(request))

    def waiting_blocks(self, waiting: Sequence[Request]) -> int:
        """New blocks admitting every waiting request would take, each on its own."""
        self.held_prefixes.keep_only({request.request_id for request in waiting})
        return sum(self.need(request) for request in waiting)

    def peak_blocks(self, admitting: Sequence[RequestView] = ()) -> int:
        """The most blocks the running requests, plus `admitting` if admitted now, will
        hold at once from now on (replica/trajectory.py)."""
        pinned: set[int] = set()  # running requests' blocks that an admitted prefix shares
        trajectories = []
        for view in admitting:
            request = self._scheduler.requests[view.request_id]
            shared = self._held_prefix(request)
            pinned.update(shared)
            trajectories.append(self._trajectory(request, len(shared), len(shared)))
        held = self.held_blocks()
        count_kept = bool(pinned) or self._any_shared(held)
        for request in self._scheduler.running:
            blocks = self._manager.coordinator.get_blocks(request.request_id)[0]
            kept = sum(1 for b in blocks if b.ref_cnt > 1 or b.block_id in pinned) \
                if count_kept else 0
            trajectories.append(self._trajectory(request, len(blocks), kept))
        return peak_blocks(held, self.block_size, trajectories)

    def _any_shared(self, held: int) -> bool:
        """Whether some held block is in more than one request's block list. Each list
        entry is one reference (ref_cnt) and a block is held while it has one, so the
        lists' total length equals the held blocks exactly when none is shared: an
        O(requests) check that spares the O(blocks) count of shared blocks when it is 0."""
        lists = self._manager.coordinator.single_type_managers[0].req_to_blocks
        return sum(map(len, lists.values())) != held

    def _trajectory(self, request: Request, counted: int, kept: int) -> Trajectory:
        # A prompt longer than one step's token budget takes extra steps to prefill.
        prefill_steps = ceil_div(request.num_tokens - request.num_computed_tokens,
                                 self._scheduler.max_num_scheduled_tokens)
        remaining = max(1, self.expected_tokens(request) - request.num_tokens)
        return Trajectory(request.num_tokens, remaining + max(0, prefill_steps - 1),
                          counted, kept)

    def _held_prefix(self, request: Request) -> list[int]:
        """Ids of the leading prompt blocks that running requests already hold."""
        if not self._pool.enable_caching or request.num_computed_tokens:
            return []
        held = []
        for block_hash in request.block_hashes:
            cached = self._pool.get_cached_block(block_hash, [0])
            if not cached or cached[0].ref_cnt == 0:
                break
            held.append(cached[0].block_id)
        return held

    def cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (evictable)."""
        return self.cached_free()


class BlockAwareMixin:
    """Policy hooks around vLLM's `schedule()`; see the module docstring."""

    # Steps still running when vLLM calls schedule(): 0 when it schedules, runs the
    # step, then schedules the next (the step between two calls is the last one begun).
    steps_in_flight = 0

    def __init__(self, *args: Any, clock: Callable[[], float] = time.time, **kwargs: Any):
        """`clock`: the time policies and snapshots read (vLLM builds the scheduler with
        wall time; the engine-less replica passes the simulator's virtual clock)."""
        super().__init__(*args, **kwargs)
        self.clock = clock
        raw = (self.vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {})
        config = checked(SchedulerConfig, raw)  # validated by build_app already
        self.policy_errors = PolicyErrors({field: getattr(config, field).cls
                                           for field in SCHEDULER_POLICIES})
        self.queue_order = config.queue_order.policy
        self.admission_gate = config.admission_gate.policy
        self.preemption = config.preemption.policy
        self.step_tokens = config.step_tokens.policy
        self.vllm_max_tokens = self.max_num_scheduled_tokens
        # The last steps begun, as (time, state, tokens), oldest first (`_budget_step`).
        self._steps_begun: deque[tuple[float, StepState, int]] = deque(
            maxlen=self.steps_in_flight + 1)
        self._first_decoded: dict[str, tuple[float, int]] = {}  # `_budget_step`
        self.block_policies = BlockPolicyAdapter(
            self.kv_cache_manager,
            BlockPolicies(config.block_eviction.policy, config.block_retention.policy,
                          config.block_budget.policy),
            clock=clock, view=self.view, errors=self.policy_errors)
        self.book = BlockBook(self)
        self._channel = (SnapshotChannel(config.snapshot_channel)
                         if config.snapshot_channel else None)
        if config.owner_pid is not None:  # this is the replica's EngineCore process
            die_with(config.owner_pid)
        self.preemptions_total = 0
        self.requests_added_total = 0
        self.last_admission_seq = 0
        self._cached_free = 0
        self._cached_counted_at = 0.0
        self.snapshot = BlockSnapshot()
        self.publish()

    # --- vLLM entry points -------------------------------------------------------
    def add_request(self, request: Request) -> None:
        super().add_request(request)
        self.requests_added_total += 1
        seq = _hints(request).admission_seq
        if seq is not None:
            self.last_admission_seq = max(self.last_admission_seq, seq)
        self.publish()

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> Any:
        result = super().finish_requests(request_ids, finished_status)
        self.publish()  # aborts free blocks without an engine step
        return result

    def schedule(self, *args: Any, **kwargs: Any):
        now = self.clock()
        self._order_waiting(now)
        self._order_running(now)
        held_back = self._gate_waiting()
        step = self._budget_step(now)
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.waiting.extend(held_back)
            self.max_num_scheduled_tokens = self.vllm_max_tokens
        self.preemptions_total += len(output.preempted_req_ids or ())
        tokens = output.total_num_scheduled_tokens
        if step is None or not tokens:
            self._steps_begun.clear()
        else:
            self._steps_begun.append((now, step, tokens))
        return output

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        reset = super().reset_prefix_cache(*args, **kwargs)
        self.book.cached_free.recount()  # the free blocks lost their hashes
        return reset

    def update_from_output(self, *args: Any, **kwargs: Any):
        outputs = super().update_from_output(*args, **kwargs)
        self.publish()
        return outputs

    # --- policy plumbing -----------------------------------------------------------
    def view(self, request: Request) -> RequestView:
        """The read-only view of a request that every replica policy sees."""
        hints = _hints(request)
        limit = min(request.num_prompt_tokens + (request.max_tokens or 0), self.max_model_len)
        return RequestView(
            request_id=request.request_id,
            seq=hints.admission_seq if hints.admission_seq is not None else 0,
            tenant=hints.tenant,
            priority=hints.priority,
            arrival=request.arrival_time,
            prompt_blocks=blocks_for(request.num_prompt_tokens, self.block_size),
            max_blocks=blocks_for(max(limit, request.num_tokens), self.block_size),
            demand_blocks=self.book.demand(request),
            computed_tokens=request.num_computed_tokens,
        )

    def _order_waiting(self, now: float) -> None:
        if self.queue_order.is_arrival_order or len(self.waiting) < 2:
            return
        order = self.queue_order
        try:
            ordered = sorted(((self.view(r), r) for r in self.waiting),
                             # Preempted requests keep their place at the front, as in vLLM.
                             key=lambda vr: (vr[1].status != RequestStatus.PREEMPTED,
                                             order.key(vr[0], now), vr[0].arrival))
        except Exception as exc:  # vLLM's order stands this step
            self.policy_errors.caught("queue_order", exc)
            return
        self.waiting.clear()
        self.waiting.extend(request for _, request in ordered)

    def _order_running(self, now: float) -> None:
        preemption = self.preemption
        if preemption.keeps_vllm_behaviour or len(self.running) < 2:
            return
        try:
            ordered = sorted(self.running, key=lambda r: preemption.key(self.view(r), now))
        except Exception as exc:  # vLLM's order stands this step
            self.policy_errors.caught("preemption", exc)
            return
        self.running[:] = ordered

    def _gate_waiting(self) -> list[Request]:
        """Remove the waiting requests from the first the gate refuses on; returned to
        re-append after vLLM's step."""
        gate = self.admission_gate
        if gate.keeps_vllm_behaviour:
            return []
        admitted: list[RequestView] = []
        for request in self.waiting:
            view = self.view(request)
            try:
                admit = gate.may_admit(view, admitted, self.book)
            except Exception as exc:  # vLLM's answer: it may be tried
                self.policy_errors.caught("admission_gate", exc)
                admit = True
            if not admit:
                break
            admitted.append(view)
        held_back: list[Request] = []
        while len(self.waiting) > len(admitted):
            held_back.append(self.waiting.pop())
        held_back.reverse()
        return held_back

    def _budget_step(self, now: float) -> StepState | None:
        """Time the step that ran since the last call, if the engine was busy since then
        (a request it ran still runs), and set this step's token budget. None: vLLM's
        budget, untimed. The time between two calls is the last step's, or with
        `steps_in_flight` steps in flight (async scheduling), the one begun before it."""
        policy = self.step_tokens
        if policy.keeps_vllm_behaviour:
            return None
        decoding = [r for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens]
        # When each decoding request was first seen decoding, and its output tokens then.
        first, seen, pace = self._first_decoded, {}, []
        for r in decoding:
            at, tokens = seen[r.request_id] = (first.get(r.request_id)
                                               or (now, r.num_output_tokens))
            pace.append((r.num_output_tokens - tokens, now - at))
        self._first_decoded = seen
        step = StepState(max_tokens=self.vllm_max_tokens, decoding=len(decoding),
                         context_tokens=sum(r.num_computed_tokens for r in self.running),
                         decode_pace=tuple(pace))
        try:
            begun = self._steps_begun
            if self.running and len(begun) > self.steps_in_flight:
                _, ran, tokens = begun[0]
                policy.on_step(ran, tokens, now - begun[-1][0])
            budget = int(policy.tokens(step))
        except Exception as exc:  # vLLM's budget this step
            self.policy_errors.caught("step_tokens", exc)
            return step
        self.max_num_scheduled_tokens = max(1, min(budget, self.vllm_max_tokens))
        return step

    def publish(self) -> None:
        """Write the block snapshot (to shared memory when a channel is configured)."""
        now = self.clock()
        book = self.book
        if now - self._cached_counted_at >= CACHED_COUNT_INTERVAL_S or not self.running:
            self._cached_free = book.cached_free_blocks()
            self._cached_counted_at = now
        free = book.free_blocks()
        held = book.usable_blocks - free
        effects = self.block_policies.stats
        self.snapshot = BlockSnapshot(
            step=self.current_step,
            timestamp=now,
            total_blocks=book.usable_blocks,
            block_size=book.block_size,
            free_blocks=free,
            cached_blocks=min(self._cached_free, free),
            held_blocks=held,
            growth_blocks=book.peak_blocks() - held,
            running=len(self.running),
            waiting=len(self.waiting),
            waiting_blocks=book.waiting_blocks(self.waiting),
            preemptions_total=self.preemptions_total,
            requests_added_total=self.requests_added_total,
            last_admission_seq=self.last_admission_seq,
            max_model_len=self.max_model_len,
            block_policies_installed=int(self.block_policies.active),
            cached_blocks_evicted_total=effects.cached_blocks_evicted,
            blocks_spared_total=effects.blocks_spared,
            blocks_sent_first_total=effects.blocks_sent_first,
            admissions_refused_total=effects.admissions_refused,
            **{f"{field}_errors_total": count
               for field, count in self.policy_errors.counts.items()},
        )
        if self._channel is not None:
            self._channel.write(self.snapshot)


class BlockAwareScheduler(BlockAwareMixin, Scheduler):
    """Block-aware policies on vLLM's synchronous scheduler (the CPU platform's)."""


class AsyncBlockAwareScheduler(BlockAwareMixin, AsyncScheduler):
    """Block-aware policies on vLLM's async scheduler (the default on GPUs)."""

    # vLLM schedules step k+1 while step k runs, so between two calls the step that ran
    # is the one begun a call earlier.
    steps_in_flight = 1
