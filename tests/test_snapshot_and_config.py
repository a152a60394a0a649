"""The shared-memory snapshot channel across processes, and config validation."""

import multiprocessing

import pytest

from blockserve.protocol.config import SCHEDULER_CLS, AppConfig, RouterConfig, parse_app_config
from blockserve.protocol.registry import BASELINE_PLACEMENTS, KINDS
from blockserve.protocol.snapshot import BlockSnapshot, SnapshotChannel
from blockserve.replica.scheduler_builtins import ItlTarget


def _writer(name: str, count: int) -> None:
    channel = SnapshotChannel(name)
    for step in range(1, count + 1):
        channel.write(BlockSnapshot(step=step, timestamp=float(step), total_blocks=160,
                                    block_size=32, free_blocks=160 - step % 160,
                                    held_blocks=step % 160))
    channel.close()


def test_snapshot_channel_crosses_processes_without_torn_reads():
    channel = SnapshotChannel.create()
    try:
        writer = multiprocessing.get_context("spawn").Process(
            target=_writer, args=(channel.name, 20_000))
        writer.start()
        seen = set()
        while True:
            done = not writer.is_alive()  # checked before the read: then it is the last
            snap = channel.read()
            # Never a torn record: every field of one write, or the initial empty one.
            assert snap == BlockSnapshot() or (
                snap.timestamp == snap.step and snap.free_blocks + snap.held_blocks == 160)
            assert snap.step >= max(seen, default=0)  # monotonic
            seen.add(snap.step)
            if done:
                break
        writer.join()
        assert writer.exitcode == 0 and snap.step == 20_000
        assert seen - {0, 20_000}, "no read overlapped the writes: nothing was tested"
    finally:
        channel.close(unlink=True)


MINIMAL = {"replica": {"model": "/models/x"}}


def test_defaults_and_engine_args_pass_through_verbatim():
    config = parse_app_config({"replica": {"model": "/models/x", "served_model_name": "x",
                                           "engine_args": {"max_model_len": 512,
                                                           "some_future_vllm_arg": True}}})
    kwargs = config.replica.engine_kwargs("chan")
    assert kwargs["max_model_len"] == 512 and kwargs["some_future_vllm_arg"] is True
    assert kwargs["scheduler_cls"] == SCHEDULER_CLS
    assert kwargs["additional_config"]["blockserve"]["snapshot_channel"] == "chan"
    assert config.router.placement.cls == "cache_aware"  # deploy.yaml's (one default)
    scheduler = config.replica.scheduler
    assert {scheduler.admission_gate.cls, scheduler.preemption.cls,
            scheduler.block_retention.cls, scheduler.block_budget.cls} == {"vllm"}
    assert scheduler.block_eviction.cls == "protect_shared"


@pytest.mark.parametrize("args, fragment", [
    ({}, "replica: Field required"),
    ({"replica": {"model": "/m", "engine_args": {"model": "/n"}}}, "top level"),
    ({"replica": {"model": "/m", "engine_args": {"scheduling_policy": "priority"}}},
     "scheduling_policy"),
    ({**MINIMAL, "router": {"placement": "blockserve.router.placement:Nope"}}, "cannot import"),
    ({**MINIMAL, "router": {"max_queued_requests": -1}}, "router.max_queued_requests"),
    ({**MINIMAL, "router": {"unknown_knob": 1}}, "Extra inputs are not permitted"),
])
def test_invalid_args_fail_with_a_clear_message(args, fragment):
    with pytest.raises(ValueError) as excinfo:
        parse_app_config(args)
    assert fragment in str(excinfo.value)


def test_policy_kwargs_build_the_policy():
    config = AppConfig.model_validate({**MINIMAL, "router": {"queue_order": {
        "cls": "shortest_demand", "kwargs": {"max_wait_s": 3}}}})
    assert config.router.queue_order.build().max_wait_s == 3


def test_the_slo_reaches_every_policy_that_takes_it_unless_its_kwargs_set_it():
    config = parse_app_config({
        "replica": {"model": "/m", "scheduler": {
            "step_tokens": "itl_target",
            "queue_order": {"cls": "on_time_first", "kwargs": {"ttft_s": 5}}}},
        "router": {"queue_order": "on_time_first"},
        "slo": {"ttft_s": 2, "tpot_s": 0.1}})
    step_tokens = config.replica.scheduler.step_tokens.policy
    assert step_tokens.seconds == pytest.approx(ItlTarget.STEP_SHARE * 0.1)
    assert config.router.queue_order.policy.ttft_s == 2
    assert config.replica.scheduler.queue_order.policy.ttft_s == 5  # its own kwargs win
    assert config.router.placement.kwargs == {}  # takes neither
    # What the replica's engine is given carries it (a replica re-parses only that).
    dumped = config.replica.scheduler.model_dump()["step_tokens"]["kwargs"]
    assert dumped == {"tpot_s": 0.1}
    with pytest.raises(ValueError, match="slo.tpot_s: Input should be greater than 0"):
        parse_app_config({**MINIMAL, "slo": {"tpot_s": 0}})


