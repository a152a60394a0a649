"""bench/contest_bounds.py: the floor lies under what a busy run measures, request by
request; the goodput ceiling counts only requests whose floors meet the SLOs, over the best
choice of them, and the throughput ceiling every token over the shortest run; a target is
out of reach only where the bound says so."""

from __future__ import annotations

import json
import sys

import pytest

from blockserve.bench import contest_bounds, contest_workloads
from blockserve.bench.contest import (CONFIGS, FCFS, LENGTH_RANK_TARGET, POWER_OF_TWO,
                                      run_settings)
from blockserve.bench.simulator import SIM_CONFIGS, preset_shape, simulate_variant
from blockserve.bench.step_time import StepTimeModel
from blockserve.bench.variants import parse_entry


def test_the_decode_floor_is_one_step_alone_per_token_after_the_first():
    model = StepTimeModel(0.01, 0.0, 0.001, 0.0, 1e-6)
    # tokens 2 and 3 read contexts of 11 and 12 tokens
    assert contest_bounds.decode_floor_s(model, 10, 3) == pytest.approx(2 * 0.011 + 23e-6)
    assert contest_bounds.decode_floor_s(model, 10, 1) == 0


def test_the_ceilings_count_requests_whose_floors_meet_the_slos_and_the_shortest_run():
    model = StepTimeModel(0.0, 0.0, 0.01, 0.0, 0.0)  # 10 ms per decode step
    floors = {"arrivals": [0.0, 1.0, 2.0, 3.0, 3.0],
              "prompt_tokens": [8] * 5,
              "output_tokens": [1, 1, 1, 701, 2],
              # each request's best first token; the last one never within the TTFT SLO
              "ttft_s": {"a": [0.1, 0.5, 0.1, 0.1, 2.0], "b": [0.2, 0.3, 0.4, 0.2, 3.0]}}
    b = contest_bounds.bounds(floors, model, slo_ttft_s=1.0, slo_tpot_s=0.05)
    assert b["countable_requests"] == 4
    # answered, the four end at 0.1, 1.3, 2.1 and 10.1 (3.0 + 0.1 + 700 x 10 ms) and the
    # fifth at 5.01; shedding the one that ends at 10.1, three count by 3.0 (the last arrival)
    assert b["goodput_ceiling_rps"] == pytest.approx(4 / 10.1)
    assert b["goodput_ceiling_shedding_rps"] == pytest.approx(3 / 3.0)
    # every output token over the run from the first arrival to the latest floor end
    assert b["makespan_floor_s"] == pytest.approx(10.1)
    assert b["throughput_ceiling_tok_s"] == pytest.approx(706 / 10.1)
    assert b["last_floor_end"]["index"] == 3
    assert b["last_floor_end"]["end_s"] == pytest.approx(10.1)
    assert b["ttft_p90_floor_s"] == 2.0  # of 0.1, 0.3, 0.1, 0.1, 2.0
    assert b["ttft_mean_floor_s"] == pytest.approx(2.6 / 5)
    slow = {**floors, "output_tokens": [1, 1, 1, 2, 2]}
    floors_tpot = contest_bounds.bounds(slow, StepTimeModel(0.0, 0.0, 0.06, 0.0, 0.0), 1.0, 0.05)
    assert floors_tpot["countable_requests"] == 3  # 60 ms per token is beyond the TPOT SLO


