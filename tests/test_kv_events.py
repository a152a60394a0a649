"""The exact prefix index from vLLM's own KV cache events.

The engine-less tests run vLLM's real scheduler, KV cache manager, block pool and ZMQ
event publisher (tools/engine_less.py; no model weights are needed for cache events),
and check the router's index against the block pool's own table of cached hashes.
"""

import asyncio
import random


from blockserve.router.prefix_cache import ExactPrefixIndex

BLOCK = 32


# --- the index alone -----------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_exact_index_answers_from_events_and_pending_dispatches_expire():
    owners, clock = {}, Clock()
    index = ExactPrefixIndex("a", 100, owners, pending_s=2.0, clock=clock)
    index.start()
    index.stored_blocks([1, 2, 3])
    assert index.credit([1, 2, 3, 4]) == 3
    index.removed_blocks([2])  # vLLM evicted the middle block: the chain breaks there
    assert index.credit([1, 2, 3]) == 1 and owners[1] == {"a"} and 2 not in owners
    index.on_dispatched([1, 2, 3, 4])  # dispatched: credited until the events confirm or it expires
    assert index.credit([1, 2, 3, 4]) == 4 and owners[4] == {"a"}
    index.stored_blocks([2])
    clock.now = 3.0
    index.on_dispatched([9])  # expiry runs on the next dispatch
    assert index.credit([1, 2, 3, 4]) == 3 and 4 not in owners
    index.reset()  # AllBlocksCleared
    assert index.credit([1]) == 0 and index.credit([9]) == 0 and owners == {}


def test_exact_index_uses_its_approximate_fallback_until_events_flow():
    owners = {}
    index = ExactPrefixIndex("a", 100, owners)
    index.on_dispatched([5, 6])
    assert index.credit([5, 6, 7]) == 2 and owners[5] == {"a"}
    index.stored_blocks([7])
    index.start()  # the events say only 7 is cached: the guess is withdrawn
    assert index.credit([5, 6]) == 0 and 5 not in owners and owners[7] == {"a"}


# --- against vLLM's real scheduler and publisher -------------------------------------------
def engine_less(model_dir, num_blocks, buffer_steps=10_000):
    from blockserve.replica.scheduler import BlockAwareScheduler

    from blockserve.replica.kv_events import publisher_engine_args
    from blockserve.tools.engine_less import EngineLessReplica

    events = publisher_engine_args({})["kv_events_config"]
    events["buffer_steps"] = buffer_steps
    return EngineLessReplica(model_dir, BlockAwareScheduler, num_blocks=num_blocks, block_size=BLOCK,
                             max_num_seqs=8, kv_events_config=events)


def source_of(replica):
    from blockserve.replica.kv_events import reproducible_seed

    config = replica.scheduler.get_kv_event_publisher_config()
    return {"endpoint": config.endpoint, "replay_endpoint": config.replay_endpoint,
            "topic": config.topic, "hash_algo": "sha256", "seed": reproducible_seed("sha256")}


def cached_in_vllm(replica) -> set:
    """The block pool's own table: what vLLM would hit right now."""
    from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

    table = replica.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block._cache
    return {maybe_convert_block_hash(get_block_hash(key)) for key in table}


def shared_prefix_traffic(replica, n, seed=0, tenants=6, prefix_blocks=6):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 4000) for _ in range(prefix_blocks * BLOCK)]
                for _ in range(tenants)]
    prompts = []
    for i in range(n):
        prompt = rng.choice(prefixes) + [rng.randrange(10, 4000) for _ in range(40)]
        prompts.append(prompt)
        replica.add(f"r{seed}-{i}", prompt, max_tokens=8)
        replica.step()
    replica.run_until_idle()
    return prompts


async def settle(stream, replica, timeout_s=5.0):
    """Wait until the stream applied everything the publisher sent."""
    publisher = replica.scheduler.kv_event_publisher
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        published = publisher._buffer[-1][0] if publisher._buffer else -1
        if publisher._event_queue.empty() and stream.last_seq >= published \
                and stream.index.live:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"stream at {stream.last_seq}, publisher at {published}")


def follow(replica, index):
    from blockserve.router.kv_events import KvEventStream

    stream = KvEventStream("a", source_of(replica), index)
    return stream, asyncio.get_running_loop().create_task(stream.run())


def test_router_hashes_equal_the_hashes_vllm_publishes(model_dir):
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from blockserve.router.kv_events import VllmBlockHasher

    async def run():
        replica = engine_less(model_dir, num_blocks=400)
        index = ExactPrefixIndex("a", 1600, {})
        stream, task = follow(replica, index)
        await asyncio.sleep(0.5)
        prompts = shared_prefix_traffic(replica, 12)
        await settle(stream, replica)
        task.cancel()
        hasher = VllmBlockHasher("sha256", source_of(replica)["seed"])
        for prompt in prompts:
            ours = hasher(prompt, BLOCK)
            assert ours == tuple(maybe_convert_block_hash(h)
                                 for h in replica.block_hashes(prompt))
            assert index.credit(ours) == len(ours)  # all published as stored
        assert index.stored == cached_in_vllm(replica)
        replica.scheduler.shutdown()

    asyncio.run(run())


