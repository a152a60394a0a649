"""The router's block ledger: what each replica reported, plus reservations in flight.

A replica's free blocks for routing = its total blocks - what its last snapshot says
is committed (held + reserved growth + engine-side waiting demand) - the reservations
the router dispatched that the snapshot cannot reflect yet. A reservation counts as
"in flight" until the replica has visibly received it: its first response chunk came
back, or a snapshot taken `reflect_after_s` after the dispatch arrived. Every
reservation is released exactly once (completion, error, disconnect, dead replica).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable

from replica.snapshot import BlockSnapshot


@dataclass(eq=False)
class Reservation:
    request_id: str
    replica_id: str
    blocks: int
    dispatched_at: float
    acknowledged: bool = False
    released: bool = False


class PrefixIndex:
    """Approximate record of which prompt block hashes a replica has seen (bounded LRU)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def credit(self, block_hashes: Iterable[int]) -> int:
        """Leading prompt blocks likely still cached on the replica."""
        hits = 0
        for block_hash in block_hashes:
            if block_hash not in self._hashes:
                break
            hits += 1
        return hits

    def add(self, block_hashes: Iterable[int]) -> None:
        for block_hash in block_hashes:
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


@dataclass
class ReplicaLedger:
    replica_id: str
    snapshot: BlockSnapshot
    received_at: float
    reservations: dict[str, Reservation] = field(default_factory=dict)
    # Not yet visible to the replica: neither acknowledged nor older than a snapshot.
    unreflected: dict[str, Reservation] = field(default_factory=dict)
    reserved_blocks: int = 0
    prefix: PrefixIndex = field(default_factory=lambda: PrefixIndex(0))
    drift_blocks: int = 0  # predicted minus reported committed blocks, at the last report
    engine: dict = field(default_factory=dict)  # vLLM's own counters (replica/engine_stats.py)

    @property
    def total_blocks(self) -> int:
        return self.snapshot.total_blocks

    @property
    def ongoing(self) -> int:
        return len(self.reservations)

    def in_flight_blocks(self) -> int:
        return sum(r.blocks for r in self.unreflected.values())

    def free_blocks(self) -> int:
        return self.total_blocks - self.snapshot.committed_blocks - self.in_flight_blocks()

    def usage(self) -> float:
        used = self.snapshot.held_blocks + self.in_flight_blocks()
        return used / self.total_blocks if self.total_blocks else 1.0

    def reflect(self, reflect_after_s: float) -> None:
        """Reservations dispatched long enough before the snapshot are in it now."""
        horizon = self.snapshot.timestamp - reflect_after_s
        for key in [k for k, r in self.unreflected.items() if r.dispatched_at <= horizon]:
            del self.unreflected[key]


class Ledger:
    """All replicas' ledgers. Not thread-safe: the router's event loop owns it."""

    def __init__(self, reflect_after_s: float = 0.5, stale_after_s: float = 5.0,
                 clock: Callable[[], float] = time.time):
        self.reflect_after_s = reflect_after_s
        self.stale_after_s = stale_after_s
        self.clock = clock
        self.replicas: dict[str, ReplicaLedger] = {}
        self._ids = itertools.count()

    # --- replica membership and reports ---------------------------------------------
    def report(self, replica_id: str, snapshot: BlockSnapshot, engine: dict | None = None
               ) -> None:
        """A snapshot arrived (polled or piggy-backed). Capacity is learned from the first."""
        now = self.clock()
        ledger = self.replicas.get(replica_id)
        if ledger is None:
            if snapshot.total_blocks <= 0:
                return
            self.replicas[replica_id] = ReplicaLedger(
                replica_id, snapshot, now, prefix=PrefixIndex(4 * snapshot.total_blocks),
                engine=engine or {})
            return
        if snapshot.timestamp < ledger.snapshot.timestamp:
            return  # an older report overtaken by a newer one
        if engine:
            ledger.engine = engine
        predicted = ledger.snapshot.committed_blocks + ledger.in_flight_blocks()
        ledger.snapshot, ledger.received_at = snapshot, now
        ledger.reflect(self.reflect_after_s)
        reported = snapshot.committed_blocks + ledger.in_flight_blocks()
        ledger.drift_blocks = predicted - reported

    def drop(self, replica_id: str) -> list[Reservation]:
        """The replica is gone: forget it and hand back its live reservations."""
        ledger = self.replicas.pop(replica_id, None)
        return list(ledger.reservations.values()) if ledger else []

    def routable(self) -> list[ReplicaLedger]:
        """Replicas with a fresh enough report to route on."""
        now = self.clock()
        return [r for r in self.replicas.values()
                if now - r.received_at <= self.stale_after_s]

    # --- reservations -------------------------------------------------------------------
    def reserve(self, replica_id: str, blocks: int, prefix_hashes: Iterable[int] = ()
                ) -> Reservation:
        ledger = self.replicas[replica_id]
        reservation = Reservation(f"r{next(self._ids)}", replica_id, blocks, self.clock())
        ledger.reservations[reservation.request_id] = reservation
        ledger.unreflected[reservation.request_id] = reservation
        ledger.reserved_blocks += blocks
        ledger.prefix.add(prefix_hashes)
        return reservation

    def acknowledge(self, reservation: Reservation) -> None:
        """The replica answered for this reservation: its snapshots include it."""
        if not reservation.acknowledged:
            reservation.acknowledged = True
            ledger = self.replicas.get(reservation.replica_id)
            if ledger is not None:
                ledger.unreflected.pop(reservation.request_id, None)

    def release(self, reservation: Reservation) -> bool:
        """Release once; returns False if it was already released."""
        if reservation.released:
            return False
        reservation.released = True
        ledger = self.replicas.get(reservation.replica_id)
        if ledger is not None and ledger.reservations.pop(reservation.request_id, None):
            ledger.unreflected.pop(reservation.request_id, None)
            ledger.reserved_blocks -= reservation.blocks
        return True

    def reserved_blocks(self) -> int:
        return sum(ledger.reserved_blocks for ledger in self.replicas.values())

    def in_flight(self) -> int:
        return sum(ledger.ongoing for ledger in self.replicas.values())
