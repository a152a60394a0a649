"""Relaying a replica's response to the client, with the router's metrics.

The request goes to the replica it is leased on (router/dispatch.py; placed again by
router/failover.py if that replica fails before answering). Every chunk back carries
the replica's latest snapshot, which goes to the ledger; the response's usage trains
the output predictor and scores the prefix index's prediction (router/regret.py). A
stream's first chunk and its usage at the end give the TTFT and TPOT the placement hears
(`Placement.on_outcome`). The lease is released when the response ends, however it ends.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable

from fastapi.responses import JSONResponse, Response, StreamingResponse

from blockserve.protocol.blocks import ceil_div
from blockserve.protocol.chunks import ReplicaChunk
from blockserve.protocol.hints import Hints
from blockserve.protocol.path_trace import mark
from blockserve.protocol.router_policies import Transport
from blockserve.router.admission import AdmissionQueue, Lease
from blockserve.router.demand import DemandEstimator
from blockserve.router.dispatch import ReplicaUnavailable
from blockserve.router.failover import RETRY_AFTER_S, Failover, Unserved, stream_error
from blockserve.router.ledger import Ledger
from blockserve.router.metrics import RouterMetrics
from blockserve.router.regret import predicted_hit_tokens, reported_hit
from blockserve.router.usage import completion_tokens, request_stream_usage, stream_usage
from blockserve.router.validation import error

logger = logging.getLogger("blockserve.router")


async def _finish(stream: AsyncIterator[ReplicaChunk]) -> None:
    """Read a whole response's end of stream, so that its connection can be reused."""
    try:
        async for _ in stream:
            pass
    except Exception as exc:  # the response is complete; only the connection is lost
        logger.debug("end of a whole response not read: %r", exc)
    finally:
        await stream.aclose()


def _hinted(body: dict, lease: Lease) -> dict:
    """The request body with the router's hints for the replica it is leased on."""
    demand = lease.entry.demand
    hints = Hints(demand_blocks=demand.blocks, expected_output=demand.expected_output,
                  priority=demand.priority, tenant=demand.tenant, admission_seq=lease.seq)
    return dict(body, vllm_xargs={**(body.get("vllm_xargs") or {}), **hints.to_xargs()})


class Relay:
    def __init__(self, dispatch: Transport, queue: AdmissionQueue,
                 ledger: Ledger, failover: Failover, metrics: RouterMetrics,
                 estimator: DemandEstimator, report: Callable[[str, dict], None]) -> None:
        self.dispatch, self.queue, self.ledger = dispatch, queue, ledger
        self.failover, self.metrics, self.estimator = failover, metrics, estimator
        self.report = report  # a replica's snapshot, as a chunk carried it

    async def respond(self, endpoint: str, body: dict, lease: Lease,
                      arrived: float) -> Response:
        """The leased request's response: whole, or streamed as it comes."""
        body = dict(body, priority=0)  # the replica orders by the hint, not vLLM's policy
        strip_usage = request_stream_usage(body)  # the predictor learns from usage

        def start(lease: Lease) -> AsyncIterator[ReplicaChunk]:
            return self.dispatch.generate(lease.replica_id, endpoint, _hinted(body, lease))

        try:  # a replica that fails before answering: the request is placed again
            lease, first, stream = await self.failover.first_chunk(lease, start)
            mark("router: first chunk read")
        except Exception as exc:  # (cancellation, the client leaving, propagates)
            logger.warning("request failed before a response: %r", exc)
            self.metrics.finished(503, arrived)
            retry_after = exc.retry_after_s if isinstance(exc, Unserved) else RETRY_AFTER_S
            return error(503, str(exc) if isinstance(exc, Unserved) else
                         f"The replica serving this request failed: {exc}",
                         headers={"Retry-After": str(retry_after)})
        self._observe(first, lease)
        self.metrics.first_response(arrived)
        if first.kind == "json":
            await _finish(stream)
            self.queue.release(lease)
            if first.status == 200:
                self._learn(lease, completion_tokens(first.payload))
                self._score(lease, first.payload)
            self.metrics.finished(first.status, arrived)
            return JSONResponse(first.payload, status_code=first.status)
        return StreamingResponse(self._stream(first, stream, lease, arrived, strip_usage),
                                 media_type="text/event-stream")

    async def _stream(self, first: ReplicaChunk, stream: AsyncIterator[ReplicaChunk],
                      lease: Lease, arrived: float, strip_usage: bool):
        status = "200"
        first_at = self.queue.clock()
        self.queue.placement.on_outcome(lease.entry.demand, lease.chosen,
                                        first_at - lease.entry.admitted_at, None)
        try:
            if text := self._relayed(first.payload, lease, strip_usage, first_at):
                mark("router: first text relayed")
                yield text
            async for chunk in stream:
                self._observe(chunk, lease)
                if text := self._relayed(chunk.payload, lease, strip_usage, first_at):
                    yield text
        except asyncio.CancelledError:
            status = "499"  # the client went away: closing the stream aborts the request
            raise
        except ReplicaUnavailable as failure:  # tokens were sent: it cannot be retried
            status = "503"
            self.failover.replica_failed(failure)
            yield stream_error(503, f"The stream broke off: {failure}")
        except Exception as exc:
            status = "502"
            logger.warning("stream from %s broke: %r", lease.replica_id, exc)
            yield stream_error(502, f"The stream broke off: {exc!r}")
        finally:
            await stream.aclose()
            self.queue.release(lease)
            self.metrics.finished(status, arrived)

    def _relayed(self, text: str, lease: Lease, strip_usage: bool, first_at: float) -> str:
        """A stream message as the client gets it; its usage event trains the predictor
        and, with the time since the first chunk, the placement."""
        self._score(lease, text)
        tokens, text = stream_usage(text, strip_usage)
        self._learn(lease, tokens, first_at)
        return text

    def _score(self, lease: Lease, payload: Any) -> None:
        """Routing regret: the hit the prefix index predicted at placement against the
        hit the engine reports in the response's usage (router/regret.py)."""
        hit = reported_hit(payload)
        if hit is not None:
            prompt, reported = hit
            predicted = predicted_hit_tokens(lease.reservation.predicted_hit_blocks, prompt,
                                             lease.entry.demand.block_size)
            self.metrics.routing_outcome(lease.replica_id, prompt, predicted, reported)

    def _learn(self, lease: Lease, tokens: int | None, first_at: float | None = None
               ) -> None:
        """A finished request's real output length trains the output predictor; a
        stream's (`first_at`: its first chunk) gives the placement its TPOT."""
        if tokens is None:
            return
        demand = lease.entry.demand
        per_sequence = ceil_div(tokens, demand.sequences)
        self.estimator.lengths.learn(demand.prompt_tokens, demand.tenant, per_sequence)
        if first_at is not None and per_sequence > 1:
            tpot = (self.queue.clock() - first_at) / (per_sequence - 1)
            self.queue.placement.on_outcome(demand, lease.chosen, None, tpot)

    def _observe(self, chunk: ReplicaChunk, lease: Lease) -> None:
        self.ledger.acknowledge(lease.reservation)
        self.report(chunk.replica_id, chunk.snapshot)
        self.queue.pump()
