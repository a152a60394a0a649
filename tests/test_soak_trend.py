"""The soak's trend test and pacing (bench/soak.py), on series of known shape: pure logic."""

import random

from blockserve.bench.soak import trend

MINUTES = [60.0 * m for m in range(12)]


def test_a_noisy_flat_series_is_flat_and_a_slow_leak_is_not():
    rng = random.Random(0)
    flat = [500 + rng.gauss(0, 3) for _ in MINUTES]
    leak = [500 + 4 * i + rng.gauss(0, 3) for i, _ in enumerate(MINUTES)]  # 4 MB a minute
    assert trend(MINUTES, flat, floor=20)["flat"]
    verdict = trend(MINUTES, leak, floor=20)
    assert not verdict["flat"] and 38 < verdict["drift"] < 50


def test_noise_widens_what_counts_as_flat_but_one_outlier_does_not_make_a_trend():
    spiky = [500.0] * len(MINUTES)
    spiky[5] = 900.0  # one slow minute
    assert trend(MINUTES, spiky, floor=1)["flat"]
    wide = [500 + (60 if i % 2 else -60) for i, _ in enumerate(MINUTES)]
    assert trend(MINUTES, wide, floor=1)["allowed"] > 100


def test_windows_are_spread_over_the_measured_period_with_their_gaps_shape():
    from blockserve.bench.request_spec import RequestSpec
    from blockserve.bench.soak import spread

    window = [RequestSpec(t, [1] * 8, 4) for t in (0.0, 1.0, 3.0, 7.0)]
    stretched = spread(window, period_s=40.0)
    # the last arrival leaves one mean gap before the next window: 4 windows per 160 s
    assert [s.arrival_s for s in stretched] == [0.0, 30 / 7, 90 / 7, 30.0]
