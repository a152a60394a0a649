"""What the tests of the real deployment share (tests/conftest.py starts it): the model
and prompts they send, waiting until it is idle, and the checks of the failure tests
(their load and faults are bench/engine_kill.py's). A module of its own, so that test modules never import each other."""

from __future__ import annotations

import time

import psutil

from blockserve.bench.engine_kill import Outcome
from conftest import SHAPE

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


def running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
