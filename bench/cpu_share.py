"""Where a replay's CPU went on this machine: cores used per kind of process.

On the 2-core development machine every process competes with the engines for CPU, so
a configuration that costs more CPU elsewhere (the router, the replica actors, the
client) leaves its engines less, and its throughput shows it. The policy benchmark
(bench/harness.py) reads every process's CPU time with psutil (as tools/launch.py finds
leftovers) before and after each replay; `cores` divides what each kind used by the
replay's length.
"""

from __future__ import annotations

import os
from collections import Counter

import psutil

# (a substring of the command line, the kind), first match wins.
KINDS = (
    ("VLLM::EngineCore", "engine core"),
    ("VLLM::Worker", "engine worker"),
    ("vllm.entrypoints", "vLLM server"),
    (":RouterBoard", "router board"),
    (":Router", "router"),
    (":Replica", "replica actor"),
    ("ServeReplica", "other Serve replica"),
    ("haproxy", "HAProxy"),
    ("ProxyActor", "Serve proxy"),
    ("raylet", "Ray"),
    ("gcs_server", "Ray"),
    ("ray::", "Ray"),
)


def kind_of(command: str, pid: int, client_pid: int) -> str:
    if pid == client_pid:
        return "client"
    for marker, kind in KINDS:
        if marker in command:
            return kind
    return "other"


def cpu_times(client_pid: int | None = None) -> dict[int, tuple[str, float]]:
    """pid -> (kind, CPU seconds so far, user and system) for every process readable."""
    client_pid = os.getpid() if client_pid is None else client_pid
    times = {}
    for proc in psutil.process_iter(["cmdline", "cpu_times"]):
        used = proc.info["cpu_times"]
        if used is None:  # gone, or not ours to read
            continue
        command = " ".join(proc.info["cmdline"] or [])
        times[proc.pid] = (kind_of(command, proc.pid, client_pid), used.user + used.system)
    return times


def cores(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
          seconds: float) -> dict[str, float]:
    """Cores used per kind between two `cpu_times` readings `seconds` apart, most first.
    A process that started between them counts from 0; one that ended is not seen."""
    used: Counter[str] = Counter()
    for pid, (kind, total) in after.items():
        start = before.get(pid)
        used[kind] += total - (start[1] if start and start[0] == kind else 0.0)
    return {kind: round(value / seconds, 3) for kind, value in used.most_common()
            if seconds > 0 and value > 0}
