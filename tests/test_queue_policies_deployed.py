from deployed import wait_until_idle
"""Queue orders on the real deployment: requests wait in the router's queue behind fills
of a known size (tests/cluster_load.py), a queue order is switched in while they wait,
and the order in which they then finish shows what it decided. The priority and tenant
headers must reach the admission queue for Priority and FairShare to see them."""

import asyncio
import random
import time
import uuid

import httpx
import pytest

from cluster_load import (FILL_BLOCKS, PER_REPLICA, PRIORITY_HEADER, TENANT_HEADER, Router,
                          fill_body, finished_at)

pytestmark = pytest.mark.deployment
FILLS = 60  # 10 admitted at once (5 per replica), the rest queued: six waves
MIN_QUEUED_FILLS = 30  # at the switch, or the scenario proves nothing


def small_body(rng):  # 2 blocks: fits the 5 blocks a replica full of fills has left
    return fill_body(rng, prompt_tokens=40, max_tokens=8)


# name: (queue order switched in, headers of the fills, probes sent after the fills in
# this order: (name, headers, body), names expected ahead of most queued fills, names
# expected behind them)
SCENARIOS = {
    "priority header": ("priority", {},
                        [("late", {PRIORITY_HEADER: "5"}, fill_body),
                         ("urgent", {PRIORITY_HEADER: "-5"}, fill_body)],
                        {"urgent"}, {"late"}),
    "tenant header": ("fair_share", {TENANT_HEADER: "heavy"},
                      [("light", {TENANT_HEADER: "light"}, fill_body)], {"light"}, set()),
    "smaller demand": ({"cls": "shortest_demand",
                        "kwargs": {"max_wait_s": 60}}, {},
                       [("small", {}, small_body)], {"small"}, set()),
}


async def run_scenario(deployment, order, fill_headers, probes):
    """Returns (finish times of the fills, {probe: finish time}, fills queued when the
    order was switched in, the switch's response)."""
    rng = random.Random(uuid.uuid4().int)
    async with httpx.AsyncClient(base_url=deployment.base_url, headers=deployment.headers,
                                 timeout=120, limits=httpx.Limits(max_connections=200)) as http:
        router = Router(http)
        since = await router.admitted()
        fills = [asyncio.ensure_future(finished_at(http, fill_body(rng), fill_headers))
                 for _ in range(FILLS)]
        await router.all_arrived(since, FILLS)
        probe_tasks = {}
        for name, headers, body in probes:
            probe_tasks[name] = asyncio.ensure_future(finished_at(http, body(rng), headers))
            await asyncio.sleep(0.01)  # arrival order = the order listed
        admitted, queued = await router.all_arrived(since, FILLS + len(probes))
        switched = await http.post("/admin/policies", json={"queue_order": order})
        finished = await asyncio.gather(*fills)
        probe_finished = {name: await task for name, task in probe_tasks.items()}
    # Under FCFS the probes came last: all of them, and the fills before them, queued.
    assert admitted < FILLS, "a probe was admitted before the switch"
    return finished, probe_finished, queued - len(probes), switched


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_queue_order_switched_in_decides_for_requests_already_queued(deployment, scenario):
    order, fill_headers, probes, ahead, behind = SCENARIOS[scenario]
    original = deployment.get("/admin/state").json()["policies"]
    wait_until_idle(deployment)
    started = time.perf_counter()
    try:
        # From FCFS (not the default, on_time_first, which puts the fills behind the
        # probes once they are late), so the probes wait behind every fill until the switch.
        fcfs = deployment.post("/admin/policies", json={"queue_order": "fcfs"})
        assert fcfs.status_code == 200, fcfs.text
        fills, probe_finished, queued_fills, switched = asyncio.run(
            run_scenario(deployment, order, fill_headers, probes))
    finally:
        restored = deployment.post("/admin/policies", json=original)
    assert switched.status_code == 200, switched.text
    assert restored.status_code == 200 and restored.json()["policies"] == original
    assert queued_fills >= MIN_QUEUED_FILLS, f"only {queued_fills} fills still queued"
    after = {name: sum(t > finished for t in fills) for name, finished in
             probe_finished.items()}
    print(f"{scenario}: {queued_fills} fills queued at the switch; fills finishing after "
          f"each probe {after}; {time.perf_counter() - started:.1f}s")
    for name in ahead:  # admitted in the first wave after the switch, not the last
        assert after[name] >= queued_fills // 2, (name, after, queued_fills)
    for name in behind:  # still behind every fill: at most its own wave ends later
        assert after[name] <= 2 * PER_REPLICA, (name, after, queued_fills)
    if "urgent" in probe_finished:
        assert probe_finished["urgent"] < probe_finished["late"]
    wait_until_idle(deployment)


def test_policy_switch_rejects_unknown_policies_and_keeps_the_old_one(deployment):
    before = deployment.get("/admin/state").json()["policies"]
    for body in ({"placement": "no.such:Policy"}, {"queue_order": {"cls": "x"}}, {},
                 {"placement": "fcfs"}, {"queue_order": "router_order"},
                 {"queue_order": {"cls": "shortest_demand",
                                  "kwargs": {"max_wait_s": -1}}}):
        response = deployment.post("/admin/policies", json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["code"] == 400
    assert deployment.get("/admin/state").json()["policies"] == before
    assert FILL_BLOCKS * PER_REPLICA <= 160 < FILL_BLOCKS * (PER_REPLICA + 1)
