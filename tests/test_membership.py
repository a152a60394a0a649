"""router/membership.py without Ray: snapshots and engine counters reach the ledger, a
replica whose engine died leaves placement for good, a replica Ray Serve stops listing
gets no new work (tests/router_parts.py)."""

import asyncio

import pytest

from blockserve.router.demand import DemandEstimator, Rejected
from blockserve.router.membership import Membership
from router_parts import SNAPSHOT, router_parts


def membership(replicas=("a", "b"), **router):
    parts = router_parts(replicas=replicas, **router)
    return Membership("app", None, parts.transport, parts.ledger, parts.queue,
                      parts.failover, DemandEstimator(None), None, parts.config), parts


def test_a_report_updates_the_snapshot_and_keeps_the_engines_counters_beside_it():
    members, parts = membership()
    members.report("a", {**SNAPSHOT.to_dict(), "timestamp": 2.0, "held_blocks": 30,
                         "free_blocks": 70, "engine_pid": 123, "replica_id": "a"})
    entry = parts.ledger.replicas["a"]
    assert entry.snapshot.held_blocks == 30
    assert entry.engine == {"engine_pid": 123, "held_fraction_at_read": 0.3}


def test_a_response_chunks_snapshot_leaves_the_counters_the_last_poll_brought():
    members, parts = membership()
    members.report("a", {**SNAPSHOT.to_dict(), "timestamp": 2.0, "engine_pid": 123,
                         "vllm_kv_cache_usage": 0.25})
    members.report("a", {**SNAPSHOT.to_dict(), "timestamp": 3.0, "held_blocks": 40,
                         "free_blocks": 60, "engine_dead": False})  # a chunk's
    entry = parts.ledger.replicas["a"]
    assert entry.snapshot.held_blocks == 40
    assert entry.engine["vllm_kv_cache_usage"] == 0.25 and entry.engine["engine_pid"] == 123


def test_a_dead_engine_takes_its_replica_out_for_good():
    members, parts = membership()
    members.report("a", {**SNAPSHOT.to_dict(), "engine_dead": True})
    assert "a" not in parts.ledger.replicas and parts.transport.removed == ["a"]
    members.report("a", {**SNAPSHOT.to_dict(), "timestamp": 3.0})  # a late snapshot
    assert "a" not in parts.ledger.replicas


def test_an_unlisted_replica_gets_no_new_work_but_keeps_its_reservations():
    members, parts = membership()

    async def unlist():
        reservation = parts.ledger.reserve("a", 10)
        members._on_replicas_changed(added=set(), removed={"a"})
        return reservation
    reservation = asyncio.run(unlist())
    assert [r.replica_id for r in parts.ledger.routable()] == ["b"]
    assert parts.ledger.replicas["a"].reservations == {reservation.request_id: reservation}


def test_capacity_waits_for_a_first_report_then_gives_up_with_503():
    members, _ = membership()
    assert asyncio.run(members.capacity()).block_size == SNAPSHOT.block_size
    empty, _ = membership(replicas=(), queue_timeout_s=0.05)
    with pytest.raises(Rejected) as rejected:
        asyncio.run(empty.capacity())
    assert rejected.value.status == 503
