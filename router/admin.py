"""The admin API: the cluster's state (/admin/state) and live policy switching
(/admin/policies). Both need the API key (router/auth.py)."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from blockserve.protocol.config import RouterConfig
from blockserve.router.admission import AdmissionQueue
from blockserve.router.failover import Failover
from blockserve.router.ledger import Ledger
from blockserve.router.metrics import RouterMetrics
from blockserve.router.validation import error

logger = logging.getLogger("blockserve.router")

SWITCHABLE = ("placement", "queue_order")  # the router's policies that switch live


class Admin:
    def __init__(self, config: RouterConfig, queue: AdmissionQueue, ledger: Ledger,
                 failover: Failover, metrics: RouterMetrics, kv_events: Any) -> None:
        self.queue, self.ledger, self.failover = queue, ledger, failover
        self.metrics, self.kv_events = metrics, kv_events
        self.policies = {key: getattr(config, key).model_dump() for key in SWITCHABLE}

    def state(self) -> dict:
        """Cluster state: active policies, queue, and each replica's blocks and ledger."""
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
                "block_policies": {**entry.block_policies(),
                                   "policy_errors": entry.snapshot.policy_errors()},
                "in_flight_requests": entry.ongoing,
                "drift_blocks": entry.drift_blocks,
                "suspect": entry.suspect,
            } for replica_id, entry in sorted(self.ledger.replicas.items())],
        }

    async def switch(self, request: Request) -> Response:
        """Switch the router's placement and/or queue order at run time.

        Body: {"placement": <policy>, "queue_order": <policy>} (either or both). The swap
        is atomic on the event loop; admitted requests keep their leases.
        """
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict) or not body.keys() & set(SWITCHABLE):
                raise ValueError("give 'placement' and/or 'queue_order'")
            refs = {key: RouterConfig.policy_ref(key, body[key])
                    for key in SWITCHABLE if key in body}
            built = {key: ref.policy for key, ref in refs.items()}
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
        return JSONResponse(self.state())
