"""The shared-memory snapshot channel across processes, and config validation."""

import multiprocessing

import pytest

from blockserve.controller.config import SCHEDULER_CLS, AppConfig, parse_app_config
from blockserve.protocol.snapshot import BlockSnapshot, SnapshotChannel


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
    assert config.router.placement.cls == "blockserve.router.placement:BestFitBlocks"


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
        "cls": "blockserve.router.ordering:ShortestDemandFirst", "kwargs": {"max_wait_s": 3}}}})
    assert config.router.queue_order.build().max_wait_s == 3


@pytest.mark.parametrize("path", ["deploy/deploy.yaml", "deploy/deploy-gpu.yaml"])
def test_deploy_files_validate_against_ray_serve_and_blockserve_schemas(path):
    """Both shipped configs (the GPU one is never served here): Ray Serve's own schema,
    blockserve's args, vLLM engine arguments that AsyncEngineArgs knows, and deployment
    names that match what the application binds (Serve rejects unknown ones)."""
    import dataclasses

    from ray.serve.schema import ServeDeploySchema
    from vllm.engine.arg_utils import AsyncEngineArgs

    from blockserve.controller.app import build_app
    from blockserve.controller.config import ASYNC_SCHEDULER_CLS, load_object
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
    app = build_app(application.args)
    bound = {app._bound_deployment.name}
    bound |= {arg._bound_deployment.name for arg in app._bound_deployment.init_args
              if hasattr(arg, "_bound_deployment")}
    assert {d.name for d in application.deployments} == bound == {"Router", "Replica"}
