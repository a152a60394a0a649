"""The router ingress: the OpenAI-compatible HTTP API in front of the replicas.

request -> validated with vLLM's own protocol models (router/validation.py) -> block
demand (model's tokenizer) -> admission queue (order, ledger, placement) -> pinned
dispatch to the chosen replica -> vLLM's serving layer there -> response relayed, its
snapshots fed back into the ledger (router/relay.py).

`Router` wires the parts together; each job lives in its own module: validation and
errors (validation.py), the API key (auth.py), the admin API (admin.py), relaying
responses (relay.py), replica membership and snapshots (membership.py), what crosses
routers when there are several (board.py, peers.py; docs/routers.md).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from blockserve.protocol.chunks import CHAT, COMPLETIONS
from blockserve.protocol.config import AppConfig, checked
from blockserve.protocol.path_trace import mark
from blockserve.router.admin import Admin
from blockserve.router.admission import AdmissionQueue, Lease
from blockserve.router.auth import ApiKey
from blockserve.router.demand import DemandEstimator, Rejected
from blockserve.router.failover import Failover
from blockserve.router.haproxy_guard import guard_haproxy_forever
from blockserve.router.kv_events import KvEventFollower
from blockserve.router.ledger import Ledger
from blockserve.router.membership import Membership
from blockserve.router.metrics import RouterMetrics
from blockserve.router.openapi import describe
from blockserve.router.relay import Relay
from blockserve.router.validation import Invalid, RequestValidator, error, error_from

app = FastAPI(title="blockserve")
logger = logging.getLogger("blockserve.router")

PRIORITY_HEADER = "x-blockserve-priority"
TENANT_HEADER = "x-blockserve-tenant"
# Bodies up to this size are tokenized on the event loop: for a short prompt the hand-off
# to a thread costs about as much as the tokenizing (docs/benchmarks.md, the router tier's
# floor before and after). Longer prompts go to a thread, where the tokenizer releases
# the GIL and the loop keeps serving.
INLINE_TOKENIZE_BYTES = 2048


async def _client_gone(raw: Request) -> None:
    """Returns the moment the ASGI server reports that the client disconnected: its
    request body was read already, so the next message it receives is that disconnect."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


