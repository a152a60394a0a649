"""Autoscaling on KV blocks vs Ray Serve's default (ongoing requests) on a ramp, one run.

    python -m blockserve.bench.autoscale [--requests 300] [--max-replicas 2]

Both start from one replica of deploy/deploy.yaml with autoscaling on. Reports when the
second replica joined the router's ledger (with its reported capacity), queue wait and
TTFT during the ramp, preemptions, and whether the new replica took traffic.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from pathlib import Path

import httpx

from blockserve.bench.client import replay
from blockserve.bench.report import percentile
from blockserve.bench.targets import API_KEY, http
from blockserve.bench.workloads import ramp
from blockserve.tools.launch import app_config, load_config, serve_run

SERVE_AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
                     "metrics_interval_s": 1.0, "look_back_period_s": 3.0,
                     "upscale_delay_s": 0.0, "downscale_delay_s": 600.0}
POLICIES = {
    "blocks": {**SERVE_AUTOSCALING, "policy": {
        "policy_function": "blockserve.controller.autoscaling:BlockDemandAutoscaler",
        "policy_kwargs": {"target_utilization": 0.75, "scale_down_utilization": 0.2,
                          "upscale_delay_s": 2.0, "downscale_delay_s": 600.0}}},
    "ray default (ongoing requests)": {**SERVE_AUTOSCALING, "target_ongoing_requests": 16},
}


def autoscaled(config: dict, autoscaling: dict, max_replicas: int) -> dict:
    for deployment in config["applications"][0]["deployments"]:
        if deployment["name"] == "Replica":
            deployment.pop("num_replicas", None)
            deployment["autoscaling_config"] = {**autoscaling, "max_replicas": max_replicas}
    return config


def run(name: str, autoscaling: dict, specs, max_replicas: int) -> dict:
    config = autoscaled(load_config(), autoscaling, max_replicas)
    with serve_run(config, expected_replicas=autoscaling["initial_replicas"],
                   env={"BLOCKSERVE_API_KEY": API_KEY}) as target:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        timeline, stop = [], threading.Event()
        started = time.time()

        def watch() -> None:
            while not stop.is_set():
                try:
                    state = http.get(f"{target.base_url}/admin/state", headers=headers,
                                     timeout=5).json()
                    timeline.append((time.time() - started, [
                        (r["replica_id"], r["snapshot"]["total_blocks"])
                        for r in state["replicas"]], state["queue"]["requests"]))
                except httpx.HTTPError:
                    pass
                stop.wait(1.0)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        records, makespan = asyncio.run(replay(specs, [target.base_url], API_KEY,
                                                   app_config(config).replica.model_name))
        stop.set()
        watcher.join()
        metrics = http.get(f"{target.base_url}/metrics").text
    first = {rid for rid, _ in timeline[0][1]} if timeline else set()
    joined = next(((t, [r for r in reps if r[0] not in first]) for t, reps, _ in timeline
                   if any(r[0] not in first for r in reps)), None)
    new_ids = {rid for rid, _ in joined[1]} if joined else set()
    decisions_on_new = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                           if line.startswith("blockserve_decisions_total{")
                           and any(f'replica="{rid}"' in line for rid in new_ids))
    preemptions = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                      if line.startswith("blockserve_replica_preemptions_total{"))
    ok = [r for r in records if r.status == 200]
    return {"second_replica_joined_s": joined[0] if joined else None,
            "new_replica_capacity_blocks": joined[1][0][1] if joined else None,
            "requests_routed_to_new_replica": decisions_on_new,
            "max_queue": max((q for _, _, q in timeline), default=0),
            "ok": len(ok), "rejected": sum(r.status == 429 for r in records),
            "ttft_p50_s": percentile([r.ttft_s for r in ok], 0.5),
            "ttft_p99_s": percentile([r.ttft_s for r in ok], 0.99),
            "preemptions_seen_by_router": preemptions, "makespan_s": makespan,
            "replica_timeline": timeline}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--end-rate", type=float, default=8.0,
                        help="arrivals per second at the end of the ramp")
    parser.add_argument("--max-replicas", type=int, default=2)
    parser.add_argument("--out", default="results/autoscale.json")
    args = parser.parse_args()
    specs = ramp(n=args.requests, end_rate=args.end_rate)
    print(f"ramp: {len(specs)} requests over {specs[-1].arrival_s:.0f}s")
    results = {name: run(name, policy, specs, args.max_replicas)
               for name, policy in POLICIES.items()}
    for name, r in results.items():
        summary = {k: v for k, v in r.items() if k != "replica_timeline"}
        print(f"{name}: {json.dumps(summary)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