def _config_with(field: str, value) -> AppConfig:
    section, _, name = field.rpartition(".")
    args = {"replica": {"model": "/models/x"}, "router": {}}
    target = args["replica"].setdefault("scheduler", {}) if section == "replica.scheduler" \
        else args[section]
    target[name] = value
    return parse_app_config(args)


def _ref(config: AppConfig, field: str):
    node = config
    for part in field.split("."):
        node = getattr(node, part)
    return node


@pytest.mark.parametrize("field, name", [(field, name) for field, kind in KINDS.items()
                                         for name in kind.names])
def test_every_short_name_selects_its_built_in(field, name):
    ref = _ref(_config_with(field, name), field)
    policy_cls = ref.policy_class
    assert ref.cls == name  # what /admin/state shows
    assert f"{policy_cls.__module__}:{policy_cls.__name__}" == KINDS[field].built_ins[name]
    if not KINDS[field].runtime_args:  # built by validation, handed out by `policy`
        assert type(ref.policy) is policy_cls and ref.policy is ref.policy
    # the import string of the same class still selects it, as for a user class
    assert _ref(_config_with(field, KINDS[field].built_ins[name]), field).policy_class \
        is policy_cls


def test_vllms_own_behaviour_is_named_vllm_wherever_a_policy_replaces_it():
    replaceable = [field for field, kind in KINDS.items() if "vllm" in kind.built_ins]
    assert replaceable == [f"replica.scheduler.{name}" for name in (
        "admission_gate", "preemption", "block_eviction", "block_retention", "block_budget",
        "step_tokens")]
    assert not any("VllmDefault" in name or "lru" in name.lower()
                   for kind in KINDS.values() for name in kind.built_ins)


@pytest.mark.parametrize("field", sorted(KINDS))
def test_an_unknown_short_name_names_the_field_and_the_valid_names(field):
    with pytest.raises(ValueError) as excinfo:
        _config_with(field, "no_such_policy")
    message = str(excinfo.value)
    assert f"{field}: " in message and "'no_such_policy'" in message
    assert str(KINDS[field].names) in message


def test_a_policy_of_another_field_is_refused():
    with pytest.raises(ValueError, match=r"router\.placement: .*does not implement "
                                         r"blockserve\.protocol\.router_policies:Placement"):
        _config_with("router.placement", KINDS["router.queue_order"].built_ins["fcfs"])
    with pytest.raises(ValueError, match="unknown router.queue_order 'router_order'"):
        _config_with("router.queue_order", "router_order")  # replica side only


def test_a_run_time_policy_switch_takes_short_names():
    assert RouterConfig.policy_ref("placement", "balanced").policy.prefix_weight == 4.0
    with pytest.raises(ValueError, match="unknown router.queue_order 'nope'"):
        RouterConfig.policy_ref("queue_order", "nope")
    with pytest.raises(ValueError, match="not a policy"):
        RouterConfig.policy_ref("max_retries", 3)


@pytest.mark.parametrize("path", ["deploy/deploy.yaml", "deploy/deploy-gpu.yaml"])
def test_deploy_files_name_every_built_in_by_its_short_name(path):
    from blockserve.tools.launch import REPO

    text = (REPO / path).read_text()
    assert not [path for kind in KINDS.values() for path in kind.built_ins.values()
                if path.rpartition(":")[2] in text]


