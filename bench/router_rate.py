"""The highest request rate the router tier sustains when the replicas answer at once
(tools/echo_replica.py: no engine), with 1 and 2 routers: deploy.yaml behind `serve run`
(HAProxy, the routers, two echo replicas), a closed loop of non-streamed completions at
each concurrency for `--seconds`, and the routers' CPU (their processes' user + system
time over the window) per request; before the load, the routers' CPU and memory idle.
The load generator shares the machine's 2 cores.

    flock /tmp/blockserve-heavy.lock python -m blockserve.bench.router_rate \
        --routers 1 2 --concurrency 8 32 --seconds 15 --out docs/results/router_rate

`--floor` splits one request's latency at a time instead: the same echo answer from
uvicorn serving a FastAPI app alone (as `vllm serve` serves its API), from that app as
one Serve deployment behind Serve's HAProxy (no router), and through one blockserve
router to echo replicas, each started twice in A B C C B A order. With `--stream` the
completions are streamed and the time to the first token's event is measured instead
(the echo sends every event at once: what the path adds to a stream's TTFT):

    flock /tmp/blockserve-heavy.lock python -m blockserve.bench.router_rate --floor \
        --seconds 20 --out docs/results/router_floor
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import psutil

from blockserve.bench.provenance import announce
from blockserve.bench.report import percentile
from blockserve.tools.launch import (listen_ports, load_config, serve_run, stop,
                                     wait_until_answers)

API_KEY = "router-rate-key"
ECHO_APP = "blockserve.tools.echo_replica:build_echo_app"
ECHO_API = "blockserve.tools.echo_replica:echo_api"  # FastAPI alone
PLAIN_ECHO = {"applications": [{"name": "echo", "route_prefix": "/",
                                "import_path": "blockserve.tools.echo_replica:plain_echo"}]}
IDLE_S = 10.0


def echo_config(routers: int) -> dict:
    """deploy.yaml with echo replicas, `routers` routers and the approximate prefix index
    (echo replicas publish no KV events)."""
    config = load_config()
    app = config["applications"][0]
    app["import_path"] = ECHO_APP
    app["args"]["router"]["prefix_index"] = "approximate"
    for deployment in app["deployments"]:
        if deployment["name"] == "Router":
            deployment["num_replicas"] = routers
    return config


async def closed_loop(base_url: str, concurrency: int, seconds: float,
                      stream: bool = False) -> list[float]:
    """`concurrency` clients each sending the next completion when the last ended;
    returns each answered request's latency (s): to the whole answer, or with `stream` to
    its first token's event. Any answer but 200 fails the run."""
    body = {"model": load_config()["applications"][0]["args"]["replica"]["served_model_name"],
            "prompt": "the quick brown fox " * 30, "max_tokens": 16, "stream": stream}
    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=base_url, timeout=30,
                                 headers={"Authorization": f"Bearer {API_KEY}"},
                                 limits=httpx.Limits(max_connections=concurrency)) as http:
        async def client() -> None:
            while time.monotonic() < deadline:
                sent = time.monotonic()
                if not stream:
                    response = await http.post("/v1/completions", json=body)
                    if response.status_code != 200:
                        raise RuntimeError(f"{response.status_code}: {response.text[:200]}")
                    latencies.append(time.monotonic() - sent)
                    continue
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        raise RuntimeError(f"{response.status_code}: {await response.aread()}")
                    first = None
                    async for line in response.aiter_lines():  # read to the end
                        if first is None and '"text"' in line:
                            first = time.monotonic() - sent
                    latencies.append(first)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies


def router_processes(base_url: str) -> list[psutil.Process]:
    state = httpx.get(f"{base_url}/admin/state", timeout=10,
                      headers={"Authorization": f"Bearer {API_KEY}"}).json()
    return [psutil.Process(r["pid"]) for r in state["routers"]]


def cpu_s(processes: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in processes)


