"""bench/no_regression.py: the no-regression figures pooled over harness runs (pure
logic, on hand-made run files)."""

import pytest

from blockserve.bench.no_regression import figures


def replay(tokens_per_request: int, makespan_s: float, ttft_s: float = 0.5,
           cpu_speed: float | None = None) -> dict:
    """A configuration's pooled result on a workload: 10 requests of one seed, with the
    CPU speed probe's median if given."""
    records = [{"status": 200, "output_tokens": tokens_per_request, "ttft_s": ttft_s,
                "itl_s": 0.01, "e2e_s": 1.0} for _ in range(10)]
    summary = {"output_tokens_per_s": 10 * tokens_per_request / makespan_s,
               "makespan_s": makespan_s, "preemptions": 0}
    seed = {"seed": 0, "summary": summary}
    if cpu_speed is not None:
        seed["cpu_speed"] = {"median": cpu_speed}
    return {"records": records, "seeds": [seed], "summary": summary}


def run(ours: dict, peers: dict, slo_ttft: float = 2.0) -> dict:
    results = {"blockserve": {"w": ours}, **{name: {"w": r} for name, r in peers.items()}}
    return {"args": {"workloads": ["w"], "slo_ttft": slo_ttft, "slo_itl": 0.1},
            "results": results}


def throughput(checks: list[dict], against: str) -> dict:
    return next(c for c in checks if c["metric"] == "output_tokens_per_s"
                and c["against"] == against)


def test_runs_pool_into_one_figure_with_each_runs_ratio_beside_it():
    slow = run(replay(100, 10.0), {"power of two": replay(100, 9.0)})  # ours 0.90x
    fast = run(replay(100, 9.0), {"power of two": replay(100, 10.0)})  # ours 1.11x
    check = throughput(figures([slow, fast]), "power of two")
    assert check["ratio"] == pytest.approx(1.0)  # 2000 tokens in 19 s each
    assert check["met"]
    assert check["per_run"] == pytest.approx([0.9, 10 / 9])
    assert not throughput(figures([slow]), "power of two")["met"]


def test_ttft_p99_is_at_most_and_throughput_at_least():
    checks = figures([run(replay(100, 10.0, ttft_s=1.3), {"round robin": replay(100, 9.8)})])
    by_metric = {c["metric"]: c for c in checks}
    assert set(by_metric) == {"output_tokens_per_s", "goodput_rps", "ttft_p99_s"}
    assert by_metric["output_tokens_per_s"]["met"]  # 0.98x >= 0.97x
    assert not by_metric["ttft_p99_s"]["met"]  # 2.6x > 1.2x
    assert all(c["configuration"] == "blockserve" for c in checks)  # peers are not judged


def test_a_peer_missing_from_a_run_leaves_that_run_out_of_its_figures():
    both = run(replay(100, 10.0), {"power of two": replay(100, 10.0)})
    ours_only = run(replay(100, 20.0), {})
    check = throughput(figures([ours_only, both]), "power of two")
    assert check["per_run"] == pytest.approx([1.0])
    assert check["ratio"] == pytest.approx(1.0)  # not ours' 20 s window, unseen by the peer
    assert check["runs"] == 1


def test_runs_with_different_goodput_slos_are_refused():
    with pytest.raises(ValueError, match="SLOs differ"):
        figures([run(replay(100, 10.0), {}), run(replay(100, 10.0), {}, slo_ttft=1.0)])


def test_a_configuration_that_ran_other_settings_in_another_run_is_refused():
    """"blockserve" is deploy.yaml as each run found it: a changed default does not pool."""
    before = run(replay(100, 10.0), {})
    after = run(replay(100, 10.0), {})
    before["results"]["blockserve"]["notes"] = {"router": {"queue_order": "fcfs"}}
    after["results"]["blockserve"]["notes"] = {"router": {"queue_order": "on_time_first"}}
    with pytest.raises(ValueError, match="'blockserve' ran other settings in run 2"):
        figures([before, after])


