"""The router's CPU per request, for capacity planning: the production router parts
(validation, demand with the model's tokenizer, the admission queue and placement over
the ledger, the relay, the metrics), wired as router/ingress.py wires them, in one
process against replicas that answer at once (`EchoReplicas`). CPU microseconds per
request by stage: parse, demand, placement, relay (less its metrics calls) and metrics;
plus one `/metrics` scrape, and one output length heard from another router. The HTTP
server (uvicorn), HAProxy and the network are not in it: the deployed rate
(bench/router_rate.py) has them.

    python -m blockserve.bench.router_cost --requests 2000 --replicas 2 64 \
        --out docs/results/router_cost
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import AsyncIterator

from starlette.requests import Request

from blockserve.bench.provenance import announce
from blockserve.protocol.chunks import COMPLETIONS, ReplicaChunk
from blockserve.protocol.router_policies import Transport
from blockserve.protocol.snapshot import BlockSnapshot
from blockserve.router.admission import AdmissionQueue
from blockserve.router.demand import DemandEstimator
from blockserve.router.failover import Failover
from blockserve.router.ledger import Ledger
from blockserve.router.metrics import RouterMetrics
from blockserve.router.relay import Relay
from blockserve.router.shared_lengths import POSTED_LENGTHS
from blockserve.router.validation import RequestValidator
from blockserve.tools.launch import app_config

PROMPT = "the quick brown fox " * 30  # ~150 tokens, as the deployment tests send
MAX_TOKENS = 16
MESSAGES = 4  # stream messages per response (stream_coalesce_ms groups the tokens)
STAGES = ("parse", "demand", "placement", "relay", "metrics")


class EchoReplicas(Transport):
    """Replicas that answer at once: `MESSAGES` stream messages, usage, [DONE], each
    chunk with a snapshot as a real replica's carries."""

    def __init__(self, snapshot: BlockSnapshot) -> None:
        self.snapshot = snapshot

    async def generate(self, replica_id: str, endpoint: str, body: dict
                       ) -> AsyncIterator[ReplicaChunk]:
        snap = {**self.snapshot.to_dict(), "timestamp": time.time()}
        per = MAX_TOKENS // MESSAGES
        for i in range(MESSAGES):
            event = {"id": "cmpl-1", "object": "text_completion", "model": "m",
                     "choices": [{"index": 0, "text": " x" * per, "finish_reason":
                                  "length" if i == MESSAGES - 1 else None}]}
            yield ReplicaChunk("sse", 200, f"data: {json.dumps(event)}\n\n", snap, replica_id)
        usage = {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [],
                 "usage": {"prompt_tokens": 150, "completion_tokens": MAX_TOKENS,
                           "total_tokens": 150 + MAX_TOKENS}}
        # compact, as vLLM writes it: the router finds the usage event by its text
        compact = json.dumps(usage, separators=(",", ":"))
        yield ReplicaChunk("sse", 200, f"data: {compact}\n\ndata: [DONE]\n\n",
                           snap, replica_id)


class TimedMetrics(RouterMetrics):
    """RouterMetrics that adds the CPU time of every call to `spent`."""

    spent = 0.0

    def __getattribute__(self, name: str):
        attribute = super().__getattribute__(name)
        if name in ("first_response", "finished", "admitted", "routing_outcome"):
            def timed(*args, **kwargs):
                started = time.thread_time()
                try:
                    return attribute(*args, **kwargs)
                finally:
                    TimedMetrics.spent += time.thread_time() - started
            return timed
        return attribute


def http_request(body: bytes) -> Request:
    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "headers": headers}, receive)


