"""Where a replay's CPU went on this machine: cores used per kind of process.

On the 2-core development machine every process competes with the engines for CPU, so
a configuration that costs more CPU elsewhere (the router, the replica actors, the
client) leaves its engines less, and its throughput shows it. The policy benchmark
(bench/harness.py) reads every process's CPU time from /proc before and after each
replay; `cores` divides what each kind used by the replay's length.
"""

from __future__ import annotations

import os
from collections import Counter

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
TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


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
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/stat") as stat:
                text = stat.read()
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone, or not ours to read
            continue
        fields = text[text.rfind(")") + 2:].split()  # after "pid (comm) "
        seconds = (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime + stime
        times[pid] = (kind_of(command, pid, client_pid), seconds)
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
