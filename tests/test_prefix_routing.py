"""Cache-aware placement (router/cache_placement.py) and the ledger's prefix bookkeeping."""

import json

import pytest

from blockserve.protocol.snapshot import BlockSnapshot
from blockserve.router.cache_placement import CacheAwarePlacement, DynamoCost
from blockserve.router.demand import Demand
from blockserve.router.ledger import Ledger
from blockserve.router.placement import Candidate
from blockserve.router.prefix_cache import ExactPrefixIndex

BLOCK = 32


def demand(prompt_blocks=10, output_tokens=64):
    return Demand(prompt_blocks * BLOCK, output_tokens, 1, BLOCK)


def replica(rid, credit=0, usage=0.0, cached=0, prefill=0, available=100, total=160, ongoing=0):
    return Candidate(rid, total, available, credit, ongoing, usage, cached, prefill)


def test_prefix_credit_wins_between_equally_loaded_replicas():
    placement = CacheAwarePlacement()
    assert placement.choose(demand(), [replica("a"), replica("b", credit=8)]) == "b"
    assert DynamoCost().choose(demand(), [replica("a"), replica("b", credit=8)]) == "b"


def test_a_hot_prefix_spreads_once_its_replica_is_saturated():
    placement, request = CacheAwarePlacement(), demand(prompt_blocks=10)
    holder = dict(credit=10)
    # a little queued work on the holder: the saved prefill is worth more
    assert placement.choose(request, [replica("hot", **holder, prefill=5, usage=0.1),
                                      replica("cold", usage=0.1)]) == "hot"
    # queued prefill beyond what the prefix saves: it spreads
    assert placement.choose(request, [replica("hot", **holder, prefill=30, usage=0.1),
                                      replica("cold", usage=0.1)]) == "cold"
    # active blocks are no cost by default (decoding costs the same on any replica) ...
    busy_holder = [replica("hot", **holder, usage=0.3), replica("cold", usage=0.1)]
    assert placement.choose(request, busy_holder) == "hot"
    # ... and where they weigh, active blocks beyond the saving spread it too
    assert CacheAwarePlacement(decode_weight=1).choose(request, busy_holder) == "cold"


def test_the_placement_that_evicts_no_useful_cache_is_preferred():
    request = demand(prompt_blocks=10)
    full_of_cache = replica("a", usage=0.25, cached=120)  # 0 empty: evicts 10 cached
    has_room = replica("b", usage=0.25, cached=0)
    assert CacheAwarePlacement().choose(request, [full_of_cache, has_room]) == "b"
    # Dynamo's cost has no eviction term: a tie, broken by the replica id
    assert DynamoCost().choose(request, [full_of_cache, has_room]) == "a"


def test_only_replicas_with_room_are_chosen_unlike_dynamo():
    request = demand(prompt_blocks=10)
    full = [replica("a", available=5, usage=0.95), replica("b", available=3, usage=0.95)]
    assert CacheAwarePlacement().choose(request, full) is None
    assert DynamoCost().choose(request, full) == "a"  # it always picks one
    # credit lowers what the request needs: the holder fits
    assert CacheAwarePlacement().choose(request, [replica("a", available=5, credit=10),
                                                  replica("b", available=3)]) == "a"


def test_free_blocks_take_what_fits_no_prediction_if_its_prompt_fits_beyond_the_queued():
    request = demand(prompt_blocks=10)  # 12 blocks with its predicted output
    placement = CacheAwarePlacement()
    # predicted peaks fill both (80 blocks free); a already has 75 prompt blocks queued
    assert placement.choose(request, [replica("a", available=5, prefill=75, usage=0.5),
                                      replica("b", available=5, prefill=60, usage=0.5)]) == "b"
    # ... not when the prompt does not fit the free blocks: vLLM would not start it
    assert placement.choose(request, [replica("b", available=5, usage=0.95)]) is None
    assert CacheAwarePlacement(fill_idle=False).choose(
        request, [replica("b", available=5, usage=0.5)]) is None
    # a replica the prediction fits is still preferred to free blocks elsewhere
    assert placement.choose(request, [replica("a", available=20, usage=0.5),
                                      replica("b", available=5, usage=0.1)]) == "a"


def test_a_replica_with_enough_prefill_queued_takes_no_more_so_the_request_waits_here():
    request = demand(prompt_blocks=10)
    placement = CacheAwarePlacement(max_queued_prefill_tokens=20 * BLOCK)
    # 20 blocks queued is at the limit: still taken; 21 is over it
    assert placement.choose(request, [replica("a", prefill=20)]) == "a"
    assert placement.choose(request, [replica("a", prefill=21)]) is None
    # it never sends the request to the busier replica, however cheap the cache there
    assert placement.choose(request, [replica("a", prefill=21, credit=10),
                                      replica("b", prefill=15)]) == "b"
    assert CacheAwarePlacement().choose(request, [replica("a", prefill=21)]) == "a"
    with pytest.raises(ValueError, match="max_queued_prefill_tokens"):
        CacheAwarePlacement(max_queued_prefill_tokens=-1)


def snapshot(total=160, cached=0, held=0, t=1.0):
    return BlockSnapshot(step=1, timestamp=t, total_blocks=total, block_size=BLOCK,
                         free_blocks=total - held, cached_blocks=cached, held_blocks=held)


