"""Issue 15's target checks (bench/report.py): ratios on the values, 0 against 0 met."""

import math

from blockserve.bench.report import OURS, ratio, target_checks


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