def test_a_target_is_out_of_reach_only_where_its_bound_says_so():
    cell_bounds = {"ttft_p90_floor_s": 0.5, "goodput_ceiling_rps": 10.0,
                   "goodput_ceiling_shedding_rps": 12.0, "ttft_mean_floor_s": 0.2,
                   "throughput_ceiling_tok_s": 1.05}
    targets = [
        {"measure": "TTFT p90", "against": "x", "theirs_value": 0.6, "ratio": 1.1,
         "bound": "<= 0.8", "met": False},
        {"measure": "goodput", "against": "y", "theirs_value": 8.0, "ratio": 1.0,
         "bound": ">= 1.15", "met": False},
        {"measure": LENGTH_RANK_TARGET, "against": FCFS, "theirs_value": 0.3, "ratio": 0.9,
         "bound": "<= 0.6", "met": False},
        {"measure": "throughput", "against": "z", "theirs_value": 1.0, "ratio": 0.9,
         "bound": ">= 1.0", "met": False},
        {"measure": "ITL p99", "against": POWER_OF_TWO, "theirs_value": 0.1, "ratio": 0.9,
         "bound": "<= 0.8", "met": False}]
    cell = {FCFS: {"summary": {"ttft_mean_s": 0.25}}}
    v = {x["measure"]: x for x in contest_bounds.verdicts(cell_bounds, targets, cell)}
    assert set(v) == {"TTFT p90", "goodput", "throughput", LENGTH_RANK_TARGET}  # no ITL bound
    assert v["TTFT p90"]["best_possible"] == pytest.approx(0.5 / 0.6)
    assert not v["TTFT p90"]["reachable"]
    assert v["goodput"]["best_possible"] == pytest.approx(1.25) and v["goodput"]["reachable"]
    assert v["goodput"]["best_possible_shedding"] == pytest.approx(1.5)
    assert v[LENGTH_RANK_TARGET]["best_possible"] == pytest.approx(0.8)
    assert not v[LENGTH_RANK_TARGET]["reachable"]
    assert v["throughput"]["best_possible"] == pytest.approx(1.05)
    assert v["throughput"]["reachable"]


def test_no_request_of_a_busy_run_beats_its_floor(tmp_path, monkeypatch):
    """The command on a two-replica contest cell; the same requests at that rate under
    power of two come no sooner, one by one, than their floors (Azure code: no shared
    prefixes, so the bound holds without the prefix-cache assumption)."""
    preset, per_replica, replicas = "a100-llama3-8b", 6, 2
    settings = run_settings(preset, 0, requests_per_replica=per_replica)
    rate = 12.0  # per replica: above this preset's capacity on Azure code, so requests wait
    source = tmp_path / "contest.json"
    source.write_text(json.dumps({
        "preset": preset, "slo": {"ttft_s": 1.0, "tpot_s": 0.05},
        "args": {"requests_per_replica": per_replica, "duration_s": None, "seed": 0},
        "capacity": {"azure_code": {"per_replica_rps": rate}},
        "results": {"azure_code": {str(replicas): {"1.0": {}}}},
        "targets": [{"workload": "azure_code", "replicas": replicas, "load": 1.0,
                     "measure": "TTFT p90", "against": POWER_OF_TWO, "theirs_value": 1.0,
                     "ratio": 1.0, "bound": "<= 0.8", "met": False}]}))
    out = tmp_path / "bounds"
    monkeypatch.setattr(sys, "argv", ["contest_bounds", str(source), "--jobs", "1",
                                      "--out", str(out)])
    contest_bounds.main()
    cell = json.loads(out.with_suffix(".json").read_text())["results"]["azure_code/2/1.0"]
    assert cell["requests"] == per_replica * replicas
    assert [v["measure"] for v in cell["verdicts"]] == ["TTFT p90"]
    assert "TTFT p90" in out.with_suffix(".md").read_text()

    n = per_replica * replicas
    floors = contest_bounds.first_token_floors("azure_code", replicas, n, rate * replicas,
                                               settings)
    best = [min(both) for both in zip(*floors["ttft_s"].values())]
    shape = preset_shape(preset)
    specs = contest_workloads.requests("azure_code", n, rate * replicas, 0, shape)
    busy = simulate_variant(parse_entry(CONFIGS[POWER_OF_TWO], SIM_CONFIGS), replicas, specs,
                            settings, shape)
    ttfts = [r["ttft_s"] for r in busy["records"]]
    assert busy["summary"]["ttft_p90_s"] > 1.5 * cell["ttft_p90_floor_s"]  # requests waited
    assert all(t >= f - 1e-9 for t, f in zip(ttfts, best))
    assert sum(t > 1.5 * f for t, f in zip(ttfts, best)) >= n // 2