def test_index_tracks_evictions_and_a_late_subscriber_catches_up(model_dir):
    async def run():
        replica = engine_less(model_dir, num_blocks=40)  # far less than the prefixes
        shared_prefix_traffic(replica, 20, seed=1)  # published before anyone listens
        index = ExactPrefixIndex("a", 160, {})
        stream, task = follow(replica, index)
        await settle(stream, replica)
        assert index.stored == cached_in_vllm(replica) and index.stored
        shared_prefix_traffic(replica, 20, seed=2)  # evicts most of the first prefixes
        await settle(stream, replica)
        assert stream.stats.batches > 0 and stream.stats.lost_batches == 0
        assert index.stored == cached_in_vllm(replica)
        task.cancel()
        replica.scheduler.shutdown()

    asyncio.run(run())


def test_a_sequence_gap_is_replayed_and_a_short_buffer_rebuilds_the_index(model_dir):
    async def run():
        replica = engine_less(model_dir, num_blocks=40, buffer_steps=4)
        index = ExactPrefixIndex("a", 160, {})
        stream, task = follow(replica, index)
        await asyncio.sleep(0.5)
        shared_prefix_traffic(replica, 4, seed=3)
        await settle(stream, replica)
        stream.last_seq -= 2  # as if ZMQ had dropped the last two batches
        index.reset()
        shared_prefix_traffic(replica, 2, seed=4)
        await settle(stream, replica)
        assert stream.stats.gaps == 1 and stream.stats.resyncs == 2
        # the replay buffer (4 batches) still held the two, so nothing was lost
        assert stream.stats.lost_batches == 0
        shared_prefix_traffic(replica, 12, seed=5)  # > 4 batches
        stream.last_seq = 0  # now the gap reaches past the buffer
        index.reset()
        shared_prefix_traffic(replica, 1, seed=6)
        await settle(stream, replica)
        assert stream.stats.lost_batches > 0
        # rebuilt from what the buffer held: only blocks vLLM really caches are credited
        assert index.stored <= cached_in_vllm(replica)
        task.cancel()
        replica.scheduler.shutdown()

    asyncio.run(run())


def test_the_follower_refuses_unmatchable_hashes_and_refollows_a_new_index(model_dir):
    from blockserve.router.kv_events import KvEventFollower

    async def run():
        replica = engine_less(model_dir, num_blocks=40)
        follower = KvEventFollower()
        first, second = ExactPrefixIndex("a", 160, {}), ExactPrefixIndex("a", 160, {})
        # xxhash without PYTHONHASHSEED: vLLM draws a random seed the router cannot know
        assert not follower.follow("x", {**source_of(replica), "seed": None}, first)
        assert follower.settled("x", second)  # refused once: not asked again
        assert follower.follow("a", source_of(replica), first)
        assert follower.settled("a", first) and not follower.settled("a", second)
        assert follower.follow("a", source_of(replica), second)  # the ledger's new entry
        shared_prefix_traffic(replica, 3, seed=7)
        await settle(follower.streams["a"][0], replica)
        assert second.stored == cached_in_vllm(replica) and not first.stored
        follower.retain({"b"})  # "a" left the ledger
        assert follower.streams == {}
        await asyncio.sleep(0)
        replica.scheduler.shutdown()

    asyncio.run(run())


def test_a_publisher_that_starts_over_clears_the_index():
    """A new publisher at the same address numbers its batches from 0 again: what the
    old engine cached is gone, so the index starts from the new stream."""
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    from blockserve.router.kv_events import KvEventStream

    def batch(*hashes):
        return msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[BlockStored(
            block_hashes=list(hashes), parent_block_hash=None, token_ids=[1] * BLOCK,
            block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None)]))

    index = ExactPrefixIndex("a", 160, {})
    index.start()
    stream = KvEventStream("a", {"endpoint": "tcp://127.0.0.1:1"}, index, context=object())
    for seq, hashes in enumerate([(1,), (2,), (3,)]):
        stream._receive(seq, batch(*hashes))
    stream._receive(1, batch(2))  # a duplicate the replay delivered already: skipped
    assert index.stored == {1, 2, 3} and stream.stats.restarts == 0
    stream._receive(0, batch(9))  # the engine behind the address was restarted
    assert index.stored == {9} and stream.stats.restarts == 1 and stream.last_seq == 0
    stream._receive(2, batch(10))  # batch 1 of the new stream is missing: a gap
    assert stream.stats.gaps == 1 and stream._pending_gap == 1 and 10 not in index.stored