@serve.ingress(app)
class Router:
    """One router replica: its admission queue, and a ledger of every replica's snapshots
    plus its own reservations (several routers share none of it: docs/routers.md)."""

    def __init__(self, replicas: DeploymentHandle, board: DeploymentHandle, config: dict):
        from transformers import AutoTokenizer

        self.config = checked(AppConfig, config)  # validated by build_app already
        router = self.config.router
        self.replicas = replicas
        self.validator = RequestValidator(self.config.replica.model_name,
                                          router.max_body_bytes)
        self.api_key = ApiKey(router.api_key)
        self.dispatch = router.transport.build(replicas)
        self.ledger = Ledger(stale_after_s=router.stale_after_s,
                             prefix_index=router.prefix_index.build)
        # vLLM's KV cache events, per replica, for an index that follows them
        kv_events = (KvEventFollower() if router.prefix_index.policy_class.follows_kv_events
                     else None)
        self.queue = AdmissionQueue(
            self.ledger, router.placement.policy, router.queue_order.policy,
            max_requests=router.max_queued_requests, max_tokens=router.max_queued_tokens,
            timeout_s=router.queue_timeout_s)
        context = serve.get_replica_context()
        app_name = context.app_name
        self.metrics = RouterMetrics(app_name, router.placement.cls.rpartition(":")[2],
                                     self.queue, router=context.replica_id.unique_id)
        self.queue.on_taken = lambda lease: self.metrics.admitted(lease.replica_id,
                                                                   lease.queue_wait_s)
        self.queue.on_reject = lambda rejection: self.metrics.rejected(rejection.reason)
        self.failover = Failover(self.queue, self.ledger, self.dispatch.on_removed,
                                 router.max_retries)
        self.estimator = DemandEstimator(
            AutoTokenizer.from_pretrained(self.config.replica.model),
            router.output_predictor.policy)
        self.admin = Admin(router, self.config.slo, self.queue, self.ledger, self.failover,
                           self.metrics, kv_events, self.estimator.lengths, board)
        self.membership = Membership(app_name, replicas, self.dispatch, self.ledger,
                                     self.queue, self.failover, self.estimator, kv_events,
                                     router)
        self.relay = Relay(self.dispatch, self.queue, self.ledger, self.failover,
                           self.metrics, self.estimator,
                           functools.partial(self.membership.report, joins=False))
        self._models: dict | None = None
        keyed = bool(router.api_key)
        app.openapi = functools.cache(lambda: describe(app, keyed))  # router/openapi.py
        loop = asyncio.get_running_loop()
        self._poller = self.membership.start(loop)
        self._peers = self.admin.peers.start(loop)
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
        others = [report["metrics"] for report in self.admin.peers.others.values()]
        return Response(self.metrics.exposition(others),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        if (denied := self.api_key.denied(request)) is not None:
            return denied
        if self._models is None:
            self._models = await self.replicas.models.remote()
        return JSONResponse(self._models)

    @app.get("/admin/state")
    async def admin_state(self, request: Request) -> Response:
        """Cluster state: active policies, queue, and each replica's blocks and ledger."""
        if (denied := self.api_key.denied(request)) is not None:
            return denied
        return JSONResponse(self.admin.state())

    @app.post("/admin/policies")
    async def admin_policies(self, request: Request) -> Response:
        """Switch the router's placement and/or queue order at run time (router/admin.py)."""
        if (denied := self.api_key.denied(request)) is not None:
            return denied
        return await self.admin.switch(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, CHAT)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, COMPLETIONS)

    # --- the data path ----------------------------------------------------------------------
    async def _handle(self, raw: Request, endpoint: str) -> Response:
        """A request's response; whatever its handling raises is an OpenAI error that the
        log explains, never Serve's bare 500 (a client leaving still cancels it)."""
        arrived = time.time()
        mark("router: handler entered")
        try:
            return await self._respond(raw, endpoint, arrived)
        except Exception as exc:
            logger.exception("handling a request to %s failed", endpoint)
            self.metrics.finished(500, arrived)
            return error(500, f"The router failed to handle the request: {exc!r}")

    async def _respond(self, raw: Request, endpoint: str, arrived: float) -> Response:
        if (denied := self.api_key.denied(raw)) is not None:
            return denied
        try:
            body, request = await self.validator.parse(raw, endpoint)
        except Invalid as invalid:
            return invalid.response
        mark("router: request validated")
        try:
            demand = await self._demand(endpoint, request, raw)
            mark("router: demand sized")
            lease = await self._admit_while_connected(raw, demand)
        except Rejected as exc:
            if exc.reason == "invalid":  # the queue counts its own rejections
                self.metrics.rejected(exc.reason)
            headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
            return error(exc.status, str(exc), exc.param, headers=headers)
        except Exception as exc:  # e.g. a prompt the tokenizer cannot take
            self.metrics.rejected("invalid")
            response = error_from(exc)
            if response.status_code >= 500:  # not the request's fault, as vLLM maps it
                logger.error("sizing a request failed: %r", exc, exc_info=exc)
            return response
        mark("router: admitted")
        if lease is None:  # the client left while it waited: nobody reads an answer
            self.metrics.finished(499, arrived)
            return Response(status_code=499)
        return await self.relay.respond(endpoint, body, lease, arrived)

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
        capacity = await self.membership.capacity()
        priority = raw.headers.get(PRIORITY_HEADER)
        labels = {
            "priority": int(priority) if priority and priority.lstrip("-").isdigit()
            else (request.priority or 0),
            "tenant": raw.headers.get(TENANT_HEADER) or request.user or "default",
        }
        estimate = self.estimator.chat if endpoint == CHAT else self.estimator.completion
        if len(await raw.body()) <= INLINE_TOKENIZE_BYTES:  # read once, by validation
            return estimate(request, capacity.block_size, capacity.max_model_len, **labels)
        return await asyncio.to_thread(estimate, request, capacity.block_size,
                                       capacity.max_model_len, **labels)
