"""The admission queue and placement policies as pure code (asyncio, no Ray, no vLLM)."""

import asyncio
import gc
import random
import weakref

import pytest

from blockserve.protocol.queue_orders import FirstComeFirstServed, ShortestDemandFirst
from blockserve.protocol.snapshot import BlockSnapshot
from blockserve.router.admission import AdmissionQueue, DrainForecast
from blockserve.router.cache_placement import CacheAwarePlacement, DynamoCost
from blockserve.router.demand import Demand, Rejected
from blockserve.router.ledger import Ledger
from blockserve.router.placement import (BalancedBlocks, BestFitBlocks, Candidate, LeastKvUsage,
                              MostFreeBlocks, PowerOfTwoChoices, RoundRobin)


def demand(blocks, tenant="default", priority=0, prefix=()):
    # block_size 1 token: blocks == tokens, which keeps the arithmetic readable.
    return Demand(prompt_tokens=blocks, expected_output=0, sequences=1, block_size=1,
                  prefix_hashes=prefix, priority=priority, tenant=tenant)


def make_queue(order=None, placement=None, totals=(100, 100), timeout_s=5.0, max_requests=100):
    ledger = Ledger(reflect_after_s=1e9)  # nothing reflected: reservations count in full
    for i, total in enumerate(totals):
        ledger.report(f"r{i}", BlockSnapshot(timestamp=1.0, total_blocks=total, block_size=1,
                                             free_blocks=total, max_model_len=10_000))
    return AdmissionQueue(ledger, placement or BestFitBlocks(), order or FirstComeFirstServed(),
                          max_requests=max_requests, max_tokens=10_000, timeout_s=timeout_s)


def test_best_fit_packs_and_never_overcommits():
    async def scenario():
        queue = make_queue()
        first = await queue.admit(demand(60))
        second = await queue.admit(demand(30))
        assert second.replica_id == first.replica_id  # best fit: the tighter replica
        third = await queue.admit(demand(60))
        assert third.replica_id != first.replica_id
        waiting = asyncio.ensure_future(queue.admit(demand(50)))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # 10 + 40 free: no replica can hold 50 blocks
        queue.release(first)
        lease = await asyncio.wait_for(waiting, 1)
        assert lease.replica_id == first.replica_id
        for held in (second, third, lease):
            queue.release(held)
        assert queue.ledger.reserved_blocks() == 0

    asyncio.run(scenario())


def test_too_large_is_400_at_once_and_full_queue_is_429_with_retry_after():
    async def scenario():
        queue = make_queue(max_requests=1)
        with pytest.raises(Rejected) as too_large:
            await queue.admit(demand(101))
        assert too_large.value.status == 400
        held = await queue.admit(demand(100))
        await queue.admit(demand(100))  # fills the other replica
        blocked = asyncio.ensure_future(queue.admit(demand(100)))
        await asyncio.sleep(0.01)
        with pytest.raises(Rejected) as full:
            await queue.admit(demand(10))
        assert full.value.status == 429 and full.value.reason == "queue_full"
        assert full.value.retry_after_s >= 1
        queue.release(held)
        await asyncio.wait_for(blocked, 1)

    asyncio.run(scenario())


def test_timeout_is_429_and_leaves_nothing_behind():
    async def scenario():
        queue = make_queue(totals=(10,), timeout_s=0.05)
        held = await queue.admit(demand(10))
        with pytest.raises(Rejected) as timed_out:
            await queue.admit(demand(5))
        assert timed_out.value.status == 429 and timed_out.value.reason == "timeout"
        assert queue.waiting == []
        queue.release(held)
        assert queue.ledger.reserved_blocks() == 0

    asyncio.run(scenario())


def test_cancelled_waiter_frees_its_place_and_any_lease():
    async def scenario():
        queue = make_queue(totals=(10,))
        held = await queue.admit(demand(10))
        waiter = asyncio.ensure_future(queue.admit(demand(10)))
        await asyncio.sleep(0.01)
        waiter.cancel()  # the client disconnected while queued
        await asyncio.gather(waiter, return_exceptions=True)
        assert queue.waiting == []
        queue.release(held)
        assert queue.ledger.reserved_blocks() == 0

    asyncio.run(scenario())


