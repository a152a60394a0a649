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


def test_the_speed_probe_charges_products_to_its_own_cpu_time_not_to_the_wait():
    """The same products per CPU-second with a spinning process beside it as without:
    a thread that waits for a core is not charged for the wait."""
    from blockserve.bench.cpu_speed import SpeedProbe

    def median_speed() -> float:
        with SpeedProbe(interval_s=0.1) as probe:
            time.sleep(1.5)
        summary = probe.summary()
        assert summary["samples"] >= 5, summary
        assert summary["p25"] <= summary["median"] <= summary["p75"]
        return summary["median"]

    alone = median_speed()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.3)
        loaded = median_speed()
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert 0.6 < loaded / alone < 1.6, (alone, loaded)
