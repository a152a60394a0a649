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
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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
# Serve's HTTP port and HAProxy's stats and metrics listeners are chosen at or above this
# and below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range): every
# outgoing connection of Ray's many processes takes its source port from that range, so
# a port found free there (bind 0) can be taken before HAProxy binds it (issue 28). Ray's
# workers listen on 10002-19999 (its defaults), hence 20000.
LISTEN_PORTS_FROM = 20000
# What HAProxy says when a chosen port was taken all the same (another listener chose it
# meanwhile); `serve run` then exits, and serve_run starts once more on other ports.
PORT_TAKEN = "cannot bind socket (Address already in use)"


def serve_env(workdir: Path, stats_port: int, metrics_port: int) -> dict[str, str]:
    """The environment `make serve` gives `serve run` (deploy/serve.env), with HAProxy's
    files moved from the shared /tmp/haproxy-serve into this run's own directory and its
    stats and metrics listeners (fixed ports by default) on the given ports, so that runs
    side by side do not collide."""
    env = {}
    for line in SERVE_ENV.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.lstrip().startswith("#"):
            env[key.strip()] = value.strip().strip('"')  # as the shell reads it
    haproxy = workdir / "haproxy"
    haproxy.mkdir()
    env.update(RAY_SERVE_HAPROXY_CONFIG_FILE_LOC=str(haproxy / "haproxy.cfg"),
               RAY_SERVE_HAPROXY_SOCKET_PATH=str(haproxy / "admin.sock"),
               RAY_SERVE_HAPROXY_SERVER_STATE_BASE=str(haproxy),
               RAY_SERVE_HAPROXY_SERVER_STATE_FILE=str(haproxy / "server-state"),
               RAY_SERVE_HAPROXY_STATS_PORT=str(stats_port),
               RAY_SERVE_HAPROXY_METRICS_PORT=str(metrics_port))
    return env


