"""HAProxy dies with Serve's proxy actor that started it, even when that actor is SIGKILLed.

Ray Serve's HAProxy (high-throughput mode, deploy/serve.env) is started by the proxy actor,
which can die by SIGKILL (an OOM kill, `ray stop --force`, a killed `serve run`); nothing then
stops HAProxy, init adopts it and it keeps port 8000. `guard_haproxy(node_pid)`, run by the
router: for each HAProxy that Serve's proxy actor (like the router, a child of the node's
raylet) started, a detached reaper process (this file run as a script, stdlib and psutil
only) waits for HAProxy's parent, Serve's proxy actor, and then kills every HAProxy on that
config. Detached (its own session), so the signal that takes the proxy's process group does
not take the reaper. (deploy/haproxy also runs HAProxy under a parent-death signal.)
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import logging
import os
import subprocess
import sys
import tempfile
import time

import psutil

logger = logging.getLogger("blockserve.haproxy_guard")

HAPROXY = "haproxy"


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


def _exited(pid: int) -> bool:
    """Gone, or a zombie (dead; its parent has not reaped it yet)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def reap_haproxy(owner: int, config_path: str, grace_s: float = 1.0) -> int:
    """Wait for `owner` to exit, then stop every HAProxy on `config_path` (SIGTERM,
    SIGKILL after `grace_s`). Returns how many were stopped."""
    lock_path = os.path.join(tempfile.gettempdir(), f"blockserve-reaper-{owner}.lock")
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0  # this owner already has a reaper
        while not _exited(owner):
            time.sleep(0.05)
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
