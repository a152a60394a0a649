"""A replica's engine publishes vLLM's KV cache events for the router's exact prefix index.

The engine binds both of vLLM's ZMQ sockets on a port the OS picks (`tcp://*:0`: the
node's IP), so replicas on one host never collide; vLLM hands the bound addresses back
to the engine client at start-up, and `event_source` passes them on with what the
router needs to compute the same block hashes: the hash algorithm and the seed vLLM
derives NONE_HASH from (PYTHONHASHSEED, else vLLM's fixed default for SHA-256). For a
non-cryptographic algorithm without PYTHONHASHSEED vLLM draws a random seed in the
engine process; the source then says `seed: None` and the router keeps its
approximate index for this replica.
"""

from __future__ import annotations

import os
from typing import Any

TOPIC = "kv"
REPLAY_BUFFER_STEPS = 10_000  # engine steps a late or lossy subscriber can replay


def publisher_engine_args(engine_args: dict[str, Any]) -> dict[str, Any]:
    """Engine args with vLLM's ZMQ KV event publisher on."""
    return dict(engine_args, kv_events_config={
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
        "replay_endpoint": "tcp://*:0", "buffer_steps": REPLAY_BUFFER_STEPS,
        "topic": TOPIC})


def reproducible_seed(hash_algo: str) -> str | None:
    """The seed the engine derives NONE_HASH from, when another process can know it."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import _NON_CRYPTO_HASH_FUNCTIONS, resolve_none_hash_seed

    hash_fn = get_hash_fn_by_name(hash_algo)
    if hash_fn in _NON_CRYPTO_HASH_FUNCTIONS and os.getenv("PYTHONHASHSEED") is None:
        return None
    return resolve_none_hash_seed(hash_fn)


def event_source(engine: Any) -> dict[str, Any] | None:
    """Where the router subscribes, and how it hashes; None if the engine publishes none."""
    sources = engine.get_kv_event_sources()
    config = sources.get(0)
    if config is None or not config.enable_kv_cache_events:
        return None
    cache = engine.vllm_config.cache_config
    return {"endpoint": config.endpoint, "replay_endpoint": config.replay_endpoint,
            "topic": config.topic, "block_size": cache.block_size,
            "hash_algo": cache.prefix_caching_hash_algo,
            "seed": reproducible_seed(cache.prefix_caching_hash_algo)}
