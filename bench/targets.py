"""What a benchmark runs against: blockserve under a given policy set, or what a user
would run without it (raw vLLM api_servers behind client-side round robin). Every target
uses the engine settings of deploy/deploy.yaml and exposes its KV usage and preemptions."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import httpx

from blockserve.tools.launch import free_port, load_config, replica_count, serve_run, stop, with_args

API_KEY = "bench"
# One keep-alive client for every scrape: a fresh client loads the CA bundle, seconds of
# CPU on a saturated 2-core machine, and the sampler thread would hold up the load client.
http = httpx.Client(timeout=10)


@dataclass
class Target:
    name: str
    base_urls: list[str]
    model: str
    kv_usage: Callable[[], dict[str, float]]  # per replica, now
    preemptions: Callable[[], float]  # cumulative
    startup_s: float = 0.0
    notes: dict = field(default_factory=dict)
    # Cumulative admission counters of blockserve's router (None for other targets): where
    # a request waits before it reaches an engine, and which replica it went to.
    router_counters: Callable[[], dict] | None = None
    # blockserve's KV usage and queues now, from one scrape (`replica_state`; None for
    # other targets, whose sampler reads `kv_usage` alone)
    replica_state: Callable[[], dict] | None = None


def _scrape(url: str) -> str:
    return http.get(f"{url}/metrics").text


def _samples(text: str, name: str) -> dict[str, float]:
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return {labels or "": float(value) for labels, value in pattern.findall(text)}


# Time to first token as two points of the path measure it (histograms' sum and count):
# from the request's arrival at the router, and inside vLLM (AsyncLLM's arrival to its
# first output; the replicas' counters, which reach the router with its polls).
TTFT_AT = {"router": "blockserve_time_to_first_token_seconds",
           "engine": "blockserve_replica_time_to_first_token_seconds"}
# vLLM's own inter-token latency in the replicas (sum and count): the engines' side of a
# client's ITL, without the way out through the router.
ENGINE_ITL = "blockserve_replica_inter_token_latency_seconds"


def router_counters(text: str) -> dict:
    """The router's admission counters in a scrape: requests admitted, their summed wait
    in the admission queue, decisions per replica, and TTFT's sum and count as the router
    and the engines measure it (`TTFT_AT`)."""
    decisions: dict[str, float] = {}
    for labels, value in _samples(text, "blockserve_decisions_total").items():
        replica = _replica_label(labels)
        decisions[replica] = decisions.get(replica, 0.0) + value
    ttft = {f"{at}_ttft_{part}": sum(_samples(text, f"{name}_{part}").values())
            for at, name in TTFT_AT.items() for part in ("sum", "count")}
    itl = {f"engine_itl_{part}": sum(_samples(text, f"{ENGINE_ITL}_{part}").values())
           for part in ("sum", "count")}
    return {"admitted": sum(_samples(text, "blockserve_admission_wait_seconds_count").values()),
            "admission_wait_s": sum(
                _samples(text, "blockserve_admission_wait_seconds_sum").values()),
            "decisions": decisions, **ttft, **itl}


def kv_usage_of(text: str) -> dict[str, float]:
    """From a scrape: each replica's held KV blocks over its capacity."""
    values = _samples(text, "blockserve_replica_kv_usage_ratio")
    return {_replica_label(k): v for k, v in values.items()}


def replica_state(text: str) -> dict:
    """From a scrape: each replica's KV usage, the requests waiting in the router's queue,
    and per replica those running and waiting in its engine and its free (cached or
    empty) blocks."""
    running, waiting, free = {}, {}, {}
    for labels, value in _samples(text, "blockserve_replica_requests").items():
        if 'state="waiting"' in labels:
            waiting[_replica_label(labels)] = value
        elif 'state="running"' in labels:
            running[_replica_label(labels)] = value
    for labels, value in _samples(text, "blockserve_replica_kv_blocks").items():
        if 'state="cached"' in labels or 'state="empty"' in labels:
            replica = _replica_label(labels)
            free[replica] = free.get(replica, 0.0) + value
    return {"kv_usage": kv_usage_of(text),
            "router_queue": sum(_samples(text, "blockserve_queue_requests").values()),
            "engine_running": running, "engine_waiting": waiting, "free_blocks": free}


