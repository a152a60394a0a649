"""Shared fixtures: the tiny model, and the real deployment started once per session."""

import asyncio
import contextlib
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

from blockserve.tools.launch import EngineShape, app_config, load_config, replica_count, serve_run

# deploy/deploy.yaml's engine: the model name and KV blocks its replicas must report.
SHAPE = EngineShape.of()
# deploy/deploy.yaml's model, unless BLOCKSERVE_MODEL_DIR names another.
MODEL_DIR = os.path.expanduser(os.environ.get("BLOCKSERVE_MODEL_DIR") or app_config().replica.model)


@pytest.fixture(scope="session")
def model_dir() -> str:
    if not os.path.exists(os.path.join(MODEL_DIR, "config.json")):
        pytest.fail(f"the tiny model is missing at {MODEL_DIR}: run `make setup`")
    return MODEL_DIR


# --- HAProxy, as Serve's proxy runs it through deploy/haproxy ------------------------------
HAPROXY_WRAPPER = Path(__file__).resolve().parent.parent / "deploy" / "haproxy"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def accepts(port: int) -> bool:
    """Something listens on `port` of this host."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def haproxy_config(front: int, servers: dict[str, int], options: tuple[str, ...],
                   timeout_s: int) -> str:
    """A config with Serve's `options` in its defaults: one frontend on `front`, one
    backend of `servers` (name: port)."""
    lines = "\n    ".join(options)
    backends = "\n    ".join(f"server {name} 127.0.0.1:{port}" for name, port in servers.items())
    return f"""global
    maxconn 4096
    nbthread 4
defaults
    mode http
    timeout connect 5s
    timeout client {timeout_s}s
    timeout server {timeout_s}s
    timeout http-keep-alive 90s
    {lines}
frontend http_frontend
    bind 127.0.0.1:{front}
    default_backend routers
backend routers
    balance roundrobin
    http-reuse always
    {backends}
"""


@contextlib.asynccontextmanager
async def running_haproxy(command: list[str], config: Path, front: int):
    """HAProxy started by `command` on `config`, once it accepts on `front`; stopped at exit.

    Started by a process that has loaded Ray, as Serve's proxy actor has: the wrapper
    finds the binary beside Ray, and execs, so the process is HAProxy itself."""
    import ray._raylet  # noqa: F401

    haproxy = subprocess.Popen([*command, "-db", "-f", str(config)])
    try:
        deadline = time.monotonic() + 30
        while not accepts(front):
            assert haproxy.poll() is None and time.monotonic() < deadline
            await asyncio.sleep(0.1)
        yield
    finally:
        haproxy.terminate()
        haproxy.wait(10)


# --- the real deployment, shared by every integration test --------------------------------
API_KEY = "blockserve-test-key"  # deploy.yaml reads $BLOCKSERVE_API_KEY


@dataclass
class Deployment:
    """The running application, reached through one keep-alive HTTP client.

    One client, not a fresh one per call: building a client loads the CA bundle, CPU
    work that takes seconds while the engines saturate this 2-core machine, long enough
    for the request a test is watching to finish before the test's next call is sent.
    """

    base_url: str
    log_tail: Callable[[], str]
    api_key: str = API_KEY

    def __post_init__(self):
        self.http = httpx.Client(base_url=self.base_url, headers=self.headers, timeout=60)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def post(self, path: str, **kwargs) -> httpx.Response:
        return self.http.post(path, **kwargs)

    def get(self, path: str, **kwargs) -> httpx.Response:
        return self.http.get(path, **kwargs)

    def stream(self, path: str, body: dict):
        """A streamed POST; use as a context manager."""
        return self.http.stream("POST", path, json=body)

    def metrics(self) -> dict[str, float]:
        """Samples of the router's /metrics: {'name{labels}': value}."""
        text = self.http.get("/metrics").text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                samples[key] = float(value)
        return samples

    def metrics_replicas(self) -> set[str]:
        return {k.split('replica="')[1].split('"')[0] for k in self.metrics()
                if k.startswith("blockserve_replica_kv_blocks_capacity")}

    def metric_sum(self, name: str, **labels: str) -> float:
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        return sum(v for k, v in self.metrics().items()
                   if k.split("{")[0] == name and all(w in k for w in wanted))

    def wait_for_replicas(self, count: int = 2, timeout_s: float = 300) -> None:
        """Until `count` replicas are in the router's ledger and recently heard from. Ray
        Serve restarts a replica that died; tests that need both wait for it."""
        deadline = time.time() + timeout_s
        while True:
            replicas = self.get("/admin/state").json()["replicas"]
            if len([r for r in replicas if r["heard_from_s_ago"] < 5]) >= count:
                return
            if time.time() > deadline:
                raise AssertionError(f"only {len(replicas)} replicas after {timeout_s}s")
            time.sleep(1)


@pytest.fixture(scope="session")
def launch(model_dir):
    """Start a Serve config as a user would (`serve run`), as a context manager that
    yields a `Deployment`; `expected_replicas` must report before it is yielded."""
    @contextlib.contextmanager
    def start(config: dict, expected_replicas: int | None = None) -> Iterator[Deployment]:
        """`expected_replicas`: default, the config's replica count."""
        try:
            with serve_run(config, expected_replicas=expected_replicas or replica_count(config),
                           env={"BLOCKSERVE_API_KEY": API_KEY}) as run:
                print(f"\ndeployment healthy in {run.startup_s:.0f}s")
                deployment = Deployment(run.base_url, run.log_tail)
                try:
                    yield deployment
                finally:
                    deployment.http.close()
        except RuntimeError as exc:
            pytest.fail(str(exc))

    return start


@pytest.fixture(scope="session")
def deployment_session(launch):
    """`serve run deploy/deploy.yaml` on a private Ray instance (only the port differs)."""
    with launch(load_config()) as deployment:
        yield deployment


@pytest.fixture
def deployment(deployment_session):
    """The shared deployment, with both replicas in the ledger when the test starts."""
    deployment_session.wait_for_replicas(2)
    return deployment_session


def pytest_collection_modifyitems(items):
    """Tests that start a deployment of their own run first, before the shared one
    starts (it lives until the session ends): never two deployments at once on a
    2-core machine. The sort is stable, so each group keeps its files' order."""
    def own_deployment(item) -> bool:
        names = set(getattr(item, "fixturenames", ()))
        starts_one = "launch" in names or item.get_closest_marker("own_deployment")
        return bool(starts_one) and "deployment_session" not in names

    items.sort(key=lambda item: not own_deployment(item))
