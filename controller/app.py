"""The application builder that a Ray Serve config's `import_path` names.

    import_path: blockserve.controller.app:build_app

It validates the application's `args` (protocol/config.py) and binds the deployments:
`Router` (ingress: queue, ledger, placement; `num_replicas` routers share nothing but
the board), `Replica` (vLLM engines), the latter with the pinned request router so the
central decision is carried out, and `RouterBoard` (router/board.py: policy switches and
reports that cross routers).
Deployment options in the config file's `deployments:` list override the defaults here.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from blockserve.protocol.config import parse_app_config
from blockserve.replica.deployment import VLLMReplica
from blockserve.router.board import RouterBoard
from blockserve.router.ingress import Router

# The router admits by KV blocks, so Ray Serve's per-replica request cap must not bind.
REPLICA_MAX_ONGOING_REQUESTS = 4096
# A replica whose engine died fails its health check (replica/deployment.py); checked
# this often, Ray Serve starts its replacement within seconds (Ray's default: 10 s).
HEALTH_CHECK_PERIOD_S = 2
# Ray's default: a live replica that is busy has this long to answer a health check.
HEALTH_CHECK_TIMEOUT_S = 30
# Ray Serve kills a stopping replica after this long (its default: 20 s), so that a
# deployment stops within seconds; a stream it cuts ends with an error event.
GRACEFUL_SHUTDOWN_TIMEOUT_S = 5


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve's application builder: exactly one parameter, the config's `args`."""
    return bind(args, VLLMReplica)


def bind(args: dict[str, Any], replica_cls: type) -> serve.Application:
    """The application with `replica_cls` as the replicas (tools/echo_replica.py's
    answers at once, to measure the router alone)."""
    config = parse_app_config(args)
    replica = serve.deployment(
        replica_cls,
        name="Replica",
        max_ongoing_requests=REPLICA_MAX_ONGOING_REQUESTS,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_TIMEOUT_S,
        request_router_config=RequestRouterConfig(
            request_router_class="blockserve.router.dispatch:PinnedReplicaRouter",
        ),
    ).bind(config.replica.model_dump())
    # Every router holds a long poll and posts a report each poll interval: no CPU of
    # its own to speak of, and one replica (Serve restarts it; routers post again).
    board = serve.deployment(
        RouterBoard, name="RouterBoard", num_replicas=1,
        max_ongoing_requests=REPLICA_MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0},
    ).bind()
    router = serve.deployment(
        Router, name="Router", max_ongoing_requests=REPLICA_MAX_ONGOING_REQUESTS,
    ).bind(replica, board, config.model_dump())
    return router
