"""The held-prefix lengths the snapshot's `waiting_blocks` keeps (replica/held_prefix.py)
equal the walk over each waiting prompt's block hashes after every step: on vLLM's REAL
scheduler and block pool, engine-less, with shared prefixes held and released, evictions,
preemptions and a prefix-cache reset, under vLLM's block order and policies that move
cached blocks."""

import random

import pytest

from blockserve.protocol.hints import Hints
from blockserve.protocol.policies import AdmissionGate
from blockserve.replica.scheduler import BlockAwareScheduler
from blockserve.tools.engine_less import EngineLessReplica

POLICIES = {
    "vllm": {},
    "protect_shared": {"block_eviction": "protect_shared"},
    "priority retention": {"block_retention": "priority"},
    "reservation gate": {"admission_gate": "reservation"},
}


def walked(book, request) -> int:
    return len(book._held_prefix(request))


def kept(book, request) -> int:
    return book.held_prefixes.length(request)


def assert_kept_equals_walk(scheduler) -> int:
    """Every waiting request's kept length is the walk's; returns how many are held."""
    book, held = scheduler.book, 0
    for request in scheduler.waiting:
        if request.num_computed_tokens:
            continue
        assert kept(book, request) == walked(book, request), request.request_id
        held += walked(book, request) > 0
    assert scheduler.snapshot.waiting_blocks == sum(book.need(r) for r in scheduler.waiting)
    return held


@pytest.mark.parametrize("policies", POLICIES.values(), ids=POLICIES)
def test_kept_lengths_equal_the_walk_after_every_step(model_dir, policies):
    rng = random.Random(4)
    rep = EngineLessReplica(model_dir, BlockAwareScheduler, num_blocks=24, block_size=32,
                            max_num_seqs=16, max_num_batched_tokens=512, scheduler=policies)
    assert rep.scheduler.book.held_prefixes.keeps
    prefixes = [list(range(1 + 100 * p, 97 + 100 * p)) for p in range(4)]  # 3 blocks each
    questions = [[rng.randrange(1000, 4000) for _ in range(rng.randrange(1, 100))]
                 for _ in range(6)]  # repeated questions: whole prompts held, too
    waiting_held = preempted = 0
    for i in range(160):
        if rng.random() < 0.6:
            prompt = rng.choice(prefixes) + rng.choice(questions)
            rep.add(f"r{i}", prompt, rng.randrange(1, 300),
                    hints=Hints(priority=rng.randrange(0, 2), tenant=rng.choice("ab")))
        if rep.scheduler.has_unfinished_requests():
            preempted += len(rep.step().preempted)
        waiting_held += assert_kept_equals_walk(rep.scheduler)
    rep.run_until_idle()
    assert waiting_held > 0  # lengths were kept, and held prefixes came and went
    assert preempted > 0 or "admission_gate" in policies  # the gate admits what fits


class NeverTheWaiter(AdmissionGate):
    """Admits every request but tenant "waiter"'s, which stays waiting, unchanged."""

    def may_admit(self, request, admitted, pool):
        return request.tenant != "waiter"


def test_a_kept_length_follows_free_hit_eviction_and_reset(model_dir):
    """One waiting request that never changes; its prefix's holder frees it (ref_cnt to
    0, still cached), a new request hits it (back above 0), other prompts evict it, a new
    request computes it afresh (new blocks under the same hashes), vLLM's prefix-cache
    reset replaces the hash map. The kept length must follow each change."""
    rep = EngineLessReplica(model_dir, BlockAwareScheduler, num_blocks=24, block_size=32,
                            scheduler={"queue_order": "router_order",
                                       "admission_gate": "tests.test_held_prefix:NeverTheWaiter"})
    sched, seq = rep.scheduler, iter(range(1000))
    book = sched.book

    def add(request_id, prompt, output=20):
        return rep.add(request_id, prompt, output, hints=Hints(admission_seq=next(seq)))

    def drain():
        rep.step()
        while sched.running:
            rep.step()

    prefix = list(range(1, 129))  # 4 blocks
    add("a", prefix + [5])
    rep.step()  # a runs and holds the prefix
    waiter = rep.add("w", prefix + [6] * 33, 2, hints=Hints(tenant="waiter", admission_seq=10**6))
    rep.step()
    assert list(sched.waiting) == [waiter]
    assert kept(book, waiter) == walked(book, waiter) == 4
    drain()  # a finishes: its blocks are free, still cached
    assert kept(book, waiter) == walked(book, waiter) == 0
    add("b", prefix + [8])
    rep.step()  # b hits the cached prefix: held again
    assert kept(book, waiter) == walked(book, waiter) == 4
    drain()
    assert kept(book, waiter) == walked(book, waiter) == 0
    for i in range(3):  # other prompts take every block: the cached prefix is evicted
        add(f"x{i}", [3000 + i] * 730, 2)
        drain()
    assert sched.kv_cache_manager.block_pool.get_cached_block(waiter.block_hashes[0], [0]) \
        is None
    add("c", prefix + [4])
    rep.step()  # c computes the prefix afresh
    assert kept(book, waiter) == walked(book, waiter) == 4
    drain()
    sched.waiting.remove_requests([waiter])  # a reset needs every block free
    assert sched.reset_prefix_cache()
    sched.waiting.add_request(waiter)
    assert kept(book, waiter) == walked(book, waiter) == 0
    add("d", prefix + [2])
    rep.step()
    assert kept(book, waiter) == walked(book, waiter) == 4
    assert sched.snapshot.waiting_blocks == book.need(waiter)
