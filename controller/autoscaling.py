"""Autoscaling the replica deployment on KV block demand (a Ray Serve custom policy).

    deployments:
      - name: Replica
        autoscaling_config:
          min_replicas: 1
          max_replicas: 4
          policy:
            policy_function: blockserve.controller.autoscaling:BlockDemandAutoscaler
            policy_kwargs: {target_utilization: 0.75, scale_down_utilization: 0.3,
                            upscale_delay_s: 5, downscale_delay_s: 30}

Demand = the committed blocks (held + growth + waiting, protocol/blocks.py) of every replica +
the demand queued at the router (each replica reports the router's queue, which the
router pushes to it with its snapshot polls). Scale up when demand stays above
`target_utilization` of capacity for `upscale_delay_s`, to the replica count that brings
it back to the target; scale down one replica at a time when it stays below
`scale_down_utilization` for `downscale_delay_s`. Ray Serve's min/max bounds apply.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("ray.serve")
DEMAND_METRICS = ("held_blocks", "growth_blocks", "waiting_blocks")  # protocol/blocks.py


def block_demand(metrics: dict[str, dict[Any, float]]) -> tuple[float, float] | None:
    """(demand, capacity) in blocks from replica-reported metrics; None until reported."""
    capacity = sum(metrics.get("total_blocks", {}).values())
    if capacity <= 0:
        return None
    demand = sum(sum(metrics.get(name, {}).values()) for name in DEMAND_METRICS)
    queued = max(metrics.get("router_queued_blocks", {}).values(), default=0.0)
    return demand + queued, capacity


@dataclass
class BlockDemandAutoscaler:
    target_utilization: float = 0.75
    scale_down_utilization: float = 0.3
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.scale_down_utilization < self.target_utilization <= 1:
            raise ValueError("need 0 < scale_down_utilization < target_utilization <= 1")

    def __call__(self, ctx: Any) -> tuple[int, dict]:
        metrics = ctx.aggregated_metrics
        metrics = metrics() if callable(metrics) else (metrics or {})
        measured = block_demand(metrics)
        decision, state = self.decide(ctx.current_num_replicas, measured,
                                      ctx.capacity_adjusted_min_replicas,
                                      ctx.capacity_adjusted_max_replicas,
                                      dict(ctx.policy_state or {}),
                                      ctx.current_time or time.time())
        if decision != ctx.current_num_replicas:  # in the Serve controller's log
            logger.info("block autoscaling: demand %s of capacity %s blocks: %d -> %d replicas",
                        *(measured or (None, None)), ctx.current_num_replicas, decision)
        return decision, state

    def decide(self, current: int, measured: tuple[float, float] | None, minimum: int,
               maximum: int, state: dict, now: float) -> tuple[int, dict]:
        """Pure decision: the replica count and the policy state to keep."""
        if measured is None or current <= 0:
            return max(minimum, min(maximum, max(current, minimum))), {}
        demand, capacity = measured
        per_replica = capacity / current
        utilization = demand / capacity
        wanted = max(1, math.ceil(demand / (self.target_utilization * per_replica)))
        state = {"utilization": utilization, **{k: v for k, v in state.items()
                                                if k in ("above_since", "below_since")}}
        if utilization > self.target_utilization:
            state.pop("below_since", None)
            since = state.setdefault("above_since", now)
            if now - since >= self.upscale_delay_s:
                state.pop("above_since")
                return min(maximum, max(current + 1, wanted)), state
        elif utilization < self.scale_down_utilization:
            state.pop("above_since", None)
            since = state.setdefault("below_since", now)
            if now - since >= self.downscale_delay_s and current > minimum:
                state.pop("below_since")
                return max(minimum, current - 1), state
        else:
            state.pop("above_since", None)
            state.pop("below_since", None)
        return max(minimum, min(maximum, current)), state
