"""The cached-free count the snapshot reports (replica/cached_free.py), kept as blocks move
through vLLM's free queue, equals the walk over the free list after every step: on
vLLM's REAL scheduler and block pool, engine-less, with shared prefixes, evictions and
preemptions, under vLLM's block order and under policies that move cached blocks
(sparing: remove + append; retention: remove + prepend)."""

import random

import pytest
from vllm.v1.core.block_pool import BlockPool

from blockserve.protocol.hints import Hints
from blockserve.replica.cached_free import CachedFreeCount, walk_cached_free
from blockserve.replica.scheduler import BlockAwareScheduler
from blockserve.tools.engine_less import EngineLessReplica

POLICIES = {
    "vllm": {},
    "protect_shared": {"block_eviction": "protect_shared"},
    "s3fifo": {"block_eviction": "s3fifo"},
    "priority retention": {"block_retention": "priority"},
}


@pytest.mark.parametrize("scheduler", POLICIES.values(), ids=POLICIES)
def test_the_kept_count_equals_the_walk_after_every_step(model_dir, scheduler):
    rng = random.Random(7)
    rep = EngineLessReplica(model_dir, BlockAwareScheduler, num_blocks=40, block_size=32,
                            max_num_batched_tokens=512, scheduler=scheduler)
    book, pool = rep.scheduler.book, rep.scheduler.kv_cache_manager.block_pool
    assert book.cached_free.counts
    prefixes = [list(range(1 + 100 * p, 65 + 100 * p)) for p in range(4)]  # 2 blocks each
    seen_cached = preempted = 0
    for i in range(120):
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes) + [rng.randrange(1000, 4000)
                                             for _ in range(rng.randrange(1, 150))]
            rep.add(f"r{i}", prompt, rng.randrange(1, 60),
                    hints=Hints(priority=rng.randrange(0, 2), tenant=rng.choice("ab")))
        if rep.scheduler.has_unfinished_requests():
            record = rep.step()
            preempted += len(record.preempted)
        assert book.cached_free_blocks() == walk_cached_free(pool)
        seen_cached = max(seen_cached, book.cached_free_blocks())
    rep.run_until_idle()
    assert book.cached_free_blocks() == walk_cached_free(pool) > 0
    assert seen_cached > 0 and preempted > 0  # the run moved cached blocks and preempted


def test_a_prefix_cache_reset_is_counted_again(model_dir):
    rep = EngineLessReplica(model_dir, BlockAwareScheduler, num_blocks=12, block_size=32)
    rep.add("a", list(range(1, 130)), 4)
    rep.run_until_idle()
    assert rep.scheduler.book.cached_free_blocks() == 4
    assert rep.scheduler.reset_prefix_cache()
    assert rep.scheduler.book.cached_free_blocks() == 0


def test_a_pool_that_a_kv_connector_also_moves_is_walked():
    pool = BlockPool(8, enable_caching=True, hash_block_size=16)
    count = CachedFreeCount(pool, kv_connector=True)
    assert not count.counts and count() == 0
    pool.free_block_queue.get_all_free_blocks()[0]._block_hash = b"cached"  # as a connector might
    assert count() == 1


def test_a_queue_with_a_method_this_count_does_not_know_is_walked(monkeypatch):
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    monkeypatch.setattr(FreeKVCacheBlockQueue, "popright", lambda self: None, raising=False)
    count = CachedFreeCount(BlockPool(8, enable_caching=True, hash_block_size=16),
                            kv_connector=False)
    assert not count.counts
