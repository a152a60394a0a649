"""Workloads and their length modes (bench/workloads.py), real traces scaled to the
deployment (bench/traces.py): the transformations their docstrings promise."""

from __future__ import annotations

import pytest

from blockserve.bench import traces
from blockserve.bench.workloads import (END_BIAS, KNOWN, LengthMode, Lengths, RequestSpec,
                             end_token_id, pressure)
from blockserve.tools.launch import EngineShape, load_config

CAPACITY = traces.Capacity.of_deployment()
TRACES = {"azure_code": traces.azure_code, "mooncake": traces.mooncake,
          "sharegpt": traces.sharegpt}


def test_capacity_is_read_from_the_deployment():
    engine = load_config()["applications"][0]["args"]["replica"]["engine_args"]
    assert CAPACITY.max_model_len == engine["max_model_len"]
    assert CAPACITY.kv_tokens == 2 * (engine["num_gpu_blocks_override"] - 1) * engine["block_size"]


def test_the_engine_shape_is_the_deployments_with_a_clear_error_where_it_is_missing():
    config = load_config()
    engine = config["applications"][0]["args"]["replica"]["engine_args"]
    shape = EngineShape.of(config)
    assert (shape.num_blocks, shape.block_size, shape.max_model_len, shape.max_num_seqs) == (
        engine["num_gpu_blocks_override"], engine["block_size"], engine["max_model_len"],
        engine["max_num_seqs"])
    assert shape.usable_blocks == engine["num_gpu_blocks_override"] - 1
    assert max(s.prompt_tokens + s.output_tokens for s in pressure(n=200)) < shape.max_model_len
    del engine["max_num_seqs"]
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineShape.of(config)


def test_known_mode_tells_the_true_length_and_ignores_eos():
    spec = RequestSpec(0.0, [11] * 100, 37)
    assert KNOWN.fields(spec) == {"max_tokens": 37, "ignore_eos": True}


def test_unknown_mode_sends_the_context_cap_and_ends_at_the_true_length():
    lengths = Lengths(LengthMode.UNKNOWN, 1024, end_token_id(4096))
    fields = lengths.fields(RequestSpec(0.0, [11] * 100, 37))
    assert fields["max_tokens"] == 1024 - 100  # the loose cap: what the context allows
    assert fields["min_tokens"] == 36  # token 37 is the first allowed to be the stop id
    assert fields["ignore_eos"] is False
    assert fields["stop_token_ids"] == [4095]
    assert fields["logit_bias"] == {"4095": END_BIAS}  # ... and the bias makes it so
    with pytest.raises(ValueError, match="end_token_id"):
        Lengths(LengthMode.UNKNOWN, 1024)
    with pytest.raises(ValueError, match="max_model_len"):
        Lengths(LengthMode.UNKNOWN, None, 4095)


def test_text_prompts_need_the_servers_token_count():
    assert RequestSpec(0.0, "hello", 4, text_prompt_tokens=3).prompt_tokens == 3
    with pytest.raises(ValueError):
        RequestSpec(0.0, "hello", 4).prompt_tokens


