"""Issue 15's target checks (bench/report.py): ratios on the values, 0 against 0 met."""

import math

import pytest

from blockserve.bench.report import OURS, pooled, ratio, target_checks, target_table


def summary(**values):
    base = {"output_tokens_per_s": 1000.0, "goodput_rps": 10.0, "ttft_p99_s": 1.0,
            "preemptions": 10.0}
    return {"summary": {**base, **values}}


def test_ratios_of_zero_and_unmeasured_values():
    assert ratio({"x": 2.0}, {"x": 4.0}, "x") == 0.5
    assert math.isinf(ratio({"x": 1.0}, {"x": 0.0}, "x"))
    assert math.isnan(ratio({"x": 0.0}, {"x": 0.0}, "x"))
    assert ratio({"x": 1.0}, {"x": math.nan}, "x") is None


def test_targets_against_memory_blind_routing_and_raw_servers():
    results = {OURS: {"w": summary(output_tokens_per_s=1100.0, goodput_rps=12.0,
                                   ttft_p99_s=0.5, preemptions=0.0)},
               "power of two": {"w": summary()},
               "round robin": {"w": summary(preemptions=0.0, goodput_rps=9.0)},
               "raw vLLM x2": {"w": summary(output_tokens_per_s=1200.0)}}
    checks = {(c["against"], c["metric"]): c["met"] for c in target_checks(results, "w")}
    assert checks == {
        ("power of two", "output_tokens_per_s"): True,   # 1.10x >= 1.05x
        ("round robin", "output_tokens_per_s"): True,
        ("power of two", "goodput_rps"): False,          # 1.20x < 1.3x
        ("round robin", "goodput_rps"): True,            # 1.33x
        ("power of two", "ttft_p99_s"): True,            # 0.5x <= 0.7x
        ("round robin", "ttft_p99_s"): True,
        ("power of two", "preemptions"): True,           # 0 <= 0.2 x 10
        ("round robin", "preemptions"): True,            # 0 <= 0.2 x 0
        ("raw vLLM x2", "output_tokens_per_s"): False,   # 0.92x < 0.95x
    }
    assert target_checks({"power of two": results["power of two"]}, "w") == []


def _seed_run(seed, makespan, tokens, ttfts, preemptions=0.0):
    records = [{"index": i, "tenant": "default", "status": 200, "ttft_s": t, "itl_s": 0.01,
                "e2e_s": t + 1, "output_tokens": tokens, "prompt_tokens": 10}
               for i, t in enumerate(ttfts)]
    return {"seed": seed, "records": records, "kv_usage": [],
            "summary": {"makespan_s": makespan, "preemptions": preemptions,
                        "output_tokens_per_s": tokens * len(ttfts) / makespan},
            "length_check": {"ok": len(ttfts), "exact": len(ttfts), "max_over": 0,
                             "max_under": 0}}


def test_seeds_pool_into_one_run_over_their_summed_makespans():
    """Two seeds: 2 x 100 tokens in 1 s and 2 x 100 in 3 s pool to 400 tokens / 4 s, not
    the mean of 200 and 66.7 tok/s; percentiles are over all four requests."""
    run = pooled([_seed_run(0, 1.0, 100, [0.1, 0.2]), _seed_run(1, 3.0, 100, [3.0, 0.3], 2.0)],
                 slo_ttft_s=2.0, slo_itl_s=0.1)
    s = run["summary"]
    assert s["output_tokens_per_s"] == 100.0 and s["makespan_s"] == 4.0
    assert s["goodput_rps"] == 3 / 4.0 and s["preemptions"] == 2.0
    assert s["requests"] == 4 and run["length_check"]["exact"] == 4
    assert [r["seed"] for r in run["seeds"]] == [0, 1]
    unmeasured = _seed_run(1, 3.0, 100, [0.3])
    unmeasured["summary"]["preemptions"] = None  # a peer that exports none
    assert pooled([_seed_run(0, 1.0, 100, [0.1]), unmeasured], 2.0, 0.1)["summary"][
        "preemptions"] is None


def test_each_target_shows_its_range_over_the_seeds():
    def with_seeds(*tokens_per_s):
        return {"w": {**summary(output_tokens_per_s=sum(tokens_per_s) / len(tokens_per_s)),
                      "seeds": [{"seed": i, **summary(output_tokens_per_s=v)}
                                for i, v in enumerate(tokens_per_s)]}}

    results = {OURS: with_seeds(1100.0, 900.0, 1200.0),
               "power of two": with_seeds(1000.0, 1000.0, 1000.0)}
    check = next(c for c in target_checks(results, "w") if c["metric"] == "output_tokens_per_s")
    assert check["seed_ratios"] == [1.1, 0.9, 1.2] and check["met_seeds"] == 2
    assert "0.90-1.20x over 3 seeds, met in 2" in "\n".join(target_table([check]))
    single = {name: {"w": {**by["w"], "seeds": by["w"]["seeds"][:1]}}
              for name, by in results.items()}
    assert "seed_ratios" not in target_checks(single, "w")[0]  # one seed: no range


