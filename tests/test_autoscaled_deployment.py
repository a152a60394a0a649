"""Autoscaling on KV blocks in a real deployment: the replica Ray Serve adds joins the
router's ledger with its real capacity and takes traffic.

Its own deployment (one replica to start, at most two), with a low target so that a few
long streams are enough demand; the router spreads (MostFreeBlocks) so that the new,
empty replica is the obvious place for new work.
"""

import threading
import time

import httpx
import pytest

from blockserve.bench.autoscale import autoscaled
from blockserve.tools.launch import load_config, with_args
from conftest import SHAPE

pytestmark = pytest.mark.deployment
STREAM = {"model": SHAPE.model_name, "prompt": [7, 8, 9, 10] * 40, "max_tokens": 800,
          "stream": True, "ignore_eos": True}
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
               "metrics_interval_s": 0.5, "look_back_period_s": 2.0,
               "upscale_delay_s": 0.0, "downscale_delay_s": 600.0,
               "policy": {"policy_function": "blockserve.controller.autoscaling:BlockDemandAutoscaler",
                          "policy_kwargs": {"target_utilization": 0.1,
                                            "scale_down_utilization": 0.05,
                                            "upscale_delay_s": 1.0,
                                            "downscale_delay_s": 600.0}}}


@pytest.fixture(scope="module")
def autoscaled_deployment(launch):
    config = with_args(load_config(), router={"placement": "most_free"})
    with launch(autoscaled(config, AUTOSCALING, max_replicas=2), expected_replicas=1) as run:
        yield run


def keep_streaming(deployment, stop: threading.Event, workers: int = 4):
    """`workers` clients, each streaming long completions back to back until `stop`."""
    def worker():
        with httpx.Client(base_url=deployment.base_url, headers=deployment.headers,
                          timeout=120) as http:
            while not stop.is_set():
                with http.stream("POST", "/v1/completions", json=STREAM) as response:
                    for _ in response.iter_bytes():
                        if stop.is_set():
                            break

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for thread in threads:
        thread.start()
    return threads


def test_replica_added_by_autoscaling_joins_the_ledger_and_takes_traffic(
        autoscaled_deployment):
    deployment = autoscaled_deployment
    [first] = [r["replica_id"] for r in deployment.get("/admin/state").json()["replicas"]]
    stop = threading.Event()
    threads = keep_streaming(deployment, stop)
    try:
        deadline = time.time() + 240
        while True:
            replicas = {r["replica_id"]: r for r in deployment.get("/admin/state").json()[
                "replicas"]}
            added = [r for rid, r in replicas.items() if rid != first]
            if added:
                break
            assert time.time() < deadline, "no replica was added within 240 s"
            time.sleep(1)
        [new] = added
        # It entered the ledger with the capacity its engine reported, not a guess.
        assert new["snapshot"]["total_blocks"] == SHAPE.usable_blocks
        assert new["snapshot"]["block_size"] == SHAPE.block_size
        deadline = time.time() + 60
        while deployment.metric_sum("blockserve_decisions_total",
                                    replica=new["replica_id"]) == 0:
            assert time.time() < deadline, "the new replica got no traffic within 60 s"
            time.sleep(0.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    deadline = time.time() + 60  # and the streams cut short left nothing in the ledger
    while deployment.metric_sum("blockserve_ledger_reserved_blocks") or \
            deployment.metric_sum("blockserve_ledger_in_flight_requests"):
        assert time.time() < deadline, "reservations left in the ledger"
        time.sleep(0.5)