def free_port() -> int:
    """A free port of the kernel's choice, from the ephemeral range: for a listener this
    process binds at once (a server it starts must use listen_ports)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def listen_ports(count: int, rng: random.Random | None = None) -> list[int]:
    """`count` distinct ports, each free to listen on now, that no outgoing connection
    can take meanwhile (LISTEN_PORTS_FROM)."""
    rng = rng or random.Random()
    low = ephemeral_range()[0]
    if low <= LISTEN_PORTS_FROM:
        raise RuntimeError(f"the ephemeral port range starts at {low}: no port from "
                           f"{LISTEN_PORTS_FROM} below it to listen on")
    ports: list[int] = []
    for _ in range(1000):
        port = rng.randrange(LISTEN_PORTS_FROM, low)
        if port not in ports and port_free(port):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"no {count} free ports in {LISTEN_PORTS_FROM}-{low - 1}")


def wait_until_answers(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Until a GET of `url` answers 200; raises if `process` exits or `timeout_s` passes
    first (a server this process started: Prometheus, a lone uvicorn)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer (exit code {process.poll()})")
        time.sleep(0.1)


def port_free(port: int) -> bool:
    """Whether a listener can bind `port` on every address, as HAProxy does."""
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


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
    enable_prefix_caching: bool = True  # vLLM's engine argument (its default: on)

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
                   float(engine.get("watermark", 0.0)),
                   bool(engine.get("enable_prefix_caching", True)))

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def engine_less_kwargs(self) -> dict[str, float | bool]:
        """`EngineLessReplica`'s keyword arguments for this shape (all but the model)."""
        kwargs = dict(num_blocks=self.num_blocks, block_size=self.block_size,
                      max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs)
        if self.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.watermark:
            kwargs["watermark"] = self.watermark
        if not self.enable_prefix_caching:
            kwargs["enable_prefix_caching"] = False
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
    """A running `serve run` process in its private directory; `base_url` answers once
    healthy."""

    def __init__(self, process: subprocess.Popen, base_url: str, workdir: Path):
        self.process, self.base_url, self.workdir = process, base_url, workdir
        self.log_path = workdir / "serve.log"
        self.startup_s = 0.0

    @classmethod
    def start(cls, config: dict, env: dict[str, str] | None = None,
              address: str | None = None) -> "ServeRun":
        """`address`: a running Ray cluster's, to deploy on (its raylets need serve_env's
        variables themselves: Serve's proxy starts HAProxy there); else its own Ray."""
        workdir = Path(tempfile.mkdtemp(prefix="bs-", dir="/tmp"))  # short: Ray socket paths
        config = copy.deepcopy(config)
        http_port, stats_port, metrics_port = listen_ports(3)
        config.setdefault("http_options", {})["port"] = http_port
        config_path = workdir / "serve.yaml"
        config_path.write_text(yaml.safe_dump(config))
        process_env = {**os.environ, **serve_env(workdir, stats_port, metrics_port),
                       "RAY_TMPDIR": str(workdir / "ray"), "RAY_USAGE_STATS_ENABLED": "0",
                       **(env or {})}
        process_env.pop("RAY_ADDRESS", None)  # no address: serve run starts its own Ray
        serve_bin = Path(sys.executable).parent / "serve"
        joined = ["--address", address] if address else []
        # Own process group (stopped as a group) but the caller's session: with the
        # kernel's autogroup scheduling a new session would compete with the caller as an
        # equal, and a load client or test starved by the engines measures its own delays
        # (seen: event loop stalls of 1 s). In one session, Ray's nice-15 workers yield to
        # the caller.
        with open(workdir / "serve.log", "wb") as log:
            process = subprocess.Popen([str(serve_bin), "run", *joined, str(config_path)],
                                       cwd=REPO,
                                       env=process_env, stdout=log, stderr=subprocess.STDOUT,
                                       process_group=0)
        return cls(process, f"http://127.0.0.1:{http_port}", workdir)

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

    def wait_until_ready(self, expected_replicas: int | None, timeout_s: float) -> None:
        started = time.time()
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"serve run exited with {self.process.returncode}:\n"
                                   f"{self.log_tail()}")
            if time.time() - started > timeout_s:
                raise RuntimeError(f"not healthy after {timeout_s:.0f}s:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
                if self.ready(expected_replicas):
                    break
            time.sleep(2)
        self.startup_s = time.time() - started

    def port_taken(self) -> bool:
        """Whether HAProxy found one of its ports taken (PORT_TAKEN)."""
        return PORT_TAKEN in self.log_path.read_text(errors="replace")

    def close(self) -> None:
        stop(self.process)
        kill_leftovers(self.workdir)


@contextlib.contextmanager
def serve_run(config: dict, *, expected_replicas: int | None, env: dict[str, str] | None = None,
              startup_timeout_s: float = 420, address: str | None = None
              ) -> Iterator[ServeRun]:
    """`serve run config` until ready (ServeRun.ready), stopped on exit. A start that
    fails because a port was taken before HAProxy bound it is made once more on other
    ports, saying so on stderr. A SIGTERM to this process (a `kill`, a job's timeout)
    stops the deployment as Ctrl-C does (`terminate_unwinds`)."""
    with terminate_unwinds():
        yield from _serve_run(config, expected_replicas, env, startup_timeout_s, address)


@contextlib.contextmanager
def terminate_unwinds() -> Iterator[None]:
    """Within it, SIGTERM raises SystemExit in the main thread, so the `finally` blocks
    that stop deployments run: Python's default SIGTERM ends the process without them,
    leaving Ray, HAProxy and the engines running. A handler already installed, or a
    caller off the main thread (which cannot install one), is left as it is."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def unwind(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one cannot cut the cleanup
        sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serve_run(config: dict, expected_replicas: int | None, env: dict[str, str] | None,
               startup_timeout_s: float, address: str | None) -> Iterator[ServeRun]:
    for attempt in (1, 2):
        run = ServeRun.start(config, env, address)
        try:
            run.wait_until_ready(expected_replicas, startup_timeout_s)
        except BaseException as exc:
            run.close()
            if attempt == 1 and isinstance(exc, RuntimeError) and run.port_taken():
                print(f"blockserve launcher: HAProxy found a port taken ({PORT_TAKEN}, "
                      f"{run.log_path}); starting once more on other ports", file=sys.stderr)
                continue
            raise
        break
    try:
        yield run
    finally:
        run.close()


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
