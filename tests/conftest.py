"""Shared fixtures: the tiny model, and the real deployment started once per session."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from support import free_port

MODEL_DIR = os.path.expanduser(
    os.environ.get("BLOCKSERVE_MODEL_DIR", "~/.cache/blockserve/models/tiny-llama"))


@pytest.fixture(scope="session")
def model_dir() -> str:
    if not os.path.exists(os.path.join(MODEL_DIR, "config.json")):
        pytest.fail(f"the tiny model is missing at {MODEL_DIR}: run `make setup`")
    return MODEL_DIR


# --- the real deployment, shared by every integration test --------------------------------

REPO = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 420
API_KEY = "blockserve-test-key"  # deploy.yaml reads $BLOCKSERVE_API_KEY


@dataclass
class Deployment:
    base_url: str
    log_path: Path
    api_key: str = API_KEY

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def post(self, path: str, **kwargs) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.post(f"{self.base_url}{path}", headers=headers,
                          timeout=kwargs.pop("timeout", 60), **kwargs)

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(f"{self.base_url}{path}", headers=self.headers,
                         timeout=kwargs.pop("timeout", 30), **kwargs)

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def metrics(self) -> dict[str, float]:
        """Samples of the router's /metrics: {'name{labels}': value}."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
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


@pytest.fixture(scope="session")
def deployment(model_dir):
    """`serve run deploy/deploy.yaml` on a private Ray instance (only the port differs)."""
    workdir = Path(tempfile.mkdtemp(prefix="bs-", dir="/tmp"))
    config = yaml.safe_load((REPO / "deploy" / "deploy.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    config_path = workdir / "deploy.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = workdir / "serve.log"
    env = {**os.environ, "RAY_TMPDIR": str(workdir / "ray"), "RAY_USAGE_STATS_ENABLED": "0",
           "BLOCKSERVE_API_KEY": API_KEY}
    env.pop("RAY_ADDRESS", None)  # no address: serve run starts its own Ray instance
    serve_bin = Path(sys.executable).parent / "serve"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([str(serve_bin), "run", str(config_path)], cwd=REPO, env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    handle = Deployment(f"http://127.0.0.1:{port}", log_path)
    started = time.time()
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"serve run exited with {process.returncode}:\n{handle.log_tail()}")
            if time.time() - started > STARTUP_TIMEOUT_S:
                pytest.fail(f"deployment not healthy after {STARTUP_TIMEOUT_S}s:\n"
                            f"{handle.log_tail()}")
            try:
                if httpx.get(f"{handle.base_url}/health", timeout=5).status_code == 200 and \
                        len(handle.metrics_replicas()) == 2:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        print(f"\ndeployment healthy in {time.time() - started:.0f}s")
        yield handle
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
