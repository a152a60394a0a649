"""Soak: thousands of mixed requests against the real deployment; nothing may be lost.

    python -m blockserve.bench.soak [--requests 2000] [--concurrency 48]

Mix: streaming and not, chat and completions, clients that disconnect mid-stream or
before the first token, and bad requests. At the end every request is accounted for
(answered, rejected with a 4xx, or disconnected by the client), the router's ledger holds
no reservation, no replica holds a block, and the router's memory is compared with its
memory after a warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import time
from pathlib import Path

import httpx

from blockserve.bench.targets import API_KEY
from blockserve.tools.launch import app_config, load_config, replica_count, serve_run

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _parent(pid: int) -> int:
    return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


def router_rss_mb(serve_pid: int) -> float:
    """RSS of the router replica that `serve run` (process `serve_pid`) started."""
    for proc in Path("/proc").iterdir():
        try:
            if not (proc.name.isdigit()
                    and b"ServeReplica:blockserve:Router" in (proc / "cmdline").read_bytes()):
                continue
            pid = int(proc.name)
            while pid > 1 and pid != serve_pid:
                pid = _parent(pid)
            if pid == serve_pid:
                for line in (proc / "status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            continue
    return float("nan")


async def one(http: httpx.AsyncClient, kind: str, rng: random.Random, model: str) -> str:
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(
        rng.randint(5, 120)))
    chat = {"model": model, "messages": [{"role": "user", "content": words}],
            "max_tokens": rng.randint(4, 96), "ignore_eos": True}
    if kind == "bad":
        response = await http.post("/v1/chat/completions", json={**chat, "max_tokens": -1})
        return f"bad:{response.status_code}"
    if kind == "chat":
        response = await http.post("/v1/chat/completions", json=chat)
        return f"chat:{response.status_code}"
    if kind == "completion":
        response = await http.post("/v1/completions", json={
            "model": model, "prompt": words, "max_tokens": chat["max_tokens"],
            "ignore_eos": True})
        return f"completion:{response.status_code}"
    body = {**chat, "stream": True}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return f"{kind}:{response.status_code}"
        if kind == "disconnect_before_first_token":
            return f"{kind}:closed"
        lines = 0
        async for line in response.aiter_lines():
            lines += 1
            if kind == "disconnect_mid_stream" and lines >= 3:
                return f"{kind}:closed"
        return f"{kind}:{response.status_code}"


async def soak(base_url: str, requests: int, concurrency: int, seed: int, model: str
               ) -> collections.Counter:
    rng = random.Random(seed)
    kinds = (["stream"] * 5 + ["chat"] * 3 + ["completion"] * 2 + ["bad"] +
             ["disconnect_mid_stream", "disconnect_before_first_token"])
    outcomes: collections.Counter = collections.Counter()
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, headers=HEADERS, timeout=120,
                                 limits=httpx.Limits(max_connections=concurrency * 2)) as http:
        async def guarded(kind: str) -> None:
            async with gate:
                try:
                    outcomes[await one(http, kind, rng, model)] += 1
                except httpx.HTTPError as exc:
                    outcomes[f"{kind}:client-error:{type(exc).__name__}"] += 1

        await asyncio.gather(*(guarded(rng.choice(kinds)) for _ in range(requests)))
    return outcomes


def idle_state(base_url: str) -> dict:
    state = httpx.get(f"{base_url}/admin/state", headers=HEADERS, timeout=10).json()
    return {"queued": state["queue"]["requests"],
            "ledger_reserved_blocks": sum(r["blocks"]["reserved"] for r in state["replicas"]),
            "in_flight": sum(r["in_flight_requests"] for r in state["replicas"]),
            "replica_held_blocks": sum(r["snapshot"]["held_blocks"] for r in state["replicas"]),
            "replica_running": sum(r["snapshot"]["running"] for r in state["replicas"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = load_config()
    with serve_run(config, expected_replicas=replica_count(config),
                   env={"BLOCKSERVE_API_KEY": API_KEY}) as run:
        model = app_config(config).replica.model_name
        asyncio.run(soak(run.base_url, 200, args.concurrency, args.seed + 1, model))  # warm-up
        rss_before = router_rss_mb(run.process.pid)
        started = time.time()
        outcomes = asyncio.run(soak(run.base_url, args.requests, args.concurrency, args.seed,
                                    model))
        elapsed = time.time() - started
        time.sleep(3)
        final = idle_state(run.base_url)
        rss_after = router_rss_mb(run.process.pid)
    accounted = sum(outcomes.values())
    print(f"{accounted} of {args.requests} requests accounted for in {elapsed:.0f}s:")
    for outcome, count in sorted(outcomes.items()):
        print(f"  {outcome:<45} {count}")
    print(f"final state: {final}")
    print(f"router RSS: {rss_before:.0f} MB after warm-up, {rss_after:.0f} MB at the end")
    assert accounted == args.requests
    assert all(v == 0 for v in final.values()), final


if __name__ == "__main__":
    main()
