"""Typed interfaces of the block policies that run inside every replica.

vLLM keeps every free KV-cache block in one eviction order (its free queue): blocks
without cached content at the front, cached blocks behind them, least recently used
first. Three policies may change what happens to blocks, each at one point:

- `EvictionPolicy.may_evict(block)` - when the pool is about to reuse the cached free
  block at the front of the order. False spares it once: it moves to the back.
- `RetentionPolicy.retain(block)` - when a request frees a cached block. False puts it
  at the front of the order (the next block reused) instead of the back.
- `BlockBudget.may_admit(request, usage)` - when a waiting request is about to take its
  first blocks. False makes it wait (vLLM stops admitting for this step); it is asked
  again next step. It is never an error.

One convention for all of them: every decision is a yes/no question whose "yes" is
what vLLM does, and vLLM's own behaviour is a class that always answers yes
(`VllmDefault*`), never a missing method or None. Methods named `on_*` are
notifications; they return nothing and do nothing unless a policy overrides them.
The adapter (replica/block_adapter.py) bounds every "no": spared blocks run out within
one pass over the free blocks, so an allocation vLLM would grant is always granted, and
a budget cannot hold a request back while nothing runs. Policies see read-only views,
never vLLM objects, so they import nothing from vLLM.

Built-ins (replica/block_builtins.py) are chosen by short name (controller/policy_registry.py),
user classes by import path ("package.module:Class"), in the replica's `scheduler` config.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol


@dataclass(frozen=True, slots=True)
class RequestView:
    """A request as block policies see it (the router's hints give tenant and priority)."""

    request_id: str
    tenant: str
    priority: int  # lower is more urgent, as in vLLM (protocol/hints.py)
    arrival: float  # on the scheduler's clock; age = now - arrival
    prompt_blocks: int  # blocks the prompt fills or starts
    max_blocks: int  # blocks the request can hold at most: prompt + max_tokens


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


class BlockUsage(Protocol):
    """The pool as a budget sees it. A request reserves its `max_blocks` from admission
    until it finishes or is preempted."""

    @property
    def usable_blocks(self) -> int: ...
    def free_blocks(self) -> int: ...
    def reserved(self, tenant: str) -> int:
        """Blocks reserved by the tenant's admitted requests."""


class BlockPolicy(ABC):
    """Common base: `is_vllm_default` lets the adapter skip a policy that changes nothing."""

    is_vllm_default: ClassVar[bool] = False


class EvictionPolicy(BlockPolicy):
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


class RetentionPolicy(BlockPolicy):
    """Where a freed cached block goes in the eviction order."""

    @abstractmethod
    def retain(self, block: BlockView) -> bool:
        """True (vLLM): the back of the order, reused last. False: the front, reused next."""


class BlockBudget(BlockPolicy):
    """Whether a waiting request may take its blocks now."""

    @abstractmethod
    def may_admit(self, request: RequestView, usage: BlockUsage) -> bool:
        """True (vLLM): allocate as vLLM would. False: the request waits this step."""


class VllmDefaultEviction(EvictionPolicy):
    """vLLM: the least recently used cached free block is reused first."""

    is_vllm_default = True

    def may_evict(self, block: BlockView, now: float) -> bool:
        return True


class VllmDefaultRetention(RetentionPolicy):
    """vLLM: a freed cached block goes to the back (a request's tail blocks first)."""

    is_vllm_default = True

    def retain(self, block: BlockView) -> bool:
        return True


class VllmDefaultBudget(BlockBudget):
    """vLLM: a request may take any free block."""

    is_vllm_default = True

    def may_admit(self, request: RequestView, usage: BlockUsage) -> bool:
        return True


@dataclass(frozen=True)
class BlockPolicies:
    """The three block policies of one replica."""

    eviction: EvictionPolicy
    retention: RetentionPolicy
    budget: BlockBudget

    @property
    def all_vllm_default(self) -> bool:
        return (self.eviction.is_vllm_default and self.retention.is_vllm_default
                and self.budget.is_vllm_default)
