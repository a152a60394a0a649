"""The deployment launcher of tests and benchmarks (tools/launch.py) leaves nothing behind,
and a port taken before HAProxy binds it does not lose the start (issue 28)."""

import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from blockserve.tools import launch
from blockserve.tools.launch import (LISTEN_PORTS_FROM, ephemeral_range, kill_leftovers,
                                     listen_ports, serve_run)

# The smallest app serve_run calls ready (tests/echo_app.py): a start in seconds.
ECHO = {"applications": [{"name": "echo", "route_prefix": "/", "import_path": "echo_app:echo"}]}


SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]  # a path after it: argv[1]


def test_what_outlives_a_run_and_names_its_directory_is_killed_and_reported(tmp_path, capsys):
    """After the grace period; a process that exits within it is no leftover."""
    workdir = tmp_path / "bs-run"
    workdir.mkdir()
    # In their own sessions, as HAProxy ends up when the proxy actor that started it dies.
    leftover = subprocess.Popen([*SLEEPER, str(workdir / "haproxy.cfg")], start_new_session=True)
    unrelated = subprocess.Popen([*SLEEPER, str(tmp_path / "bs-other")], start_new_session=True)
    try:
        killed = kill_leftovers(workdir, grace_s=0.5)
        assert leftover.wait(5) == -9 and len(killed) == 1 and str(workdir) in killed[0]
        assert unrelated.poll() is None
        assert "still running" in capsys.readouterr().err
        assert kill_leftovers(workdir, grace_s=0.5) == [] and capsys.readouterr().err == ""
    finally:
        leftover.kill()
        unrelated.kill()


def test_a_process_that_exits_within_the_grace_period_is_left_alone(tmp_path, capsys):
    workdir = tmp_path / "bs-run"
    slow_exit = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)",
                                  str(workdir)], start_new_session=True)
    try:
        assert kill_leftovers(workdir, grace_s=5) == [] and slow_exit.wait(5) == 0
        assert capsys.readouterr().err == ""
    finally:
        slow_exit.kill()


def listening(port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind(("0.0.0.0", port))
    sock.listen()
    return sock


def test_listen_ports_lie_below_the_ephemeral_range_and_skip_a_taken_one():
    low = ephemeral_range()[0]
    ports = listen_ports(50)
    assert len(set(ports)) == 50 and all(LISTEN_PORTS_FROM <= p < low for p in ports)
    first = random.Random(7).randrange(LISTEN_PORTS_FROM, low)  # what seed 7 tries first
    with listening(first):
        assert first not in listen_ports(3, random.Random(7))


@pytest.mark.own_deployment  # it calls serve_run itself: conftest runs it before the shared one
def test_a_port_taken_before_haproxy_binds_it_costs_one_more_start(monkeypatch, capsys):
    """The test takes HAProxy's stats port between the launcher's choice and HAProxy's
    bind, as another socket did in issue 28: HAProxy cannot bind it, `serve run` exits,
    and serve_run starts once more on other ports."""
    held: list[socket.socket] = []
    chosen = launch.listen_ports

    def then_taken(count, rng=None):
        ports = chosen(count, rng)
        if not held:
            held.append(listening(ports[1]))  # (http, stats, metrics): the stats port
        return ports

    monkeypatch.setattr(launch, "listen_ports", then_taken)
    tests = str(Path(__file__).resolve().parent)
    try:
        with serve_run(ECHO, expected_replicas=None, startup_timeout_s=180,
                       env={"PYTHONPATH": tests}) as run:
            assert httpx.get(f"{run.base_url}/v1/models", timeout=10).json()["data"][0]["id"] \
                == "echo"
        err = capsys.readouterr().err
        assert "HAProxy found a port taken (cannot bind socket (Address already in use)" in err
        assert err.count("starting once more") == 1
    finally:
        for sock in held:
            sock.close()


def test_sigterm_unwinds_so_the_cleanup_that_stops_a_deployment_runs(tmp_path):
    """A benchmark killed with SIGTERM once left Ray, HAProxy and both engines running:
    Python's default SIGTERM skips `finally`. Within `terminate_unwinds` it runs."""
    marker = tmp_path / "cleaned"
    script = (
        "import sys, time\n"
        "from blockserve.tools.launch import terminate_unwinds\n"
        "with terminate_unwinds():\n"
        "    try:\n"
        "        print('ready', flush=True)\n"
        "        time.sleep(60)\n"
        "    finally:\n"
        f"        open({str(marker)!r}, 'w').write('yes')\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == 128 + signal.SIGTERM
    assert marker.read_text() == "yes"