def test_queue_releases_in_policy_order():
    async def scenario():
        queue = make_queue(order=ShortestDemandFirst(max_wait_s=60), totals=(100,))
        held = await queue.admit(demand(100))
        admitted = []

        async def wait(blocks):
            lease = await queue.admit(demand(blocks))
            admitted.append(blocks)
            return lease

        tasks = [asyncio.ensure_future(wait(b)) for b in (50, 10, 30)]
        await asyncio.sleep(0.01)
        queue.release(held)
        leases = await asyncio.wait_for(asyncio.gather(*tasks), 1)
        assert admitted == [10, 30, 50]
        for lease in leases:
            queue.release(lease)

    asyncio.run(scenario())


def test_drain_forecast_is_sane():
    forecast = DrainForecast(half_life_s=1.0)
    for t in range(20):
        forecast.record(10, float(t))  # 10 blocks freed every second
    assert 8 < forecast.rate < 12
    assert forecast.seconds_until(50, fallback_s=60) in (4, 5, 6, 7)
    assert forecast.seconds_until(10_000, fallback_s=60) == 60  # bounded by the timeout
    assert DrainForecast().seconds_until(5, fallback_s=30) == 30  # nothing known yet


CANDIDATES = [Candidate("a", 100, 20, 0, 5, 0.8), Candidate("b", 100, 70, 0, 1, 0.3),
              Candidate("c", 100, 30, 30, 9, 0.6)]


def test_a_prefix_term_joins_any_cost_placement():
    """`prefix_weight` lowers each candidate's cost by its cached prompt blocks, whatever
    the placement's own cost: most_free plus the term is balanced; least_kv follows the
    prefix once the term outweighs its usage gap."""
    d = demand(35)
    assert MostFreeBlocks(prefix_weight=4).choose(d, CANDIDATES) == BalancedBlocks().choose(
        d, CANDIDATES) == "c"
    assert LeastKvUsage().choose(d, CANDIDATES) == "b"
    assert LeastKvUsage(prefix_weight=0.02).choose(d, CANDIDATES) == "c"  # 0.6 - 0.6 < 0.3
    with pytest.raises(ValueError, match="prefix_weight"):
        BestFitBlocks(prefix_weight=-1)


def test_placement_policies():
    d = demand(35)
    assert BestFitBlocks().choose(d, CANDIDATES) == "c"  # prefix credit: needs only 5
    assert MostFreeBlocks().choose(d, CANDIDATES) == "b"
    # b keeps 35 free blocks after the request and c keeps 25, but c holds 30 of its
    # prompt blocks: affinity wins at weight 4, not at weight 0.
    assert BalancedBlocks().choose(d, CANDIDATES) == "c"
    assert BalancedBlocks(prefix_weight=0).choose(d, CANDIDATES) == "b"
    assert BalancedBlocks().choose(demand(90), CANDIDATES) is None
    assert BestFitBlocks().choose(demand(90), CANDIDATES) is None
    assert LeastKvUsage().choose(demand(90), CANDIDATES) == "b"  # baselines always choose
    rr = RoundRobin()
    assert [rr.choose(d, CANDIDATES) for _ in range(4)] == ["a", "b", "c", "a"]
    p2c = PowerOfTwoChoices(seed=1)
    assert {p2c.choose(d, CANDIDATES) for _ in range(50)} == {"a", "b"}  # c never wins a pair
    assert all(p2c.choose(d, CANDIDATES[1:]) == "b" for _ in range(10))  # fewer ongoing


def test_a_released_lease_needs_no_garbage_collector():
    """`admit` leaves no reference cycle (entry -> future -> lease -> entry): a request's
    objects go when its lease is dropped, not at the next collection."""
    async def scenario():
        queue = make_queue()
        lease = await queue.admit(demand(10))
        queue.release(lease)
        gone = weakref.ref(lease)
        gc.disable()
        try:
            del lease
            assert gone() is None
        finally:
            gc.enable()

    asyncio.run(scenario())