def measure(routers: int, levels: list[int], seconds: float) -> dict:
    results = {}
    with serve_run(echo_config(routers), expected_replicas=2,
                   env={"BLOCKSERVE_API_KEY": API_KEY}) as run:
        deadline = time.monotonic() + 60
        while len(processes := router_processes(run.base_url)) < routers:
            assert time.monotonic() < deadline, "the routers did not all report"
            time.sleep(0.5)
        asyncio.run(closed_loop(run.base_url, levels[0], 2.0))  # warm-up
        time.sleep(2.0)
        idle_before = cpu_s(processes)
        time.sleep(IDLE_S)  # no traffic: snapshot polls and board reports only
        results["idle"] = {"router_cpu_share_of_a_core": (cpu_s(processes) - idle_before) / IDLE_S,
                           "router_rss_mb": sum(p.memory_info().rss for p in processes) / 2**20}
        for concurrency in levels:
            load_before, cpu_before = os.getloadavg()[0], cpu_s(processes)
            started = time.monotonic()
            latencies = asyncio.run(closed_loop(run.base_url, concurrency, seconds))
            wall = time.monotonic() - started
            router_cpu = cpu_s(processes) - cpu_before
            results[f"concurrency {concurrency}"] = figures = {
                "requests": len(latencies), "requests_per_s": len(latencies) / wall,
                "latency_p50_ms": percentile(latencies, 0.5) * 1e3,
                "latency_p99_ms": percentile(latencies, 0.99) * 1e3,
                "router_cpu_us_per_request": router_cpu / len(latencies) * 1e6,
                "router_cpu_share_of_a_core": router_cpu / wall,
                "load_average_1m_before": load_before}
            print(f"{routers} routers, concurrency {concurrency}: " + ", ".join(
                f"{k} {v:.4g}" for k, v in figures.items()), flush=True)
    return results


@contextlib.contextmanager
def uvicorn_alone() -> Iterator[str]:
    """`echo_api` served by uvicorn in its own process, as vLLM's API server is; its URL."""
    port = listen_ports(1)[0]
    process = subprocess.Popen([sys.executable, "-m", "uvicorn", ECHO_API, "--port",
                                str(port), "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answers(f"{url}/v1/models", process, timeout_s=60)
        yield url
    finally:
        stop(process)


def one_at_a_time(base_url: str, seconds: float, stream: bool = False) -> dict:
    asyncio.run(closed_loop(base_url, 1, 2.0, stream))  # warm-up
    latencies = asyncio.run(closed_loop(base_url, 1, seconds, stream))
    return {"requests": len(latencies), "latency_p50_ms": percentile(latencies, 0.5) * 1e3,
            "latency_p99_ms": percentile(latencies, 0.99) * 1e3}


@contextlib.contextmanager
def served(config: dict, expected_replicas: int | None) -> Iterator[str]:
    """A Serve config run with `serve run`, its URL; stopped on exit."""
    with serve_run(config, expected_replicas=expected_replicas,
                   env={"BLOCKSERVE_API_KEY": API_KEY}) as run:
        yield run.base_url


# Each front end of `--floor`, by name: a context manager that yields its URL.
FRONT_ENDS = {"uvicorn alone": uvicorn_alone,
              "Serve ingress + HAProxy": lambda: served(PLAIN_ECHO, None),
              "blockserve router + echo replicas": lambda: served(echo_config(1), 2)}


def floor(seconds: float, stream: bool = False) -> dict:
    """One request at a time, the same echo answer behind each front end, A B C C B A."""
    names = list(FRONT_ENDS)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for name in names + names[::-1]:
        with FRONT_ENDS[name]() as url:
            runs[name].append(one_at_a_time(url, seconds, stream))
        print(f"{name}: {runs[name][-1]}", flush=True)
    return {name: {"runs": values,
                   "latency_p50_ms_mean": sum(v["latency_p50_ms"] for v in values) / len(values)}
            for name, values in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--floor", action="store_true",
                        help="one request at a time behind uvicorn alone, Serve's ingress "
                             "and the router (ignores --routers and --concurrency)")
    parser.add_argument("--stream", action="store_true",
                        help="with --floor: streamed completions, timed to the first token")
    parser.add_argument("--out", default="docs/results/router_rate")
    args = parser.parse_args()
    provenance = announce("router_rate")

    def write(results: dict) -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps({
            "command": "python -m blockserve.bench.router_rate " + shlex.join(sys.argv[1:]),
            **provenance, "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cores": os.cpu_count(), "results": results}, indent=1))

    if args.floor:
        write(floor(args.seconds, args.stream))
    else:
        results = {}
        for routers in args.routers:
            results[f"{routers} router" + ("s" if routers > 1 else "")] = measure(
                routers, args.concurrency, args.seconds)
            write(results)
    print(f"wrote {args.out}.json")


if __name__ == "__main__":
    main()