@pytest.mark.parametrize("path", ["deploy/deploy.yaml", "deploy/deploy-gpu.yaml"])
def test_deploy_files_validate_against_ray_serve_and_blockserve_schemas(path):
    """Both shipped configs (the GPU one is never served here): Ray Serve's own schema,
    blockserve's args, vLLM engine arguments that AsyncEngineArgs knows, and deployment
    names that match what the application binds (Serve rejects unknown ones)."""
    import dataclasses

    from ray.serve.schema import ServeDeploySchema
    from vllm.engine.arg_utils import AsyncEngineArgs

    from blockserve.controller.app import build_app
    from blockserve.protocol.config import ASYNC_SCHEDULER_CLS, load_object
    from blockserve.tools.launch import REPO, load_config

    raw = load_config(REPO / path)
    schema = ServeDeploySchema.model_validate(raw)
    [application] = schema.applications
    config = parse_app_config(application.args)
    engine_kwargs = config.replica.engine_kwargs("chan")
    unknown = set(engine_kwargs) - {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    assert not unknown, f"{path}: not vLLM engine arguments: {sorted(unknown)}"
    scheduler = load_object(engine_kwargs["scheduler_cls"])
    assert scheduler.__module__ == "blockserve.replica.scheduler"
    if "gpu" in path:
        assert engine_kwargs["scheduler_cls"] == ASYNC_SCHEDULER_CLS
        assert config.replica.engine_args["max_model_len"] == 8192
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    # as Serve calls the import_path's builder (it takes exactly one parameter)
    app = call_user_app_builder_with_args_if_necessary(build_app, application.args)
    bound = {app._bound_deployment.name}
    bound |= {arg._bound_deployment.name for arg in app._bound_deployment.init_args
              if hasattr(arg, "_bound_deployment")}
    assert {d.name for d in application.deployments} == {"Router", "Replica"}
    assert bound == {"Router", "Replica", "RouterBoard"}


def test_every_benchmark_policy_set_validates():
    """The harness's and the simulator's configurations (deploy.yaml's policies with their
    changes) build through the same config validation as a deployment."""
    from blockserve.bench.harness import BASELINES, WORST_CASE
    from blockserve.bench.simulator import SIM_CONFIGS, sim_config
    from blockserve.protocol.config import SchedulerConfig

    sets = [WORST_CASE, *BASELINES.values(), *(sim_config(name) for name in SIM_CONFIGS)]
    for router, scheduler in sets:
        for key, value in router.items():
            RouterConfig.policy_ref(key, value).build()
        SchedulerConfig.model_validate(scheduler)
    assert [router["placement"] for router, _ in BASELINES.values()] == list(BASELINE_PLACEMENTS)
    assert set(BASELINE_PLACEMENTS) <= set(KINDS["router.placement"].names)


def test_the_baselines_and_the_labs_configs_run_vllms_own_scheduling_where_they_change_none():
    """A field a scheduler section leaves out takes the registry's default (protect_shared
    eviction), so "vLLM's own scheduling" must name every field: the memory-blind
    baselines run vLLM's decision in each, and each lab config changes only its own."""
    from blockserve.bench.block_lab import built_in_configs
    from blockserve.bench.harness import BASELINES
    from blockserve.bench.variants import VLLM_SCHEDULING
    from blockserve.protocol.config import SchedulerConfig

    def vllms_own(scheduler: dict) -> set[str]:
        built = SchedulerConfig.model_validate(scheduler)
        return {field for field in VLLM_SCHEDULING
                if getattr(getattr(built, field).policy, "keeps_vllm_behaviour", False)
                or getattr(getattr(built, field).policy, "is_arrival_order", False)}

    assert set(VLLM_SCHEDULING) == {k.rpartition(".")[2] for k in KINDS
                                    if k.startswith("replica.scheduler.")}
    assert all(vllms_own(scheduler) == set(VLLM_SCHEDULING) for _, scheduler in BASELINES.values())
    for name, scheduler in built_in_configs(160).items():
        changed = {field for field in VLLM_SCHEDULING if scheduler[field] != VLLM_SCHEDULING[field]}
        assert vllms_own(scheduler) == set(VLLM_SCHEDULING) - changed, name
        assert len(changed) == (name != "vllm (LRU)"), name


@pytest.mark.parametrize("path", ["deploy/deploy.yaml", "deploy/deploy-gpu.yaml"])
def test_the_deploy_files_run_the_codes_default_policies(path):
    """One default everywhere: every policy of either file is its field's default in the
    registry, built with the same arguments, so the GPU file shares deploy.yaml's."""
    from blockserve.tools.launch import REPO, load_config

    args = load_config(REPO / path)["applications"][0]["args"]
    config = parse_app_config(args)
    # the file's SLO reaches the defaults too (protocol/config.py, Slo)
    defaults = parse_app_config({"replica": {"model": "m"}, "slo": args.get("slo", {})})
    for field, kind in KINDS.items():
        ref, default = _ref(config, field), _ref(defaults, field)
        assert ref.cls == default.cls == kind.default, field
        if not kind.runtime_args:
            assert _state(ref.policy) == _state(default.policy), field


def _state(policy):
    """A policy's attributes, and theirs where they are objects (a fresh StepTimeFit)."""
    if not hasattr(policy, "__dict__"):
        return policy
    return {name: _state(value) for name, value in vars(policy).items()}
