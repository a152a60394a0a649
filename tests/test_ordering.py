"""Queue orders as pure code: the same classes order the router's and the replicas' queues."""

import random
from dataclasses import dataclass

import pytest

from blockserve.protocol.queue_orders import (FairShare, FirstComeFirstServed, OnTimeFirst, Priority,
                                             ShortestDemandFirst)


@dataclass(eq=False)
class Item:
    seq: int
    arrival: float
    demand_blocks: int
    priority: int = 0
    tenant: str = "default"


def ordered(order, items, now):
    return [i.seq for i in sorted(items, key=lambda i: order.key(i, now))]


def test_fcfs_is_arrival_order_and_leaves_vllm_queues_alone():
    items = [Item(2, 1.0, 1), Item(1, 0.0, 50), Item(3, 2.0, 5)]
    assert ordered(FirstComeFirstServed(), items, now=3.0) == [1, 2, 3]
    assert FirstComeFirstServed.is_arrival_order


def test_shortest_demand_first_with_aging_bound():
    order = ShortestDemandFirst(max_wait_s=10)
    items = [Item(1, 0.0, 30), Item(2, 5.0, 2), Item(3, 6.0, 8)]
    assert ordered(order, items, now=7.0) == [2, 3, 1]
    # Once the big request has waited max_wait_s it goes first: no starvation.
    assert ordered(order, items, now=10.0) == [1, 2, 3]


def test_shortest_demand_first_rejects_nonpositive_bound():
    with pytest.raises(ValueError):
        ShortestDemandFirst(max_wait_s=0)


def test_aging_bounds_starvation_under_a_stream_of_small_requests():
    order, now = ShortestDemandFirst(max_wait_s=5), 0.0
    queue = [Item(0, 0.0, 100)]
    served_big_at = None
    for step in range(1, 100):
        now = float(step)
        queue.append(Item(step, now, 1))  # a small request arrives every second
        head = min(queue, key=lambda i: order.key(i, now))
        queue.remove(head)
        if head.seq == 0:
            served_big_at = now
            break
    assert served_big_at == 5.0


def test_on_time_first_puts_the_late_behind_and_is_arrival_order_without_them():
    order = OnTimeFirst(ttft_s=1.0)
    items = [Item(1, 0.0, 1), Item(2, 0.5, 1), Item(3, 2.0, 1), Item(4, 2.4, 1)]
    assert ordered(order, items, now=0.9) == [1, 2, 3, 4]
    # At 2.5 s the first two have waited past 1 s: the two that can still be on time go first.
    assert ordered(order, items, now=2.5) == [3, 4, 1, 2]
    with pytest.raises(ValueError):
        OnTimeFirst(ttft_s=0)


def test_on_time_first_gives_a_request_that_waited_max_wait_s_its_place_back():
    order = OnTimeFirst(ttft_s=1.0, max_wait_s=3.0)
    items = [Item(1, 0.0, 1), Item(2, 1.0, 1), Item(3, 2.5, 1)]
    assert ordered(order, items, now=2.9) == [3, 1, 2]  # 1 and 2 late, behind 3
    assert ordered(order, items, now=3.0) == [1, 3, 2]  # 1 waited 3 s: first again
    assert ordered(order, items, now=4.2) == [1, 2, 3]  # all late or back: arrival order
    with pytest.raises(ValueError, match="longer than ttft_s"):
        OnTimeFirst(ttft_s=2.0, max_wait_s=2.0)


def test_on_time_first_with_a_late_share_serves_the_late_at_that_pace():
    """Under an overload that keeps on-time requests waiting, `late_share` 0.25 gives
    one admission in four to the oldest late request; without it the late ones wait
    while any request is on time. A queue that never reports admissions (a replica's)
    orders as without it."""
    def serve(order, admissions=40):
        queue = [Item(seq, 0.0, 1) for seq in range(20)]  # late by now = 5
        served, now = [], 5.0
        for seq in range(20, 20 + admissions):
            queue.append(Item(seq, now, 1))  # a new on-time arrival before each admission
            head = order.first(queue, now)
            assert head is min(queue, key=lambda i: order.key(i, now))
            queue.remove(head)
            order.on_admitted(head, now)
            served.append(head.seq < 20)
        return served

    shared = serve(OnTimeFirst(ttft_s=1.0, late_share=0.25))
    assert shared == [False, False, False, True] * 10
    assert not any(serve(OnTimeFirst(ttft_s=1.0)))
    with pytest.raises(ValueError, match="late_share"):
        OnTimeFirst(late_share=1.0)


@pytest.mark.parametrize("order", [FirstComeFirstServed(), OnTimeFirst(ttft_s=1.0),
                                   OnTimeFirst(ttft_s=1.0, max_wait_s=3.0),
                                   OnTimeFirst(ttft_s=1.0, late_share=0.25),
                                   ShortestDemandFirst(max_wait_s=2.0), Priority()],
                         ids=["fcfs", "on_time_first", "on_time_first_max_wait",
                              "on_time_first_late_share", "shortest_demand", "priority"])
def test_first_is_the_smallest_key_of_a_queue_in_arrival_order(order):
    """`first` (what the router's queue asks after every chunk) picks what sorting by
    key would, whether an order overrides it (a binary search) or not."""
    rng = random.Random(7)
    for _ in range(200):
        arrivals = sorted(rng.uniform(0, 10) for _ in range(rng.randint(1, 40)))
        queue = [Item(seq, arrival, rng.randint(1, 20), priority=rng.randint(0, 2))
                 for seq, arrival in enumerate(arrivals)]
        now = rng.uniform(0, 12)
        assert order.first(queue, now) is min(queue, key=lambda i: order.key(i, now))


def test_priority_then_arrival():
    items = [Item(1, 0, 1, priority=5), Item(2, 1, 1, priority=-1), Item(3, 2, 1, priority=5)]
    assert ordered(Priority(), items, now=3) == [2, 1, 3]


def test_fair_share_counts_block_seconds_and_converges():
    """Two tenants with equal backlogs: service alternates so their block-seconds converge."""
    order = FairShare()
    now, used = 0.0, {"heavy": 0.0, "light": 0.0}
    backlog = [Item(i, 0.0, 10 if i % 2 else 2, tenant="heavy" if i % 2 else "light")
               for i in range(1200)]
    running = []
    for _ in range(300):
        now += 1.0
        for item, started in running:
            order.on_finished(item, item.demand_blocks, started, now)
            used[item.tenant] += item.demand_blocks * (now - started)
        running = []
        head = min(backlog, key=lambda i: order.key(i, now))
        backlog.remove(head)
        order.on_admitted(head, now)
        running.append((head, now))
    ratio = used["heavy"] / used["light"]
    assert 0.8 < ratio < 1.25, used  # equal KV block-seconds, not equal request counts
    assert order.usage("heavy", now) == pytest.approx(used["heavy"], rel=0.05)


def test_fair_share_charges_work_in_flight():
    order = FairShare()
    busy, idle = Item(1, 0, 10, tenant="busy"), Item(2, 0, 10, tenant="idle")
    order.on_admitted(busy, now=0.0)
    assert order.usage("busy", now=3.0) == pytest.approx(30.0)
    assert ordered(order, [Item(3, 1, 1, tenant="busy"), Item(4, 2, 1, tenant="idle")], 3.0) \
        == [4, 3]
    order.on_finished(busy, 10, 0.0, 4.0)
    assert order.usage("busy", now=10.0) == pytest.approx(40.0)
    assert order.usage(idle.tenant, now=10.0) == 0.0
