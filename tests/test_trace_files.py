"""Trace and workload files as requests (bench/trace_files.py) and the side-by-side
configuration entries (bench/variants.py): pure logic, no engine."""

import json

import pytest

from blockserve.bench.trace_files import Scaling, load_workload, read_trace
from blockserve.bench.variants import variants, workload_kwargs

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.9799600,300,8
2023-11-16 18:17:06.9799600,900,20
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_azure_csv_keeps_its_gaps_scaled_by_the_rate_and_cuts_to_the_context(tmp_path):
    path = write(tmp_path, "azure.csv", AZURE)
    replay = read_trace(path, Scaling(rate_scale=2.0), max_model_len=1024, block_size=16)
    assert [round(s.arrival_s, 6) for s in replay.specs] == [0.0, 0.5, 1.5]
    assert [s.output_tokens for s in replay.specs] == [10, 8, 20]
    assert [len(s.prompt) for s in replay.specs] == [1014, 300, 900]  # the first one cut
    assert replay.scaling["prompts_cut"] == 1 and replay.scaling["rate_scale"] == 2.0
    half = read_trace(path, Scaling(length_scale=0.5, max_requests=2), 8192, 16)
    assert [(len(s.prompt), s.output_tokens) for s in half.specs] == [(2404, 5), (150, 4)]


def test_mooncake_hash_ids_share_blocks_and_nothing_else(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
            {"timestamp": 1000, "input_length": 1024, "output_length": 5, "hash_ids": [1, 3]}]
    path = write(tmp_path, "mooncake.jsonl", "\n".join(map(json.dumps, rows)))
    a, b = read_trace(path, Scaling(length_scale=1 / 16), 4096, 32).specs
    assert len(a.prompt) == len(b.prompt) == 64  # 512 tokens per id, scaled: one block
    assert a.prompt[:32] == b.prompt[:32] and a.prompt[32:] != b.prompt[32:]
    assert b.arrival_s == 1.0


def test_length_only_csv_arrives_at_the_stated_rate(tmp_path):
    text = "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n" + \
        "".join(f"{100 + i},{10 + i},0,0\n" for i in range(400))
    replay = read_trace(write(tmp_path, "lengths.csv", text), Scaling(rate=50.0), 1024, 16)
    assert 40 < replay.scaling["rate_rps"] < 60
    assert [s.output_tokens for s in replay.specs[:3]] == [10, 11, 12]


def test_a_workload_file_carries_tokens_or_block_hashes_tenants_and_sessions(tmp_path):
    rows = [{"arrival_s": 0.0, "prompt": [5, 6, 7], "output_tokens": 4, "tenant": "a"},
            {"arrival_s": 0.2, "block_hashes": [9, 10], "output_tokens": 3, "tenant": "b",
             "session": "s1"},
            {"arrival_s": 0.4, "block_hashes": [9], "prompt_tokens": 20, "output_tokens": 3}]
    path = write(tmp_path, "mine.jsonl", "\n".join(map(json.dumps, rows)))
    first, second, third = load_workload(str(path), None, 0, {}, Scaling(), 1024, 16).specs
    assert first.prompt == [5, 6, 7] and first.tenant == "a"
    assert len(second.prompt) == 32 and second.session == "s1" and second.tenant == "b"
    assert third.prompt[:16] == second.prompt[:16] and len(third.prompt) == 20
    bad = write(tmp_path, "bad.jsonl", json.dumps({"arrival_s": 0, "output_tokens": 1}))
    with pytest.raises(ValueError, match="either prompt"):
        read_trace(bad, Scaling(), 1024, 16)


def test_built_in_workloads_take_their_own_options():
    specs = load_workload("cross_tenant", 60, 0, {"tenants": 4, "shared_prefixes": 1},
                          Scaling(), 1024, 16).specs
    assert len(specs) == 60 and {s.tenant for s in specs} == {f"tenant-{i}" for i in range(4)}
    assert len({tuple(s.prompt[:256]) for s in specs}) == 1  # one prefix across tenants
    assert len({tuple(s.prompt[:384]) for s in specs}) == 4  # then each tenant's own
    given = workload_kwargs(["cross_tenant:tenants=16,shared_prefixes=2", '{"rate": 3}'],
                            ["cross_tenant", "poisson"])
    assert given == {"cross_tenant": {"tenants": 16, "shared_prefixes": 2, "rate": 3},
                     "poisson": {"rate": 3}}
    with pytest.raises(ValueError, match="NAME:KEY=VALUE"):
        workload_kwargs(["mooncake:tenants=2"], ["poisson"])


def test_configs_override_any_section_with_kwargs_and_sweep_one_of_them():
    named = {"power of two": None}
    plain, based = variants(
        ["scheduler.block_eviction=tenant_quota(default_quota=80), engine.watermark=0.05",
         "power of two + router.queue_timeout_s=5"], named)
    assert plain.base is None and plain.overrides["engine"] == {"watermark": 0.05}
    assert plain.applied("scheduler", {"queue_order": "fcfs"}) == {
        "queue_order": "fcfs",
        "block_eviction": {"cls": "tenant_quota", "kwargs": {"default_quota": 80}}}
    assert based.base == "power of two" and based.applied("router", {}) == {
        "queue_timeout_s": 5}
    swept = variants(["power of two"], named, "scheduler.block_eviction.keep=1,2")
    assert [v.label for v in swept] == ["power of two, scheduler.block_eviction.keep=1",
                                        "power of two, scheduler.block_eviction.keep=2"]
    assert swept[1].applied("scheduler", {"block_eviction": "mine:Keep"}) == {
        "block_eviction": {"cls": "mine:Keep", "kwargs": {"keep": 2}}}
    for wrong in ["blockserve", "replica.x=1", "round robin + router.placement=x"]:
        with pytest.raises(ValueError):
            variants([wrong], named)