def lowest_so_far(placement, d, candidates):
    """CostPlacement's rule as a plain loop: the first of the cheapest admitted,
    ties broken by fewer requests in flight, then the replica id."""
    best, best_cost = None, 0.0
    for c in placement.admits(d, candidates):
        value = placement.cost(d, c) - placement.prefix_weight * c.prefix_credit
        if (best is None or value < best_cost or value == best_cost
                and (c.ongoing, c.replica_id) < (best.ongoing, best.replica_id)):
            best, best_cost = c, value
    return best


@pytest.mark.parametrize("placement", [BestFitBlocks(), MostFreeBlocks(), BalancedBlocks(),
                                       LeastKvUsage(), CacheAwarePlacement(), DynamoCost()],
                         ids=lambda p: type(p).__name__)
def test_cost_placement_picks_what_a_plain_loop_picks(placement):
    """`CostPlacement.pick` finds the cheapest with min/index/count; on candidates full of
    ties (few distinct values) it returns the very Candidate the loop keeps."""
    rng = random.Random(7)
    for _ in range(300):
        candidates = [Candidate(f"r{i}", 100, rng.choice([10, 40, 70]), rng.choice([0, 8]),
                                rng.randrange(3), rng.choice([0.2, 0.5]), rng.choice([0, 30]),
                                rng.choice([0, 5]))
                      for i in rng.sample(range(12), rng.randrange(1, 12))]
        d = demand(rng.randrange(5, 60))
        assert placement.pick(d, candidates) is lowest_so_far(placement, d, candidates)


def test_several_routers_spread_their_picks_over_the_near_cheapest():
    """With `routers` > 1 a cost placement picks at random among that many of the
    cheapest within one request's blocks of the cheapest, never beyond; the queue hands
    its count to a placement switched in later."""
    rng = random.Random(3)
    placement = CacheAwarePlacement()
    placement.rng = random.Random(0)
    for _ in range(200):
        candidates = [Candidate(f"r{i}", 100, 90, 0, rng.randrange(3), rng.random(), 0, 0)
                      for i in range(8)]
        d = demand(rng.randrange(1, 20))
        placement.routers = 1
        alone = placement.pick(d, candidates)
        assert alone is lowest_so_far(placement, d, candidates)
        placement.routers = 3
        values = placement.costs(d, candidates)
        near = sorted(range(8), key=lambda i: (values[i], candidates[i].ongoing,
                                               candidates[i].replica_id))[:3]
        allowed = {candidates[i].replica_id for i in near
                   if values[i] <= min(values) + d.blocks}
        assert placement.pick(d, candidates).replica_id in allowed
    picks = {placement.pick(demand(5), [Candidate(f"r{i}", 100, 90, 0, 0, 0.1, 0, 0)
                                        for i in range(8)]).replica_id for _ in range(50)}
    assert len(picks) == 3  # equal replicas: the three routers' picks differ
    queue = make_queue(placement=CacheAwarePlacement())
    queue.routers = 4
    assert queue.placement.routers == 4
    queue.placement = DynamoCost()
    assert queue.placement.routers == 4
    queue.routers = 0
    assert queue.routers == queue.placement.routers == 1


def test_pick_is_the_chosen_candidate():
    rr = RoundRobin()
    assert [rr.pick(demand(1), CANDIDATES) for _ in range(2)] == CANDIDATES[:2]

    class Stranger(RoundRobin):
        def choose(self, demand, candidates):
            return "z"

    with pytest.raises(ValueError, match="Stranger.choose returned 'z'"):
        Stranger().pick(demand(1), CANDIDATES)


@pytest.mark.parametrize("cancelled_first", [True, False], ids=["cancel-then-grant",
                                                                 "grant-then-cancel"])
