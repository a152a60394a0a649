"""The router ingress: the OpenAI-compatible HTTP API in front of the replicas.

request -> parse with vLLM's own protocol models -> block demand (model's tokenizer)
-> admission queue (order, ledger, placement) -> pinned dispatch to the chosen replica
-> vLLM's serving layer there -> response relayed, snapshots fed back into the ledger.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from http import HTTPStatus
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from blockserve.controller.config import AppConfig, RouterConfig, describe_errors, error_path
from blockserve.controller.registry import directory
from blockserve.protocol.chunks import CHAT, COMPLETIONS, ReplicaChunk
from blockserve.protocol.hints import Hints
from blockserve.protocol.snapshot import BlockSnapshot
from blockserve.replica.watchdog import guard_haproxy_forever
from blockserve.router.admission import AdmissionQueue, Lease
from blockserve.router.demand import DemandEstimator, Rejected
from blockserve.router.dispatch import DirectDispatch, HandleDispatch, ReplicaUnavailable
from blockserve.router.failover import Failover, Unserved, stream_error
from blockserve.router.kv_events import KvEventFollower
from blockserve.router.ledger import Ledger, PrefixIndex
from blockserve.router.prefix_cache import ExactPrefixIndex
from blockserve.router.regret import predicted_hit_tokens, reported_hit
from blockserve.router.metrics import RouterMetrics
from blockserve.router.usage import completion_tokens, request_stream_usage, stream_usage

logger = logging.getLogger("blockserve.router")

app = FastAPI(title="blockserve")

PRIORITY_HEADER = "x-blockserve-priority"
MISSING_GRACE_S = 3.0  # how long Ray Serve may stop listing a replica before it is dropped
TENANT_HEADER = "x-blockserve-tenant"


def error(status: int, message: str, param: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:
    """An OpenAI-format error object (vLLM's own ErrorResponse)."""
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

    err_type = HTTPStatus(status).phrase.replace(" ", "") + "Error"
    body = ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def error_from(exc: Exception) -> JSONResponse:
    """Map an exception as vLLM's api_server does (validation errors are 400s)."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    body = create_error_response(exc)
    return JSONResponse(body.model_dump(), status_code=body.error.code)


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """The OpenAI error's message (the first few problems) and param (the first's path)."""
    return describe_errors(exc, "body", limit=5), error_path(exc.errors()[0]) or None


async def _client_gone(raw: Request) -> None:
    """Returns the moment the ASGI server reports that the client disconnected: its
    request body was read already, so the next message it receives is that disconnect."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


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


