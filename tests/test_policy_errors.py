"""Policies fail safe (replica/policy_errors.py): a policy that raises, on vLLM's REAL
scheduler and block pool (engine-less), changes nothing of vLLM's schedule, is counted
in the block snapshot and logged once with its traceback; the router exports the count."""

import logging
import random
import time

import pytest

from blockserve.protocol.hints import Hints
from blockserve.protocol.policies import (AdmissionGate, BlockBudget, EvictionPolicy,
                                          PreemptionOrder, QueueOrder, RetentionPolicy,
                                          StepTokens)
from blockserve.protocol.queue_orders import FirstComeFirstServed
from blockserve.protocol.snapshot import SCHEDULER_POLICIES, BlockSnapshot
from blockserve.replica.scheduler import BlockAwareScheduler
from blockserve.router.admission import AdmissionQueue
from blockserve.router.ledger import Ledger
from blockserve.router.metrics import RouterMetrics
from blockserve.router.placement import BestFitBlocks
from blockserve.tools.engine_less import EngineLessReplica


def bug(*args, **kwargs):
    raise RuntimeError("a bug in a user's policy")


class RaisingQueueOrder(QueueOrder):
    key = bug


class RaisingGate(AdmissionGate):
    may_admit = bug


class RaisingPreemption(PreemptionOrder):
    key = bug


class RaisingEvictionAndNotifications(EvictionPolicy):
    may_evict = on_hit = on_free = on_evict = bug


class RaisingRetention(RetentionPolicy):
    retain = bug


class RaisingBudget(BlockBudget):
    may_admit = bug


class RaisingStepTokens(StepTokens):
    tokens = on_step = bug


# vLLM's own behaviour in every field, spelled out (a default may change).
VLLM = {"queue_order": "fcfs", "admission_gate": "vllm", "preemption": "vllm",
        "block_eviction": "vllm", "block_retention": "vllm", "block_budget": "vllm",
        "step_tokens": "vllm"}
RAISING = {
    "queue_order": RaisingQueueOrder,
    "admission_gate": RaisingGate,
    "preemption": RaisingPreemption,
    "block_eviction": RaisingEvictionAndNotifications,
    "block_retention": RaisingRetention,
    "block_budget": RaisingBudget,
    "step_tokens": RaisingStepTokens,
}


def run(model_dir, scheduler=VLLM, seed=0):
    """Shared prefixes, more blocks asked than the pool holds (evictions, preemptions,
    a waiting queue): every hook is asked. Returns the replica and each step's record."""
    rep = EngineLessReplica(model_dir, BlockAwareScheduler, num_blocks=41, block_size=32,
                            scheduler=scheduler)
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 4000) for _ in range(96)]
    for i in range(24):
        unique = [rng.randrange(1, 4000) for _ in range(rng.randint(20, 160))]
        rep.add(f"r{i}", (prefix if i % 2 else []) + unique, rng.randint(8, 120),
                hints=Hints(tenant="ab"[i % 2], priority=i % 3))
    trace = []
    for _ in range(5000):
        if not rep.scheduler.has_unfinished_requests():
            break
        record = rep.step()
        trace.append((record.scheduled, record.preempted, record.prefix_hits))
    assert not rep.scheduler.has_unfinished_requests()
    assert all(r.num_output_tokens == r.max_tokens for r in rep.requests.values())
    return rep, trace


@pytest.fixture(scope="module")
def vllm_trace(model_dir):
    rep, trace = run(model_dir)
    assert any(preempted for _, preempted, _ in trace), "the workload must preempt"
    return trace


@pytest.fixture
def policy_log():
    """The records of the logger the adapters log policy errors to."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.blockserve.policies")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


@pytest.mark.parametrize("field", SCHEDULER_POLICIES)
def test_a_raising_policy_leaves_vllms_schedule_and_is_counted_and_logged_once(
        model_dir, vllm_trace, policy_log, field):
    rep, trace = run(model_dir, {**VLLM,
                                 field: f"tests.test_policy_errors:{RAISING[field].__name__}"})
    assert trace == vllm_trace  # vLLM's answer stood for every call that raised
    errors, snap = rep.scheduler.policy_errors, rep.scheduler.snapshot
    assert errors.counts[field] > 1 and errors.total == errors.counts[field]
    assert getattr(snap, f"{field}_errors_total") == errors.counts[field]
    logged = [r for r in policy_log if r.levelno == logging.ERROR]
    assert len(logged) == 1  # once per policy, however often it raised
    message = logged[0].getMessage()
    assert field in message and RAISING[field].__name__ in message
    assert "a bug in a user's policy" in message and "Traceback" in message


def test_policies_that_answer_count_no_errors(model_dir, policy_log):
    rep, _ = run(model_dir, {**VLLM, "queue_order": "shortest_demand",
                             "block_eviction": "s3fifo", "block_retention": "priority",
                             "block_budget": "tenant_quota"})
    assert rep.scheduler.policy_errors.total == 0 and not policy_log


def test_the_router_exports_each_replicas_policy_errors():
    ledger = Ledger()
    ledger.report("r1", BlockSnapshot(timestamp=time.time(), total_blocks=160, block_size=32,
                                      free_blocks=160, block_eviction_errors_total=3))
    queue = AdmissionQueue(ledger, BestFitBlocks(), FirstComeFirstServed(), max_requests=1,
                           max_tokens=1, timeout_s=1)
    text = RouterMetrics("blockserve", "BestFitBlocks", queue).exposition().decode()
    exported = {line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
                for line in text.splitlines() if line.startswith("blockserve_replica_policy_")}
    assert exported == {f'blockserve_replica_policy_errors_total{{app="blockserve",'
                        f'policy="{field}",replica="r1"}}': 3.0 if field == "block_eviction"
                        else 0.0 for field in SCHEDULER_POLICIES}


def test_the_lab_and_the_simulator_finish_a_raising_policys_run_and_count_its_errors(model_dir):
    """The lab's and the simulator's figures say how often a policy raised (0 when it
    answers): a buggy policy's row is not read as the policy's effect."""
    import dataclasses
    from types import SimpleNamespace

    from blockserve.bench.block_lab import replay
    from blockserve.bench.simulator import simulate_policies
    from blockserve.bench.step_time import PRESETS
    from blockserve.bench.workloads import LengthMode, cross_tenant
    from blockserve.tools.launch import EngineShape

    shape = dataclasses.replace(EngineShape.of(), model=model_dir)
    specs = cross_tenant(n=40, tenants=4)
    raising = {**VLLM, "block_retention": "tests.test_policy_errors:RaisingRetention"}
    assert replay(specs, VLLM, shape, PRESETS["cpu-tiny"], 2).policy_errors == 0
    lab = replay(specs, raising, shape, PRESETS["cpu-tiny"], 2)
    assert lab.requests == 40 and lab.policy_errors > 0
    args = SimpleNamespace(preset="cpu-tiny", slo_ttft=2.0, slo_itl=0.1)
    simulated = simulate_policies({"placement": "round_robin", "queue_order": "fcfs"}, raising,
                                  2, specs, shape, LengthMode.UNKNOWN, args, "exact")["summary"]
    assert simulated["ok"] == 40 and simulated["policy_errors"] > 0
