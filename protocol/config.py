"""Typed configuration of a blockserve application, validated in one place.

The `args:` block of an application in a Ray Serve config file (deploy/deploy.yaml) is
parsed into `AppConfig`. vLLM engine arguments stay verbatim under `engine_args` and go
straight to `AsyncEngineArgs`; everything blockserve adds is a named, checked field here.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import os
from typing import Any, ClassVar, TypeVar

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from blockserve.protocol.registry import KINDS, PolicyKind

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


# Validation context of a config the driver has validated already (build_app): its
# policies are not built again to check them, only when this process first uses one.
CHECKED = {"checked": True}


class PolicyRef(_Strict):
    """A policy: a built-in's short name (protocol/registry.py) or an import path, and
    keyword arguments for its constructor. Validation builds it (a kind with run-time
    arguments: checks its class and arguments), so a bad name, import path or argument
    fails at start-up with a message naming the field; `policy` hands out that instance,
    so each process builds each policy it uses once. One subclass per config field
    (`REFS`), generated from the registry's kinds."""

    config_field: ClassVar[str]  # its key in registry.KINDS
    cls: str
    kwargs: dict[str, Any] = Field(default_factory=dict)
    _policy: Any = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        return {"cls": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _buildable(self, info: ValidationInfo) -> "PolicyRef":
        if (info.context or {}) != CHECKED:
            if self.kind.runtime_args:
                self._bind(*self.kind.runtime_args)
            else:
                self._policy = self.build()
        return self

    @property
    def kind(self) -> PolicyKind:
        return KINDS[self.config_field]

    @property
    def import_path(self) -> str:
        return self.kind.import_path(self.config_field, self.cls)

    @property
    def policy_class(self) -> type:
        """The class it names, checked against its kind's interface."""
        policy_cls = load_object(self.import_path)
        interface = load_object(self.kind.interface)
        if not (isinstance(policy_cls, type) and issubclass(policy_cls, interface)):
            raise ValueError(f"{self.cls} does not implement {self.kind.interface}")
        return policy_cls

    @property
    def policy(self) -> Any:
        """This process's instance: the one validation built, or built on first use."""
        if self._policy is None:
            self._policy = self.build()
        return self._policy

    def build(self, *runtime: Any) -> Any:
        """A new instance; `runtime`: its kind's run-time arguments, in order."""
        policy_cls = self.policy_class
        try:
            return policy_cls(*runtime, **self.kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cannot build {self.cls} with {self.kwargs}: {exc}") from None

    def _bind(self, *runtime: Any) -> None:
        """Check that the constructor takes the run-time arguments and the config's."""
        try:
            inspect.signature(self.policy_class).bind(*runtime, **self.kwargs)
        except TypeError as exc:
            raise ValueError(f"cannot build {self.cls} with {self.kwargs}: {exc}") from None


def _ref_class(field: str) -> type[PolicyRef]:
    """The PolicyRef of one config field: "router.output_predictor" -> OutputPredictorRef
    (the replica's queue order: ReplicaQueueOrderRef)."""
    side, name = field.split(".")[0], field.rpartition(".")[2]
    prefix = side.title() if name == "queue_order" else ""
    title = prefix + "".join(part.title() for part in name.split("_"))
    return type(f"{title}Ref", (PolicyRef,), {"config_field": field, "__module__": __name__})


REFS: dict[str, type[PolicyRef]] = {field: _ref_class(field) for field in KINDS}


def _default(field: str) -> Any:
    """A policy field defaulting to its kind's default, built only when a config is."""
    return Field(default_factory=lambda: REFS[field](cls=KINDS[field].default))


class SchedulerConfig(_Strict):
    """Policies of the block-aware vLLM scheduler inside every replica; `vllm` keeps
    vLLM's own behaviour."""

    queue_order: REFS["replica.scheduler.queue_order"] = _default(
        "replica.scheduler.queue_order")
    admission_gate: REFS["replica.scheduler.admission_gate"] = _default(
        "replica.scheduler.admission_gate")
    preemption: REFS["replica.scheduler.preemption"] = _default("replica.scheduler.preemption")
    # Block policies (protocol/policies.py).
    block_eviction: REFS["replica.scheduler.block_eviction"] = _default(
        "replica.scheduler.block_eviction")
    block_retention: REFS["replica.scheduler.block_retention"] = _default(
        "replica.scheduler.block_retention")
    block_budget: REFS["replica.scheduler.block_budget"] = _default(
        "replica.scheduler.block_budget")
    # Tokens per engine step (protocol/policies.py's StepTokens).
    step_tokens: REFS["replica.scheduler.step_tokens"] = _default(
        "replica.scheduler.step_tokens")
    # Where the scheduler publishes its block snapshot (set by the replica at start-up).
    snapshot_channel: str | None = None
    # The replica process: the engine kills itself when it exits (set at start-up).
    owner_pid: int | None = None


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
    # The engine publishes vLLM's KV cache events (replica/kv_events.py), which the
    # router's exact prefix index follows (router.prefix_index: exact, the default): on
    # by default, so that the default config is valid without deploy.yaml.
    publish_kv_events: bool = True

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
        """Keyword arguments for vLLM's AsyncEngineArgs: the verbatim engine args plus the
        model, the block-aware scheduler and its config."""
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

    placement: REFS["router.placement"] = _default("router.placement")
    queue_order: REFS["router.queue_order"] = _default("router.queue_order")
    max_queued_requests: int = Field(default=256, ge=0)
    max_queued_tokens: int = Field(default=1_000_000, ge=0)
    queue_timeout_s: float = Field(default=60.0, gt=0)
    # Expected output tokens of each request, from which its reservation starts
    # (router/predictors.py); the replica extends leases that run out.
    output_predictor: REFS["router.output_predictor"] = _default("router.output_predictor")
    # Snapshots are polled when older than this and no traffic refreshed them.
    poll_interval_s: float = Field(default=0.5, gt=0)
    # vLLM's own counters (the vllm_* metrics) come only with polls: each replica is
    # polled at least this often, even while traffic keeps its snapshot fresh.
    counters_interval_s: float = Field(default=2.0, gt=0)
    # A replica whose snapshot is older than this gets no new work.
    stale_after_s: float = Field(default=5.0, gt=0)
    # A replica with requests in flight whose snapshot has not changed for this long is
    # suspect: no new work until it changes (slow is not dead: its requests go on).
    suspect_after_s: float = Field(default=2.0, gt=0)
    # A replica Ray Serve stops listing gets no new work at once, and leaves the ledger
    # (its reservations with it) if it is still unlisted after this long.
    missing_grace_s: float = Field(default=3.0, gt=0)
    # How often a request that a failed replica never answered is placed again.
    max_retries: int = Field(default=2, ge=0)
    # Larger request bodies get 413 before they are parsed.
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    # How requests reach the chosen replica: `direct` (TCP to the replica's data port) or
    # `serve_handle` (a pinned Ray Serve handle call, ~2.5 ms more per request here).
    transport: REFS["router.transport"] = _default("router.transport")
    # Prefix credit for placement: `approximate` remembers the prompts the router sent
    # to each replica; `exact` follows each replica's vLLM KV cache events
    # (router/prefix_cache.py; needs replica.publish_kv_events, on by default).
    prefix_index: REFS["router.prefix_index"] = _default("router.prefix_index")
    # Optional bearer token ("$NAME" reads environment variable NAME); None disables it.
    api_key: str | None = None

    @classmethod
    def policy_ref(cls, field: str, value: Any) -> PolicyRef:
        """`value` validated as the policy of `field` (run-time switching of policies)."""
        ref_cls = cls.model_fields[field].annotation
        if not (isinstance(ref_cls, type) and issubclass(ref_cls, PolicyRef)):
            raise ValueError(f"router.{field} is not a policy")
        return ref_cls.model_validate(value)

    @field_validator("api_key")
    @classmethod
    def _api_key_from_env(cls, value: str | None) -> str | None:
        if value and value.startswith("$"):
            return os.environ.get(value[1:]) or None
        return value or None


class Slo(_Strict):
    """The latency the service promises. A policy whose constructor takes `ttft_s` or
    `tpot_s` is given these unless its own kwargs set them, so one setting reaches every
    policy that plans by it, in the router and in each replica."""

    ttft_s: float | None = Field(default=None, gt=0)
    tpot_s: float | None = Field(default=None, gt=0)

    def fill(self, args: dict[str, Any]) -> dict[str, Any]:
        """A copy of `args` (application args as written) in which every policy field,
        its default included, is `given` this SLO."""
        args = copy.deepcopy(args)
        for field, kind in KINDS.items():
            *parents, name = field.split(".")
            section: Any = args
            for parent in parents:
                section = section.setdefault(parent, {}) if isinstance(section, dict) else None
            if isinstance(section, dict):
                policy = section.get(name, kind.default)
                given = self.given(field, policy)
                if given is not policy:
                    section[name] = given
        return args

    def given(self, field: str, policy: Any) -> Any:
        """`policy` of config field `field` (a name or {cls, kwargs}) with this SLO's
        values for the arguments its class takes and its kwargs leave unset; `policy`
        itself where there are none (or where it is no policy, which the field's own
        validation reports)."""
        promised = {name: value for name, value in self.model_dump().items()
                    if value is not None}
        ref = {"cls": policy} if isinstance(policy, str) else policy
        if not promised or not isinstance(ref, dict) or not isinstance(ref.get("cls"), str):
            return policy
        try:
            taken = inspect.signature(
                load_object(KINDS[field].import_path(field, ref["cls"]))).parameters
        except (TypeError, ValueError):
            return policy
        kwargs = dict(ref.get("kwargs") or {})
        fills = {name: value for name, value in promised.items()
                 if name in taken and name not in kwargs}
        return {**ref, "kwargs": {**kwargs, **fills}} if fills else policy


class AppConfig(_Strict):
    """The `args:` of a blockserve application in a Ray Serve config file."""

    replica: ReplicaConfig
    router: RouterConfig = Field(default_factory=RouterConfig)
    slo: Slo = Field(default_factory=Slo)

    @model_validator(mode="before")
    @classmethod
    def _slo_to_policies(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("slo"), dict):
            return data
        try:
            slo = Slo.model_validate(data["slo"])
        except ValidationError:
            return data  # reported by the field's own validation
        return slo.fill(data)

    @model_validator(mode="after")
    def _exact_index_has_events(self) -> "AppConfig":
        index = self.router.prefix_index
        if index.policy_class.follows_kv_events and not self.replica.publish_kv_events:
            raise ValueError(f"router.prefix_index {index.cls!r} follows the replicas' KV "
                             "cache events: set replica.publish_kv_events: true")
        return self


def error_path(error: dict[str, Any]) -> str:
    """Where one of pydantic's errors is, as a dotted path ("" for the whole input)."""
    return ".".join(str(part) for part in error.get("loc", ()))


def describe_errors(exc: ValidationError, whole: str, limit: int | None = None) -> str:
    """pydantic's errors as one readable line, `path: message; ...` (`whole` names an
    error of the whole input); config files and request bodies both say it this way."""
    return "; ".join(f"{error_path(error) or whole}: {error['msg']}"
                     for error in exc.errors()[:limit])


def parse_app_config(args: dict[str, Any]) -> AppConfig:
    """Validate application args, turning pydantic's errors into one readable message."""
    try:
        return AppConfig.model_validate(args)
    except ValidationError as exc:
        raise ValueError("invalid blockserve application args: "
                         f"{describe_errors(exc, '<args>')}") from None


Config = TypeVar("Config", bound=BaseModel)


def checked(model: type[Config], data: dict[str, Any]) -> Config:
    """A config that build_app validated already, parsed in another process (the router,
    a replica, its EngineCore) without building its policies again: each is built when
    this process first uses it (`PolicyRef.policy`)."""
    return model.model_validate(data, context=CHECKED)