def counters_since(before: dict, after: dict) -> dict:
    """`router_counters` over an interval: `after` less `before`, with the mean wait, the
    mean TTFT at the router and in the engines and the engines' mean ITL (None where none
    was counted)."""
    admitted = after["admitted"] - before["admitted"]
    wait = after["admission_wait_s"] - before["admission_wait_s"]
    means = {}
    for key in [f"{at}_ttft" for at in TTFT_AT] + ["engine_itl"]:
        count = after[f"{key}_count"] - before[f"{key}_count"]
        total = after[f"{key}_sum"] - before[f"{key}_sum"]
        means[f"{key}_mean_s"] = total / count if count else None
    return {"admitted": admitted, "admission_wait_mean_s": wait / admitted if admitted else 0.0,
            "decisions": {replica: n - before["decisions"].get(replica, 0.0)
                          for replica, n in after["decisions"].items()}, **means}


def _replica_label(labels: str) -> str:
    match = re.search(r'replica="([^"]+)"', labels)
    return match.group(1) if match else labels


def blockserve_config(router: dict | None = None, scheduler: dict | None = None,
                      engine_args: dict | None = None, replica_args: dict | None = None) -> dict:
    """The Serve config `blockserve` deploys: deploy/deploy.yaml with these settings over
    its own (a setting not given stays deploy.yaml's)."""
    config = load_config()
    replica = config["applications"][0]["args"]["replica"]
    return with_args(config, router=router or {}, replica={
        "scheduler": replica.get("scheduler", {}) if scheduler is None else scheduler,
        "engine_args": {**replica["engine_args"], **(engine_args or {})},
        **(replica_args or {})})


@contextlib.contextmanager
def blockserve(name: str, router: dict | None = None, scheduler: dict | None = None,
               engine_args: dict | None = None, replica_args: dict | None = None,
               env: dict[str, str] | None = None) -> Iterator[Target]:
    """deploy/deploy.yaml, with these router settings, replica scheduler policies (in
    place of deploy.yaml's), vLLM engine arguments (verbatim) and other replica settings
    where given; `env`: more of `serve run`'s environment, which Ray's workers inherit."""
    config = blockserve_config(router, scheduler, engine_args, replica_args)
    model = config["applications"][0]["args"]["replica"]["served_model_name"]
    with serve_run(config, expected_replicas=replica_count(config),
                   env={"BLOCKSERVE_API_KEY": API_KEY, **(env or {})}) as run:
        def preemptions() -> float:
            return sum(_samples(_scrape(run.base_url),
                                "blockserve_replica_preemptions_total").values())

        args = config["applications"][0]["args"]
        yield Target(name, [run.base_url], model, lambda: kv_usage_of(_scrape(run.base_url)),
                     preemptions, run.startup_s,
                     {"router": args["router"], "scheduler": args["replica"]["scheduler"],
                      "engine_args": args["replica"]["engine_args"]},
                     lambda: router_counters(_scrape(run.base_url)),
                     lambda: replica_state(_scrape(run.base_url)))


def _engine_flags(engine_args: dict) -> list[str]:
    flags = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, str(value)]
    return flags


PREFIX_CACHE_AFFINITY = "ray.serve.llm.request_router:PrefixCacheAffinityRouter"


