"""The router's real parts wired as router/ingress.py wires them, without Ray or an engine,
for the engine-less tests of one router module each (relay, admin, membership,
validation)."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from blockserve.protocol.config import RouterConfig
from blockserve.protocol.router_policies import Transport
from blockserve.protocol.snapshot import BlockSnapshot
from blockserve.router.admission import AdmissionQueue
from blockserve.router.failover import Failover
from blockserve.router.ledger import Ledger
from blockserve.router.metrics import RouterMetrics

SNAPSHOT = BlockSnapshot(timestamp=1.0, total_blocks=100, block_size=16, free_blocks=100,
                         max_model_len=1024)


class PlayedBack(Transport):
    """Answers every request with `chunks`, or fails it with `error` first: the one fake,
    standing for the network."""

    def __init__(self, replicas=None, chunks=(), error=None):
        self.chunks, self.error, self.bodies, self.removed = list(chunks), error, [], []

    def on_removed(self, replica_id: str) -> None:
        self.removed.append(replica_id)

    async def generate(self, replica_id, endpoint, body):
        self.bodies.append(body)
        if self.error:
            raise self.error
        for chunk in self.chunks:
            yield chunk


@dataclass
class Parts:
    config: RouterConfig
    ledger: Ledger
    queue: AdmissionQueue
    failover: Failover
    metrics: RouterMetrics
    transport: PlayedBack

    def metric(self, name: str, **labels) -> float:
        return self.metrics.registry.get_sample_value(
            name, {"app": "app", "router": self.metrics.router, **labels}) or 0


def router_parts(transport: PlayedBack | None = None, replicas=("a",), **router) -> Parts:
    """The configured policies (deploy.yaml's unless `router` says otherwise) over a
    ledger where each of `replicas` has reported SNAPSHOT."""
    config = RouterConfig(**{"prefix_index": "approximate", **router})
    ledger = Ledger(stale_after_s=1e9, prefix_index=config.prefix_index.build)
    for replica_id in replicas:
        ledger.report(replica_id, SNAPSHOT)
    queue = AdmissionQueue(ledger, config.placement.policy, config.queue_order.policy,
                           max_requests=8, max_tokens=10**6, timeout_s=5)
    transport = transport or PlayedBack()
    failover = Failover(queue, ledger, transport.on_removed, retries=0)
    return Parts(config, ledger, queue, failover, RouterMetrics("app", "p", queue), transport)


class InProcess:
    """A deployment's methods called as a Serve handle calls them (`.remote(...)`,
    awaited), on an instance in this process: the router board in the admin tests."""

    def __init__(self, instance) -> None:
        self.instance = instance

    def __getattr__(self, name: str):
        method = getattr(self.instance, name)
        return type("Method", (), {"remote": staticmethod(method)})


def http_request(body: bytes = b"", headers: dict[str, str] | None = None,
                 path: str = "/") -> Request:
    """A Starlette request as the ASGI server hands it to the router."""
    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    raw_headers = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return Request({"type": "http", "method": "POST", "path": path, "headers": raw_headers},
                   receive)
