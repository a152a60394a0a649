"""The contract between the router and the replica scheduler: per-request hints.

The router puts these keys into the OpenAI request's `vllm_xargs`; vLLM's serving
layer copies them into `SamplingParams.extra_args`, where the scheduler reads them.
Every hint is optional: a request sent straight to a replica without hints is
scheduled from its own prompt length and `max_tokens`.

| key                              | type | meaning                                         |
|----------------------------------|------|-------------------------------------------------|
| blockserve_demand_blocks         | int  | the request's demand (protocol/blocks.py)       |
| blockserve_expected_output       | int  | output tokens the router expects                |
| blockserve_priority              | int  | lower is more urgent                            |
| blockserve_tenant                | str  | who the request is accounted to (fair share)    |
| blockserve_admission_seq         | int  | the router's admission order                    |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEMAND_BLOCKS = "blockserve_demand_blocks"
EXPECTED_OUTPUT = "blockserve_expected_output"
PRIORITY = "blockserve_priority"
TENANT = "blockserve_tenant"
ADMISSION_SEQ = "blockserve_admission_seq"


@dataclass(frozen=True)
class Hints:
    demand_blocks: int | None = None
    expected_output: int | None = None
    priority: int = 0
    tenant: str = "default"
    admission_seq: int | None = None

    def to_xargs(self) -> dict[str, Any]:
        """The `vllm_xargs` entries for an OpenAI request body."""
        values = {
            DEMAND_BLOCKS: self.demand_blocks,
            EXPECTED_OUTPUT: self.expected_output,
            PRIORITY: self.priority,
            TENANT: self.tenant,
            ADMISSION_SEQ: self.admission_seq,
        }
        return {k: v for k, v in values.items() if v is not None}

    @classmethod
    def from_extra_args(cls, extra: dict[str, Any] | None) -> "Hints":
        extra = extra or {}

        def integer(key: str) -> int | None:
            value = extra.get(key)
            return int(value) if isinstance(value, (int, float)) else None

        return cls(
            demand_blocks=integer(DEMAND_BLOCKS),
            expected_output=integer(EXPECTED_OUTPUT),
            priority=integer(PRIORITY) or 0,
            tenant=str(extra.get(TENANT, "default")),
            admission_seq=integer(ADMISSION_SEQ),
        )
