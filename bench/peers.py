"""Code that runs inside Ray Serve LLM when the policy benchmark deploys it as a peer
(bench/targets.py). Ray workers import it, so `bench` is an installed package."""

from __future__ import annotations

import os

from ray import serve
# Ray 2.60 exports no public path for the callback base class of LLMConfig.callback_config.
from ray.llm._internal.common.callbacks.base import CallbackBase


class BindOmpThreadsByRank(CallbackBase):
    """One VLLM_CPU_OMP_THREADS_BIND value per replica rank (cycled), as blockserve's
    replicas get from `omp_threads_bind`: all Ray Serve LLM replicas share one
    runtime_env, so the rank must choose at start-up, before the engine starts."""

    async def on_before_node_init(self) -> None:
        binds = self.kwargs["binds"]
        rank = serve.get_replica_context().rank.rank
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binds[rank % len(binds)]
