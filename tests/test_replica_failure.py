"""A replica actor killed under load (runs after the other deployment tests: it takes a
replica away until Ray Serve has restarted it). Its engine must die with it, every
stream must complete or end with an error event after its tokens, and the ledger must
drop the replica and take its replacement with its real capacity."""

import asyncio
import os
import signal
import time

import psutil
import pytest

from blockserve.bench.engine_kill import load_and_fault, replicas, wait_for
from conftest import API_KEY
from deployed import (DETECT_S, FIRST_SUCCESS_S, PROCESSES_GONE_S, all_gone, assert_outcomes,
                      engine_tree, wait_until_idle)

pytestmark = pytest.mark.deployment


def test_killed_replica_leaves_the_ledger_and_rejoins_with_its_capacity(deployment):
    base = deployment.base_url
    before = replicas(base, API_KEY)
    assert len(before) == 2

    def kill_busiest_actor():
        victim_id, victim = max(replicas(base, API_KEY).items(),
                                key=lambda item: item[1]["in_flight_requests"])
        actor = psutil.Process(victim["engine"]["pid"])  # the replica actor's own pid
        tree = engine_tree(victim["engine"]["engine_pid"])
        assert tree[0].ppid() == actor.pid  # the engine is the actor's child
        os.kill(actor.pid, signal.SIGKILL)
        killed = time.monotonic()
        left = wait_for(lambda: victim_id not in replicas(base, API_KEY), 10, 0.02)
        return {"victim": victim_id, "tree": tree, "in_flight": victim["in_flight_requests"],
                "left_after_s": time.monotonic() - killed if left else None}

    fault_at, info, outcomes, probes = asyncio.run(load_and_fault(base, kill_busiest_actor, api_key=API_KEY))
    print(f"\nkilled replica actor {info['victim']} with {info['in_flight']} in flight; "
          f"left the ledger after {info['left_after_s']}s; "
          f"outcomes: {[o.kind for o in outcomes]}")
    assert info["in_flight"] > 0
    # Its engine and the engine's workers die with it (replica/watchdog.py).
    assert all_gone(info["tree"], PROCESSES_GONE_S), "the engine outlived its replica"
    assert info["left_after_s"] is not None and info["left_after_s"] < DETECT_S
    assert_outcomes(outcomes)
    assert [o.kind for o in probes] == ["completed"] * len(probes)
    assert min(o.first_token_at for o in probes) - fault_at < FIRST_SUCCESS_S
    wait_until_idle(deployment)

    current = wait_for(lambda: len(replicas(base, API_KEY)) == 2 and replicas(base, API_KEY), 300, 0.5)
    assert current, "Ray Serve did not restart the replica within 300 s"
    newcomer = (set(current) - set(before)).pop()
    assert current[newcomer]["snapshot"]["total_blocks"] == 160  # its real capacity
    wait_until_idle(deployment)