def test_the_ledger_counts_queued_prefill_until_the_first_token_and_records_the_prediction():
    ledger = Ledger(clock=lambda: 1.0)
    ledger.report("a", snapshot(cached=40))
    hashes = (11, 12, 13, 14)
    first = ledger.reserve("a", 6, hashes)
    assert (first.prefill_blocks, first.predicted_hit_blocks) == (4, 0)
    second = ledger.reserve("a", 6, hashes)  # the approximate index credits the first
    assert (second.prefill_blocks, second.predicted_hit_blocks) == (0, 4)
    [view] = ledger.candidates(hashes)
    assert (view.prefill_blocks, view.cached_blocks, view.prefix_credit) == (4, 40, 4)
    ledger.acknowledge(first)
    assert ledger.candidates(hashes)[0].prefill_blocks == 0
    ledger.release(first)
    ledger.release(second)
    assert ledger.replicas["a"].prefill_blocks == 0



def test_the_ledger_builds_the_prefix_index_it_is_given():
    ledger = Ledger(clock=lambda: 1.0, prefix_index=ExactPrefixIndex)
    ledger.report("a", snapshot())
    ledger.report("b", snapshot())
    index_a = ledger.replicas["a"].prefix
    assert isinstance(index_a, ExactPrefixIndex)
    index_a.start()
    index_a.stored_blocks([21, 22])
    views = {v.replica_id: v.prefix_credit for v in ledger.candidates((21, 22, 23))}
    assert views == {"a": 2, "b": 0}
    index_a.removed_blocks([21])  # vLLM evicted it: no credit, unlike the guess
    assert {v.replica_id: v.prefix_credit for v in ledger.candidates((21, 22))} == \
        {"a": 0, "b": 0}


def test_regret_compares_like_with_like():
    from blockserve.router.regret import predicted_hit_tokens, reported_hit

    # vLLM computes a prompt's last token: 4 full blocks cached report 3 blocks of hits
    assert predicted_hit_tokens(4, 4 * BLOCK, BLOCK) == 3 * BLOCK
    assert predicted_hit_tokens(4, 4 * BLOCK + 5, BLOCK) == 4 * BLOCK
    assert predicted_hit_tokens(9, 2 * BLOCK + 1, BLOCK) == 2 * BLOCK
    usage = {"prompt_tokens": 70, "completion_tokens": 3,
             "prompt_tokens_details": {"cached_tokens": 64}}
    stream = ('data: {"id":"x","choices":[{"text":"a"}]}\n\n'
              f'data: {{"id":"x","choices":[],"usage":{json.dumps(usage, separators=(",", ":"))}}}'
              '\n\ndata: [DONE]\n\n')
    assert reported_hit(stream) == (70, 64)
    assert reported_hit({"usage": usage}) == (70, 64)
    assert reported_hit('data: {"choices":[{"text":"a"}]}\n\n') is None
    assert reported_hit({"usage": {"prompt_tokens": 70}}) is None  # details off


def test_the_exact_index_needs_replicas_that_publish_kv_events():
    """The default (the exact index) is valid on its own: replicas publish KV events by
    default; a config that turns them off must choose the approximate index."""
    from blockserve.protocol.config import parse_app_config

    args = {"replica": {"model": "m", "publish_kv_events": False}}
    with pytest.raises(ValueError, match="publish_kv_events"):
        parse_app_config(args)
    assert parse_app_config({**args, "router": {"prefix_index": "approximate"}})
    config = parse_app_config({"replica": {"model": "m"}})
    assert config.router.prefix_index.cls == "exact" and config.replica.publish_kv_events


def test_the_simulated_cluster_routes_on_the_same_event_stream(model_dir):
    """bench/simulated_cluster.py with the exact index: each replica's index ends equal
    to its block pool's cached hashes, and routing on it gets more prefix hits than
    power of two on a cache-bound tenant workload."""
    import asyncio
    import dataclasses

    from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

    from blockserve.bench.cache_bound import tenants
    from blockserve.bench.simulated_cluster import SimulatedCluster
    from blockserve.bench.step_time import PRESETS
    from blockserve.tools.launch import EngineShape

    shape = dataclasses.replace(EngineShape.of(), model=model_dir)
    specs = tenants(n=120, rate=12.0, seed=3)

    def run(placement, prefix_index):
        cluster = SimulatedCluster(2, shape, placement=placement, queue_order="fcfs",
                                   scheduler={}, step_time=PRESETS["cpu-tiny"],
                                   prefix_index=prefix_index)
        asyncio.run(cluster.run(specs))
        return cluster

    exact = run("cache_aware", "exact")
    for replica_id, replica in exact.replicas.items():
        table = replica.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block._cache
        assert exact.routers[0].ledger.replicas[replica_id].prefix.stored == \
            {maybe_convert_block_hash(get_block_hash(key)) for key in table}

    baseline = run("power_of_two", "approximate")
    rate = {name: c.prefix_hits / c.prefix_queries for name, c in
            (("exact", exact), ("power of two", baseline))}
    assert rate["exact"] > rate["power of two"], rate
