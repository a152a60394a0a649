"""Built-in queue orders: which waiting request goes next (protocol/policies.py's
`QueueOrder`). The router's admission queue and the waiting queue of the vLLM scheduler
in each replica use the same classes, so they live here, where a replica's EngineCore
can import them without the router's code.

Write a new order in a few lines::

    class LongestPromptFirst(QueueOrder):
        def key(self, item, now):
            return (-item.demand_blocks, item.seq)

and name it by import path in the config (`queue_order: mymodule:LongestPromptFirst`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from operator import attrgetter
from typing import Any, Sequence

from blockserve.protocol.policies import QueueOrder, Waiting


_arrival = attrgetter("arrival")


class FirstComeFirstServed(QueueOrder):
    """`fcfs`: arrival order, vLLM's own; neither queue sorts."""

    is_arrival_order = True

    def key(self, item: Waiting, now: float) -> Any:
        return item.seq

    def first(self, waiting: Sequence[Waiting], now: float) -> Waiting:
        return waiting[0]


class ShortestDemandFirst(QueueOrder):
    """`shortest_demand`: fewest KV blocks first; anything that waited `max_wait_s`
    jumps ahead (no starvation)."""

    def __init__(self, max_wait_s: float = 10.0):
        if max_wait_s <= 0:
            raise ValueError("max_wait_s must be positive")
        self.max_wait_s = max_wait_s

    def key(self, item: Waiting, now: float) -> Any:
        starving = now - item.arrival >= self.max_wait_s
        # Starving items go first, oldest first; the rest by demand.
        return (0, item.seq) if starving else (1, item.demand_blocks, item.seq)


class Priority(QueueOrder):
    """`priority`: lower `priority` value first, arrival order within a priority."""

    def key(self, item: Waiting, now: float) -> Any:
        return (item.priority, item.seq)


class OnTimeFirst(QueueOrder):
    """`on_time_first`: the requests that have waited less than `ttft_s` first, then those
    already past it, each in arrival order; with `max_wait_s`, a request that has waited
    that long gets its arrival-order place back (ahead of the on-time ones); with
    `late_share`, at least that share of the admissions made while some are late goes to
    the oldest late one.

    Once an overloaded queue is longer than `ttft_s`, arrival order makes every request
    late; this one keeps serving the requests that can still be on time, and the late ones
    wait longer (a queue's timeout still ends the wait). Without a queue that long, it is
    arrival order. `max_wait_s` bounds how much longer: under a burst the late ones are
    served as they reach it, under overload that lasts they are served in arrival order,
    as by `fcfs`, and with them the tail of the waits. `late_share` lets the late ones
    move at that share of the pace however long the overload, and the on-time ones keep
    the rest. It counts admissions (`on_admitted`), which only the router's queue reports:
    in a replica's queue it changes nothing. `ttft_s` is the TTFT the service promises; a
    replica counts the wait from its own arrival, which leaves out the router's queue."""

    def __init__(self, ttft_s: float = 1.0, max_wait_s: float | None = None,
                 late_share: float = 0.0):
        if ttft_s <= 0:
            raise ValueError("ttft_s must be positive")
        if max_wait_s is not None and max_wait_s <= ttft_s:
            raise ValueError("max_wait_s must be longer than ttft_s")
        if not 0 <= late_share < 1:
            raise ValueError("late_share must be at least 0 and below 1")
        self.ttft_s = ttft_s
        self.max_wait_s = max_wait_s
        self.late_share = late_share
        # Admissions owed to the late ones: each on-time admission made while some were
        # late adds late_share / (1 - late_share); at 1 the oldest late one is next.
        self._owed_late = 0.0
        self._late_waiting = False

    def key(self, item: Waiting, now: float) -> Any:
        waited = now - item.arrival
        late = waited >= self.ttft_s and (self.max_wait_s is None or waited < self.max_wait_s)
        return (late and self._owed_late < 1, item.seq)

    def first(self, waiting: Sequence[Waiting], now: float) -> Waiting:
        # In arrival order, a request that waited max_wait_s is at the head, the late
        # ones follow, and those still on time are the tail: a binary search finds the
        # first of them.
        if self.max_wait_s is not None and waiting[0].arrival <= now - self.max_wait_s:
            return waiting[0]
        on_time = bisect_right(waiting, now - self.ttft_s, key=_arrival)
        self._late_waiting = on_time > 0
        if on_time < len(waiting) and self._owed_late < 1:
            return waiting[on_time]
        return waiting[0]

    def on_admitted(self, item: Waiting, now: float) -> None:
        if not self.late_share:
            return
        if now - item.arrival >= self.ttft_s:
            self._owed_late = max(0.0, self._owed_late - 1)
        elif self._late_waiting:
            self._owed_late += self.late_share / (1 - self.late_share)


class RouterOrder(QueueOrder):
    """`router_order`, replica side only: the order in which the central router admitted
    (its sequence hint)."""

    def key(self, item: Waiting, now: float) -> Any:
        return (item.seq, item.arrival)


class FairShare(QueueOrder):
    """`fair_share`: the tenant that has consumed the fewest KV block-seconds goes first.

    Usage counts finished requests (blocks x seconds held) and the block-seconds that
    admitted requests have accrued so far, so a tenant with long-running work in flight
    is charged for it before it finishes. `decay_s` forgets old usage (0 keeps it all).
    """

    def __init__(self, decay_s: float = 0.0):
        self.decay_s = decay_s
        self._used: dict[str, float] = defaultdict(float)
        self._decayed_at = 0.0
        self._active: dict[int, tuple[str, int, float]] = {}  # id(item) -> tenant, blocks, start

    def usage(self, tenant: str, now: float) -> float:
        self._decay(now)
        accrued = sum(blocks * (now - start) for t, blocks, start in self._active.values()
                      if t == tenant)
        return self._used[tenant] + accrued

    def key(self, item: Waiting, now: float) -> Any:
        return (self.usage(item.tenant, now), item.seq)

    def on_admitted(self, item: Waiting, now: float) -> None:
        self._active[id(item)] = (item.tenant, item.demand_blocks, now)

    def on_finished(self, item: Waiting, held_blocks: int, started: float, now: float) -> None:
        self._active.pop(id(item), None)
        self._decay(now)
        self._used[item.tenant] += held_blocks * max(0.0, now - started)

    def _decay(self, now: float) -> None:
        if self.decay_s <= 0 or now <= self._decayed_at:
            return
        factor = 0.5 ** ((now - self._decayed_at) / self.decay_s)
        for tenant in self._used:
            self._used[tenant] *= factor
        self._decayed_at = now
