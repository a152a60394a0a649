"""vLLM's own per-step statistics, kept as running totals beside the block snapshot.

A vLLM stat logger (`AsyncLLM(stat_loggers=[...])`) sees every engine output batch in
the replica process. It keeps vLLM's own view (KV cache usage, prefix-cache queries and
hits, preemptions) so the router can export it next to blockserve's block picture and
tests can check one against the other.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from vllm.v1.metrics.loggers import StatLoggerBase

from blockserve.protocol.snapshot import LATENCY_BUCKETS_S


def _empty_buckets() -> list[int]:
    return [0] * (len(LATENCY_BUCKETS_S) + 1)  # the last one is +Inf


@dataclass
class EngineCounters:
    vllm_kv_cache_usage: float = 0.0
    vllm_prefix_cache_queries_total: int = 0
    vllm_prefix_cache_hits_total: int = 0
    vllm_preemptions_total: int = 0
    # Histograms of vLLM's own per-token latencies: counts per bucket (not cumulative).
    vllm_itl_buckets: list[int] = field(default_factory=_empty_buckets)
    vllm_itl_sum: float = 0.0
    vllm_ttft_buckets: list[int] = field(default_factory=_empty_buckets)
    vllm_ttft_sum: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def observe(self, kind: str, values: list[float]) -> None:
        buckets = getattr(self, f"vllm_{kind}_buckets")
        for value in values:
            buckets[bisect.bisect_left(LATENCY_BUCKETS_S, value)] += 1
        setattr(self, f"vllm_{kind}_sum", getattr(self, f"vllm_{kind}_sum") + sum(values))

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """One engine step's statistics, as vLLM's stat loggers get them."""
        if scheduler_stats is not None:
            self.vllm_kv_cache_usage = scheduler_stats.kv_cache_usage
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:
                self.vllm_prefix_cache_queries_total += prefix.queries
                self.vllm_prefix_cache_hits_total += prefix.hits
        if iteration_stats is not None:
            self.vllm_preemptions_total += iteration_stats.num_preempted_reqs
            self.observe("itl", iteration_stats.inter_token_latencies_iter)
            self.observe("ttft", iteration_stats.time_to_first_tokens_iter)


StepStats = Callable[[Any, Any], None]  # (scheduler_stats, iteration_stats) of one step


class CallbackStatLogger(StatLoggerBase):
    """vLLM's stat logger interface around one function of each step's statistics."""

    def __init__(self, record: StepStats):
        self._record = record

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        self._record(scheduler_stats, iteration_stats)

    def log_engine_initialized(self) -> None:
        pass


def stat_logger_factory(record: StepStats):
    """The factory vLLM calls with (vllm_config, engine_index), e.g. for
    `EngineCounters.record`."""

    def make(vllm_config: Any, engine_index: int = 0) -> CallbackStatLogger:
        return CallbackStatLogger(record)

    return make