@serve.ingress(app)
class Router:
    """One router replica owns the admission queue and the block ledger."""

    def __init__(self, replicas: DeploymentHandle, config: dict):
        from transformers import AutoTokenizer
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        self.config = AppConfig.model_validate(config)
        router = self.config.router
        self.model_name = self.config.replica.model_name
        self.protocols = {CHAT: ChatCompletionRequest, COMPLETIONS: CompletionRequest}
        self.replicas = replicas
        self.dispatch = (DirectDispatch if router.transport == "direct"
                         else HandleDispatch)(replicas)
        exact = router.prefix_index == "exact"
        self.ledger = Ledger(stale_after_s=router.stale_after_s,
                             prefix_index=ExactPrefixIndex if exact else PrefixIndex)
        self.kv_events = KvEventFollower() if exact else None  # vLLM's, per replica
        self.queue = AdmissionQueue(
            self.ledger, router.placement.build(), router.queue_order.build(),
            max_requests=router.max_queued_requests, max_tokens=router.max_queued_tokens,
            timeout_s=router.queue_timeout_s)
        app_name = serve.get_replica_context().app_name
        self.metrics = RouterMetrics(app_name, router.placement.cls.rpartition(":")[2],
                                     self.queue)
        self.queue.on_taken = lambda lease: self.metrics.admitted(lease.replica_id,
                                                                   lease.queue_wait_s)
        self.queue.on_reject = lambda rejection: self.metrics.rejected(rejection.reason)
        self.failover = Failover(self.queue, self.ledger, self.dispatch.remove,
                                 router.max_retries)
        self.estimator = DemandEstimator(
            AutoTokenizer.from_pretrained(self.config.replica.model),
            router.output_predictor.build())
        self.policies = {"placement": router.placement.model_dump(),
                         "queue_order": router.queue_order.model_dump()}
        self._models: dict | None = None
        loop = asyncio.get_running_loop()
        directory(app_name).subscribe(loop, self._on_replicas_changed)
        self._poller = loop.create_task(self._poll_snapshots())
        self._proxy_guard = loop.create_task(guard_haproxy_forever())

    # --- HTTP API -----------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        if self.ledger.routable():
            return Response(status_code=200)
        return error(503, "No replica has reported its KV capacity yet.")

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Router and per-replica block metrics (Prometheus text format)."""
        return Response(self.metrics.exposition(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        if (denied := self._authorize(request)) is not None:
            return denied
        if self._models is None:
            self._models = await self.replicas.models.remote()
        return JSONResponse(self._models)

    @app.get("/admin/state")
    async def admin_state(self, request: Request) -> Response:
        """Cluster state: active policies, queue, and each replica's blocks and ledger."""
        if (denied := self._authorize(request)) is not None:
            return denied
        return JSONResponse(self._state())

    @app.post("/admin/policies")
    async def admin_policies(self, request: Request) -> Response:
        """Switch the router's placement and/or queue order at run time.

        Body: {"placement": <policy>, "queue_order": <policy>} (either or both). The swap
        is atomic on the event loop; admitted requests keep their leases.
        """
        if (denied := self._authorize(request)) is not None:
            return denied
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict) or not body.keys() & {"placement", "queue_order"}:
                raise ValueError("give 'placement' and/or 'queue_order'")
            refs = {key: RouterConfig.policy_ref(key, body[key])
                    for key in ("placement", "queue_order") if key in body}
            built = {key: ref.build() for key, ref in refs.items()}
        except (ValueError, TypeError) as exc:
            return error(400, f"Invalid policy switch: {exc}")
        if "placement" in built:
            self.queue.placement = built["placement"]
            self.metrics.policy = refs["placement"].cls.rpartition(":")[2]
        if "queue_order" in built:
            self.queue.order = built["queue_order"]
        self.policies.update({key: ref.model_dump() for key, ref in refs.items()})
        logger.info("policies switched: %s", self.policies)
        self.queue.pump()
        return JSONResponse(self._state())

    def _state(self) -> dict:
        now = time.time()
        return {
            "router_pid": os.getpid(),
            "retried_requests": self.failover.retried,
            "kv_events": self.kv_events.stats() if self.kv_events is not None else None,
            "policies": self.policies,
            "queue": {"requests": len(self.queue.waiting), "blocks": self.queue.queued_blocks(),
                      "tokens": self.queue.queued_tokens()},
            "replicas": [{
                "replica_id": replica_id,
                "snapshot": entry.snapshot.to_dict(),
                "engine": entry.engine,
                "heard_from_s_ago": round(now - entry.received_at, 3),
                "snapshot_age_s": round(now - entry.snapshot.timestamp, 3),
                "blocks": entry.blocks.to_dict(),  # protocol/blocks.py's words
                "block_policies": entry.block_policies(),
                "in_flight_requests": entry.ongoing,
                "drift_blocks": entry.drift_blocks,
                "suspect": entry.suspect,
            } for replica_id, entry in sorted(self.ledger.replicas.items())],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, CHAT)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, COMPLETIONS)

    # --- the data path ----------------------------------------------------------------------
    async def _handle(self, raw: Request, endpoint: str) -> Response:
        arrived = time.time()
        if (denied := self._authorize(raw)) is not None:
            return denied
        if "application/json" not in raw.headers.get("content-type", ""):
            return error(415, "Unsupported Media Type: Only 'application/json' is allowed")
        limit = self.config.router.max_body_bytes
        if int(raw.headers.get("content-length") or 0) > limit:
            return error(413, f"The request body is larger than {limit} bytes.")
        data = await raw.body()
        if len(data) > limit:
            return error(413, f"The request body is larger than {limit} bytes.")
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            return error(400, f"The request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return error(400, "The request body must be a JSON object.")
        try:
            request = self.protocols[endpoint].model_validate(body)
        except ValidationError as exc:
            return error(400, *_validation_message(exc))
        except Exception as exc:  # vLLM's own request checks raise their own errors
            return error_from(exc)
        if request.model_extra:
            unknown = ", ".join(sorted(request.model_extra))
            return error(400, f"Unrecognized request argument supplied: {unknown}",
                         sorted(request.model_extra)[0])
        if endpoint == CHAT and not request.messages:
            return error(400, "'messages' must contain at least one message.", "messages")
        if request.model is not None and request.model != self.model_name:
            return error(404, f"The model `{request.model}` does not exist.", "model")
        try:
            demand = await self._demand(endpoint, request, raw)
            lease = await self._admit_while_connected(raw, demand)
        except Rejected as exc:
            if exc.reason == "invalid":  # the queue counts its own rejections
                self.metrics.rejected(exc.reason)
            headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
            return error(exc.status, str(exc), exc.param, headers=headers)
        except Exception as exc:  # e.g. a prompt the tokenizer cannot take
            self.metrics.rejected("invalid")
            return error_from(exc)
        if lease is None:  # the client left while it waited: nobody reads an answer
            self.metrics.e2e.labels(self.metrics.app, "499").observe(time.time() - arrived)
            return Response(status_code=499)
        return await self._dispatch(endpoint, body, lease, arrived)

    async def _admit_while_connected(self, raw: Request, demand: Any) -> Lease | None:
        """The queue's admission, given up when the client disconnects (None). The router
        does not rely on the ASGI server to cancel a handler whose client left before its
        response started: a departed client would keep its place and be admitted later.
        A lease granted once the disconnect is known is released and not counted (the
        queue's `abandoned`); one handed over in the very step the disconnect arrived is
        released here (it counted: the router had not heard yet)."""
        gone = asyncio.ensure_future(_client_gone(raw))
        admission = asyncio.ensure_future(self.queue.admit(demand, abandoned=gone.done))
        try:
            await asyncio.wait({admission, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this handler was cancelled
            self._give_back(admission)
            raise
        finally:
            gone.cancel()  # no effect once it has returned
        if gone.done() or not admission.done():  # the client left
            self._give_back(admission)
            await asyncio.wait({admission})  # withdrawn from the queue once this returns
            return None
        return admission.result()  # raises Rejected as the queue decided

    def _give_back(self, admission: asyncio.Future) -> None:
        """Cancel an admission nobody waits for (the queue withdraws the entry); a lease
        it yields anyway, now or later, is released."""
        def release_unclaimed(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                self.queue.release(done.result())

        admission.cancel()
        admission.add_done_callback(release_unclaimed)

    async def _demand(self, endpoint: str, request: Any, raw: Request):
        capacity = await self._capacity()
        priority = raw.headers.get(PRIORITY_HEADER)
        labels = {
            "priority": int(priority) if priority and priority.lstrip("-").isdigit()
            else (request.priority or 0),
            "tenant": raw.headers.get(TENANT_HEADER) or request.user or "default",
        }
        estimate = self.estimator.chat if endpoint == CHAT else self.estimator.completion
        # Tokenizing long prompts is CPU work: keep it off the event loop.
        return await asyncio.to_thread(estimate, request, capacity.block_size,
                                       capacity.max_model_len, **labels)

    async def _dispatch(self, endpoint: str, body: dict, lease: Lease,
                        arrived: float) -> Response:
        body = dict(body, priority=0)  # the replica orders by the hint, not vLLM's policy
        strip_usage = request_stream_usage(body)  # the predictor learns from usage

        def start(lease: Lease) -> AsyncIterator[ReplicaChunk]:
            return self.dispatch.generate(lease.replica_id, endpoint, _hinted(body, lease))

        try:  # a replica that fails before answering: the request is placed again
            lease, first, stream = await self.failover.first_chunk(lease, start)
        except Exception as exc:  # (cancellation, the client leaving, propagates)
            logger.warning("request failed before a response: %r", exc)
            self.metrics.e2e.labels(self.metrics.app, "503").observe(time.time() - arrived)
            retry_after = exc.retry_after_s if isinstance(exc, Unserved) else 1
            return error(503, str(exc) if isinstance(exc, Unserved) else
                         f"The replica serving this request failed: {exc}",
                         headers={"Retry-After": str(retry_after)})
        self._observe(first, lease)
        self.metrics.ttft.labels(self.metrics.app).observe(time.time() - arrived)
        if first.kind == "json":
            await _finish(stream)
            self.queue.release(lease)
            if first.status == 200:
                self._learn(lease, completion_tokens(first.payload))
                self._score(lease, first.payload)
            self.metrics.e2e.labels(self.metrics.app, str(first.status)).observe(
                time.time() - arrived)
            return JSONResponse(first.payload, status_code=first.status)
        return StreamingResponse(self._relay(first, stream, lease, arrived, strip_usage),
                                 media_type="text/event-stream")

    async def _relay(self, first: ReplicaChunk, stream: AsyncIterator[ReplicaChunk],
                     lease: Lease, arrived: float, strip_usage: bool):
        status = "200"
        try:
            if text := self._relayed(first.payload, lease, strip_usage):
                yield text
            async for chunk in stream:
                self._observe(chunk, lease)
                if text := self._relayed(chunk.payload, lease, strip_usage):
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
            self.metrics.e2e.labels(self.metrics.app, status).observe(time.time() - arrived)

    def _relayed(self, text: str, lease: Lease, strip_usage: bool) -> str:
        """A stream message as the client gets it; its usage event trains the predictor."""
        self._score(lease, text)
        tokens, text = stream_usage(text, strip_usage)
        self._learn(lease, tokens)
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

    def _learn(self, lease: Lease, tokens: int | None) -> None:
        """A finished request's real output length trains the output predictor."""
        if tokens is not None:
            demand = lease.entry.demand
            self.estimator.predictor.observe(demand.prompt_tokens, demand.tenant,
                                             -(-tokens // demand.sequences))

    def _observe(self, chunk: ReplicaChunk, lease: Lease) -> None:
        self.ledger.acknowledge(lease.reservation)
        self._report(chunk.replica_id, chunk.snapshot)
        self.queue.pump()

    def _report(self, replica_id: str, data: dict) -> None:
        """Snapshot fields go to the ledger's snapshot; the rest (vLLM's counters, the
        replica's pid) is kept beside it."""
        if data.get("engine_dead"):
            self.failover.replica_failed(ReplicaUnavailable(replica_id, "its engine died",
                                                            dead=True))
            return
        snapshot = BlockSnapshot.from_dict(data)
        engine = {k: v for k, v in data.items()
                  if k != "replica_id" and not hasattr(snapshot, k)}
        self.ledger.report(replica_id, snapshot, engine)

    def _authorize(self, request: Request) -> Response | None:
        """The OpenAI API and /admin need the bearer key when one is configured;
        /health and /metrics (block counts and latencies, no request content) do not."""
        key = self.config.router.api_key
        supplied = request.headers.get("authorization", "")
        if key and not hmac.compare_digest(supplied.encode(), f"Bearer {key}".encode()):
            return error(401, "Missing or invalid API key (Authorization: Bearer ...).")
        return None

    # --- replica membership and snapshots --------------------------------------------------
    async def _capacity(self) -> BlockSnapshot:
        deadline = time.time() + self.config.router.queue_timeout_s
        while not self.ledger.replicas:
            if time.time() > deadline:
                raise Rejected(503, "no_replicas", "No replica is ready.")
            await asyncio.sleep(0.1)
        return next(iter(self.ledger.replicas.values())).snapshot

    def _on_replicas_changed(self, added: set[str], removed: set[str]) -> None:
        for replica_id in removed:
            logger.warning("Ray Serve no longer lists replica %s", replica_id)
            self.ledger.mark_missing(replica_id)  # no new work from now on
        for replica_id in added:
            self.ledger.mark_listed(replica_id)
        if added:
            asyncio.get_running_loop().create_task(self._refresh(sorted(added)))
        self.queue.pump()

    async def _refresh(self, replica_ids: list[str]) -> None:
        queued = float(self.queue.queued_blocks())

        async def one(replica_id: str) -> None:
            try:
                await asyncio.wait_for(self.dispatch.connect(replica_id), timeout=5)
                data = await asyncio.wait_for(self.replicas.snapshot.remote(
                    replica_id=replica_id, router_queued_blocks=queued), timeout=5)
            except Exception as exc:  # a dying or starting replica: stale, then excluded
                logger.debug("snapshot of %s failed: %r", replica_id, exc)
                return
            if replica_id in directory(self.metrics.app).replica_ids:
                self._report(replica_id, data)
                await self._follow_kv_events(replica_id)

        await asyncio.gather(*(one(r) for r in replica_ids))
        self.queue.pump()

    async def _follow_kv_events(self, replica_id: str) -> None:
        """Exact prefix index: follow the replica's KV cache events into its ledger
        entry's index (again when the ledger made a new entry for it); prompts are then
        hashed as vLLM hashes them."""
        entry = self.ledger.replicas.get(replica_id)
        if self.kv_events is None or entry is None or self.kv_events.settled(replica_id,
                                                                             entry.prefix):
            return
        try:
            source = await asyncio.wait_for(
                self.replicas.kv_event_source.remote(replica_id=replica_id), timeout=5)
        except Exception as exc:  # retried with the next refresh
            logger.debug("KV event source of %s unknown: %r", replica_id, exc)
            return
        entry = self.ledger.replicas.get(replica_id)
        if entry is not None and self.kv_events.follow(replica_id, source, entry.prefix):
            self.estimator.block_hasher = self.kv_events.hasher

    async def _poll_snapshots(self) -> None:
        """Refresh snapshots that traffic did not refresh recently."""
        interval = self.config.router.poll_interval_s
        members = directory(self.metrics.app)
        pushed_queue = 0
        while True:
            try:
                if not members.replica_ids:
                    # The first call through the handle makes Ray Serve report replicas
                    # (which _refresh then connects to and reads).
                    await asyncio.wait_for(self.replicas.snapshot.remote(), timeout=10)
                now = time.time()
                queued = self.queue.queued_blocks()
                # Stale snapshots are refreshed; while requests queue, every replica hears
                # the queue's demand (for autoscaling) with its poll.
                stale = [r for r in members.replica_ids
                         if queued or pushed_queue or r not in self.ledger.replicas
                         or now - self.ledger.replicas[r].received_at >= interval]
                pushed_queue = queued
                if stale:
                    await self._refresh(stale)
                if self.ledger.find_suspects(self.config.router.suspect_after_s):
                    logger.warning("suspect replicas (no new snapshot while busy): %s",
                                   [r for r, e in self.ledger.replicas.items() if e.suspect])
                    self.queue.pump()
                # Unlisted past the grace period: gone. Its in-flight requests fail and
                # release their leases on their own.
                for replica_id in self.ledger.drop_missing(MISSING_GRACE_S):
                    logger.warning("replica %s left the ledger", replica_id)
                    self.dispatch.remove(replica_id)
                if self.kv_events is not None:
                    self.kv_events.retain(self.ledger.replicas)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("snapshot poll failed: %r", exc)
            await asyncio.sleep(interval)
