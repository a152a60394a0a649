"""vLLM's real v1 scheduler, KV cache manager and block pool, driven without a model.

Each `step()` calls the real `schedule()`, fabricates one sampled token for every
scheduled request whose prefill is complete (none for partial prefill chunks; `sample`
chooses it, random by default: the simulator's sampler plays the model that knows when
an output ends), and feeds it back through the real `update_from_output()`. Block
allocation, prefix caching, preemption and stop conditions are vLLM's own. Used by the
unit tests of the scheduler policies and by the simulator.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from vllm.config import CacheConfig, KVEventsConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from blockserve.protocol.config import ADDITIONAL_CONFIG_KEY
from blockserve.protocol.hints import Hints


@dataclass
class StepRecord:
    scheduled: dict[str, int]
    preempted: list[str]
    finished: list[str] = field(default_factory=list)
    # Per scheduled request, its computed tokens before this step (vLLM's
    # SchedulerOutput: prefix-cache hits and earlier chunks; 0 again after a preemption,
    # less what still hits).
    computed_before: dict[str, int] = field(default_factory=dict)
    # vLLM's own prefix-cache counters for this step (what its metrics add up).
    prefix_queries: int = 0
    prefix_hits: int = 0


class EngineLessReplica:
    """One replica's scheduler with fabricated model outputs."""

    def __init__(self, model_dir: str, scheduler_cls: type, *, num_blocks: int,
                 block_size: int = 32, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 2048, max_model_len: int = 1024,
                 enable_prefix_caching: bool = True, watermark: float = 0.0,
                 scheduler: dict[str, Any] | None = None,
                 seed: int = 0, sample: Callable[[Request], int] | None = None,
                 clock: Callable[[], float] = time.time,
                 kv_events_config: dict[str, Any] | None = None):
        """`clock`: the scheduler's time (its policies and snapshots); the simulator's
        virtual clock, or wall time. `kv_events_config`: vLLM's KV event publisher
        settings (vLLM publishes from `update_from_output`, as in a real engine).
        `watermark`: vLLM's engine argument (the share of blocks kept free of new admissions)."""
        model_config = ModelConfig(model=model_dir, dtype="float32", seed=seed,
                                   max_model_len=max_model_len, skip_tokenizer_init=True)
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, is_encoder_decoder=False,
            enable_chunked_prefill=True, async_scheduling=False,
            **({"watermark": watermark} if watermark else {}))
        cache_config = CacheConfig(block_size=block_size,
                                   enable_prefix_caching=enable_prefix_caching)
        vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                                 cache_config=cache_config,
                                 kv_events_config=(KVEventsConfig(**kv_events_config)
                                                   if kv_events_config else None),
                                 additional_config={ADDITIONAL_CONFIG_KEY: scheduler or {}})
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(
                ["model.layers.0.self_attn.attn"],
                FullAttentionSpec(block_size=block_size, num_kv_heads=4, head_size=32,
                                  dtype=torch.float32))])
        self.scheduler = scheduler_cls(
            vllm_config=vllm_config, kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size, hash_block_size=block_size, log_stats=True, clock=clock)
        self._clock = clock
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(block_size, hash_fn)
        self._rng = random.Random(seed)
        self._sample = sample or (lambda request: self._rng.randrange(1, 4000))
        self.requests: dict[str, Request] = {}

    def add(self, request_id: str, prompt: list[int], max_tokens: int,
            hints: Hints | None = None, arrival: float | None = None,
            **sampling: Any) -> Request:
        """`sampling`: more SamplingParams fields, as a request body carries them."""
        params = SamplingParams(max_tokens=max_tokens, **{"ignore_eos": True, **sampling},
                                extra_args=hints.to_xargs() if hints else None)
        request = Request(request_id, prompt, params, None,
                          arrival_time=self._clock() if arrival is None else arrival,
                          block_hasher=self._hasher)
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def step(self) -> StepRecord:
        output = self.scheduler.schedule()
        req_ids = list(output.num_scheduled_tokens)
        sampled = [[] if self.scheduler.requests[r].is_prefill_chunk
                   else [self._sample(self.scheduler.requests[r])] for r in req_ids]
        runner_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled)
        engine_outputs = self.scheduler.update_from_output(output, runner_output)
        finished = [o.request_id for outs in engine_outputs.values() for o in outs.outputs
                    if o.finish_reason is not None]
        cached = output.scheduled_cached_reqs
        computed_before = dict(zip(cached.req_ids, cached.num_computed_tokens))
        computed_before.update((new.req_id, new.num_computed_tokens)
                               for new in output.scheduled_new_reqs)
        record = StepRecord(dict(output.num_scheduled_tokens),
                            sorted(output.preempted_req_ids or ()), finished, computed_before)
        for outs in engine_outputs.values():
            stats = outs.scheduler_stats and outs.scheduler_stats.prefix_cache_stats
            if stats:
                record.prefix_queries += stats.queries
                record.prefix_hits += stats.hits
        return record

    def forget(self, request_id: str) -> None:
        """Drop a finished request's record (kept until then for its output tokens), so
        that a long simulation holds only the requests in flight."""
        del self.requests[request_id]

    def block_hashes(self, prompt: list[int]) -> list[bytes]:
        """vLLM's prefix hashes of a prompt's full blocks, as its requests get them."""
        return list(Request("block-hashes", prompt, SamplingParams(max_tokens=1), None,
                            block_hasher=self._hasher).block_hashes)

    def run_until_idle(self, max_steps: int = 100_000) -> list[StepRecord]:
        records = []
        while self.scheduler.has_unfinished_requests():
            if len(records) >= max_steps:
                raise RuntimeError("engine-less replica did not drain")
            records.append(self.step())
        return records
