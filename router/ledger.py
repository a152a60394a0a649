"""The router's block ledger: what each replica reported, plus the router's reservations.

In protocol/blocks.py's words: a replica's available blocks = total - committed (from
its last snapshot) - unreflected (reserved for requests dispatched to it that the
snapshot cannot include yet). A reservation stays unreflected until the replica has
visibly received it: a snapshot reports its admission sequence as received, its first
response chunk came back, or a snapshot was taken `reflect_after_s` after the dispatch.
Admission numbers are times (router/admission.py `AdmissionSequence`), so with several
routers a replica's highest number received also speaks for the other routers' earlier
admissions; only a later one that overtook an earlier one in transit (milliseconds)
reflects it early, as between two connections of one router.
Every reservation is released exactly once (completion, error, disconnect, dead replica).

A replica that failed a request (`fail`) leaves placement at once and its reservations
with it; a transient failure rejoins with its next snapshot, a replica whose engine
reported its death never does (Ray Serve replaces it under a new id). A replica with
requests in flight whose snapshots stop changing is `suspect` (`find_suspects`): no new
work until a snapshot changes, but its requests go on: slow is not dead.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from blockserve.protocol.blocks import BlockStates
from blockserve.protocol.config import RouterConfig
from blockserve.protocol.snapshot import BLOCK_POLICY_EFFECTS, BlockSnapshot
from blockserve.protocol.router_policies import Candidate, PrefixIndex
from blockserve.router.prefix_cache import ApproximatePrefixIndex

# The prefix index remembers this many prompt block hashes per KV block of the replica.
# It cannot see the replica's evictions, and the replica caches at most its total blocks,
# so 1 would be the tight bound; 4 is the guess the ledger was written with (9f67104),
# never measured: it credits prefixes the replica may have evicted.
PREFIX_INDEX_HASHES_PER_BLOCK = 4
# A dispatch is assumed to be in the replica's snapshots once a snapshot was taken this
# long after it, even if no snapshot reported its admission sequence (router -> replica
# -> EngineCore takes milliseconds; this bounds the double count if a sequence is lost).
REFLECT_AFTER_S = 0.5


@dataclass(eq=False)
class Reservation:
    request_id: str
    replica_id: str
    blocks: int
    dispatched_at: float
    seq: int | None = None  # the admission sequence the replica reports back
    acknowledged: bool = False
    released: bool = False
    prefill_blocks: int = 0  # prompt blocks to compute there: not cached, by the index
    predicted_hit_blocks: int = 0  # the index's prefix credit when it was placed


@dataclass
class ReplicaLedger:
    replica_id: str
    snapshot: BlockSnapshot
    received_at: float
    reservations: dict[str, Reservation] = field(default_factory=dict)
    # Not yet visible to the replica: neither acknowledged nor older than a snapshot.
    unreflected: dict[str, Reservation] = field(default_factory=dict)
    unreflected_blocks: int = 0
    reserved_blocks: int = 0
    prefill_blocks: int = 0  # queued prefill: unacknowledged reservations' prefill_blocks
    prefix: PrefixIndex | None = None
    drift_blocks: int = 0  # predicted minus reported committed blocks, at the last report
    engine: dict = field(default_factory=dict)  # vLLM's own counters (replica/engine_stats.py)
    engine_read_at: float = 0.0  # when a poll last brought `engine`
    missing_since: float | None = None  # Ray Serve stopped listing it at this time
    changed_at: float = 0.0  # when a report last carried a new snapshot
    suspect: bool = False  # busy, yet no new snapshot for `suspect_after_s`

    @property
    def total_blocks(self) -> int:
        return self.snapshot.total_blocks

    @property
    def ongoing(self) -> int:
        return len(self.reservations)

    # The replica's blocks (protocol/blocks.py), and the replica as placement sees it
    # (prefix credit 0; the ledger adds credit). Kept current on every change, so a
    # decision reads them without recomputing anything. `credited` keeps the view with
    # each prefix credit decisions gave it since: the requests of a shared prompt get
    # the same credit, so a view is built once per change, not once per decision.
    blocks: BlockStates = field(init=False)
    candidate: Candidate = field(init=False)
    credited: dict[int, Candidate] = field(init=False)

    def __post_init__(self) -> None:
        self.refresh()

    def refresh(self) -> None:
        self.blocks = BlockStates.of(self.snapshot, self.reserved_blocks,
                                     self.unreflected_blocks)
        self.candidate = Candidate(self.replica_id, self.total_blocks, self.blocks.available,
                                   0, len(self.reservations), self.usage(),
                                   self.snapshot.cached_blocks, self.prefill_blocks)
        self.credited = {}

    def with_credit(self, credit: int) -> Candidate:
        """The placement view with this prefix credit, kept in `credited`."""
        view = self.credited[credit] = self.candidate.with_credit(credit)
        return view

    def usage(self) -> float:
        """Held / total, counting unreflected reservations as held (they soon will be)."""
        used = self.snapshot.held_blocks + self.unreflected_blocks
        return used / self.total_blocks if self.total_blocks else 1.0

    def block_policies(self) -> dict:
        """The replica's block policies as it reported them: their names in its config,
        whether its engine installed them, and what they did (protocol/snapshot.py)."""
        snap = self.snapshot
        return {**self.engine.get("block_policies", {}),
                "installed": bool(snap.block_policies_installed),
                **{effect: getattr(snap, f"{effect}_total") for effect in BLOCK_POLICY_EFFECTS}}

    def add(self, reservation: Reservation) -> None:
        self.reservations[reservation.request_id] = reservation
        self.unreflected[reservation.request_id] = reservation
        self.unreflected_blocks += reservation.blocks
        self.reserved_blocks += reservation.blocks
        self.prefill_blocks += reservation.prefill_blocks
        self.refresh()

    def mark_reflected(self, reservation: Reservation) -> None:
        if self._drop_unreflected(reservation):
            self.refresh()

    def remove(self, reservation: Reservation) -> None:
        if self.reservations.pop(reservation.request_id, None) is not None:
            self._drop_unreflected(reservation)
            self.reserved_blocks -= reservation.blocks
            if not reservation.acknowledged:
                self.prefill_blocks -= reservation.prefill_blocks
            self.refresh()

    def reflect(self, reflect_after_s: float) -> None:
        """Reservations the snapshot includes are no longer counted on top of it: those
        whose admission sequence the replica reports having received, and any dispatched
        long enough before the snapshot. The caller refreshes the placement view once,
        after the new snapshot is in."""
        snapshot = self.snapshot
        horizon = snapshot.timestamp - reflect_after_s
        for reservation in [r for r in self.unreflected.values() if r.dispatched_at <= horizon
                            or (r.seq is not None and r.seq <= snapshot.last_admission_seq
                                and r.dispatched_at <= snapshot.timestamp)]:
            self._drop_unreflected(reservation)

    def _drop_unreflected(self, reservation: Reservation) -> bool:
        if self.unreflected.pop(reservation.request_id, None) is None:
            return False
        self.unreflected_blocks -= reservation.blocks
        return True


class Ledger:
    """All replicas' ledgers. Not thread-safe: the router's event loop owns it."""

    def __init__(self, reflect_after_s: float = REFLECT_AFTER_S,
                 stale_after_s: float = RouterConfig.model_fields["stale_after_s"].default,
                 clock: Callable[[], float] = time.time,
                 prefix_index: Callable[[str, int, dict], PrefixIndex] = ApproximatePrefixIndex):
        """`prefix_index(replica_id, capacity, owners)` makes each replica's prefix index:
        the router passes its config's (`PolicyRef.build`); a ledger alone, with no KV
        events to follow, keeps the approximate one."""
        self.prefix_index = prefix_index
        self.reflect_after_s = reflect_after_s
        self.stale_after_s = stale_after_s
        self.clock = clock
        self.replicas: dict[str, ReplicaLedger] = {}
        self.dead: set[str] = set()  # replicas whose engine died: their reports are ignored
        self.prefix_owners: dict[int, set[str]] = {}
        self._largest: int | None = None
        self._ids = itertools.count()
        # routable()'s answer and the staleness horizons within which it holds; dropped
        # when membership or a flag changes, or a replica it left out reports.
        self._routable: list[ReplicaLedger] | None = None
        self._routable_bounds = (0.0, 0.0)

    # --- replica membership and reports ---------------------------------------------
    def report(self, replica_id: str, snapshot: BlockSnapshot, engine: dict | None = None,
               joins: bool = True) -> None:
        """A snapshot arrived (polled or piggy-backed). Capacity is learned from the first.
        `joins=False`: a response's snapshot, which refreshes a replica the ledger holds but
        never brings back one it dropped: the chunks still in flight from a replica that
        failed carry snapshots too."""
        now = self.clock()
        ledger = self.replicas.get(replica_id)
        if ledger is None:
            if not joins or snapshot.total_blocks <= 0 or replica_id in self.dead:
                return
            self._largest = self._routable = None
            self.replicas[replica_id] = ReplicaLedger(
                replica_id, snapshot, now, engine=engine or {},
                engine_read_at=now if engine else 0.0, changed_at=now,
                prefix=self.prefix_index(replica_id, PREFIX_INDEX_HASHES_PER_BLOCK
                                   * snapshot.total_blocks, self.prefix_owners))
            return
        if engine:  # a poll's counters are its newest, even if traffic overtook its snapshot
            ledger.engine, ledger.engine_read_at = engine, now
        if snapshot.timestamp < ledger.snapshot.timestamp:
            return  # an older report overtaken by a newer one
        if ledger.suspect or ledger.received_at < self._routable_bounds[0]:
            self._routable = None  # left out of routable() as suspect or stale, it may be in
        if snapshot.timestamp > ledger.snapshot.timestamp:
            ledger.changed_at, ledger.suspect = now, False
        predicted = ledger.blocks.committed + ledger.unreflected_blocks
        ledger.snapshot, ledger.received_at = snapshot, now
        ledger.reflect(self.reflect_after_s)
        ledger.refresh()
        ledger.drift_blocks = predicted - ledger.blocks.committed - ledger.unreflected_blocks

    def largest_capacity(self) -> int:
        """Blocks of the largest replica (0 before any reported), cached per membership."""
        if self._largest is None:
            self._largest = max((r.total_blocks for r in self.replicas.values()), default=0)
        return self._largest

    def drop(self, replica_id: str) -> list[Reservation]:
        """The replica is gone: forget it and hand back its live reservations."""
        ledger = self.replicas.pop(replica_id, None)
        self._largest = self._routable = None
        if ledger is None:
            return []
        ledger.prefix.on_removed()
        return list(ledger.reservations.values())

    def fail(self, replica_id: str, dead: bool) -> list[Reservation]:
        """The replica failed a request: out of placement now, its reservations released
        (`drop`). `dead`: its engine reported its death, so it never comes back."""
        if dead:
            self.dead.add(replica_id)
        return self.drop(replica_id)

    def find_suspects(self, suspect_after_s: float) -> bool:
        """Mark replicas suspect whose oldest request in flight and last new snapshot
        are both older than `suspect_after_s`; returns whether any flag changed."""
        oldest = self.clock() - suspect_after_s
        changed = False
        for ledger in self.replicas.values():
            first = next(iter(ledger.reservations.values()), None)
            suspect = (first is not None and first.dispatched_at < oldest
                       and ledger.changed_at < oldest)
            changed |= suspect != ledger.suspect
            ledger.suspect = suspect
        if changed:
            self._routable = None
        return changed

    def routable(self) -> list[ReplicaLedger]:
        """Listed replicas with a fresh enough report to route on, not suspect (a shared
        list: do not change it). It runs per decision, so the last answer is kept while
        it holds: no report or flag changed since, and the staleness horizon has neither
        gone back (the clock stepped back) nor passed the oldest report in it."""
        oldest = self.clock() - self.stale_after_s
        low, high = self._routable_bounds
        if self._routable is None or not low <= oldest <= high:
            self._routable = [r for r in self.replicas.values()
                              if r.received_at >= oldest and r.missing_since is None
                              and not r.suspect]
            self._routable_bounds = (oldest, min((r.received_at for r in self._routable),
                                                 default=math.inf))
        return self._routable

    def mark_missing(self, replica_id: str) -> None:
        """Ray Serve no longer lists the replica: no new work now; `drop_missing` forgets
        it once it has stayed unlisted (a transient gap in Serve's list must not lose
        the replica's reservations)."""
        ledger = self.replicas.get(replica_id)
        if ledger is not None and ledger.missing_since is None:
            ledger.missing_since = self.clock()
            self._routable = None

    def mark_listed(self, replica_id: str) -> None:
        ledger = self.replicas.get(replica_id)
        if ledger is not None and ledger.missing_since is not None:
            ledger.missing_since = None
            self._routable = None

    def drop_missing(self, grace_s: float) -> list[str]:
        oldest = self.clock() - grace_s
        gone = [rid for rid, r in self.replicas.items()
                if r.missing_since is not None and r.missing_since <= oldest]
        for replica_id in gone:
            self.drop(replica_id)
        return gone

    def candidates(self, prefix_hashes: tuple[int, ...] = ()) -> list[Candidate]:
        """Placement views of the routable replicas, with prefix credit where it exists.
        Runs once per decision over every replica, so it is written for speed."""
        routable = self.routable()
        holders = self.prefix_owners.get(prefix_hashes[0]) if prefix_hashes else None
        if not holders:
            return [r.candidate for r in routable]
        views = []
        for replica in routable:
            view = replica.candidate
            if replica.replica_id in holders:
                credit = replica.prefix.credit(prefix_hashes)
                if credit:
                    view = replica.credited.get(credit) or replica.with_credit(credit)
            views.append(view)
        return views

    # --- reservations -------------------------------------------------------------------
    def reserve(self, replica_id: str, blocks: int, prefix_hashes: Iterable[int] = (),
                seq: int | None = None) -> Reservation:
        ledger = self.replicas[replica_id]
        prefix_hashes = tuple(prefix_hashes)
        credit = ledger.prefix.credit(prefix_hashes)
        reservation = Reservation(f"r{next(self._ids)}", replica_id, blocks, self.clock(), seq,
                                  prefill_blocks=len(prefix_hashes) - credit,
                                  predicted_hit_blocks=credit)
        ledger.add(reservation)
        ledger.prefix.on_dispatched(prefix_hashes)
        return reservation

    def acknowledge(self, reservation: Reservation) -> None:
        """The replica answered for this reservation: its snapshots include it."""
        if not reservation.acknowledged:
            reservation.acknowledged = True
            ledger = self.replicas.get(reservation.replica_id)
            if ledger is not None:
                ledger.prefill_blocks -= reservation.prefill_blocks  # its first token is out
                ledger.mark_reflected(reservation)
                ledger.refresh()

    def release(self, reservation: Reservation) -> bool:
        """Release once; returns False if it was already released."""
        if reservation.released:
            return False
        reservation.released = True
        ledger = self.replicas.get(reservation.replica_id)
        if ledger is not None:
            ledger.remove(reservation)
        return True

    def reserved_blocks(self) -> int:
        return sum(ledger.reserved_blocks for ledger in self.replicas.values())

    def in_flight(self) -> int:
        return sum(ledger.ongoing for ledger in self.replicas.values())
