"""Short names of the built-in policies, per config field: the one list that config
validation (protocol/config.py), the benchmarks and the docs read.

A config names a built-in by its short name (`placement: best_fit`) and a user class by
import path (`mymodule:MyPolicy`, as Ray Serve's `request_router_class`). vLLM's own
behaviour is called `vllm` in every field where a policy can replace it. A new built-in
is one line in its field's table below.

Only import paths are kept here, so reading the registry imports no policy: a replica's
EngineCore imports only the replica-side policies it runs, never the router's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

_REPLICA = "blockserve.replica"
_ROUTER = "blockserve.router"
_PROTOCOL = "blockserve.protocol"


@dataclass(frozen=True)
class PolicyKind:
    """The policies one config field accepts: the interface each must be an instance of
    and the built-ins by short name."""

    interface: str
    built_ins: Mapping[str, str]

    @property
    def names(self) -> list[str]:
        return sorted(self.built_ins)

    def import_path(self, field: str, name: str) -> str:
        """A built-in's import path; an import path itself ("module:Class") as it is."""
        if name in self.built_ins:
            return self.built_ins[name]
        if ":" in name or "." in name:
            return name
        raise ValueError(f"unknown {field} {name!r}: use one of {self.names} or an import "
                         "path 'package.module:Class'")


PLACEMENTS = {
    "best_fit": f"{_ROUTER}.placement:BestFitBlocks",
    "balanced": f"{_ROUTER}.placement:BalancedBlocks",
    "most_free": f"{_ROUTER}.placement:MostFreeBlocks",
    "round_robin": f"{_ROUTER}.placement:RoundRobin",
    "power_of_two": f"{_ROUTER}.placement:PowerOfTwoChoices",
    "least_kv": f"{_ROUTER}.placement:LeastKvUsage",
    "cache_aware": f"{_ROUTER}.cache_placement:CacheAwarePlacement",
    "dynamo": f"{_ROUTER}.cache_placement:DynamoCost",
}
# Placements that copy another router's rule and are blind to request size (baselines).
BASELINE_PLACEMENTS = ("round_robin", "power_of_two", "least_kv")

QUEUE_ORDERS = {
    "fcfs": f"{_PROTOCOL}.queue_orders:FirstComeFirstServed",
    "shortest_demand": f"{_PROTOCOL}.queue_orders:ShortestDemandFirst",
    "priority": f"{_PROTOCOL}.queue_orders:Priority",
    "fair_share": f"{_PROTOCOL}.queue_orders:FairShare",
}

KINDS: dict[str, PolicyKind] = {
    "router.placement": PolicyKind(f"{_ROUTER}.placement:Placement", PLACEMENTS),
    "router.queue_order": PolicyKind(f"{_PROTOCOL}.policies:QueueOrder", QUEUE_ORDERS),
    "router.output_predictor": PolicyKind(f"{_ROUTER}.predictors:OutputPredictor", {
        "online_quantile": f"{_ROUTER}.predictors:OnlineQuantilePredictor",
        "fixed": f"{_ROUTER}.predictors:FixedPredictor",
        "max_tokens": f"{_ROUTER}.predictors:MaxTokensPredictor",
    }),
    "replica.scheduler.queue_order": PolicyKind(f"{_PROTOCOL}.policies:QueueOrder", {
        **QUEUE_ORDERS,
        "router_order": f"{_PROTOCOL}.queue_orders:RouterOrder",
    }),
    "replica.scheduler.admission_gate": PolicyKind(f"{_PROTOCOL}.policies:AdmissionGate", {
        "vllm": f"{_PROTOCOL}.policies:VllmDefaultGate",
        "reservation": f"{_REPLICA}.scheduler_builtins:ReservationGate",
    }),
    "replica.scheduler.preemption": PolicyKind(f"{_PROTOCOL}.policies:PreemptionOrder", {
        "vllm": f"{_PROTOCOL}.policies:VllmDefaultPreemption",
        "cheapest_recompute": f"{_REPLICA}.scheduler_builtins:CheapestRecompute",
    }),
    "replica.scheduler.block_eviction": PolicyKind(f"{_PROTOCOL}.policies:EvictionPolicy", {
        "vllm": f"{_PROTOCOL}.policies:VllmDefaultEviction",
        "protect_shared": f"{_REPLICA}.block_builtins:ProtectSharedPrefixes",
        "s3fifo": f"{_REPLICA}.block_builtins:S3Fifo",
    }),
    "replica.scheduler.block_retention": PolicyKind(f"{_PROTOCOL}.policies:RetentionPolicy", {
        "vllm": f"{_PROTOCOL}.policies:VllmDefaultRetention",
        "priority": f"{_REPLICA}.block_builtins:PriorityRetention",
    }),
    "replica.scheduler.block_budget": PolicyKind(f"{_PROTOCOL}.policies:BlockBudget", {
        "vllm": f"{_PROTOCOL}.policies:VllmDefaultBudget",
        "tenant_quota": f"{_REPLICA}.block_builtins:TenantBlockQuota",
    }),
}
