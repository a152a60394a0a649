"""Issue 17's benchmark inputs and checks (bench/cache_bound.py, cache_bound_report.py):
text prompts that fit the context, arrival rates from the deployment's capacity, and
target checks labelled with the configuration they are for. No engine: the tokenizer is
the deployment's own tiny model's."""

from __future__ import annotations

import dataclasses
import os

import pytest

from blockserve.bench import cache_bound, harness, traces
from blockserve.bench.cache_bound_report import CACHE_AWARE_EXACT, DEFAULT, checks, report
from blockserve.tools.launch import load_config

CAPACITY = traces.Capacity.of_deployment()


def _tokenizer():
    from transformers import AutoTokenizer

    model = load_config()["applications"][0]["args"]["replica"]["model"]
    return AutoTokenizer.from_pretrained(os.path.expanduser(model))


def test_text_prompts_that_tokenize_too_long_are_cut_from_their_end_until_they_fit():
    tokenizer = _tokenizer()
    specs, _ = cache_bound.mooncake(seed=0)
    budget = [CAPACITY.max_model_len - s.output_tokens for s in specs]
    too_long = [i for i, (s, b) in enumerate(zip(specs, budget))
                if len(tokenizer(tokenizer.decode(s.prompt))["input_ids"]) > b]
    assert too_long, "the window has prompts whose text tokenizes longer than their ids"
    cut: list[int] = []
    texts = harness.as_text(specs, cut)
    assert cut == too_long
    for i, (spec, text) in enumerate(zip(specs, texts)):
        assert text.text_prompt_tokens == len(tokenizer(text.prompt)["input_ids"])
        assert text.prompt_tokens + spec.output_tokens <= CAPACITY.max_model_len
        whole = tokenizer.decode(spec.prompt)
        if i in cut:  # the leading (shared) part stays, the end goes
            assert whole.startswith(text.prompt) and len(text.prompt) < len(whole)
        else:
            assert text.prompt == whole
    assert harness.as_text(specs) == texts  # deterministic


def _doubled_blocks() -> traces.Capacity:
    return dataclasses.replace(CAPACITY, blocks_per_replica=2 * CAPACITY.blocks_per_replica)


def _mean_rate(specs) -> float:
    return (len(specs) - 1) / (specs[-1].arrival_s - specs[0].arrival_s)


@pytest.mark.parametrize("name", ["tenants", "sessions"])
def test_generated_workloads_arrive_at_the_capacity_rules_rate(name):
    specs, scaling = cache_bound.scaled_workload(name, 0, CAPACITY)
    mean_tokens = sum(len(s.prompt) + s.output_tokens for s in specs) / len(specs)
    assert scaling["rate_rps"] == pytest.approx(CAPACITY.kv_tokens / mean_tokens)
    assert _mean_rate(specs) == pytest.approx(scaling["rate_rps"])
    assert specs[0].arrival_s == 0.0
    double, doubled = cache_bound.scaled_workload(name, 0, _doubled_blocks())
    assert doubled["rate_rps"] == pytest.approx(2 * scaling["rate_rps"])
    assert _mean_rate(double) == pytest.approx(2 * _mean_rate(specs))
    for a, b in zip(specs, double):  # the same requests, every gap halved
        assert (a.prompt, a.output_tokens, a.tenant) == (b.prompt, b.output_tokens, b.tenant)
        assert b.arrival_s == pytest.approx(a.arrival_s / 2)
    if name == "sessions":  # think times shrink with the start rate: the shape stays
        assert doubled["think_s_mean"] == pytest.approx(scaling["think_s_mean"] / 2)
        assert doubled["session_start_rate"] == pytest.approx(
            2 * scaling["session_start_rate"])


def test_explicit_rates_still_set_the_generated_timeline():
    assert _mean_rate(cache_bound.tenants(n=400, rate=12.0, seed=1)) == pytest.approx(12, rel=0.15)
    shape = cache_bound.session_shape(cache_bound.sessions(n=600, rate=2.0, think_s=3.0))
    assert shape["think_s_mean"] == pytest.approx(3.0, rel=0.15)


def _run(ttft_p50: float, hit_rate: float) -> dict:
    return {"summary": {"ttft_p50_s": ttft_p50, "ttft_p99_s": 2 * ttft_p50,
                        "output_tokens_per_s": 100.0, "ok": 10},
            "cache": {"ttft_p90_s": 1.5 * ttft_p50, "hit_rate": hit_rate, "regret": 0.01},
            "records": []}


def test_targets_are_checked_and_labelled_for_the_default_and_the_exact_index():
    results = {DEFAULT: {"notes": {"router": {"placement": "balanced"}}, "tenants": _run(0.4, 0.6)},
               CACHE_AWARE_EXACT: {"tenants": _run(0.1, 0.9)},
               "power of two": {"tenants": _run(1.0, 0.5)},
               "Ray Serve LLM prefix": {"failed": "RuntimeError()"}}
    found = checks(results, ["tenants"])
    assert {c["ours"] for c in found} == {DEFAULT, CACHE_AWARE_EXACT}
    assert all(c["default"] == (c["ours"] == DEFAULT) for c in found)

    def p50(ours):
        [check] = [c for c in found if c["ours"] == ours and c["vs"] == "power of two"
                   and c["metric"] == "ttft_p50_s"]
        return check

    assert (p50(DEFAULT)["ratio"], p50(DEFAULT)["met"]) == (pytest.approx(0.4), True)
    assert (p50(CACHE_AWARE_EXACT)["ratio"], p50(CACHE_AWARE_EXACT)["met"]) == (
        pytest.approx(0.1), True)
    hit = [c for c in found if c["ours"] == DEFAULT and c["metric"] == "hit_rate"
           and c["vs"] == "power of two"]
    assert hit[0]["met"] is False  # 0.6 / 0.5 = 1.2 < 1.5
    assert all(c["met"] is None for c in found if c["vs"] == "Ray Serve LLM prefix")
    text = report(results, ["tenants"])
    default_at = text.index(f"issue 17's targets for our default configuration, {DEFAULT}: "
                            "placement balanced, approximate prefix index")
    assert text.index(f"issue 17's targets, also checked for {CACHE_AWARE_EXACT}") > default_at
    assert f"tenants: {DEFAULT} / each (ratios)" in text


