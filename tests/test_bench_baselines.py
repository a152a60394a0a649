"""The benchmark's memory-blind baselines run vLLM as vLLM ships, not blockserve's engine
settings: deploy.yaml's `watermark` is part of blockserve's configuration, and a baseline
that inherited it measured no preemptions and less throughput (docs/benchmarks.md)."""

from __future__ import annotations

from unittest import mock

import pytest

from blockserve.bench import harness, targets
from blockserve.protocol.registry import BASELINE_PLACEMENTS


def test_the_engine_defaults_are_vllms_own():
    from vllm.engine.arg_utils import EngineArgs

    assert harness.VLLM_ENGINE_DEFAULTS == {
        key: getattr(EngineArgs, key) for key in harness.VLLM_ENGINE_DEFAULTS}


def test_every_baseline_and_the_raw_servers_override_deploy_yamls_engine_settings():
    with mock.patch.object(targets, "blockserve") as blockserve, \
            mock.patch.object(targets, "raw_vllm") as raw_vllm:
        for placement in BASELINE_PLACEMENTS:
            harness.CONFIGURATIONS[placement.replace("_", " ")]("baseline")
            assert blockserve.call_args.args[3] == harness.VLLM_ENGINE_DEFAULTS
        harness.CONFIGURATIONS["raw vLLM x2"]("raw")
        assert raw_vllm.call_args.kwargs["engine_args"] == harness.VLLM_ENGINE_DEFAULTS


def test_rounds_spread_every_configuration_over_the_run():
    """A B, then B A: each configuration deployed once per round, its seeds split."""
    assert harness.schedule(["a", "b"], [0, 1, 2, 3], 2) == [
        ("a", [0, 2]), ("b", [0, 2]), ("b", [1, 3]), ("a", [1, 3])]
    assert harness.schedule(["a", "b"], [0, 1], 1) == [("a", [0, 1]), ("b", [0, 1])]
    assert harness.schedule(["a"], [0], 2) == [("a", [0])]  # no round without a seed


def test_a_configuration_is_deploy_yaml_with_overrides():
    with mock.patch.object(targets, "blockserve") as blockserve:
        harness.configuration("blockserve + router.placement=cache_aware(must_fit=false), "
                              "scheduler.block_eviction=vllm, engine.watermark=0.01")("x")
    _, router, scheduler, engine = blockserve.call_args.args
    deployed = harness.load_config()["applications"][0]["args"]
    assert router == {**deployed["router"],
                      "placement": {"cls": "cache_aware", "kwargs": {"must_fit": False}}}
    assert scheduler == {**deployed["replica"]["scheduler"], "block_eviction": "vllm"}
    assert engine == {"watermark": 0.01}
    assert harness.configuration("power of two") is harness.CONFIGURATIONS["power of two"]
    for entry, message in (("power of two + router.placement=least_kv", "apply to"),
                           ("nonsense", "neither")):
        with pytest.raises(ValueError, match=message):
            harness.configuration(entry)


def test_the_unpinned_configuration_names_no_core_and_is_a_valid_config():
    from blockserve.protocol.config import AppConfig

    with mock.patch.object(targets, "blockserve") as blockserve:
        harness.CONFIGURATIONS["blockserve, engines unpinned"]("x")
    replica_args = blockserve.call_args.kwargs["replica_args"]
    assert replica_args == {"omp_threads_bind": []}
    config = targets.blockserve_config(replica_args=replica_args)
    assert AppConfig.model_validate(config["applications"][0]["args"]).replica \
        .omp_threads_bind == []
