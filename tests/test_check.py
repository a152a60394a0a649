"""`blockserve check CONFIG` (tools/check.py): every problem a deployment would meet,
found without one, with the deploy-time message; nonzero exit on any."""

import copy
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from blockserve.protocol.router_policies import Placement
from blockserve.tools.check import check
from blockserve.tools.launch import DEFAULT_CONFIG, load_config, with_args

USER_MODULES = Path(__file__).resolve().parent / "user_policies"


class RaisingPlacement(Placement):
    """A router policy with a bug: the check asks it about every request."""

    def choose(self, demand, candidates):
        raise KeyError("a bug in RaisingPlacement.choose")


def write(tmp_path, config) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def with_eviction(policy, **app) -> dict:
    config = load_config()
    scheduler = {**config["applications"][0]["args"]["replica"]["scheduler"],
                 "block_eviction": policy}
    config = with_args(config, replica={"scheduler": scheduler})
    config["applications"][0].update(app)
    return config


def test_deploy_yaml_passes_and_says_what_it_chose_after_hundreds_of_steps(model_dir):
    started = time.perf_counter()
    result = subprocess.run([str(Path(sys.executable).parent / "blockserve"), "check",
                             str(DEFAULT_CONFIG)], capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - started
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "replica.scheduler.block_eviction: protect_shared -> " \
           "blockserve.replica.block_builtins:ProtectSharedPrefixes" in out
    assert "router.placement: cache_aware -> " in out
    steps = int(out.split(" steps in ")[0].rsplit(" ", 1)[1])
    assert steps >= 200 and "cached blocks evicted" in out and out.rstrip().endswith(": ok")
    print(f"blockserve check deploy/deploy.yaml: {steps} steps, {seconds:.1f} s wall")


def test_a_user_module_whose_may_evict_raises_is_found_through_runtime_env(tmp_path):
    config = with_eviction("raising_policies:RaisingEviction",
                           runtime_env={"py_modules": [f"local://{USER_MODULES}"]})
    report = check(write(tmp_path, config))
    assert len(report.problems) == 1, report.problems
    problem = report.problems[0]
    assert problem.startswith("replica.scheduler.block_eviction "
                              "(raising_policies:RaisingEviction) raised")
    assert "in may_evict" in problem and "ZeroDivisionError: a bug in RaisingEviction" in problem
    assert str(USER_MODULES) not in sys.path  # the check put it there only meanwhile


def test_a_local_path_in_runtime_env_is_refused_as_serve_refuses_it(tmp_path):
    config = with_eviction("raising_policies:RaisingEviction",
                           runtime_env={"py_modules": [str(USER_MODULES)]})
    report = check(write(tmp_path, config))
    assert len(report.problems) == 1 and "is not a Ray Serve config" in report.problems[0]
    assert "support only remote URIs in working_dir and py_modules, or \"local://\" URIs" \
        in report.problems[0]


def test_without_its_runtime_env_the_user_module_is_not_found(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "raising_policies", raising=False)  # a test before's
    report = check(write(tmp_path, with_eviction("raising_policies:RaisingEviction")))
    assert len(report.problems) == 1
    assert "cannot import 'raising_policies:RaisingEviction'" in report.problems[0]


@pytest.mark.parametrize("change, message", [
    (lambda c: c["applications"][0]["args"]["replica"]["scheduler"].update(
        block_eviction="lru"),
     "replica.scheduler.block_eviction: Value error, unknown replica.scheduler.block_eviction "
     "'lru': use one of ['protect_shared', 's3fifo', 'vllm'] or an import path"),
    (lambda c: c["applications"][0]["args"]["replica"]["scheduler"].update(
        block_budget={"cls": "tenant_quota", "kwargs": {"quotas": {"a": 0}}}),
     "quotas are numbers of blocks, at least 1"),
    (lambda c: c["applications"][0]["args"]["router"].update(prefix_index="exakt"),
     "router.prefix_index"),
    (lambda c: c["applications"][0]["deployments"][0].update(num_replica=2),
     "deployment 'Replica': unknown options ['num_replica']"),
    (lambda c: c["applications"][0]["deployments"][0].update(name="Replicas"),
     "no deployment 'Replicas'"),
    (lambda c: c.update(applications="blockserve"), "is not a Ray Serve config"),
])
def test_each_deploy_time_error_is_reported_with_its_message(tmp_path, change, message):
    config = copy.deepcopy(load_config())
    change(config)
    report = check(write(tmp_path, config))
    assert report.problems and message in report.problems[0], report.problems


def test_the_cli_exits_nonzero_and_prints_the_problem(tmp_path, capsys):
    from blockserve.controller.cli import main

    config = load_config()
    config["applications"][0]["args"]["replica"]["scheduler"]["queue_order"] = "nope"
    assert main(["check", str(write(tmp_path, config))]) == 1
    captured = capsys.readouterr()
    assert "problem: application 'blockserve': invalid blockserve application args: " \
           "replica.scheduler.queue_order" in captured.err
    assert captured.out.rstrip().endswith("1 problem(s)")


def test_a_router_policy_that_raises_is_reported_too(tmp_path):
    config = with_args(load_config(), router={"placement": "tests.test_check:RaisingPlacement"})
    report = check(write(tmp_path, config))
    assert len(report.problems) == 1 and report.problems[0].startswith("router.placement failed")
    assert "KeyError: 'a bug in RaisingPlacement.choose'" in report.problems[0]
