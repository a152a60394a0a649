"""Dispatch through Ray Serve to the replica the central router chose.

`PinnedReplicaRouter` is a Ray Serve `RequestRouter` (public API) installed on the
replica deployment. It does no choosing of its own: a call made with
`replica_id=<id>` goes to exactly that replica. It also tells the router which
replicas exist, through the process-local registry (controller/registry.py), as
Ray Serve adds, restarts and removes them.
"""

from __future__ import annotations

import logging
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from controller import registry

logger = logging.getLogger("blockserve.dispatch")


class PinnedReplicaRouter(RequestRouter):
    """Routes each call to the replica named by its `replica_id` keyword argument."""

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        registry.directory(self.app_name).update({r.replica_id.unique_id for r in replicas})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        registry.directory(self.app_name).remove(replica_id.unique_id)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> List[List[RunningReplica]]:
        target = pending_request.kwargs.get("replica_id") if pending_request else None
        if target is None:
            return [candidate_replicas]
        for replica in candidate_replicas:
            if replica.replica_id.unique_id == target:
                return [[replica]]
        # The chosen replica is gone (or not yet visible here): any live one serves it;
        # its response carries that replica's snapshot, so the ledger stays truthful.
        logger.warning("replica %s not available; falling back", target)
        return [candidate_replicas]
