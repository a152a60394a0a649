"""The replica end of the router's direct data path.

A Ray Serve handle call costs ~2.5 ms on this CPU before the replica's code runs (gRPC,
request router, Serve's bookkeeping): more than the router's whole latency budget. So
requests and their streamed responses travel over plain TCP between the router and the
replica that the router chose; Ray Serve still deploys, health-checks, restarts and
lists the replicas, and carries the control calls (snapshots, models).

Wire format: frames of a 4-byte big-endian length and a JSON document. The router sends
one request frame {"token", "endpoint", "body"} and reads response frames (a
`ReplicaChunk` as a list) until a `null` frame; the connection then carries the next
request. Closing the connection aborts the request being served, which frees its
blocks. The token, random per replica and handed to the router over the Serve handle,
keeps other clients on the network from bypassing the router's admission and API key.
When the replica's engine dies the port closes (`close()`): new connections are refused
and open ones are closed, which the router reads as the replica being gone.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from typing import Any, AsyncIterator, Callable

from blockserve.protocol.frames import END, read_frame, write_frame

logger = logging.getLogger("blockserve.data_port")

Serve = Callable[[str, dict], AsyncIterator[Any]]  # (endpoint, body) -> response chunks


class DataPort:
    """Serves `serve(endpoint, body)` to the router, one request at a time per connection."""

    def __init__(self, serve: Serve) -> None:
        self.serve = serve
        self.token = secrets.token_hex(16)
        self.server: asyncio.Server | None = None
        self.address: dict = {}  # what the router needs to connect, once started
        self.writers: set[asyncio.StreamWriter] = set()  # open connections

    async def start(self, host: str) -> dict:
        """Listen on an ephemeral port; returns (and keeps) `address`."""
        self.server = await asyncio.start_server(self._connection, host, 0)
        port = self.server.sockets[0].getsockname()[1]
        self.address = {"host": host, "port": port, "token": self.token}
        return self.address

    def close(self) -> None:
        """Refuse new connections and close the open ones (their responses end)."""
        if self.server is not None:
            self.server.close()
        for writer in list(self.writers):
            writer.close()

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            while True:
                request = await read_frame(reader)
                if not hmac.compare_digest(str(request.get("token", "")), self.token):
                    logger.warning("data port: connection with a wrong token closed")
                    return
                if not await self._answer(request, reader, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # the router closed the connection between requests
        finally:
            self.writers.discard(writer)
            writer.close()

    async def _answer(self, request: dict, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> bool:
        """Stream one response. While it runs the router sends nothing, so anything
        readable is its hang-up: the response is cancelled and vLLM aborts the request.
        Returns whether the connection can carry another request."""
        sending = asyncio.ensure_future(self._send(request, writer))
        hangup = asyncio.ensure_future(reader.read(1))
        try:
            await asyncio.wait({sending, hangup}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this connection's task is cancelled (the port is closing)
            hung_up = hangup.done()
            if hung_up or not sending.done():
                sending.cancel()
            hangup.cancel()
            # Let the response's own cleanup (vLLM's abort) run; wait() does not raise.
            await asyncio.wait({sending, hangup})
        if hung_up or sending.cancelled():
            if not hangup.cancelled():
                hangup.exception()  # a reset is a hang-up too; nothing to report
            return False
        failure = sending.exception()
        if failure is None:
            return True
        if not isinstance(failure, ConnectionError):
            logger.error("data port: serving a request failed", exc_info=failure)
        return False  # the router sees the connection close before the end frame

    async def _send(self, request: dict, writer: asyncio.StreamWriter) -> None:
        async for chunk in self.serve(request["endpoint"], request["body"]):
            write_frame(writer, chunk)
            await writer.drain()
        write_frame(writer, END)
        await writer.drain()
