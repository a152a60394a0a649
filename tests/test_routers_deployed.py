"""Two routers on the real deployment (docs/routers.md): both serve, a policy switch
reaches both, /metrics shows both, and one SIGKILLed under streamed load loses nothing
that had not started. One deployment of its own (deploy.yaml with two routers)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest

from blockserve.bench.engine_kill import client, load_and_fault, stream_one
from blockserve.tools.launch import load_config
from conftest import API_KEY
from deployed import PROCESSES_GONE_S, all_gone

ROUTERS = 2
# A switch reaches the other router within its long poll's answer; the state shows it
# with that router's next report (every poll interval, 0.5 s).
SWITCH_SHOWN_S = 2.0
FIRST_SUCCESS_S = 1.0  # after a router's death, a new request's first token within this


def two_routers() -> dict:
    config = load_config()
    [router] = [d for d in config["applications"][0]["deployments"] if d["name"] == "Router"]
    router["num_replicas"] = ROUTERS
    return config


def routers(deployment) -> dict[str, dict]:
    return {r["router"]: r for r in deployment.get("/admin/state").json()["routers"]}


def wait_for(predicate, timeout_s: float, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"not within {timeout_s}s"
        time.sleep(poll_s)
    return result


@pytest.mark.deployment
def test_two_routers_share_switches_and_metrics_and_a_killed_one_loses_nothing_unsent(launch):
    with launch(two_routers()) as deployment:
        wait_for(lambda: len(routers(deployment)) == ROUTERS, 60)
        # Each counts both, and its placement spreads its picks over 2 (docs/routers.md).
        wait_for(lambda: all(r["routers_counted"] == ROUTERS
                             for r in routers(deployment).values()), 10)

        # Both serve: concurrent streams take several connections, which HAProxy spreads.
        async def burst(n: int):
            api = client(deployment.base_url, API_KEY)
            outcomes = await asyncio.gather(*(stream_one(api, time.monotonic(), 8)
                                              for _ in range(n)))
            await api.close()
            return outcomes

        assert [o.kind for o in asyncio.run(burst(12))] == ["completed"] * 12
        time.sleep(1.0)  # the routers' next reports
        decided = {}
        for key, value in deployment.metrics().items():
            if key.startswith("blockserve_decisions_total{"):
                router = key.split('router="')[1].split('"')[0]
                decided[router] = decided.get(router, 0) + value
        assert set(decided) == set(routers(deployment)) and sum(decided.values()) >= 12, decided
        print(f"\ndecisions per router: {decided}")
        # Each router's predictor learned the lengths that finished at the other one.
        heard = wait_for(lambda: (h := {r: s["lengths_heard"] for r, s in
                                        routers(deployment).items()})
                         and sum(h.values()) >= 12 and h, SWITCH_SHOWN_S)
        print(f"lengths heard from the other router: {heard}")

        # A switch posted to one router reaches both.
        posted = time.monotonic()
        response = deployment.post("/admin/policies", json={"placement": "best_fit"})
        assert response.status_code == 200, response.text
        wait_for(lambda: all(r["policies"]["placement"]["cls"] == "best_fit"
                             for r in routers(deployment).values()), SWITCH_SHOWN_S)
        print(f"switch shown at both routers after {time.monotonic() - posted:.2f}s")

        # One router SIGKILLed under streamed load.
        def kill_busiest_router():
            name, victim = max(routers(deployment).items(),
                               key=lambda item: item[1]["in_flight_requests"])
            process = psutil.Process(victim["pid"])
            os.kill(victim["pid"], signal.SIGKILL)
            return {"router": name, "process": process, "in_flight": victim["in_flight_requests"]}

        def a_router_is_busy() -> bool:
            return max(r["in_flight_requests"] for r in routers(deployment).values()) >= 6

        fault_at, info, outcomes, probes = asyncio.run(
            load_and_fault(deployment.base_url, kill_busiest_router, api_key=API_KEY, burst=24,
                           max_tokens=96, probes=10, fault_by_s=1.5, loaded=a_router_is_busy))
        kinds = [o.kind for o in outcomes]
        print(f"killed router {info['router']} with {info['in_flight']} in flight; "
              f"outcomes {kinds}; probes {[o.kind for o in probes]}")
        assert info["in_flight"] > 0
        # A stream the dead router had started (its status and headers were sent, with or
        # without tokens) cannot get an error event from it: its cut is an incomplete
        # chunked response, which the client reports as a broken connection, never as a
        # clean end. One that had not started HAProxy sends again (deploy/haproxy).
        unstarted_lost = [o for o in outcomes + probes
                          if o.kind != "completed" and not o.answered]
        assert not unstarted_lost, "lost before a response: " + "; ".join(
            f"{o.kind} sent {o.sent_at - fault_at:+.3f}s from the kill, ended "
            f"{o.ended_at - fault_at:+.3f}s: {o.error or o.status}" for o in unstarted_lost)
        print(f"started with no token and cut: "
              f"{sum(o.answered and o.tokens == 0 and o.kind != 'completed' for o in outcomes)}")
        assert not [o for o in outcomes if o.kind not in ("completed", "disconnect")], kinds
        served = [o for o in probes if o.kind == "completed"]
        assert len(served) == len(probes), [o.kind for o in probes]
        first = min(o.first_token_at for o in served) - fault_at
        print(f"first success after the kill: first token {first:.3f}s")
        assert first < FIRST_SUCCESS_S
        assert all_gone([info["process"]], PROCESSES_GONE_S)
        wait_for(lambda: info["router"] not in routers(deployment), 5)  # its reports stop
        # The replicas abort what the dead router was relaying: no block stays held.
        wait_for(lambda: deployment.metric_sum("blockserve_replica_kv_blocks",
                                               state="held") == 0, 30, 0.5)
