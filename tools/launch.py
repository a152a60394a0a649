"""Start a Serve config with `serve run` on a private Ray instance, and stop it cleanly.

Used by the integration tests and the benchmarks so that both run exactly what a user
runs (`serve run deploy/deploy.yaml`), with only the port and application args changed.
They read what the deployment is from the same file, through the config schema:
`app_config` (the application's args), `replica_count`, `EngineShape` (one replica's
engine: model, KV blocks, context).
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Iterator

import httpx
import psutil
import yaml

from blockserve.protocol.config import AppConfig, parse_app_config

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO / "deploy" / "deploy.yaml"
SERVE_ENV = REPO / "deploy" / "serve.env"


def serve_env(workdir: Path) -> dict[str, str]:
    """The environment `make serve` gives `serve run` (deploy/serve.env), with HAProxy's
    files moved from the shared /tmp/haproxy-serve into this run's own directory and its
    stats and metrics listeners (fixed ports by default) on free ports, so that runs
    side by side do not collide."""
    env = {}
    for line in SERVE_ENV.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.lstrip().startswith("#"):
            env[key.strip()] = value.strip()
    haproxy = workdir / "haproxy"
    haproxy.mkdir()
    env.update(RAY_SERVE_HAPROXY_CONFIG_FILE_LOC=str(haproxy / "haproxy.cfg"),
               RAY_SERVE_HAPROXY_SOCKET_PATH=str(haproxy / "admin.sock"),
               RAY_SERVE_HAPROXY_SERVER_STATE_BASE=str(haproxy),
               RAY_SERVE_HAPROXY_SERVER_STATE_FILE=str(haproxy / "server-state"),
               RAY_SERVE_HAPROXY_STATS_PORT=str(free_port()),
               RAY_SERVE_HAPROXY_METRICS_PORT=str(free_port()))
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_config(path: Path = DEFAULT_CONFIG) -> dict:
    return yaml.safe_load(Path(path).read_text())


def app_config(config: dict | None = None) -> AppConfig:
    """The blockserve application's args of a Serve config (deploy/deploy.yaml by
    default), validated by the config schema (protocol/config.py)."""
    return parse_app_config((config or load_config())["applications"][0]["args"])


def replica_count(config: dict | None = None) -> int:
    """How many vLLM replicas a Serve config's `Replica` deployment runs."""
    deployments = (config or load_config())["applications"][0]["deployments"]
    return next(d["num_replicas"] for d in deployments if d["name"] == "Replica")


@dataclass(frozen=True)
class EngineShape:
    """One replica's engine as a Serve config sets it (deploy/deploy.yaml by default):
    what engine-less replicas, the simulator and the workloads size themselves by."""

    model: str  # the model directory (expanded)
    model_name: str  # what requests name in "model"
    num_blocks: int  # KV blocks, vLLM's null block included
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int | None = None  # None: the engine-less replica's default
    watermark: float = 0.0  # vLLM's share of blocks kept free of new admissions (0: off)

    REQUIRED: ClassVar[tuple[str, ...]] = ("num_gpu_blocks_override", "block_size",
                                           "max_model_len", "max_num_seqs")

    @classmethod
    def of(cls, config: dict | None = None) -> "EngineShape":
        replica = app_config(config).replica
        engine = replica.engine_args
        missing = [key for key in cls.REQUIRED if key not in engine]
        if missing:
            raise ValueError(f"an engine shape needs engine_args {missing} in the Serve config")
        return cls(replica.model, replica.model_name, int(engine["num_gpu_blocks_override"]),
                   int(engine["block_size"]), int(engine["max_model_len"]),
                   int(engine["max_num_seqs"]), engine.get("max_num_batched_tokens"),
                   float(engine.get("watermark", 0.0)))

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def engine_less_kwargs(self) -> dict[str, float]:
        """`EngineLessReplica`'s keyword arguments for this shape (all but the model)."""
        kwargs = dict(num_blocks=self.num_blocks, block_size=self.block_size,
                      max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs)
        if self.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.watermark:
            kwargs["watermark"] = self.watermark
        return kwargs


def with_args(config: dict, **overrides: dict) -> dict:
    """A copy of a Serve config whose first application's args sections are updated,
    e.g. with_args(config, router={"placement": ...}, replica={"scheduler": {...}})."""
    config = copy.deepcopy(config)
    args = config["applications"][0]["args"]
    for section, values in overrides.items():
        args[section] = {**args.get(section, {}), **values}
    return config


