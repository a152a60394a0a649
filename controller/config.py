"""Typed configuration of a blockserve application, validated in one place.

The `args:` block of an application in a Ray Serve config file (deploy/deploy.yaml) is
parsed into `AppConfig`. vLLM engine arguments stay verbatim under `engine_args` and go
straight to `AsyncEngineArgs`; everything blockserve adds is a named, checked field here.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator, model_validator)

SCHEDULER_CLS = "blockserve.replica.scheduler.BlockAwareScheduler"
ASYNC_SCHEDULER_CLS = "blockserve.replica.scheduler.AsyncBlockAwareScheduler"
ADDITIONAL_CONFIG_KEY = "blockserve"


def load_object(import_path: str) -> Any:
    """Resolve "package.module:Name" (or "package.module.Name") to the object it names."""
    module_name, sep, attr = import_path.partition(":")
    if not sep:
        module_name, _, attr = import_path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{import_path!r} is not an import path like 'package.module:Name'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {import_path!r}: {exc}") from exc


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PolicyRef(_Strict):
    """A policy chosen by import path, with keyword arguments for its constructor."""

    cls: str
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        return {"cls": value} if isinstance(value, str) else value

    @field_validator("cls")
    @classmethod
    def _importable(cls, value: str) -> str:
        load_object(value)
        return value

    def build(self) -> Any:
        return load_object(self.cls)(**self.kwargs)


def _block_names(field: str) -> dict[str, str]:
    from blockserve.replica.block_policies import BUILT_INS  # vLLM-free

    return BUILT_INS[field]


def _policy(import_path: str) -> Any:
    """A policy field whose default is imported only when a config is built."""
    return Field(default_factory=lambda: PolicyRef(cls=import_path))


class SchedulerConfig(_Strict):
    """Policies of the block-aware vLLM scheduler inside every replica."""

    queue_order: PolicyRef = _policy("blockserve.router.ordering:FirstComeFirstServed")
    admission_gate: PolicyRef = _policy("blockserve.replica.policies:VllmDefaultGate")
    preemption: PolicyRef = _policy("blockserve.replica.policies:VllmDefaultVictim")
    # Block policies (replica/block_policies.py): a built-in's short name
    # (blockserve.replica.block_policies.BUILT_INS) or an import path; "vllm" is vLLM's own behaviour.
    block_eviction: PolicyRef = _policy("blockserve.replica.block_policies:VllmDefaultEviction")
    block_retention: PolicyRef = _policy("blockserve.replica.block_policies:VllmDefaultRetention")
    block_budget: PolicyRef = _policy("blockserve.replica.block_policies:VllmDefaultBudget")
    # Where the scheduler publishes its block snapshot (set by the replica at start-up).
    snapshot_channel: str | None = None
    # The replica process: the engine kills itself when it exits (set at start-up).
    owner_pid: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _renamed_block_assignment(cls, value: Any) -> Any:
        """The earlier `block_assignment` key: its two policies map to `block_eviction`."""
        if not isinstance(value, dict) or "block_assignment" not in value:
            return value
        renamed = {"blockserve.replica.policies:LruBlockAssignment": "vllm",
                   "blockserve.replica.policies:ProtectSharedBlocks": "protect_shared"}
        old = value["block_assignment"]
        if "block_eviction" in value or old not in renamed:
            raise ValueError("block_assignment is replaced by block_eviction (short names: "
                             f"{sorted(_block_names('block_eviction'))})")
        return {**{k: v for k, v in value.items() if k != "block_assignment"},
                "block_eviction": renamed[old]}

    @field_validator("block_eviction", "block_retention", "block_budget", mode="before")
    @classmethod
    def _block_short_name(cls, value: Any, info: ValidationInfo) -> Any:
        names = _block_names(info.field_name)
        if isinstance(value, str) and value in names:
            return {"cls": names[value]}
        if isinstance(value, dict) and value.get("cls") in names:
            return {**value, "cls": names[value["cls"]]}
        if isinstance(value, str) and ":" not in value and "." not in value:
            raise ValueError(f"unknown {info.field_name} {value!r}: use one of "
                             f"{sorted(names)} or an import path 'package.module:Class'")
        return value

    @field_validator("block_eviction", "block_retention", "block_budget")
    @classmethod
    def _is_block_policy(cls, value: PolicyRef, info: ValidationInfo) -> PolicyRef:
        from blockserve.replica.block_policies import INTERFACES  # vLLM-free

        try:
            policy = value.build()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cannot build {value.cls} with {value.kwargs}: {exc}") from None
        interface = INTERFACES[info.field_name]
        if not isinstance(policy, interface):
            raise ValueError(f"{value.cls} is not a {interface.__name__} "
                             "(replica/block_policies.py)")
        return value


class ReplicaConfig(_Strict):
    """How each vLLM replica runs."""

    model: str
    served_model_name: str | None = None
    engine_args: dict[str, Any] = Field(default_factory=dict)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    # One value per replica rank (cycled): pins each CPU engine's OpenMP threads.
    omp_threads_bind: list[str] = Field(default_factory=list)
    # Streamed chunks produced within this window travel to the router as one message.
    stream_coalesce_ms: float = Field(default=50.0, ge=0, le=1000)
    # Under load the window widens so that a replica's streams together send at most
    # this many messages per second (0: the window stays fixed).
    stream_messages_per_s: float = Field(default=200.0, ge=0)
    # GPU variant of the scheduler (AsyncScheduler base), for vLLM's async scheduling.
    async_scheduling: bool = False

    @field_validator("model")
    @classmethod
    def _expand(cls, value: str) -> str:
        expanded = os.path.expanduser(os.path.expandvars(value))
        return expanded if os.path.isabs(expanded) or os.path.exists(expanded) else value

    @field_validator("engine_args")
    @classmethod
    def _not_owned(cls, value: dict[str, Any]) -> dict[str, Any]:
        owned = {"model", "served_model_name"} & set(value)
        if owned:
            raise ValueError(f"set {sorted(owned)} at the top level of args, not in engine_args")
        if value.get("scheduling_policy", "fcfs") != "fcfs":
            raise ValueError("blockserve orders the waiting queue itself: keep "
                             "scheduling_policy 'fcfs' and choose scheduler.queue_order")
        return value

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def engine_kwargs(self, snapshot_channel: str | None, owner_pid: int | None = None
                      ) -> dict[str, Any]:
        """Keyword arguments for vLLM's AsyncEngineArgs: the verbatim engine args plus ours."""
        kwargs = dict(self.engine_args)
        kwargs["model"] = self.model
        kwargs["served_model_name"] = [self.model_name]
        kwargs.setdefault("scheduler_cls", ASYNC_SCHEDULER_CLS if self.async_scheduling
                          else SCHEDULER_CLS)
        scheduler = self.scheduler.model_copy(update={"snapshot_channel": snapshot_channel,
                                                      "owner_pid": owner_pid})
        additional = dict(kwargs.get("additional_config") or {})
        additional[ADDITIONAL_CONFIG_KEY] = scheduler.model_dump()
        kwargs["additional_config"] = additional
        return kwargs


