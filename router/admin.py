"""The admin API: the cluster's state (/admin/state) and live policy switching
(/admin/policies). Both need the API key (router/auth.py). With several routers a switch
reaches every router, and the state shows every router, through the router board
(router/board.py, router/peers.py)."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from blockserve.protocol.config import RouterConfig, Slo
from blockserve.router.admission import AdmissionQueue
from blockserve.router.failover import Failover
from blockserve.router.ledger import Ledger
from blockserve.router.metrics import RouterMetrics
from blockserve.router.peers import Peers
from blockserve.router.shared_lengths import SharedLengths
from blockserve.router.validation import error

logger = logging.getLogger("blockserve.router")

SWITCHABLE = ("placement", "queue_order")  # the router's policies that switch live


class Admin:
    def __init__(self, config: RouterConfig, slo: Slo, queue: AdmissionQueue, ledger: Ledger,
                 failover: Failover, metrics: RouterMetrics, kv_events: Any,
                 lengths: SharedLengths, board: Any) -> None:
        """`board`: the RouterBoard deployment's handle; `slo`: the deployment's, given
        to a switched-in policy as the config's were given it; `lengths`: the finished
        requests' lengths this router posts and hears."""
        self.slo = slo
        self.queue, self.ledger, self.failover = queue, ledger, failover
        self.metrics, self.kv_events, self.lengths = metrics, kv_events, lengths
        self.policies = {key: getattr(config, key).model_dump() for key in SWITCHABLE}
        self.peers = Peers(board, metrics.router, config.poll_interval_s, self.install,
                           self.report, on_read=self._heard)

    def _heard(self, others: dict[str, dict]) -> None:
        """The other routers' reports: how many routers place on the same replicas, and
        the lengths they saw finish."""
        self.queue.routers = 1 + len(others)
        self.lengths.hear({router: report.get("finished_lengths", [])
                           for router, report in others.items()})

    def router(self) -> dict:
        """This router alone: what only it holds (its queue, reservations, policies)."""
        return {"router": self.metrics.router, "pid": os.getpid(),
                "policies": self.policies, "policies_version": self.peers.version,
                "queue": {"requests": len(self.queue.waiting),
                          "blocks": self.queue.queued_blocks()},
                "in_flight_requests": self.ledger.in_flight(),
                "routers_counted": self.queue.routers,  # its placement spreads over these
                "lengths_heard": self.lengths.heard,  # finished at other routers
                "reserved_blocks": self.ledger.reserved_blocks(),
                "retried_requests": self.failover.retried}

    def report(self) -> dict:
        """What this router posts to the board for the others to show."""
        return {"router": self.router(), "metrics": self.metrics.own(),
                "finished_lengths": self.lengths.posted()}

    def state(self) -> dict:
        """Cluster state: active policies, queue, and each replica's blocks and ledger
        (as this router holds them), and every router's own part (`routers`)."""
        now = time.time()
        return {
            "router": self.metrics.router,
            "routers": sorted([self.router(), *(report["router"] for report
                                                in self.peers.others.values())],
                              key=lambda r: r["router"]),
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
                "block_policies": {**entry.block_policies(),
                                   "policy_errors": entry.snapshot.policy_errors()},
                "in_flight_requests": entry.ongoing,
                "drift_blocks": entry.drift_blocks,
                "suspect": entry.suspect,
            } for replica_id, entry in sorted(self.ledger.replicas.items())],
        }

    async def switch(self, request: Request) -> Response:
        """Switch every router's placement and/or queue order at run time.

        Body: {"placement": <policy>, "queue_order": <policy>} (either or both). The swap
        is atomic on each router's event loop, here at once and at the other routers when
        the board tells them; admitted requests keep their leases.
        """
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict) or not body.keys() & set(SWITCHABLE):
                raise ValueError("give 'placement' and/or 'queue_order'")
            self.install({key: body[key] for key in SWITCHABLE if key in body})
        except (ValueError, TypeError) as exc:
            return error(400, f"Invalid policy switch: {exc}")
        try:
            await self.peers.switch(self.policies)
        except Exception as exc:  # applied here; the others did not hear of it
            logger.error("policy switch not posted to the router board: %r", exc)
            return error(503, f"The switch applies to this router only: the router board "
                         f"is unreachable ({exc!r}). Post it again.")
        return JSONResponse(self.state())

    def install(self, policies: dict) -> None:
        """Build and install the named policies (all or nothing); raises ValueError or
        TypeError for one that does not build."""
        refs = {key: RouterConfig.policy_ref(key, self.slo.given(f"router.{key}", value))
                for key, value in policies.items()}
        built = {key: ref.policy for key, ref in refs.items()}
        if "placement" in built:
            self.queue.placement = built["placement"]
            self.metrics.policy = refs["placement"].cls.rpartition(":")[2]
        if "queue_order" in built:
            self.queue.order = built["queue_order"]
        self.policies = {**self.policies, **{key: ref.model_dump() for key, ref in refs.items()}}
        logger.info("policies switched: %s", self.policies)
        self.queue.pump()
