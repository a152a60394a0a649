"""Replica membership: which replicas exist, and what their KV blocks are.

Ray Serve lists the replicas (the pinned request router tells the replica directory,
router/replica_directory.py); each listed replica's snapshot reaches the ledger with every
response chunk and, when traffic did not bring one recently, from a poll. A replica
Serve stops listing gets no new work, and leaves the ledger after a grace period. With
the exact prefix index the router also follows each replica's vLLM KV cache events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray.serve.handle import DeploymentHandle

from blockserve.protocol.config import RouterConfig
from blockserve.protocol.router_policies import Transport
from blockserve.protocol.snapshot import SNAPSHOT_FIELDS, BlockSnapshot
from blockserve.router.admission import AdmissionQueue
from blockserve.router.demand import DemandEstimator, Rejected
from blockserve.router.dispatch import ReplicaUnavailable
from blockserve.router.failover import Failover
from blockserve.router.ledger import Ledger
from blockserve.router.replica_directory import directory

logger = logging.getLogger("blockserve.router")

# A control call (data-port address, snapshot, KV event source) to a live replica
# answers in milliseconds; one that takes this long goes to a replica that is dying or
# still starting, which stays stale (no new work) and is asked again at the next poll.
CONTROL_CALL_TIMEOUT_S = 5.0
# The first call through the handle waits for Ray Serve to route it, which makes Serve
# list the replicas (start-up only); past this the poll loop tries again.
FIRST_CALL_TIMEOUT_S = 10.0
# How often a request that arrived before any replica reported looks again (start-up).
FIRST_REPLICA_POLL_S = 0.1
# A report's keys that are not the replica's engine counters (`Membership.report`).
_NOT_ENGINE = frozenset(SNAPSHOT_FIELDS) | {"replica_id", "engine_dead"}


class Membership:
    def __init__(self, app_name: str, replicas: DeploymentHandle,
                 dispatch: Transport, ledger: Ledger,
                 queue: AdmissionQueue, failover: Failover, estimator: DemandEstimator,
                 kv_events: Any, config: RouterConfig) -> None:
        self.app_name, self.replicas, self.dispatch = app_name, replicas, dispatch
        self.ledger, self.queue, self.failover = ledger, queue, failover
        self.estimator, self.kv_events, self.config = estimator, kv_events, config

    def start(self, loop: asyncio.AbstractEventLoop) -> asyncio.Task:
        """Follow Serve's replica list and poll snapshots, on the router's loop."""
        directory(self.app_name).subscribe(loop, self._on_replicas_changed)
        return loop.create_task(self._poll_snapshots())

    async def capacity(self) -> BlockSnapshot:
        """A replica's snapshot (block size, context length), once one has reported."""
        deadline = time.time() + self.config.queue_timeout_s
        while not self.ledger.replicas:
            if time.time() > deadline:
                raise Rejected(503, "no_replicas", "No replica is ready.")
            await asyncio.sleep(FIRST_REPLICA_POLL_S)
        return next(iter(self.ledger.replicas.values())).snapshot

    def report(self, replica_id: str, data: dict, joins: bool = True) -> None:
        """Snapshot fields go to the ledger's snapshot; the rest of a poll's answer (vLLM's
        counters, the replica's pid) is kept beside it. A response chunk carries the
        snapshot alone, and leaves what the last poll brought; it comes with
        `joins=False` (`Ledger.report`)."""
        if data.get("engine_dead"):
            self.failover.replica_failed(ReplicaUnavailable(replica_id, "its engine died",
                                                            dead=True))
            return
        snapshot = BlockSnapshot.from_dict(data)
        engine = {k: v for k, v in data.items() if k not in _NOT_ENGINE}
        if engine and snapshot.total_blocks:  # read in the same call: vLLM's twin
            engine["held_fraction_at_read"] = snapshot.held_blocks / snapshot.total_blocks
        self.ledger.report(replica_id, snapshot, engine, joins)

    def _on_replicas_changed(self, added: set[str], removed: set[str]) -> None:
        for replica_id in removed:
            logger.warning("Ray Serve no longer lists replica %s", replica_id)
            self.ledger.mark_missing(replica_id)  # no new work from now on
        for replica_id in added:
            self.ledger.mark_listed(replica_id)
        if added:
            asyncio.get_running_loop().create_task(self._refresh(sorted(added)))
        self.queue.pump()

    async def _refresh(self, replica_ids: list[str]) -> None:
        queued = float(self.queue.queued_blocks())

        async def one(replica_id: str) -> None:
            try:
                await asyncio.wait_for(self.dispatch.connect(replica_id),
                                       CONTROL_CALL_TIMEOUT_S)
                data = await asyncio.wait_for(self.replicas.snapshot.remote(
                    replica_id=replica_id, router_queued_blocks=queued),
                    CONTROL_CALL_TIMEOUT_S)
            except Exception as exc:  # a dying or starting replica: stale, then excluded
                logger.debug("snapshot of %s failed: %r", replica_id, exc)
                return
            if replica_id in directory(self.app_name).replica_ids:
                self.report(replica_id, data)
                await self._follow_kv_events(replica_id)

        await asyncio.gather(*(one(r) for r in replica_ids))
        self.queue.pump()

    async def _follow_kv_events(self, replica_id: str) -> None:
        """Exact prefix index: follow the replica's KV cache events into its ledger
        entry's index (again when the ledger made a new entry for it); prompts are then
        hashed as vLLM hashes them."""
        entry = self.ledger.replicas.get(replica_id)
        if self.kv_events is None or entry is None or self.kv_events.settled(replica_id,
                                                                             entry.prefix):
            return
        try:
            source = await asyncio.wait_for(
                self.replicas.kv_event_source.remote(replica_id=replica_id),
                CONTROL_CALL_TIMEOUT_S)
        except Exception as exc:  # retried with the next refresh
            logger.debug("KV event source of %s unknown: %r", replica_id, exc)
            return
        entry = self.ledger.replicas.get(replica_id)
        if entry is not None and self.kv_events.follow(replica_id, source, entry.prefix):
            self.estimator.block_hasher = self.kv_events.hasher

    async def _poll_snapshots(self) -> None:
        """Refresh snapshots that traffic did not refresh recently, and vLLM's counters
        (which traffic never brings) every `counters_interval_s`."""
        interval, counters_interval = (self.config.poll_interval_s,
                                       self.config.counters_interval_s)
        members = directory(self.app_name)
        pushed_queue = 0
        while True:
            try:
                if not members.replica_ids:
                    # The first call through the handle makes Ray Serve report replicas
                    # (which _refresh then connects to and reads).
                    await asyncio.wait_for(self.replicas.snapshot.remote(),
                                           FIRST_CALL_TIMEOUT_S)
                now = time.time()
                queued = self.queue.queued_blocks()
                # Stale snapshots are refreshed; while requests queue, every replica hears
                # the queue's demand (for autoscaling) with its poll.
                stale = [r for r in members.replica_ids
                         if queued or pushed_queue or r not in self.ledger.replicas
                         or now - self.ledger.replicas[r].received_at >= interval
                         or now - self.ledger.replicas[r].engine_read_at >= counters_interval]
                pushed_queue = queued
                if stale:
                    await self._refresh(stale)
                if self.ledger.find_suspects(self.config.suspect_after_s):
                    logger.warning("suspect replicas (no new snapshot while busy): %s",
                                   [r for r, e in self.ledger.replicas.items() if e.suspect])
                    self.queue.pump()
                # Unlisted past the grace period: gone. Its in-flight requests fail and
                # release their leases on their own.
                for replica_id in self.ledger.drop_missing(self.config.missing_grace_s):
                    logger.warning("replica %s left the ledger", replica_id)
                    self.dispatch.on_removed(replica_id)
                if self.kv_events is not None:
                    self.kv_events.retain(self.ledger.replicas)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("snapshot poll failed: %r", exc)
            await asyncio.sleep(interval)