async def measure(requests: int, replicas: int) -> dict:
    from transformers import AutoTokenizer

    config = app_config()
    # deploy.yaml's router; the approximate prefix index, which needs no KV events
    router = type(config.router).model_validate({**config.router.model_dump(),
                                                 "prefix_index": "approximate"})
    snapshot = BlockSnapshot(timestamp=time.time(), total_blocks=160, block_size=32,
                             free_blocks=160, max_model_len=config.replica.engine_args[
                                 "max_model_len"])
    ledger = Ledger(stale_after_s=1e9, prefix_index=router.prefix_index.build)
    for i in range(replicas):
        ledger.report(f"r{i}", snapshot)
    queue = AdmissionQueue(ledger, router.placement.policy, router.queue_order.policy,
                           max_requests=router.max_queued_requests,
                           max_tokens=router.max_queued_tokens, timeout_s=router.queue_timeout_s)
    metrics = TimedMetrics("app", "p", queue)
    queue.on_taken = lambda lease: metrics.admitted(lease.replica_id, lease.queue_wait_s)
    transport = EchoReplicas(snapshot)
    failover = Failover(queue, ledger, transport.on_removed, router.max_retries)
    estimator = DemandEstimator(AutoTokenizer.from_pretrained(config.replica.model),
                                router.output_predictor.policy)
    validator = RequestValidator(config.replica.model_name, router.max_body_bytes)
    relay = Relay(transport, queue, ledger, failover, metrics, estimator,
                  lambda replica_id, data: ledger.report(replica_id,
                                                         BlockSnapshot.from_dict(data)))
    body = json.dumps({"model": config.replica.model_name, "prompt": PROMPT,
                       "max_tokens": MAX_TOKENS, "stream": True}).encode()
    spent: dict[str, float] = defaultdict(float)
    warmup = min(100, requests // 10)
    for n in range(warmup + requests):
        if n == warmup:
            spent.clear()
            TimedMetrics.spent = 0.0
        arrived = time.time()
        t = time.thread_time()
        _, request = await validator.parse(http_request(body), COMPLETIONS)
        t, spent["parse"] = time.thread_time(), spent["parse"] + time.thread_time() - t
        demand = estimator.completion(request, snapshot.block_size, snapshot.max_model_len,
                                      priority=0, tenant="default")
        t, spent["demand"] = time.thread_time(), spent["demand"] + time.thread_time() - t
        before = TimedMetrics.spent
        lease = await queue.admit(demand)
        t, spent["placement"] = time.thread_time(), (spent["placement"] + time.thread_time() - t
                                                     - (TimedMetrics.spent - before))
        before = TimedMetrics.spent
        response = await relay.respond(COMPLETIONS, json.loads(body), lease, arrived)
        async for _ in response.body_iterator:
            pass
        spent["relay"] += time.thread_time() - t - (TimedMetrics.spent - before)
    assert ledger.reserved_blocks() == 0
    posted = estimator.lengths.posted()
    assert len(posted) == min(warmup + requests, POSTED_LENGTHS)
    spent["metrics"] = TimedMetrics.spent
    started = time.thread_time()
    scrapes = 20
    for _ in range(scrapes):
        metrics.exposition()
    scrape_us = (time.thread_time() - started) / scrapes * 1e6
    # Off the request path: learning the lengths another router posted to the board
    # (router/shared_lengths.py), per length; with N routers each hears N - 1 per N requests.
    # Each post comes from another router, so all of its lengths are learned.
    others = 20
    started = time.thread_time()
    for other in range(others):
        estimator.lengths.hear({f"router-{other}": posted})
    hear_us = (time.thread_time() - started) / (others * len(posted)) * 1e6
    per_request = {stage: spent[stage] / requests * 1e6 for stage in STAGES}
    return {"cpu_us_per_request": {**per_request, "total": sum(per_request.values())},
            "scrape_cpu_us": scrape_us, "hear_cpu_us_per_length": hear_us,
            "requests": requests, "replicas": replicas,
            "placement": router.placement.cls, "prefix_index": "approximate",
            "prompt_tokens": demand.prompt_tokens, "stream_messages": MESSAGES + 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 64])
    parser.add_argument("--out", default="docs/results/router_cost")
    args = parser.parse_args()
    provenance = announce("router_cost")
    results = {}
    for replicas in args.replicas:
        results[f"{replicas} replicas"] = figures = asyncio.run(measure(args.requests, replicas))
        print(f"{replicas} replicas: " + ", ".join(
            f"{k} {v:.1f}" for k, v in figures["cpu_us_per_request"].items())
            + f"; scrape {figures['scrape_cpu_us']:.0f} us; a length heard "
            f"{figures['hear_cpu_us_per_length']:.1f} us", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps({
        "command": "python -m blockserve.bench.router_cost " + shlex.join(sys.argv[1:]),
        **provenance, "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_1m_after": os.getloadavg()[0], "results": results}, indent=1))
    print(f"wrote {args.out}.json")


if __name__ == "__main__":
    main()
