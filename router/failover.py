"""What the router does when a replica fails a request (router/dispatch.py raises
`ReplicaUnavailable`: refused or reset data-port connection, dead actor, dead engine).

- The replica leaves placement at once and the ledger releases its reservations
  (`Ledger.fail`); the snapshot poll brings a transient failure back, never a dead engine.
- A request that failed before its first chunk, so before any byte reached the client,
  is admitted again through the queue (at most `retries` times, within what is left of
  its queue deadline) and sent to another replica. If none can take it: `Unserved`, which
  the router answers with 503 and Retry-After, never 500.
- A stream that already sent tokens cannot be retried (the client has them): it ends
  with an OpenAI-format error event and `[DONE]` (`stream_error`), never silently short.
"""

from __future__ import annotations

import json
import logging
import time
from typing import AsyncIterator, Callable

from blockserve.protocol.chunks import ReplicaChunk
from blockserve.router.admission import AdmissionQueue, Lease
from blockserve.router.demand import Rejected
from blockserve.router.dispatch import ReplicaUnavailable
from blockserve.router.ledger import Ledger

logger = logging.getLogger("blockserve.failover")

Start = Callable[[Lease], AsyncIterator[ReplicaChunk]]  # sends the request on a lease
# Retry-After when a replica failed and none could take the request: the failed one is
# out of placement at once, so another replica or its replacement may take a retry soon.
RETRY_AFTER_S = 1


class Unserved(Exception):
    """No replica could serve the request after its replica failed."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def stream_error(status: int, message: str) -> str:
    """The SSE events that end a broken stream: an OpenAI error object, then [DONE]."""
    from http import HTTPStatus

    error = {"message": message, "type": HTTPStatus(status).phrase.replace(" ", "") + "Error",
             "param": None, "code": status}
    return f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n"


class Failover:
    def __init__(self, queue: AdmissionQueue, ledger: Ledger, remove: Callable[[str], None],
                 retries: int, clock: Callable[[], float] = time.time) -> None:
        self.queue, self.ledger, self.remove = queue, ledger, remove
        self.retries, self.clock = retries, clock
        self.retried = 0  # requests placed again after a failure (for tests and metrics)

    def replica_failed(self, failure: ReplicaUnavailable) -> None:
        """Take the replica out of placement and hand its reservations back."""
        if failure.replica_id in self.ledger.replicas:
            logger.warning("%s: out of placement", failure)
        self.ledger.fail(failure.replica_id, failure.dead)
        self.remove(failure.replica_id)
        self.queue.pump()

    async def first_chunk(self, lease: Lease, start: Start
                          ) -> tuple[Lease, ReplicaChunk, AsyncIterator[ReplicaChunk]]:
        """The first chunk of the response, from the leased replica or, if that one
        fails before answering, from the replicas the request is placed on next. Returns
        the lease it is answered on; raises `Unserved`. Any other error releases the
        lease and propagates."""
        deadline = lease.entry.arrival + self.queue.timeout_s
        for attempt in range(self.retries + 1):
            stream = start(lease)
            try:
                return lease, await stream.__anext__(), stream
            except ReplicaUnavailable as failure:
                await stream.aclose()
                self.replica_failed(failure)  # first: the release below admits others
                self.queue.release(lease)
                reason = str(failure)
            except BaseException:
                await stream.aclose()
                self.queue.release(lease)
                raise
            remaining = deadline - self.clock()
            if attempt == self.retries or remaining <= 0:
                break
            try:
                lease = await self.queue.admit(lease.entry.demand, timeout_s=remaining)
            except Rejected as rejection:
                raise Unserved(f"No replica could serve this request after {reason}: "
                               f"{rejection}", rejection.retry_after_s or RETRY_AFTER_S
                               ) from None
            self.retried += 1
        raise Unserved(f"No replica could serve this request: {reason}", RETRY_AFTER_S)