class RouterConfig(_Strict):
    """The central router: admission queue, block ledger and placement."""

    placement: PolicyRef = _policy("blockserve.router.placement:BestFitBlocks")
    queue_order: PolicyRef = _policy("blockserve.router.ordering:FirstComeFirstServed")
    max_queued_requests: int = Field(default=256, ge=0)
    max_queued_tokens: int = Field(default=1_000_000, ge=0)
    queue_timeout_s: float = Field(default=60.0, gt=0)
    # Expected output tokens of each request, from which its reservation starts
    # (router/predictors.py); the replica extends leases that run out.
    output_predictor: PolicyRef = _policy("blockserve.router.predictors:OnlineQuantilePredictor")
    # Snapshots are polled when older than this and no traffic refreshed them.
    poll_interval_s: float = Field(default=0.5, gt=0)
    # A replica whose snapshot is older than this gets no new work.
    stale_after_s: float = Field(default=5.0, gt=0)
    # A replica with requests in flight whose snapshot has not changed for this long is
    # suspect: no new work until it changes (slow is not dead: its requests go on).
    suspect_after_s: float = Field(default=2.0, gt=0)
    # How often a request that a failed replica never answered is placed again.
    max_retries: int = Field(default=2, ge=0)
    # Larger request bodies get 413 before they are parsed.
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    # How requests reach the chosen replica: "direct" (TCP to the replica's data port) or
    # "serve_handle" (a pinned Ray Serve handle call, ~2.5 ms more per request here).
    transport: Literal["direct", "serve_handle"] = "direct"
    # Optional bearer token ("$NAME" reads environment variable NAME); None disables it.
    api_key: str | None = None

    @field_validator("output_predictor")
    @classmethod
    def _is_predictor(cls, value: PolicyRef) -> PolicyRef:
        try:
            predictor = value.build()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cannot build {value.cls} with {value.kwargs}: {exc}") from None
        missing = [m for m in ("predict", "observe") if not callable(getattr(predictor, m, None))]
        if missing:
            raise ValueError(f"{value.cls} is not an output predictor: it lacks {missing}")
        return value

    @field_validator("api_key")
    @classmethod
    def _api_key_from_env(cls, value: str | None) -> str | None:
        if value and value.startswith("$"):
            return os.environ.get(value[1:]) or None
        return value or None


class AppConfig(_Strict):
    """The `args:` of a blockserve application in a Ray Serve config file."""

    replica: ReplicaConfig
    router: RouterConfig = Field(default_factory=RouterConfig)


def parse_app_config(args: dict[str, Any]) -> AppConfig:
    """Validate application args, turning pydantic's errors into one readable message."""
    try:
        return AppConfig.model_validate(args)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<args>'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ValueError(f"invalid blockserve application args: {problems}") from None
