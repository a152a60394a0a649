"""Two Ray nodes on this machine (ray.cluster_utils.Cluster: two raylets): routers and
replicas spread over both, served through Serve's HAProxy on the head; the worker node's
raylet is killed under load and the head's router and replica go on serving. The
replicas are echo replicas (tools/echo_replica.py): what is tested is Ray's and Serve's
placement and failure handling around the real router, not the engines."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from blockserve.tools.launch import listen_ports, load_config, serve_env, serve_run
from conftest import API_KEY

ECHO_APP = "blockserve.tools.echo_replica:build_echo_app"
SETTLE_S = 1.0  # after the node's death, every new request is answered from this on


def spread_config() -> dict:
    """deploy.yaml on echo replicas: one router and one replica per node, the HTTP proxy
    on the head only (two proxies on one machine would want the same port)."""
    config = load_config()
    config["proxy_location"] = "HeadOnly"
    app = config["applications"][0]
    app["import_path"] = ECHO_APP
    app["args"]["router"]["prefix_index"] = "approximate"
    for deployment in app["deployments"]:
        deployment["num_replicas"] = 2
        deployment["max_replicas_per_node"] = 1
    return config


def placed_on(address: str) -> dict[str, set[str]]:
    """The nodes the live Router and Replica actors run on, by deployment."""
    import ray
    from ray.util.state import list_actors

    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    nodes: dict[str, set[str]] = {"Router": set(), "Replica": set()}
    for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
        for name in nodes:
            if actor.class_name.endswith(f":{name}"):
                nodes[name].add(actor.node_id)
    return nodes


async def load(base_url: str, seconds: float, events: list) -> None:
    """Completions one after another on 4 connections; (sent, ended, status) of each."""
    body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 4}
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=base_url, timeout=30,
                                 headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        async def client():
            while time.monotonic() < deadline:
                sent = time.monotonic()
                try:
                    status = (await http.post("/v1/completions", json=body)).status_code
                except httpx.HTTPError as exc:
                    status = repr(exc)
                events.append((sent, time.monotonic(), status))
        await asyncio.gather(*(client() for _ in range(4)))


@pytest.mark.deployment
@pytest.mark.own_deployment  # its own Ray cluster: conftest runs it before the shared one
def test_routers_and_replicas_on_two_nodes_survive_one_nodes_raylet_killed(monkeypatch):
    from ray.cluster_utils import Cluster

    # Serve's proxy actor starts HAProxy inside the cluster: the raylets need the env.
    # short: HAProxy allows 97 characters of socket path, and Serve adds the node id
    workdir = Path(tempfile.mkdtemp(prefix="bsn", dir="/tmp"))
    for key, value in serve_env(workdir, *listen_ports(2)).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("BLOCKSERVE_API_KEY", API_KEY)
    # A dashboard port of its own: the state API (placed_on) needs this cluster's
    # dashboard, and Ray's default port may belong to another Ray instance.
    dashboard_port, = listen_ports(1)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "dashboard_port": dashboard_port})
    try:
        worker = cluster.add_node(num_cpus=1)
        with serve_run(spread_config(), expected_replicas=2, address=cluster.address) as run:
            nodes = placed_on(cluster.address)
            assert len(nodes["Router"]) == len(nodes["Replica"]) == 2, nodes
            events: list = []

            async def scenario() -> float:
                loading = asyncio.ensure_future(load(run.base_url, 12.0, events))
                await asyncio.sleep(3.0)
                await asyncio.to_thread(cluster.remove_node, worker, False)  # SIGKILL
                killed = time.monotonic()
                await loading
                return killed

            killed = asyncio.run(scenario())
            failed = [e for e in events if e[2] != 200]
            after = [e for e in events if e[0] >= killed + SETTLE_S]
            print(f"\n{len(events)} requests, {len(failed)} failed "
                  f"({[e[2] for e in failed][:5]}), {len(after)} sent {SETTLE_S:g}s or more "
                  f"after the kill")
            assert after and all(e[2] == 200 for e in after), failed
            # The dead node's router stopped posting 9 s ago: no router lists it, even
            # while the board (perhaps on that node too) is being restarted.
            state = httpx.get(f"{run.base_url}/admin/state", timeout=10,
                              headers={"Authorization": f"Bearer {API_KEY}"}).json()
            assert len(state["routers"]) == 1, state["routers"]
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