class ServeRun:
    """A running `serve run` process; `base_url` answers once healthy."""

    def __init__(self, process: subprocess.Popen, base_url: str, log_path: Path):
        self.process, self.base_url, self.log_path = process, base_url, log_path

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def replicas_reported(self) -> int:
        text = httpx.get(f"{self.base_url}/metrics", timeout=5).text
        return sum(1 for line in text.splitlines()
                   if line.startswith("blockserve_replica_kv_blocks_capacity{"))

    def ready(self, expected_replicas: int | None) -> bool:
        """blockserve: healthy with `expected_replicas` in the ledger. Any other app
        (expected_replicas=None): a one-token completion is answered."""
        if expected_replicas is None:
            model = httpx.get(f"{self.base_url}/v1/models", timeout=5).json()["data"][0]["id"]
            return httpx.post(f"{self.base_url}/v1/completions", timeout=60, json={
                "model": model, "prompt": "ready?", "max_tokens": 1}).status_code == 200
        return httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200 and \
            self.replicas_reported() >= expected_replicas


@contextlib.contextmanager
def serve_run(config: dict, *, expected_replicas: int | None, env: dict[str, str] | None = None,
              startup_timeout_s: float = 420) -> Iterator[ServeRun]:
    workdir = Path(tempfile.mkdtemp(prefix="bs-", dir="/tmp"))  # short: Ray socket paths
    config = copy.deepcopy(config)
    port = free_port()
    config.setdefault("http_options", {})["port"] = port
    config_path = workdir / "serve.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = workdir / "serve.log"
    process_env = {**os.environ, **serve_env(workdir), "RAY_TMPDIR": str(workdir / "ray"),
                   "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
    process_env.pop("RAY_ADDRESS", None)  # no address: serve run starts its own Ray
    serve_bin = Path(sys.executable).parent / "serve"
    # Own process group (stopped as a group) but the caller's session: with the kernel's
    # autogroup scheduling a new session would compete with the caller as an equal, and
    # a load client or test starved by the engines measures its own delays (seen: event
    # loop stalls of 1 s). In one session, Ray's nice-15 workers yield to the caller.
    with open(log_path, "wb") as log:
        process = subprocess.Popen([str(serve_bin), "run", str(config_path)], cwd=REPO,
                                   env=process_env, stdout=log, stderr=subprocess.STDOUT,
                                   process_group=0)
    run = ServeRun(process, f"http://127.0.0.1:{port}", log_path)
    started = time.time()
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"serve run exited with {process.returncode}:\n"
                                   f"{run.log_tail()}")
            if time.time() - started > startup_timeout_s:
                raise RuntimeError(f"not healthy after {startup_timeout_s:.0f}s:\n"
                                   f"{run.log_tail()}")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
                if run.ready(expected_replicas):
                    break
            time.sleep(2)
        run.startup_s = time.time() - started
        yield run
    finally:
        stop(process)
        kill_leftovers(workdir)


def kill_leftovers(workdir: Path, grace_s: float = 10.0) -> list[str]:
    """SIGKILL what still runs `grace_s` after a run stopped and names its private
    directory (HAProxy's config, Ray's session files), saying so on stderr: Ray's own
    processes take a few seconds to exit after `serve run` does, but none should stay,
    so a leftover is a defect to see, not to hide. Returns the command lines killed."""
    deadline = time.monotonic() + grace_s
    while (left := _naming(workdir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    killed = []
    for pid, cmdline in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            killed.append(cmdline)
    if killed:
        print(f"blockserve launcher: killed {len(killed)} process(es) still running "
              f"{grace_s:g}s after {workdir} stopped: {killed}", file=sys.stderr)
    return killed


def _naming(workdir: Path) -> list[tuple[int, str]]:
    """(pid, command line) of the live processes whose command line names `workdir`."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if (str(workdir) in cmdline and proc.pid != os.getpid()
                and proc.info["status"] != psutil.STATUS_ZOMBIE):
            found.append((proc.pid, cmdline))
    return found


def stop(process: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGINT lets serve run shut Serve and Ray down; then the whole group goes."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