def _seed_run(seed: int, ttft: float, records: list[dict], counters: dict) -> dict:
    return {"seed": seed, "records": records, "router_counters": counters, "wall_s": 1.0,
            "summary": {"makespan_s": 10.0, "preemptions": 0, "ttft_p50_s": ttft},
            "length_check": {"ok": len(records)}, "kv_usage": [], "kv_events": None,
            "cache": {"ttft_p90_s": ttft}}


def _record(ttft: float, prompt: int, cached: int) -> dict:
    return {"index": 0, "tenant": "t", "status": 200, "ttft_s": ttft, "itl_s": 0.01,
            "e2e_s": 1.0, "output_tokens": 4, "prompt_tokens": prompt,
            "finish_reason": "length", "cached_tokens": cached}


def test_seeds_pool_into_one_run_whose_counters_are_summed():
    counters = [{"prompt": 100, "predicted_hit": 50, "reported_hit": 40, "regret": 10,
                 "wait_sum": 1.0, "wait_count": 10},
                {"prompt": 300, "predicted_hit": 150, "reported_hit": 160, "regret": 30,
                 "wait_sum": 0.0, "wait_count": 30}]
    runs = [_seed_run(0, 0.1, [_record(0.1, 100, 40)], counters[0]),
            _seed_run(1, 0.3, [_record(0.3, 300, 160)], counters[1])]
    pooled = cache_bound.pooled_run(runs)
    assert len(pooled["records"]) == 2 and pooled["wall_s"] == 2.0
    assert pooled["cache"]["hit_rate"] == pytest.approx(200 / 400)
    assert pooled["cache"]["regret"] == pytest.approx(40 / 400)
    assert pooled["cache"]["admission_wait_mean_s"] == pytest.approx(1.0 / 40)
    assert [s["cache"]["ttft_p90_s"] for s in pooled["seeds"]] == [0.1, 0.3]
    no_router = [dict(run, router_counters=None) for run in runs]
    assert "regret" not in cache_bound.pooled_run(no_router)["cache"]


def test_each_target_is_also_checked_on_every_seed_both_configurations_replayed():
    def run(p50s):
        return {**_run(sum(p50s) / len(p50s), 0.6),
                "seeds": [{"seed": s, "summary": {"ttft_p50_s": v}, "cache": {}}
                          for s, v in enumerate(p50s)]}

    results = {DEFAULT: {"tenants": run([0.4, 0.6])},
               "power of two": {"tenants": run([1.0, 1.0])}}
    [check] = [c for c in checks(results, ["tenants"])
               if c["vs"] == "power of two" and c["metric"] == "ttft_p50_s"]
    assert check["seed_ratios"] == [pytest.approx(0.4), pytest.approx(0.6)]
    assert check["met_seeds"] == 1  # only 0.4 is <= 0.5
    assert "0.40-0.60x over 2 seeds, met in 1" in report(results, ["tenants"])


def test_the_hit_rate_ceiling_counts_leading_blocks_an_earlier_prompt_computed():
    from blockserve.bench.workloads import RequestSpec

    size = CAPACITY.block_size
    shared = list(range(2 * size))
    specs = [RequestSpec(0.0, shared + [1] * size, 4),  # nothing cached before it
             RequestSpec(1.0, shared + [2] * size, 4),  # 2 of its 3 blocks
             RequestSpec(2.0, shared + [2] * size, 4)]  # all but its last token's block
    ceiling = cache_bound.working_set(specs, CAPACITY)["hit_rate_ceiling"]
    assert ceiling == pytest.approx((2 * size + 2 * size) / (9 * size))


def test_every_configuration_runs_the_prefix_index_its_name_says():
    """Each configuration's Serve config as targets.blockserve builds it: deploy.yaml's
    index must not leak into one named for the other (it once did: `approximate index`
    ran deploy.yaml's exact one)."""
    from blockserve.protocol.config import parse_app_config

    indexes = {}
    for name, start in cache_bound.CONFIGURATIONS.items():
        if getattr(start, "func", None) is not cache_bound.targets.blockserve:
            continue
        config = cache_bound.targets.blockserve_config(**start.keywords)
        app = parse_app_config(config["applications"][0]["args"])
        indexes[name] = (app.router.prefix_index.cls, app.replica.publish_kv_events)
    assert indexes["cache-aware, approximate index"] == ("approximate", False)
    assert indexes["power of two"] == ("approximate", False)
    assert indexes[CACHE_AWARE_EXACT] == indexes["Dynamo cost, exact index"] == ("exact", True)
    assert indexes[cache_bound.EVENTS_ONLY] == ("approximate", True)
