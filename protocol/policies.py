"""Typed interfaces of every policy that runs inside a replica's vLLM scheduler, and
the `Policy` base that the router's policies share (protocol/router_policies.py).

Seven policies, each a small class chosen by name in the replica's `scheduler` config
(protocol/registry.py) and asked at one point of vLLM's scheduling:

- `QueueOrder.key(item, now)` - the order of the waiting queue (the router's admission
  queue uses the same interface, through `first`, which an order may answer faster);
- `AdmissionGate.may_admit(request, admitted, pool)` - whether the next waiting request
  may be tried this step;
- `PreemptionOrder.key(request, now)` - the order of the running requests; vLLM
  preempts the last one first when it runs out of blocks;
- `EvictionPolicy.may_evict(block, now)` - whether the cached free block about to be
  reused may be; False spares it once;
- `RetentionPolicy.retain(block)` - where a freed cached block goes in the eviction order;
- `BlockBudget.may_admit(request, usage)` - whether a waiting request may take blocks now;
- `StepTokens.tokens(step)` - how many tokens the next engine step may compute.

One convention for all of them: a policy answers with a value and changes nothing
itself. An order returns a sort key, smallest first; a check returns a bool whose True
is what vLLM does; a "no" only ever makes a request wait or spares a block once, never
an error. vLLM's own behaviour is a class too (short name `vllm`), flagged
`keeps_vllm_behaviour` so the adapters skip it; the queue's arrival order (`fcfs`) is
flagged `is_arrival_order`, so neither queue sorts. Methods named `on_*` are
notifications that return nothing.

Policies see read-only views (`RequestView`, `BlockView`, `PoolView`, `BlockUsage`) and
import nothing from vLLM: the adapters (replica/scheduler.py, replica/block_adapter.py)
hold every vLLM internal, so this module also loads in the router.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Sequence


class Waiting(Protocol):
    """A waiting request as a queue order sees it, in the router or a replica."""

    @property
    def seq(self) -> int:
        """Arrival order (on replicas, the router's admission sequence, if it hinted one)."""
    @property
    def arrival(self) -> float:
        """Seconds, on the same clock as `now`."""
    @property
    def demand_blocks(self) -> int:
        """KV blocks the request is expected to need in total."""
    @property
    def priority(self) -> int:
        """Lower is more urgent (vLLM's convention)."""
    @property
    def tenant(self) -> str: ...


@dataclass(frozen=True, slots=True)
class RequestView:
    """A replica's request as its policies see it (tenant, priority and the router's
    sequence come from the router's hints, protocol/hints.py). A `Waiting`."""

    request_id: str
    seq: int
    tenant: str
    priority: int
    arrival: float  # on the scheduler's clock; age = now - arrival
    prompt_blocks: int  # blocks the prompt fills or starts
    max_blocks: int  # blocks the request can hold at most: prompt + max_tokens
    demand_blocks: int  # blocks it is expected to need in total (its lease)
    computed_tokens: int  # tokens computed so far (recomputed if it is preempted)


class BlockView(Protocol):
    """A KV-cache block as block policies see it; the adapter keeps the counts."""

    @property
    def block_id(self) -> int: ...
    @property
    def prefix_hash(self) -> bytes | None:
        """Hash of the token prefix up to and including this block; None: not cached."""
    @property
    def hits(self) -> int:
        """Prefix-cache hits on this block since its content was cached."""
    @property
    def spared(self) -> int:
        """Times an eviction policy spared it since its content was cached."""
    @property
    def is_prompt(self) -> bool:
        """Whether it holds prompt tokens (False: output tokens) of its last request."""
    @property
    def request_id(self) -> str:
        """The last request that held it ("" before any)."""
    @property
    def tenant(self) -> str: ...
    @property
    def priority(self) -> int: ...
    @property
    def last_used(self) -> float:
        """When it was last freed or hit, on the scheduler's clock."""


class PoolView(Protocol):
    """The replica's KV blocks as an admission gate sees them."""

    @property
    def usable_blocks(self) -> int: ...
    @property
    def idle(self) -> bool:
        """Nothing runs (a gate that refuses then would leave the replica idle)."""
    def free_blocks(self) -> int: ...
    def peak_blocks(self, admitting: Sequence[RequestView] = ()) -> int:
        """The most blocks the running requests, plus `admitting` if admitted now, will
        hold at once from now on, each growing to its lease (replica/trajectory.py)."""


class BlockUsage(Protocol):
    """The pool as a budget sees it. A request reserves its `max_blocks` from admission
    until it finishes or is preempted."""

    @property
    def usable_blocks(self) -> int: ...
    def free_blocks(self) -> int: ...
    def reserved(self, tenant: str) -> int:
        """Blocks reserved by the tenant's admitted requests."""


class Policy(ABC):
    """Common base of every policy, the router's and the replica's: chosen through
    protocol/registry.py, built by protocol/config.py's `PolicyRef`."""


class SchedulerPolicy(Policy):
    """A policy that replaces one of vLLM's own scheduling decisions;
    `keeps_vllm_behaviour` (the `vllm` built-ins) lets the adapter skip it."""

    keeps_vllm_behaviour: ClassVar[bool] = False


class QueueOrder(Policy):
    """Which waiting request goes next: the smallest key. vLLM's own order (and the
    router's arrival order) is `FirstComeFirstServed` (protocol/queue_orders.py)."""

    # Keys follow arrival, so a queue already in arrival order need not sort.
    is_arrival_order: ClassVar[bool] = False

    @abstractmethod
    def key(self, item: Waiting, now: float) -> Any:
        """The sort key of a waiting item; smallest first."""

    def first(self, waiting: Sequence[Waiting], now: float) -> Waiting:
        """The item that goes next among `waiting`, a non-empty list in arrival order (the
        router's admission queue keeps it so): the smallest key. An order that can find it
        without a key per item overrides this: the router asks after every response
        chunk, with hundreds waiting under overload."""
        key = self.key
        return min(waiting, key=lambda item: key(item, now))

    def on_admitted(self, item: Waiting, now: float) -> None:
        """The item left the queue and started holding its blocks."""

    def on_finished(self, item: Waiting, held_blocks: int, started: float, now: float) -> None:
        """The item released `held_blocks` that it held since `started`."""


class AdmissionGate(SchedulerPolicy):
    """Whether vLLM may try the waiting requests at the head of the ordered queue."""

    @abstractmethod
    def may_admit(self, request: RequestView, admitted: Sequence[RequestView],
                  pool: PoolView) -> bool:
        """Asked for the waiting requests in queue order until one is refused; `admitted`
        are those let through before it this step. True (vLLM): vLLM may schedule it if
        its blocks and token budget allow. False: it and those behind it wait this step."""


class PreemptionOrder(SchedulerPolicy):
    """The order of the running requests: vLLM schedules them in it and, when blocks run
    out, preempts from its end, so the largest key is preempted first."""

    @abstractmethod
    def key(self, request: RequestView, now: float) -> Any:
        """The sort key of a running request; smallest first (preempted last)."""


class EvictionPolicy(SchedulerPolicy):
    """Which cached free block is reused first."""

    @abstractmethod
    def may_evict(self, block: BlockView, now: float) -> bool:
        """The pool is about to reuse `block`, the front of the eviction order. True
        (vLLM): reuse it. False: spare it once (it moves to the back)."""

    def on_hit(self, block: BlockView, request: RequestView) -> None:
        """`request` reuses cached `block` (a prefix-cache hit)."""

    def on_free(self, block: BlockView) -> None:
        """Cached `block` became free (evictable)."""

    def on_evict(self, block: BlockView) -> None:
        """`block`'s cached content is dropped: the pool hands the block out again."""


class RetentionPolicy(SchedulerPolicy):
    """Where a freed cached block goes in the eviction order."""

    @abstractmethod
    def retain(self, block: BlockView) -> bool:
        """True (vLLM): the back of the order, reused last. False: the front, reused next."""


class BlockBudget(SchedulerPolicy):
    """Whether a waiting request may take its blocks now."""

    @abstractmethod
    def may_admit(self, request: RequestView, usage: BlockUsage) -> bool:
        """True (vLLM): allocate as vLLM would. False: the request waits this step."""


@dataclass(frozen=True, slots=True)
class StepState:
    """A replica's next engine step as a step-token policy sees it."""

    max_tokens: int  # vLLM's token budget per step (max_num_batched_tokens)
    decoding: int  # running requests past their prompt: each waits for this step's token
    context_tokens: int  # KV tokens the running requests hold (what a decode step reads)
    # For each decoding request, (tokens since its first, seconds since its first): the
    # pace its TPOT is judged by.
    decode_pace: tuple[tuple[int, float], ...] = ()


class StepTokens(SchedulerPolicy):
    """How many tokens the next engine step may compute. A step lasts as long as its
    tokens take, and every decoding request waits for the whole step for its next token."""

    @abstractmethod
    def tokens(self, step: StepState) -> int:
        """The next step's token budget, at most `step.max_tokens` (vLLM's: that)."""

    def on_step(self, step: StepState, tokens: int, seconds: float) -> None:
        """A step that began in `step` computed `tokens` and lasted `seconds` (from its
        start to the next step's, the engine busy in between)."""


# --- vLLM's own behaviour, short name `vllm` --------------------------------------------
class VllmDefaultGate(AdmissionGate):
    """vLLM: every waiting request may be tried; allocation decides."""

    keeps_vllm_behaviour = True

    def may_admit(self, request: RequestView, admitted: Sequence[RequestView],
                  pool: PoolView) -> bool:
        return True


class VllmDefaultPreemption(PreemptionOrder):
    """vLLM: running requests in the order they were admitted, so the most recently
    admitted is preempted first."""

    keeps_vllm_behaviour = True

    def key(self, request: RequestView, now: float) -> Any:
        return 0  # every key equal: the sort is stable and keeps vLLM's order


class VllmDefaultEviction(EvictionPolicy):
    """vLLM: the least recently used cached free block is reused first."""

    keeps_vllm_behaviour = True

    def may_evict(self, block: BlockView, now: float) -> bool:
        return True


class VllmDefaultRetention(RetentionPolicy):
    """vLLM: a freed cached block goes to the back (a request's tail blocks first)."""

    keeps_vllm_behaviour = True

    def retain(self, block: BlockView) -> bool:
        return True


class VllmDefaultBudget(BlockBudget):
    """vLLM: a request may take any free block."""

    keeps_vllm_behaviour = True

    def may_admit(self, request: RequestView, usage: BlockUsage) -> bool:
        return True


class VllmStepTokens(StepTokens):
    """vLLM: every step may compute up to max_num_batched_tokens."""

    keeps_vllm_behaviour = True

    def tokens(self, step: StepState) -> int:
        return step.max_tokens


@dataclass(frozen=True)
class BlockPolicies:
    """The three block policies of one replica."""

    eviction: EvictionPolicy
    retention: RetentionPolicy
    budget: BlockBudget

    @property
    def keep_vllm_behaviour(self) -> bool:
        return (self.eviction.keeps_vllm_behaviour and self.retention.keeps_vllm_behaviour
                and self.budget.keeps_vllm_behaviour)