def test_router_counters_over_an_interval():
    from blockserve.bench.targets import counters_since, router_counters

    scrape = "\n".join([
        'blockserve_decisions_total{app="a",router="r",policy="p",replica="x"} 3.0',
        'blockserve_decisions_total{app="a",router="s",policy="p",replica="x"} 1.0',
        'blockserve_decisions_total{app="a",router="r",policy="p",replica="y"} 2.0',
        'blockserve_admission_wait_seconds_count{app="a",router="r"} 6.0',
        'blockserve_admission_wait_seconds_sum{app="a",router="r"} 3.5',
        'blockserve_time_to_first_token_seconds_sum{app="a",router="r"} 0.5',
        'blockserve_time_to_first_token_seconds_count{app="a",router="r"} 6.0',
        'blockserve_replica_time_to_first_token_seconds_sum{replica="x"} 0.2',
        'blockserve_replica_time_to_first_token_seconds_sum{replica="y"} 0.1',
        'blockserve_replica_time_to_first_token_seconds_count{replica="x"} 4.0',
        'blockserve_replica_time_to_first_token_seconds_count{replica="y"} 2.0',
        'blockserve_replica_inter_token_latency_seconds_sum{replica="x"} 1.5',
        'blockserve_replica_inter_token_latency_seconds_sum{replica="y"} 0.5',
        'blockserve_replica_inter_token_latency_seconds_count{replica="x"} 80.0',
        'blockserve_replica_inter_token_latency_seconds_count{replica="y"} 20.0', ""])
    after = router_counters(scrape)
    assert after == {"admitted": 6.0, "admission_wait_s": 3.5,
                     "decisions": {"x": 4.0, "y": 2.0},
                     "router_ttft_sum": 0.5, "router_ttft_count": 6.0,
                     "engine_ttft_sum": pytest.approx(0.3), "engine_ttft_count": 6.0,
                     "engine_itl_sum": 2.0, "engine_itl_count": 100.0}
    before = {"admitted": 2.0, "admission_wait_s": 0.5, "decisions": {"x": 1.0},
              "router_ttft_sum": 0.1, "router_ttft_count": 2.0,
              "engine_ttft_sum": 0.0, "engine_ttft_count": 0.0,  # no engine counts yet
              "engine_itl_sum": 1.0, "engine_itl_count": 50.0}
    assert counters_since(before, after) == {
        "admitted": 4.0, "admission_wait_mean_s": 0.75, "decisions": {"x": 3.0, "y": 2.0},
        "router_ttft_mean_s": pytest.approx(0.1), "engine_ttft_mean_s": pytest.approx(0.05),
        "engine_itl_mean_s": pytest.approx(0.02)}
    assert counters_since(after, after)["engine_itl_mean_s"] is None
    assert counters_since(after, after)["engine_ttft_mean_s"] is None


def test_how_often_an_engine_had_nothing_waiting_while_the_router_held_requests():
    from blockserve.bench.harness import engines_idle
    from blockserve.bench.targets import replica_state

    scrape = "\n".join([
        'blockserve_queue_requests{app="a",router="r"} 5.0',
        'blockserve_replica_requests{app="a",replica="x",state="running"} 9.0',
        'blockserve_replica_requests{app="a",replica="x",state="waiting"} 0.0',
        'blockserve_replica_requests{app="a",replica="y",state="waiting"} 2.0',
        'blockserve_replica_kv_blocks{app="a",replica="x",state="held"} 140.0',
        'blockserve_replica_kv_blocks{app="a",replica="x",state="cached"} 8.0',
        'blockserve_replica_kv_blocks{app="a",replica="x",state="empty"} 12.0',
        'blockserve_replica_kv_blocks{app="a",replica="y",state="empty"} 1.0',
        'blockserve_replica_kv_usage_ratio{app="a",replica="x"} 0.875', ""])
    held = replica_state(scrape)
    assert held == {"kv_usage": {"x": 0.875}, "router_queue": 5.0, "engine_running": {"x": 9.0},
                    "engine_waiting": {"x": 0.0, "y": 2.0}, "free_blocks": {"x": 20.0, "y": 1.0}}
    nothing_held = {**held, "router_queue": 0.0}  # not counted: no request waited
    assert engines_idle([held, held, nothing_held]) == {
        "samples": 2, "engine_samples": 4, "idle_share": 0.5,
        "free_blocks_median_when_idle": 20.0}
    assert engines_idle([nothing_held]) is None


def test_engine_load_is_the_batch_per_engine_while_it_had_work():
    from blockserve.bench.harness import engine_load

    def sample(queue, running, waiting):
        return {"router_queue": queue, "engine_running": running, "engine_waiting": waiting}

    samples = [sample(5.0, {"x": 9.0}, {"x": 0.0, "y": 2.0}),  # y: waiting, none running
               sample(0.0, {"x": 3.0, "y": 1.0}, {"x": 1.0, "y": 0.0}),
               sample(0.0, {}, {"x": 0.0, "y": 0.0})]  # idle: counted nowhere
    assert engine_load(samples) == {"engine_samples": 4, "running_mean": 13 / 4,
                                    "waiting_mean": 3 / 4, "router_held_share": 0.5}
    assert engine_load(samples[2:]) is None
