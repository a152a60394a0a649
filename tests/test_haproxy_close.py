"""HAProxy passes a client's close on to the router (deploy/haproxy).

Serve's HAProxy config sets `option splice-request`; with it, HAProxy 2.8 now and then
kept the router's side of a request open after its client had gone, so the router could
not see that a queued client left (issue 20). The real HAProxy binary runs here with the
options of Serve's template that shape a request's path, in front of a backend that
holds each request like the router's admission queue and records when its connection
closes. Many clients give up while their request is held: every close must arrive."""

import asyncio
import contextlib
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from conftest import HAPROXY_WRAPPER, accepts, free_port, haproxy_config, running_haproxy

# Serve's options on a request's way from client to backend (its `defaults` section).
OPTIONS = ("option abortonclose", "option splice-request", "option splice-response",
           "option http-no-delay", "option idle-close-on-response")
PROBES, HOLDERS = 40, 5


class HoldingBackend:
    """Holds every request without answering; records when each one's connection closed
    (the request's body names it)."""

    def __init__(self) -> None:
        self.held: dict[str, float | None] = {}
        self.connections: set[asyncio.StreamWriter] = set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.connections.add(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET"):  # HAProxy's health check
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                return
            length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))
            name = (await reader.readexactly(length)).decode()
            self.held[name] = None
            try:
                await reader.read()  # until HAProxy closes the connection (FIN or RST)
            except ConnectionError:
                pass
            self.held[name] = time.monotonic()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.connections.discard(writer)
            writer.close()

    async def close(self) -> None:
        """Let every held request end (its connection closed from this side)."""
        for writer in list(self.connections):
            writer.close()
        while self.connections:
            await asyncio.sleep(0.01)


async def closes_missed(front: int, backend: HoldingBackend) -> list[str]:
    """Probes that gave up while held and whose close the backend never saw (2 s)."""
    missed = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{front}", timeout=30) as http:
        for i in range(PROBES):
            names = [f"hold-{i}-{j}" for j in range(HOLDERS)] + [f"probe-{i}"]
            requests = [asyncio.ensure_future(http.post("/", content=n)) for n in names]
            deadline = time.monotonic() + 10
            while not all(n in backend.held for n in names):
                assert time.monotonic() < deadline, "HAProxy did not forward the requests"
                await asyncio.sleep(0.01)
            requests[-1].cancel()  # the probe gives up: its connection closes
            await asyncio.gather(requests[-1], return_exceptions=True)
            deadline = time.monotonic() + 2
            while backend.held[names[-1]] is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if backend.held[names[-1]] is None:
                missed.append(names[-1])
            for request in requests[:-1]:
                request.cancel()
            await asyncio.gather(*requests[:-1], return_exceptions=True)
    return missed


def run_probes(command: list[str], tmp_path: Path) -> list[str]:
    front, back = free_port(), free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(haproxy_config(front, {"router": back}, OPTIONS, 3600))
    backend = HoldingBackend()

    async def scenario():
        server = await asyncio.start_server(backend.serve, "127.0.0.1", back)
        try:
            async with running_haproxy(command, config, front):
                return await closes_missed(front, backend)
        finally:
            server.close()
            await backend.close()

    return asyncio.run(scenario())


def test_serve_still_splices_requests():
    """The wrapper is needed while Serve's template turns splicing on."""
    from ray.serve._private import haproxy_templates

    template = Path(haproxy_templates.__file__).read_text()
    assert all(option in template for option in OPTIONS)


def test_every_close_of_a_held_request_reaches_the_router(tmp_path):
    missed = run_probes([str(HAPROXY_WRAPPER)], tmp_path)
    assert missed == [], f"{len(missed)} of {PROBES} closes never reached the backend"


def test_haproxy_dies_with_the_process_that_started_it_through_the_wrapper(tmp_path):
    """The wrapper's parent (Serve's proxy actor) gets SIGKILL: HAProxy goes with it, even
    with no reaper watching (the router may end first when a deployment stops)."""
    import psutil

    front = free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(haproxy_config(front, {"router": free_port()}, OPTIONS, 3600))
    owner = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "import ray._raylet\n"  # the wrapper finds HAProxy beside the parent's Ray
        f"subprocess.Popen([{str(HAPROXY_WRAPPER)!r}, '-db', '-f', {str(config)!r}])\n"
        "time.sleep(60)\n")])
    haproxy: list = []
    try:
        deadline = time.monotonic() + 30
        # Until HAProxy accepts: the wrapper script is named haproxy too, and killed
        # before its exec it would leave an HAProxy with no parent-death signal set.
        while not ((haproxy := [p for p in owner_children(owner.pid) if p.name() == "haproxy"])
                   and accepts(front)):
            assert time.monotonic() < deadline, "HAProxy did not start"
            time.sleep(0.1)
        owner.kill()
        _, alive = psutil.wait_procs(haproxy, timeout=3)
        assert not alive, f"HAProxy outlived the process that started it: {alive}"
    finally:
        owner.kill()
        for proc in haproxy:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


def owner_children(pid: int) -> list:
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        return psutil.Process(pid).children()
    return []
