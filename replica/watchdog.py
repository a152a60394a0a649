"""No process outlives its owner: the engine dies with its replica, HAProxy with its proxy.

vLLM's EngineCore (and its VLLM::Worker children) and Ray Serve's HAProxy are started
by processes that can die by SIGKILL (an OOM kill, `ray stop --force`, a killed
`serve run`); nothing then stops them, init adopts them and they keep their memory,
their cores and port 8000. Two guards:
- `die_with(owner_pid)`, called inside the EngineCore process (replica/scheduler.py):
  a thread waits on a pidfd of the replica actor and, when it exits, kills the
  engine's process tree. A pidfd, not PR_SET_PDEATHSIG: that signal fires when the
  parent *thread* that forked exits, and which thread starts the engine is Ray's
  business.
- `guard_haproxy(node_pid)`, called by the router: for each HAProxy that Serve's proxy
  actor (like the router, a child of the node's raylet) started, a detached reaper process (this file run as a script, stdlib
  and psutil only) waits for HAProxy's parent, Serve's proxy actor, and then kills every
  HAProxy on that config. Detached (its own session), so the signal that takes the
  proxy's process group does not take the reaper.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading

import psutil

logger = logging.getLogger("blockserve.watchdog")

HAPROXY = "haproxy"


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


def haproxies(config_path: str) -> list[psutil.Process]:
    """HAProxy processes started with `-f config_path`."""
    return [proc for proc, path in _haproxies() if path == config_path]


def _haproxies() -> list[tuple[psutil.Process, str | None]]:
    """Every HAProxy process and the config file it was started with."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["name"] == HAPROXY:
            path = cmdline[cmdline.index("-f") + 1] if "-f" in cmdline[:-1] else None
            found.append((proc, path))
    return found


def guard_haproxy(node_pid: int) -> set[int]:
    """Start a reaper for the parent of every HAProxy that a child of `node_pid` (this
    node's raylet: Serve's proxy actor is one) started; one reaper per parent (a second
    finds the parent's lock taken and exits). Returns the guarded parents' pids."""
    owners = {}
    for proc, path in _haproxies():
        try:
            parent = proc.parent()
            if path and parent is not None and parent.ppid() == node_pid:
                owners[parent.pid] = path
        except psutil.Error:
            continue
    for owner, path in owners.items():
        subprocess.Popen([sys.executable, os.path.abspath(__file__), "--owner", str(owner),
                          "--haproxy-config", path],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    return set(owners)


async def guard_haproxy_forever(poll_s: float = 2.0) -> None:
    """The router's task: guard the HAProxy of this node's Serve proxy, and guard it
    again when the proxy is restarted (a new parent). The router is a child of the
    node's raylet, and so is the proxy actor."""
    node_pid = os.getppid()
    guarded: set[int] = set()
    while True:
        guarded = {pid for pid in guarded if psutil.pid_exists(pid)}
        if not guarded:
            try:
                guarded = await asyncio.to_thread(guard_haproxy, node_pid)
            except (OSError, psutil.Error) as exc:
                logger.warning("could not guard HAProxy: %r", exc)
        await asyncio.sleep(poll_s)


def reap_haproxy(owner: int, config_path: str, grace_s: float = 1.0) -> int:
    """Wait for `owner` to exit, then stop every HAProxy on `config_path` (SIGTERM,
    SIGKILL after `grace_s`). Returns how many were stopped."""
    lock_path = os.path.join(tempfile.gettempdir(), f"blockserve-reaper-{owner}.lock")
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0  # this owner already has a reaper
        wait_for_exit(owner)
        survivors = haproxies(config_path)
        for proc in survivors:
            proc.terminate()
        _, alive = psutil.wait_procs(survivors, timeout=grace_s)
        for proc in alive:
            proc.kill()
        os.unlink(lock_path)
    return len(survivors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--owner", type=int, required=True)
    parser.add_argument("--haproxy-config", required=True)
    args = parser.parse_args()
    reap_haproxy(args.owner, args.haproxy_config)


if __name__ == "__main__":
    main()