def test_throughput_at_equal_cpu_speed_stands_beside_the_figure_and_judges_nothing():
    """Ours ran 0.9x the tokens per second during a spell 0.9x as fast: 1.0x at equal
    speed, still missed. Without every replay's probe there is no such figure."""
    slow_machine = run(replay(90, 10.0, cpu_speed=1800.0),
                       {"power of two": replay(100, 10.0, cpu_speed=2000.0)})
    check = throughput(figures([slow_machine]), "power of two")
    assert check["ratio"] == pytest.approx(0.9) and not check["met"]
    assert check["at_equal_speed"] == pytest.approx(1.0)
    one_unprobed = run(replay(90, 10.0, cpu_speed=1800.0), {"power of two": replay(100, 10.0)})
    assert "at_equal_speed" not in throughput(figures([one_unprobed]), "power of two")
    assert all("at_equal_speed" not in c for c in figures([slow_machine])
               if c["metric"] != "output_tokens_per_s")


def test_the_engines_itl_at_equal_cpu_speed_tells_slower_engines_from_a_slower_machine():
    """Ours' engines took 20 ms a token on a machine 0.8x as fast, the peer's 16 ms: the
    same per token at equal speed. Weighted by tokens; absent without every replay's ITL."""
    def timed(tokens, makespan_s, speed, itl_s):
        result = replay(tokens, makespan_s, cpu_speed=speed)
        result["seeds"][0]["router"] = {"engine_itl_mean_s": itl_s}
        return result

    check = throughput(figures([run(timed(80, 10.0, 1600.0, 0.020),
                                    {"power of two": timed(100, 10.0, 2000.0, 0.016)})]),
                       "power of two")
    assert check["engine_itl_at_equal_speed"] == pytest.approx(1.0)
    slower_engines = run(timed(80, 10.0, 2000.0, 0.020),
                         {"power of two": timed(100, 10.0, 2000.0, 0.016)})
    assert throughput(figures([slower_engines]), "power of two")[
        "engine_itl_at_equal_speed"] == pytest.approx(1.25)
    two_runs = [run(timed(100, 10.0, 2000.0, 0.010), {"power of two": timed(100, 10.0, 2000.0,
                                                                            0.010)}),
                run(timed(300, 10.0, 2000.0, 0.020), {"power of two": timed(100, 10.0, 2000.0,
                                                                            0.010)})]
    # ours: (1000 x 10 + 3000 x 20) / 4000 = 17.5 ms a token, theirs 10 ms
    assert throughput(figures(two_runs), "power of two")[
        "engine_itl_at_equal_speed"] == pytest.approx(1.75)
    unrecorded = run(timed(80, 10.0, 1600.0, 0.020), {"power of two": replay(100, 10.0,
                                                                             cpu_speed=2000.0)})
    assert "engine_itl_at_equal_speed" not in throughput(figures([unrecorded]), "power of two")


def test_a_configuration_pooled_as_another_joins_its_figures():
    """A candidate of one run that is the default of the next (its setting a class default
    deploy.yaml does not spell) pools with it under the candidate's name; a run that has
    both names cannot."""
    tried = run(replay(100, 10.0), {"power of two": replay(100, 10.0)})
    tried["results"]["candidate"] = {"w": replay(100, 8.0), "notes": {"window": 64}}
    adopted = run(replay(100, 12.0), {"power of two": replay(100, 10.0)})
    adopted["results"]["blockserve"]["notes"] = {}
    check = next(c for c in figures([tried, adopted], {(1, "blockserve"): "candidate"})
                 if c["metric"] == "output_tokens_per_s" and c["configuration"] == "candidate")
    assert check["per_run"] == pytest.approx([1.25, 10 / 12])
    assert check["ratio"] == pytest.approx(2000 / 20 / 100)
    with pytest.raises(ValueError, match="has 'candidate' already"):
        figures([tried], {(0, "blockserve"): "candidate"})
