"""What the tests of the real deployment share (tests/conftest.py starts it): the model
and prompts they send, waiting until it is idle, and the engine-fault harness of the
failure tests. A module of its own, so that test modules never import each other."""

from __future__ import annotations

import asyncio
import time

import psutil

from blockserve.bench.engine_kill import Outcome, client, replicas, stream_one, wait_for
from conftest import API_KEY, SHAPE

MODEL = SHAPE.model_name
PROMPT = "the quick brown fox " * 30  # ~150 tokens: 5 blocks of prompt
# A stream that outlasts the checks made while it runs (about a thousand engine steps).
LONG_STREAM = {"model": MODEL, "prompt": [7, 8, 9, 10], "max_tokens": 1000, "stream": True,
               "ignore_eos": True}
# Measured on main: a closed stream's abort reaches vLLM 0.4-0.9 s after the close.
ABORT_BOUND_S = 2.0
# 160 sequences of a 907-token prompt (29 blocks, shared) that each grow into one block of
# their own, whatever output length the router predicts within max_tokens: 188 blocks.
TOO_MANY_BLOCKS = {"model": MODEL, "n": 160, "max_tokens": 8,
                   "messages": [{"role": "user", "content": "word " * 900}]}


def is_idle(deployment) -> tuple[bool, str]:
    reserved = deployment.metric_sum("blockserve_ledger_reserved_blocks")
    held = deployment.metric_sum("blockserve_replica_kv_blocks", state="held")
    in_flight = deployment.metric_sum("blockserve_ledger_in_flight_requests")
    return reserved == held == in_flight == 0, \
        f"reserved={reserved} held={held} in_flight={in_flight}"


def wait_until_idle(deployment, timeout_s=30, poll_s=0.1) -> float:
    """The ledger holds no reservation and no replica holds blocks for a request;
    returns how long that took."""
    started = time.monotonic()
    while True:
        idle, state = is_idle(deployment)
        if idle:
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not idle after {timeout_s}s: {state}")
        time.sleep(poll_s)


DETECT_S = 1.0  # the dead replica leaves the router's ledger within this
FIRST_SUCCESS_S = 2.0  # a request sent after the kill has its first token within this
PROCESSES_GONE_S = 5.0  # an engine (and its workers) dies this soon after its owner


def engine_tree(pid: int) -> list[psutil.Process]:
    """The engine process a replica reports and its workers. The engine is recognised by
    its parent, the replica actor, not by its title: vLLM's `VLLM::EngineCore` title was
    missing on a clean-clone run although the engine served."""
    engine = psutil.Process(pid)
    parent = engine.parent()
    assert parent is not None and "ServeReplica" in " ".join(parent.cmdline()), parent
    return [engine, *engine.children(recursive=True)]


def all_gone(processes: list[psutil.Process], timeout_s: float) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return not [p for p in alive if running(p)]


def assert_outcomes(outcomes: list[Outcome], allow_disconnects: bool = False) -> None:
    """Every request completed, or broke off with an error event after its tokens."""
    bad = [o for o in outcomes if o.kind not in ("completed", "error_event")
           and not (allow_disconnects and o.kind == "disconnect")]
    assert not bad, f"requests that neither completed nor ended with an error event: {bad}"
    without_tokens = [o for o in outcomes if o.kind != "completed" and o.tokens == 0]
    assert not without_tokens, f"failed before any token (should have been retried): " \
                               f"{without_tokens}"


def in_flight(base_url: str) -> int:
    """Requests that the answering router has placed on a replica and not yet seen end."""
    return sum(r["in_flight_requests"] for r in replicas(base_url, API_KEY).values())


async def load_and_fault(base_url: str, fault, *, burst: int = 24, max_tokens: int = 128,
                         probes: int = 10, fault_by_s: float = 1.5, loaded=None):
    """`burst` streams, then `fault()` once `loaded()` (by default: a third of them in
    flight at replicas) or at `fault_by_s` at the latest, long prompts just before it (in
    prefill then) and `probes` new requests one every 0.2 s from the fault on. The fault
    waits for load it can see, not for a fixed time: on a faster CI machine the burst had
    ended by 1.5 s and the kill found nothing in flight."""
    def a_third_in_flight() -> bool:
        return in_flight(base_url) >= burst // 3

    api = client(base_url, API_KEY)
    t0 = time.monotonic()
    tasks = []
    for _ in range(burst):
        tasks.append(asyncio.ensure_future(stream_one(api, t0, max_tokens)))
        await asyncio.sleep(0.03)
    await asyncio.to_thread(wait_for, loaded or a_third_in_flight,
                            max(0.0, fault_by_s - 0.1 - (time.monotonic() - t0)), 0.02)
    tasks += [asyncio.ensure_future(stream_one(api, t0, 16, prompt="a long prompt " * 200))
              for _ in range(2)]
    await asyncio.sleep(0.1)
    fault_at = time.monotonic() - t0
    info = await asyncio.to_thread(fault)
    probe_tasks = []
    for _ in range(probes):
        probe_tasks.append(asyncio.ensure_future(stream_one(api, t0, 16)))
        await asyncio.sleep(0.2)
    # 150 s > the client's 120 s timeout: a hung request ends as a timeout, classified
    # as a disconnect, which fails the outcome check.
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 150)
    probe_outcomes = await asyncio.wait_for(asyncio.gather(*probe_tasks), 150)
    await api.close()
    return fault_at, info, outcomes, probe_outcomes


def running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
