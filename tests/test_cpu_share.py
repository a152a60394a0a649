"""bench/cpu_share.py: cores per kind of process from /proc, on this machine's own
processes (no deployment)."""

import subprocess
import sys
import time

from blockserve.bench import cpu_share


def test_kinds_follow_the_command_line_first_match_first():
    assert cpu_share.kind_of("ray::ServeReplica:blockserve:RouterBoard", 5, 1) == "router board"
    assert cpu_share.kind_of("ray::ServeReplica:blockserve:Router", 5, 1) == "router"
    assert cpu_share.kind_of("ray::ServeReplica:blockserve:Replica", 5, 1) == "replica actor"
    assert cpu_share.kind_of("VLLM::EngineCore", 5, 1) == "engine core"
    assert cpu_share.kind_of("python bench", 1, 1) == "client"
    assert cpu_share.kind_of("bash", 5, 1) == "other"


def test_a_busy_process_shows_as_about_one_core_and_an_idle_one_as_none():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started and spinning
        before, started = cpu_share.cpu_times(client_pid=busy.pid), time.monotonic()
        time.sleep(1.0)
        shares = cpu_share.cores(before, cpu_share.cpu_times(client_pid=busy.pid),
                                 time.monotonic() - started)
    finally:
        busy.kill()
        busy.wait()
    # The spinning child is the "client" here; it shares 2 cores with the test run.
    assert 0.2 < shares["client"] <= 1.05, shares
    assert list(shares) == sorted(shares, key=shares.get, reverse=True)
