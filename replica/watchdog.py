"""The engine dies with its replica: no EngineCore outlives the actor that started it.

vLLM's EngineCore (and its VLLM::Worker children) is started by the replica actor, which can
die by SIGKILL (an OOM kill, `ray stop --force`, a killed `serve run`); nothing then stops
the engine, init adopts it and it keeps its memory and cores. `die_with(owner_pid)`, called
inside the EngineCore process (replica/scheduler.py): a thread waits on a pidfd of the
replica actor and, when it exits, kills the engine's process tree. A pidfd, not
PR_SET_PDEATHSIG: that signal fires when the parent *thread* that forked exits, and which
thread starts the engine is Ray's business. (Serve's HAProxy has its own guard,
router/haproxy_guard.py.)
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading

import psutil

logger = logging.getLogger("blockserve.watchdog")


def wait_for_exit(pid: int) -> None:
    """Block until process `pid` has exited (returns at once if it is gone)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not poller.poll():
            pass
    finally:
        os.close(fd)


class ExitWatch:
    """Whether a process has exited, checked without blocking (a pidfd; a zombie counts
    as exited). vLLM's own check waits until every holder of the engine's sentinel pipe
    is gone, the engine's forked workers too, which took up to a second more."""

    def __init__(self, pid: int) -> None:
        self._poll = select.poll()
        try:
            self._fd: int | None = os.pidfd_open(pid)
            self._poll.register(self._fd, select.POLLIN)
        except ProcessLookupError:
            self._fd = None

    def exited(self) -> bool:
        return self._fd is None or bool(self._poll.poll(0))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def kill_tree(root: int) -> None:
    """SIGKILL `root`'s descendants, then `root` (which may be the caller)."""
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    os.kill(root, signal.SIGKILL)


def die_with(owner_pid: int) -> threading.Thread:
    """Kill this process and its children as soon as `owner_pid` exits."""
    def watch() -> None:
        wait_for_exit(owner_pid)
        logger.warning("owner %d exited: killing engine process tree %d", owner_pid,
                       os.getpid())
        kill_tree(os.getpid())

    thread = threading.Thread(target=watch, name="blockserve-die-with-owner", daemon=True)
    thread.start()
    return thread