@pytest.mark.parametrize("name", sorted(TRACES))
def test_trace_lengths_fit_the_context_and_arrivals_are_monotonic(name):
    workload = TRACES[name](300, seed=0)
    specs = workload.specs
    assert len(specs) == 300
    assert all(1 <= s.output_tokens <= CAPACITY.max_model_len // 2 for s in specs)
    assert all(s.prompt_tokens >= 1 and s.prompt_tokens + s.output_tokens
               <= CAPACITY.max_model_len for s in specs)
    # the unknown mode's cap leaves room for the true length
    unknown = Lengths(LengthMode.UNKNOWN, CAPACITY.max_model_len, 4095)
    assert all(unknown.fields(s)["max_tokens"] >= s.output_tokens for s in specs)
    arrivals = [s.arrival_s for s in specs]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    # step 5: the window's mean rate is the deployment's KV capacity per mean request size
    mean_tokens = sum(s.prompt_tokens + s.output_tokens for s in specs) / len(specs)
    assert (len(specs) - 1) / arrivals[-1] == pytest.approx(CAPACITY.kv_tokens / mean_tokens)
    assert workload.scaling["rate_rps"] == pytest.approx(CAPACITY.kv_tokens / mean_tokens)


def test_azure_prompts_scale_by_the_context_ratio():
    workload = traces.azure_code(300, seed=0)
    raw = traces.read_azure(traces.trace_dir() / "azure_llm_2023_code.csv")
    start, end = workload.scaling["window"]
    assert workload.scaling["source_context"] == 8192  # longest prompt 7,437 tokens
    for request, spec in zip(raw[start:end], workload.specs):
        output = min(request.output_tokens, CAPACITY.max_model_len // 2)
        assert spec.output_tokens == output
        assert spec.prompt_tokens == min(round(request.input_tokens * 1024 / 8192),
                                         CAPACITY.max_model_len - output)
    # the window's gaps keep their shape: one compression factor for all
    scale = workload.scaling["time_scale"]
    for request, spec in zip(raw[start:end], workload.specs):
        assert spec.arrival_s == pytest.approx((request.arrival_s - raw[start].arrival_s) * scale)


def test_sharegpt_keeps_its_lengths_and_gets_one_seeded_poisson_timeline():
    path = traces.trace_dir() / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
    raw = traces.read_lengths(path)
    assert raw == traces.read_lengths(path)  # the timeline is the file's, not the seed's
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(raw, raw[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1.0, rel=0.05)  # rate 1 before step 5
    workload = traces.sharegpt(300, seed=1)
    start, _ = workload.scaling["window"]
    assert workload.scaling["source_context"] == 8192
    for request, spec in zip(raw[start:], workload.specs):
        assert spec.output_tokens == min(request.output_tokens, CAPACITY.max_model_len // 2)


def test_shared_mooncake_hash_ids_give_shared_token_blocks():
    workload = traces.mooncake(300, seed=0)
    raw = traces.read_mooncake(traces.trace_dir() / "mooncake_synthetic_trace.jsonl")
    start, _ = workload.scaling["window"]
    picked, block = raw[start:start + 300], CAPACITY.block_size
    by_id: dict[int, list[int]] = {}
    shared = 0
    for request, spec in zip(picked, workload.specs):
        for position in range(spec.prompt_tokens // block):  # full blocks of the prompt
            tokens = spec.prompt[position * block:(position + 1) * block]
            hash_id = request.hash_ids[position]
            shared += hash_id in by_id
            assert by_id.setdefault(hash_id, tokens) == tokens
            assert tokens == traces.hash_block(hash_id, block)
    assert shared > 100  # the window really shares prefixes
    distinct = {tuple(traces.hash_block(i, block)) for i in range(50)}
    assert len(distinct) == 50  # different ids, different blocks
    # a prompt is ceil(input * block / 512) tokens, cut to leave room for the output
    for request, spec in zip(picked, workload.specs):
        wanted = -(-request.input_tokens * block // 512)
        assert spec.prompt_tokens == min(wanted, CAPACITY.max_model_len - spec.output_tokens)


@pytest.mark.parametrize("name", sorted(TRACES))
def test_trace_workloads_are_seeded(name):
    first, again = TRACES[name](100, seed=3), TRACES[name](100, seed=3)
    assert first.specs == again.specs and first.scaling == again.scaling
    other = TRACES[name](100, seed=4)
    assert other.scaling["window"] != first.scaling["window"]


def test_a_window_larger_than_the_trace_is_refused():
    with pytest.raises(ValueError, match="window"):
        traces.mooncake(10**6)


def test_synthetic_workloads_carry_true_lengths_that_fit():
    specs = pressure(96, seed=0)
    assert all(s.prompt_tokens + s.output_tokens < 1024 for s in specs)
    assert specs == pressure(96, seed=0)