def test_lease_granted_as_its_waiter_is_cancelled_is_never_leaked(cancelled_first):
    """The client goes away in the same loop iteration as blocks free up and the queue
    grants its waiter a lease. Whichever the waiter sees first, the lease is released,
    never handed over or counted as taken, and the blocks go to the next request."""
    async def scenario():
        queue = make_queue(totals=(10,))
        taken = []
        queue.on_taken = taken.append
        held = await queue.admit(demand(10))
        waiter = asyncio.ensure_future(queue.admit(demand(10)))
        while not queue.waiting:
            await asyncio.sleep(0)
        if cancelled_first:
            waiter.cancel()
            queue.release(held)  # pump grants the waiter before its task runs again
        else:
            queue.release(held)
            waiter.cancel()
        assert queue.waiting == [] and queue.ledger.reserved_blocks() == 10  # granted
        [outcome] = await asyncio.gather(waiter, return_exceptions=True)
        assert isinstance(outcome, asyncio.CancelledError), outcome
        assert taken == [held]
        assert queue.ledger.reserved_blocks() == 0 and queue.ledger.in_flight() == 0
        # ... and the freed blocks go to the next request at once.
        assert (await asyncio.wait_for(queue.admit(demand(10)), 1)).replica_id == "r0"

    asyncio.run(scenario())


class Client:
    """The part of Starlette's Request the router reads while a request waits: after
    the body, the next ASGI message is the disconnect."""

    def __init__(self):
        self.left = asyncio.Event()

    async def receive(self):
        await self.left.wait()
        return {"type": "http.disconnect"}


def router_admission():
    """Router._admit_while_connected on a queue of one 10-block replica, and the leases
    its waiters took."""
    import types

    from blockserve.router.ingress import Router

    router = types.SimpleNamespace(queue=make_queue(totals=(10,)))
    router._give_back = types.MethodType(Router._give_back, router)
    taken = []
    router.queue.on_taken = taken.append
    return router, types.MethodType(Router._admit_while_connected, router), taken


def test_router_gives_up_the_place_of_a_client_that_left_while_queued():
    """The router does not wait for the ASGI server to cancel a handler whose client
    left before any response: the moment the disconnect arrives its place goes, and the
    blocks go to the next request, not to the departed one."""
    async def scenario():
        router, admit, taken = router_admission()
        held = await router.queue.admit(demand(10))
        client, other = Client(), Client()
        departed = asyncio.ensure_future(admit(client, demand(10)))
        next_one = asyncio.ensure_future(admit(other, demand(10)))
        while len(router.queue.waiting) < 2:
            await asyncio.sleep(0)
        client.left.set()
        assert await asyncio.wait_for(departed, 1) is None
        assert [e.demand.blocks for e in router.queue.waiting] == [10]  # only the other
        router.queue.release(held)
        lease = await asyncio.wait_for(next_one, 1)
        assert taken == [held, lease]
        router.queue.release(lease)
        assert router.queue.ledger.reserved_blocks() == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("left_first", [True, False], ids=["leave-then-grant",
                                                            "grant-then-leave"])
def test_router_neither_admits_nor_counts_a_client_that_left_as_blocks_freed(left_first):
    """The disconnect and the blocks that would admit the departed client arrive in the
    same loop iteration, in either order: its lease is released, not counted as taken,
    and the next request gets the blocks."""
    async def scenario():
        router, admit, taken = router_admission()
        held = await router.queue.admit(demand(10))
        client, other = Client(), Client()
        departed = asyncio.ensure_future(admit(client, demand(10)))
        next_one = asyncio.ensure_future(admit(other, demand(10)))
        while len(router.queue.waiting) < 2:
            await asyncio.sleep(0)
        if left_first:
            client.left.set()
            router.queue.release(held)  # grants the departed client's entry at once
        else:
            router.queue.release(held)
            client.left.set()
        assert await asyncio.wait_for(departed, 1) is None
        lease = await asyncio.wait_for(next_one, 1)
        assert taken == [held, lease]
        router.queue.release(lease)
        assert router.queue.ledger.reserved_blocks() == 0

    asyncio.run(scenario())
