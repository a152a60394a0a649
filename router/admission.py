"""The central admission queue: which waiting request is admitted next, and where.

Requests wait here, in the order of a `QueueOrder`, until the placement policy finds a
replica whose ledger has room for them; admission reserves the blocks in the ledger.
The queue is bounded (requests and tokens). A request that arrives to a full queue, or
waits past its timeout, is rejected with 429 and a Retry-After forecast of when blocks
free up; one that can never fit any replica is rejected with 400 at once.

Everything runs on the router's event loop; `pump()` is synchronous and cheap, called
whenever something changes (arrival, release, snapshot, replica set).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable

from blockserve.protocol.policies import QueueOrder
from blockserve.router.demand import Demand, Rejected
from blockserve.router.ledger import Ledger, Reservation
from blockserve.protocol.router_policies import Candidate, CostPlacement, Placement


@dataclass(eq=False)
class Queued:
    """A request waiting for admission (the `Waiting` shape queue orders read)."""

    seq: int
    arrival: float
    demand: Demand
    future: asyncio.Future | None  # None once `admit` took its lease
    admitted_at: float = 0.0
    key: Hashable = None  # the caller's name for the request (`enqueue`)

    @property
    def demand_blocks(self) -> int:
        return self.demand.blocks

    @property
    def priority(self) -> int:
        return self.demand.priority

    @property
    def tenant(self) -> str:
        return self.demand.tenant


@dataclass(eq=False)
class Lease:
    """An admitted request's hold on a replica's blocks; release it exactly once."""

    entry: Queued
    reservation: Reservation
    queue_wait_s: float
    chosen: Candidate  # the replica as placement saw it (`Placement.on_outcome`)

    @property
    def replica_id(self) -> str:
        return self.reservation.replica_id

    @property
    def seq(self) -> int:
        """The admission number the replica hears (`AdmissionSequence`)."""
        return self.reservation.seq


class AdmissionSequence:
    """Admission numbers that several routers hand out without talking to each other:
    the clock in microseconds, strictly increasing within a router. A replica orders by
    them and reports the highest it received (the ledger's reflection), so they must
    compare across routers, and a router that restarts must not count again from 1
    below what the replica has seen: its new reservations would look received at once."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._last = 0

    def next(self) -> int:
        self._last = max(self._last + 1, int(self.clock() * 1_000_000))
        return self._last


# The drain rate's half-life: long enough to smooth the bursts in which requests end,
# short enough that Retry-After follows a change of load within tens of seconds.
DRAIN_HALF_LIFE_S = 10.0
# Releases in the same instant count as a rate over this interval, not a division by 0.
MIN_RELEASE_INTERVAL_S = 1e-3
# Retry-After is whole seconds (RFC 9110); 0 would tell a client to retry at once.
MIN_RETRY_AFTER_S = 1


@dataclass
class DrainForecast:
    """EWMA of blocks released per second, to forecast when `blocks` will be free."""

    half_life_s: float = DRAIN_HALF_LIFE_S
    rate: float = 0.0
    _last: float | None = field(default=None, repr=False)

    def record(self, blocks: int, now: float) -> None:
        if self._last is None:
            self._last = now
            return
        elapsed = max(now - self._last, MIN_RELEASE_INTERVAL_S)
        weight = 1 - 0.5 ** (elapsed / self.half_life_s)
        self.rate += weight * (blocks / elapsed - self.rate)
        self._last = now

    def seconds_until(self, blocks: int, fallback_s: float) -> int:
        if blocks <= 0:
            return MIN_RETRY_AFTER_S
        seconds = blocks / self.rate if self.rate > 0 else fallback_s
        return int(min(max(MIN_RETRY_AFTER_S, math.ceil(seconds)),
                       max(MIN_RETRY_AFTER_S, math.ceil(fallback_s))))


class AdmissionQueue:
    def __init__(self, ledger: Ledger, placement: Placement, order: QueueOrder, *,
                 max_requests: int, max_tokens: int, timeout_s: float,
                 clock: Callable[[], float] = time.time):
        self.ledger = ledger
        self._routers = 1
        self.placement = placement
        self.order = order
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.clock = clock
        self.waiting: list[Queued] = []
        self.forecast = DrainForecast()
        self._seq = itertools.count(1)  # arrival order, for the queue's own order
        self.admissions = AdmissionSequence(clock)
        # on_admit: a lease granted (`pump`); on_taken: a lease that its waiter in `admit`
        # took (not one granted as the waiter gave up: that one is released at once).
        self.on_admit: Callable[[Lease], None] = lambda lease: None
        self.on_taken: Callable[[Lease], None] = lambda lease: None
        self.on_reject: Callable[[Rejected], None] = lambda rejection: None

    # --- the request's side -------------------------------------------------------------
    async def admit(self, demand: Demand, timeout_s: float | None = None,
                    abandoned: Callable[[], bool] = lambda: False) -> Lease:
        """Wait for a reservation (at most `timeout_s`, default the queue's timeout);
        raises `Rejected`. Cancelling the caller frees it. A lease granted just as the
        caller gives up (cancelled, or `abandoned()` says its client left) is released
        and the caller cancelled, never handed over: `on_taken` counts what was taken."""
        entry = self.enqueue(demand)
        if not entry.future.done():  # not admitted at once: wait, with a timer
            try:
                await asyncio.wait_for(asyncio.shield(entry.future),
                                       self.timeout_s if timeout_s is None else timeout_s)
            except asyncio.TimeoutError:
                self.withdraw(entry)
                raise self.timed_out(demand) from None
            except BaseException:  # the caller was cancelled: its client went away
                self.withdraw(entry)
                raise
        # The waiter takes the future from its entry: left there, the entry (which the
        # lease keeps) would hold the future that holds the lease, a reference cycle that
        # only the garbage collector frees, one per request.
        future, entry.future = entry.future, None
        lease = future.result()
        # Python 3.11's wait_for returns a result that arrived with its cancellation.
        if abandoned() or asyncio.current_task(future.get_loop()).cancelling():
            self.release(lease)
            raise asyncio.CancelledError
        self.on_taken(lease)
        return lease

    def enqueue(self, demand: Demand, key: Hashable = None) -> Queued:
        """Queue a request (admitted at once if it fits); its future resolves to a Lease.
        `key` names it in the entry (`on_admit` may run before this returns)."""
        self._check_can_ever_fit(demand)
        if (len(self.waiting) >= self.max_requests
                or self.queued_tokens() + demand.tokens > self.max_tokens):
            raise self._reject(429, "queue_full", "The admission queue is full.", demand)
        entry = Queued(next(self._seq), self.clock(), demand,
                       asyncio.get_running_loop().create_future(), key=key)
        self.waiting.append(entry)
        self.pump()
        return entry

    def withdraw(self, entry: Queued) -> None:
        """The waiter gave up (timeout, disconnect): drop it, or free what it was given."""
        if entry in self.waiting:
            self.waiting.remove(entry)
        elif entry.future.done() and not entry.future.cancelled():
            self.release(entry.future.result())

    def expire(self) -> list[Queued]:
        """Withdraw and return the entries that have waited past the timeout, for a
        caller that keeps no timer per request (the simulator, in virtual time)."""
        oldest = self.clock() - self.timeout_s
        # `waiting` is in arrival order, whatever order admits from it.
        expired = list(itertools.takewhile(lambda e: e.arrival < oldest, self.waiting))
        for entry in expired:
            self.withdraw(entry)
        return expired

    def timed_out(self, demand: Demand) -> Rejected:
        return self._reject(429, "timeout", f"No replica had room for this request "
                            f"within {self.timeout_s:g}s.", demand)

    def release(self, lease: Lease) -> None:
        if not self.ledger.release(lease.reservation):
            return
        now = self.clock()
        self.forecast.record(lease.reservation.blocks, now)
        self.order.on_finished(lease.entry, lease.reservation.blocks, lease.entry.admitted_at,
                               now)
        self.pump()

    @property
    def placement(self) -> Placement:
        return self._placement

    @placement.setter
    def placement(self, placement: Placement) -> None:
        """A placement switched in keeps the count of routers (`routers`)."""
        self._placement = placement
        if isinstance(placement, CostPlacement):
            placement.routers = self._routers

    @property
    def routers(self) -> int:
        """How many routers place on the same replicas (router/peers.py counts them):
        a cost placement spreads its picks over that many (`CostPlacement`)."""
        return self._routers

    @routers.setter
    def routers(self, routers: int) -> None:
        self._routers = max(1, routers)
        self.placement = self._placement

    # --- the router's side --------------------------------------------------------------
    def pump(self) -> None:
        """Admit waiting requests in policy order while the head finds a replica."""
        while self.waiting:
            now = self.clock()
            head = self.order.first(self.waiting, now)
            chosen = self.placement.pick(head.demand, self.candidates(head.demand))
            if chosen is None:
                return
            self.waiting.remove(head)
            head.admitted_at = now
            reservation = self.ledger.reserve(chosen.replica_id, head.demand.blocks,
                                              head.demand.prefix_hashes,
                                              self.admissions.next())
            lease = Lease(head, reservation, now - head.arrival, chosen)
            self.order.on_admitted(head, now)
            head.future.set_result(lease)
            self.on_admit(lease)

    def candidates(self, demand: Demand) -> list[Candidate]:
        return self.ledger.candidates(demand.prefix_hashes)

    def queued_tokens(self) -> int:
        return sum(e.demand.tokens for e in self.waiting)

    def queued_blocks(self) -> int:
        return sum(e.demand.blocks for e in self.waiting)

    # --- internals ----------------------------------------------------------------------
    def _check_can_ever_fit(self, demand: Demand) -> None:
        largest = self.ledger.largest_capacity()
        if largest and demand.blocks > largest:
            raise self._reject(400, "too_large", f"The request needs {demand.blocks} KV blocks "
                               f"but the largest replica has {largest}.", None)

    def _reject(self, status: int, reason: str, message: str, demand: Demand | None) -> Rejected:
        retry_after = None
        if status == 429:
            free_now = max((c.available_blocks for c in self.candidates(demand)), default=0) \
                if demand else 0
            short = self.queued_blocks() + (demand.blocks if demand else 0) - free_now
            retry_after = self.forecast.seconds_until(short, self.timeout_s)
        rejection = Rejected(status, reason, message, retry_after)
        self.on_reject(rejection)
        return rejection
