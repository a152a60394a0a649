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
    """The policies one config field accepts: the interface each must subclass, the
    built-ins by short name and the default (deploy/deploy.yaml's choice).
    `runtime_args` names the run-time parts a policy of this kind is built with, before
    its config's keyword arguments (a replica, the Serve handle); a kind without them is
    built once per process (protocol/config.py)."""

    interface: str
    built_ins: Mapping[str, str]
    default: str
    runtime_args: tuple[str, ...] = ()

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
    "llmd_precise": f"{_ROUTER}.llmd_placement:LlmdScorers",
    "llmd_load": f"{_ROUTER}.llmd_placement:LlmdLoad",
    "predicted_latency": f"{_ROUTER}.llmd_placement:PredictedLatency",
}
# Placements that copy another router's rule and are blind to request size (baselines).
BASELINE_PLACEMENTS = ("round_robin", "power_of_two", "least_kv")

QUEUE_ORDERS = {
    "fcfs": f"{_PROTOCOL}.queue_orders:FirstComeFirstServed",
    "shortest_demand": f"{_PROTOCOL}.queue_orders:ShortestDemandFirst",
    "priority": f"{_PROTOCOL}.queue_orders:Priority",
    "fair_share": f"{_PROTOCOL}.queue_orders:FairShare",
    "on_time_first": f"{_PROTOCOL}.queue_orders:OnTimeFirst",
}

_INTERFACES = f"{_PROTOCOL}.policies"
_ROUTER_INTERFACES = f"{_PROTOCOL}.router_policies"

KINDS: dict[str, PolicyKind] = {
    "router.placement": PolicyKind(f"{_ROUTER_INTERFACES}:Placement", PLACEMENTS,
                                   default="cache_aware"),
    "router.queue_order": PolicyKind(f"{_INTERFACES}:QueueOrder", QUEUE_ORDERS,
                                     default="on_time_first"),
    "router.output_predictor": PolicyKind(f"{_ROUTER_INTERFACES}:OutputPredictor", {
        "online_quantile": f"{_ROUTER}.predictors:OnlineQuantilePredictor",
        "fixed": f"{_ROUTER}.predictors:FixedPredictor",
        "max_tokens": f"{_ROUTER}.predictors:MaxTokensPredictor",
    }, default="online_quantile"),
    "router.prefix_index": PolicyKind(f"{_ROUTER_INTERFACES}:PrefixIndex", {
        "approximate": f"{_ROUTER}.prefix_cache:ApproximatePrefixIndex",
        "exact": f"{_ROUTER}.prefix_cache:ExactPrefixIndex",
    }, default="exact", runtime_args=("replica_id", "capacity", "owners")),
    "router.transport": PolicyKind(f"{_ROUTER_INTERFACES}:Transport", {
        "direct": f"{_ROUTER}.dispatch:DirectDispatch",
        "serve_handle": f"{_ROUTER}.dispatch:HandleDispatch",
    }, default="direct", runtime_args=("replicas",)),
    "replica.scheduler.queue_order": PolicyKind(f"{_INTERFACES}:QueueOrder", {
        **QUEUE_ORDERS,
        "router_order": f"{_PROTOCOL}.queue_orders:RouterOrder",
    }, default="on_time_first"),
    "replica.scheduler.admission_gate": PolicyKind(f"{_INTERFACES}:AdmissionGate", {
        "vllm": f"{_INTERFACES}:VllmDefaultGate",
        "reservation": f"{_REPLICA}.scheduler_builtins:ReservationGate",
    }, default="vllm"),
    "replica.scheduler.preemption": PolicyKind(f"{_INTERFACES}:PreemptionOrder", {
        "vllm": f"{_INTERFACES}:VllmDefaultPreemption",
        "cheapest_recompute": f"{_REPLICA}.scheduler_builtins:CheapestRecompute",
    }, default="vllm"),
    "replica.scheduler.block_eviction": PolicyKind(f"{_INTERFACES}:EvictionPolicy", {
        "vllm": f"{_INTERFACES}:VllmDefaultEviction",
        "protect_shared": f"{_REPLICA}.block_builtins:ProtectSharedPrefixes",
        "s3fifo": f"{_REPLICA}.block_builtins:S3Fifo",
    }, default="protect_shared"),
    "replica.scheduler.block_retention": PolicyKind(f"{_INTERFACES}:RetentionPolicy", {
        "vllm": f"{_INTERFACES}:VllmDefaultRetention",
        "priority": f"{_REPLICA}.block_builtins:PriorityRetention",
    }, default="vllm"),
    "replica.scheduler.block_budget": PolicyKind(f"{_INTERFACES}:BlockBudget", {
        "vllm": f"{_INTERFACES}:VllmDefaultBudget",
        "tenant_quota": f"{_REPLICA}.block_builtins:TenantBlockQuota",
    }, default="vllm"),
    "replica.scheduler.step_tokens": PolicyKind(f"{_INTERFACES}:StepTokens", {
        "vllm": f"{_INTERFACES}:VllmStepTokens",
        "itl_target": f"{_REPLICA}.scheduler_builtins:ItlTarget",
        "tpot_pace": f"{_REPLICA}.scheduler_builtins:TpotPace",
    }, default="tpot_pace"),
}
