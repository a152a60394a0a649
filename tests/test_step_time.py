"""The step-time model (bench/step_time.py): what each term charges a step."""

from __future__ import annotations

import pytest

from blockserve.bench.step_time import PRESETS, StepBatch, StepTimeModel


def test_a_batch_counts_tokens_and_query_key_pairs():
    batch = StepBatch(prefill=((512, 0), (256, 1024)), decode_contexts=(100, 300, 2000))
    assert batch.prefill_tokens == 768
    assert batch.prefill_attention == 512 * 256 + 256 * (1024 + 128)
    assert (batch.decode_tokens, batch.decode_attention) == (3, 2400)


def test_each_term_charges_its_own_quantity():
    model = StepTimeModel(base_s=1.0, per_prefill_token_s=2.0, per_decode_token_s=3.0,
                          per_prefill_attention_s=5.0, per_decode_attention_s=7.0)
    batch = StepBatch(prefill=((4, 6),), decode_contexts=(10, 20))
    assert model(batch) == pytest.approx(1 + 2 * 4 + 5 * 4 * (6 + 2) + 3 * 2 + 7 * 30)
    assert model(StepBatch()) == 1.0


def test_cpu_presets_stay_linear_in_tokens():
    """The CPU fits have no attention terms: context length changes nothing."""
    for name in ("cpu-tiny", "cpu-tiny-deployed"):
        model = PRESETS[name]
        short = StepBatch(prefill=((300, 0),), decode_contexts=(1,) * 5)
        long = StepBatch(prefill=((300, 700),), decode_contexts=(1000,) * 5)
        expected = model.base_s + 300 * model.per_prefill_token_s + 5 * model.per_decode_token_s
        assert model(short) == model(long) == pytest.approx(expected)


def test_scaled_scales_every_term():
    model = StepTimeModel(1.0, 2.0, 3.0, 4.0, 5.0)
    batch = StepBatch(prefill=((8, 8),), decode_contexts=(9,))
    assert model.scaled(1.5)(batch) == pytest.approx(1.5 * model(batch))
