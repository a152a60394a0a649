"""Policies fail safe: what the adapters do when a replica policy raises.

The adapters (replica/scheduler.py, replica/block_adapter.py) call every policy inside
`try`; on an exception vLLM's own answer stands for that one call (the queue and the
running list keep vLLM's order, a check answers True, a notification is dropped), the
error is counted here per policy (the block snapshot carries the counts to the router's
`blockserve_replica_policy_errors_total` and `/admin/state`), and the first of each
policy is logged with its traceback. The engine keeps serving.
"""

from __future__ import annotations

import traceback

from vllm.logger import init_logger

from blockserve.protocol.snapshot import SCHEDULER_POLICIES

# Under vLLM's logger, so the line lands in the engine's log beside vLLM's own.
logger = init_logger("vllm.blockserve.policies")


class PolicyErrors:
    """Exceptions raised by one scheduler's policies, counted per config field."""

    def __init__(self, names: dict[str, str]):
        """`names`: each field of SCHEDULER_POLICIES -> the class its config chose."""
        self.names = names
        self.counts = dict.fromkeys(SCHEDULER_POLICIES, 0)
        self.first: dict[str, str] = {}  # field -> the first traceback, as text

    def caught(self, field: str, exc: Exception) -> None:
        """Count `exc`, raised by the policy of `field`; log it if it is its first."""
        self.counts[field] += 1
        if field in self.first:
            return
        self.first[field] = "".join(traceback.format_exception(exc))
        logger.error(
            "%s policy %s raised %s; vLLM's own behaviour stands for every call that "
            "raises, and the engine keeps serving (logged once; counted in "
            "blockserve_replica_policy_errors_total{policy=%r}):\n%s",
            field, self.names.get(field, "?"), type(exc).__name__, field, self.first[field])

    @property
    def total(self) -> int:
        return sum(self.counts.values())
