"""CPU engines on their own cores: the cores a VLLM_CPU_OMP_THREADS_BIND value names,
and the engine's processes started on them (replica/deployment.py, bench/fit_step_time.py)."""

from __future__ import annotations

import contextlib
import os


def cpu_list(bind: str) -> set[int]:
    """Cores named by a VLLM_CPU_OMP_THREADS_BIND value ("3", "0-3", "0,2", "0-1|2-3")."""
    cores = set()
    for part in bind.replace("|", ",").split(","):
        first, _, last = part.strip().partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


@contextlib.contextmanager
def engine_processes_on(bind: str | None):
    """Start the engine's processes on the cores its OpenMP threads are bound to.

    vLLM's EngineCore process busy-waits (sched_yield) on shared memory while its worker
    computes a step. Unpinned, that spin takes most of another core from the router, the
    proxy and the other replicas; on the worker's own core it only fills the gaps, since
    the two take turns anyway. Processes inherit the affinity of the thread that starts
    them, so the calling thread is pinned for the start and restored after.
    """
    if not bind or bind in ("auto", "nobind"):
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpu_list(bind))
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)
