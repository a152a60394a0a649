"""The published-GPU-result reproductions (bench/reproductions.py): their workload
generators, the closed loop, and the published orderings on reduced, fast versions of
the same workloads on the same presets (a flipped ordering fails here)."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from blockserve.bench import reproductions as rp


def _args(name: str, **changes) -> argparse.Namespace:
    return argparse.Namespace(**{**rp.DEFAULTS[name], "preset": None, "seed": 0, "jobs": 1,
                                 **changes})


def test_random_dataset_lengths_are_vllm_bench_ranges():
    specs = rp.random_dataset(300, 1000, 5000, 0.2, seed=1)
    assert all(800 <= s.prompt_tokens <= 1200 and 4000 <= s.output_tokens <= 6000
               for s in specs)
    assert {s.arrival_s for s in specs} == {0.0}  # rate inf: all at once
    timed = rp.random_dataset(2000, 100, 10, 0.5, seed=1, rate=50.0)
    assert timed[-1].arrival_s / len(timed) == pytest.approx(1 / 50, rel=0.1)


def test_shared_prefix_dataset_cycles_fixed_prompts_at_the_stage_rates():
    stages = (rp.Stage(5, 40), rp.Stage(20, 40))
    specs = rp.shared_prefix_dataset(4, 5, 64, 16, 8, stages, seed=0)
    distinct = {tuple(s.prompt) for s in specs}
    assert len(distinct) == 20  # groups x prompts per group, each sent again and again
    assert tuple(specs[0].prompt) == tuple(specs[20].prompt)  # in one shuffled order
    by_group = {}
    for s in specs:
        by_group.setdefault(s.tenant, set()).add(tuple(s.prompt[:64]))
    assert all(len(prefixes) == 1 for prefixes in by_group.values())  # shared prefix
    first = sum(s.arrival_s < 40 for s in specs)
    assert first == pytest.approx(200, rel=0.25) and len(specs) - first == pytest.approx(
        800, rel=0.15)
    half = rp.shared_prefix_dataset(4, 5, 64, 16, 8, stages, seed=0, rate_scale=0.5,
                                    time_scale=0.5)
    assert len(half) == pytest.approx(len(specs) / 4, rel=0.2)


def test_llmd_scaling_keeps_the_prefixes_share_of_cluster_kv():
    for pods in (2, 8):
        run = rp.llmd_run(_args("llmd", pods=pods, time_scale=0.01))
        assert run.replicas == pods
        assert run.setup["prefix_share_of_cluster_kv"] == pytest.approx(0.73, abs=0.02)


def test_closed_loop_keeps_the_concurrency_and_serves_every_request():
    run = rp.watermark_run(_args("watermark", prompts=12, input_len=40, output_len=30,
                                 concurrency=3, kv_tokens=2000))
    cluster = rp.make_cluster(run, run.variants[0], "cpu-tiny")
    assert isinstance(cluster, rp.ClosedLoopCluster) and cluster.concurrency == 3
    flights = asyncio.run(cluster.run(run.specs))
    assert len(flights) == 12 and all(f.status == 200 for f in flights)
    for f in flights:  # at each arrival, at most `concurrency` requests are in flight
        in_flight = sum(g.arrival <= f.arrival < g.finished for g in flights)
        assert in_flight <= 3
    assert sorted(f.arrival for f in flights)[3] > 0  # the fourth waited for a slot


def test_checks_judge_direction_order_and_ratio():
    published = {"a": {"x": 10.0}, "b": {"x": 5.0}}
    down = rp.moves_as_published(published, "a", "b", "x")
    assert down.holds({"a": {"x": 3}, "b": {"x": 2}})
    assert not down.holds({"a": {"x": 2}, "b": {"x": 3}})
    order = rp.ordered(("a", "b", "c"), "x", descending=True)
    assert order.holds({"a": {"x": 3}, "b": {"x": 2}, "c": {"x": 1}})
    assert not order.holds({"a": {"x": 3}, "b": {"x": 4}, "c": {"x": 1}})
    ratio = rp.ratio_within("x", "a", "b", 2.0, 0.25)
    assert ratio.holds({"a": {"x": 4.4}, "b": {"x": 2}})
    assert not ratio.holds({"a": {"x": 6}, "b": {"x": 2}})
    assert rp.judge(rp.Reproduction("s", {}, "cpu-tiny", None, (ratio,), "b", ()),
                    {"a": {"x": None}, "b": {"x": 1}}) == [
        {"target": ratio.description, "met": False}]  # an unmeasured figure is a miss
    base_ratio = rp.Check("x / b", lambda sim: sim["a"]["x / b"] <= 0.8)
    assert rp.judge(rp.Reproduction("s", {}, "cpu-tiny", None, (base_ratio,), "b", ()),
                    rp.with_ratios({"a": {"x": 0}, "b": {"x": 0}}, "b", ("x",))) == [
        {"target": "x / b", "met": False}]  # no ratio to a zero (nothing preempted): a miss


def test_ratios_to_the_base_configuration():
    figures = {"base": {"x": 4.0, "y": 0, "name": "n"}, "other": {"x": 2.0, "y": 3}}
    ratios = rp.with_ratios(figures, "base", ("x", "y", "name"))
    assert ratios["other"]["x / base"] == 0.5
    assert "y / base" not in ratios["other"]  # no ratio to a zero
    assert "x / base" not in ratios["base"]
    given = rp.with_ratios({"base": {"x": 1.0}, "other": {"x / base": (0.7, 0.8)}}, "base",
                           ("x",))
    assert given["other"]["x / base"] == (0.7, 0.8)  # a published band is kept


def _targets(name: str, **changes) -> dict[str, bool]:
    result = rp.reproduce(name, _args(name, **changes))
    return {t["target"]: t["met"] for t in result["targets"]}


def test_watermark_moves_every_figure_as_published_on_a_reduced_run():
    """PR #44594's workload at 1/8 of its lengths, concurrency and prompts and 1/64 of its
    KV (the same demand per KV block), on the a100-llama3-8b preset."""
    targets = _targets("watermark", prompts=48, concurrency=16, input_len=125,
                       output_len=625, kv_tokens=299_584 // 64)
    moved = {target: met for target, met in targets.items() if "moves as published" in target}
    assert len(moved) == 4 and all(moved.values()), targets


def test_llmd_routers_keep_the_published_order_on_a_reduced_run():
    """llm-d's benchmark on 2 pods at 1/10 of its lengths and KV and 10x its rates (about
    the same tokens per second), its ramp 1/100 as long, on the h100x2-qwen3-32b preset."""
    targets = _targets("llmd", pods=2, length_scale=0.1, time_scale=0.01)
    assert targets["output_tokens_per_s: precise > approximate > random"], targets
    assert targets["ttft_p90_s: precise < approximate < random"], targets