@contextlib.contextmanager
def ray_serve_llm(name: str, request_router: str | None = None) -> Iterator[Target]:
    """Ray Serve LLM (`ray.serve.llm:build_openai_app`) on deploy.yaml's engine settings
    and replica count, with its default router or `request_router`. On CPU each replica
    takes a {CPU: 2} bundle, so Ray is given more logical CPUs than the machine has."""
    config = load_config()
    replica = config["applications"][0]["args"]["replica"]
    replicas = replica_count(config)
    deployment_config: dict = {"num_replicas": replicas}
    if request_router:
        deployment_config["request_router_config"] = {"request_router_class": request_router}
    llm_config = {
        "model_loading_config": {"model_id": replica["served_model_name"],
                                 "model_source": os.path.expanduser(replica["model"])},
        "accelerator_config": {"kind": "cpu"},
        "engine_kwargs": replica["engine_args"],
        "deployment_config": deployment_config,
        "callback_config": {"callback_class": "blockserve.bench.peers:BindOmpThreadsByRank",
                            "callback_kwargs": {"binds": replica["omp_threads_bind"]}},
    }
    peer = {"proxy_location": "EveryNode", "http_options": {"host": "127.0.0.1"},
            "applications": [{"name": "llm", "route_prefix": "/",
                              "import_path": "ray.serve.llm:build_openai_app",
                              "args": {"llm_configs": [llm_config]}}]}
    env = {"RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 4 * replicas})}
    with serve_run(peer, expected_replicas=None, env=env, startup_timeout_s=600) as run:
        # Answering one completion shows one replica up; a concurrent warm-up reaches the
        # others (Serve's REST API, which lists replica states, needs Ray's auth token).
        warm_up = [{"model": replica["served_model_name"], "prompt": f"warm up {i}",
                    "max_tokens": 4} for i in range(4 * replicas)]
        with ThreadPoolExecutor(len(warm_up)) as pool:
            list(pool.map(lambda body: http.post(f"{run.base_url}/v1/completions", json=body,
                                                 timeout=300), warm_up))
        yield Target(name, [run.base_url], replica["served_model_name"], kv_usage=dict,
                     preemptions=lambda: math.nan, startup_s=run.startup_s,
                     notes={"request_router": request_router or "default (power of two)",
                            "kv_usage_and_preemptions": "not exported by Ray Serve LLM"})


@contextlib.contextmanager
def raw_vllm(name: str = "raw vLLM x2 (client round robin)", replicas: int = 2,
             engine_args: dict | None = None) -> Iterator[Target]:
    """`python -m vllm.entrypoints.openai.api_server` per replica, the same engine args
    (with `engine_args` in place of deploy.yaml's where given)."""
    replica = load_config()["applications"][0]["args"]["replica"]
    model = os.path.expanduser(replica["model"])
    binds = replica.get("omp_threads_bind") or ["nobind"]
    workdir = Path(tempfile.mkdtemp(prefix="bs-raw-"))
    processes, urls = [], []
    started = time.time()
    try:
        for rank in range(replicas):
            port = free_port()
            log = open(workdir / f"server-{rank}.log", "wb")
            # Treated like the Ray workers of a blockserve target: nice 15, in the load
            # client's session (see controller/launch.py), in its own process group.
            processes.append(subprocess.Popen(
                ["nice", "-n", "15", sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                 "--model", model,
                 "--served-model-name", replica["served_model_name"], "--host", "127.0.0.1",
                 "--port", str(port), "--api-key", API_KEY,
                 *_engine_flags({**replica["engine_args"], **(engine_args or {})})],
                env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": binds[rank % len(binds)]},
                stdout=log, stderr=subprocess.STDOUT, process_group=0))
            urls.append(f"http://127.0.0.1:{port}")
        for url, process in zip(urls, processes):
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"api_server exited; see {workdir}")
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                time.sleep(2)

        def kv_usage() -> dict[str, float]:
            return {f"server-{i}": sum(_samples(_scrape(u), "vllm:kv_cache_usage_perc").values())
                    for i, u in enumerate(urls)}

        def preemptions() -> float:
            return sum(sum(_samples(_scrape(u), "vllm:num_preemptions_total").values())
                       for u in urls)

        yield Target(name, urls, replica["served_model_name"], kv_usage, preemptions,
                     time.time() - started)
    finally:
        for process in processes:
            stop(process, timeout_s=20)
