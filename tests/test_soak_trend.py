"""The soak's trend test (bench/soak.py) on series of known shape: pure logic."""

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
