"""The benchmarks that stand alone (no harness, no simulator sweep calls them) still run and
still measure what their docs say: each at a size that takes seconds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from blockserve.bench import cache_bound_sim, decision_time, sim_speed
from blockserve.bench.cache_bound_report import CACHE_AWARE_EXACT
from blockserve.protocol.registry import KINDS
from blockserve.tools.launch import EngineShape

ROOT = Path(__file__).resolve().parent.parent


def run_main(module, monkeypatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
    module.main()


def test_decision_time_times_every_registered_placement(tmp_path, monkeypatch):
    out = tmp_path / "decision.json"
    run_main(decision_time, monkeypatch, "--requests", "30", "--replicas", "8", "--out",
             str(out))
    results = json.loads(out.read_text())["results"]
    assert sorted(r["placement"] for r in results) == KINDS["router.placement"].names
    assert all(r["replicas"] == 8 and r["cpu_us"] > 0 for r in results)


def test_sim_speed_reports_each_cluster_size(tmp_path, monkeypatch):
    out = tmp_path / "speed"
    run_main(sim_speed, monkeypatch, "--trace",
             str(ROOT / "data/traces/azure_llm_2023_code.csv"), "--replicas", "2", "4",
             "--requests", "30", "--preset", "cpu-tiny", "--out", str(out))
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    assert sorted(results) == ["blockserve x2", "blockserve x4"]
    for run in results.values():
        assert run["ok"] == 30 and run["shed"] == 0
        assert 0 < run["wall_s_per_request"] == pytest.approx(run["wall_s"] / 30)
        assert 0 < run["vllm_scheduler_s"] < run["wall_s"]


def test_sim_speed_scales_the_rate_of_a_trace_without_timestamps(tmp_path, monkeypatch):
    """ShareGPT has lengths, no arrival times: its Poisson rate must grow with the replicas
    as a timed trace's does, or larger clusters sit idle."""
    out = tmp_path / "speed"
    run_main(sim_speed, monkeypatch, "--trace",
             str(ROOT / "data/traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv"),
             "--replicas", "1", "2", "--requests", "40", "--rate-scale-per-replica", "50",
             "--preset", "cpu-tiny", "--out", str(out))
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    rates = [results[f"blockserve x{n}"]["workload"]["rate"] for n in (1, 2)]
    assert rates == [50, 100]


def test_cache_bound_sim_hits_more_with_the_exact_index_than_power_of_two():
    specs, _ = cache_bound_sim.workloads(2, seed=0)["tenants"]
    shape = EngineShape.of()
    exact = cache_bound_sim.simulate(CACHE_AWARE_EXACT, 2, specs, "cpu-tiny", shape)
    blind = cache_bound_sim.simulate("power of two", 2, specs, "cpu-tiny", shape)
    assert exact["summary"]["ok"] == blind["summary"]["ok"] == len(specs)
    assert exact["cache"]["hit_rate"] > blind["cache"]["hit_rate"]


def test_router_kill_reads_haproxys_account_of_each_completion():
    """HAProxy's access lines as its syslog sent them in a router kill (2026-12-03): a
    502 with the server's abort before headers, a stream cut, a redispatched success; the
    health check and non-POST lines are not completions."""
    from blockserve.bench.router_kill import haproxy_account

    lines = [
        '<134>Dec  3 18:58:29 haproxy[17916]: 127.0.0.1:43128 [03/Dec/2026:18:58:29.174] '
        'http_frontend http-blockserve/SERVE_REPLICA_blockserve-Router-x5d1y4ye 0/0/0/-1/228'
        ' 502 112 - - SH-- 27/27/26/12/0 0/0 "POST /v1/completions HTTP/1.1"',
        '<134>Dec  3 18:42:41 haproxy[15277]: 127.0.0.1:48002 [03/Dec/2026:18:42:40.744] '
        'http_frontend http-blockserve/SERVE_REPLICA_blockserve-Router-r1fo1aze 0/0/0/49/349'
        ' 200 2385 - - SD-- 26/26/25/12/0 0/0 "POST /v1/completions HTTP/1.1"',
        '<134>Dec  3 19:20:02 haproxy[20001]: 127.0.0.1:50010 [03/Dec/2026:19:20:01.900] '
        'http_frontend http-blockserve/SERVE_REPLICA_blockserve-Router-eiojfgzh 0/0/0/88/228'
        ' 200 446 - - ---- 23/23/21/10/+1 0/0 "POST /v1/completions HTTP/1.1"',
        '<134>Dec  3 18:42:40 haproxy[15277]: 127.0.0.1:48030 [03/Dec/2026:18:42:40.836] '
        'http_frontend http-blockserve/SERVE_REPLICA_blockserve-Router-r1fo1aze 0/0/0/7/13 '
        '200 4669 - - ---- 25/25/24/12/0 0/0 "GET /admin/state HTTP/1.1"',
        '<129>Dec  3 18:42:41 haproxy[15277]: Server http-blockserve/SERVE_REPLICA_blockserve-'
        'Router-r1fo1aze is DOWN. 1 active and 1 backup servers left.',
    ]
    assert haproxy_account(lines) == {"502 SH--": 1, "200 SD--": 1, "200 ----": 1,
                                      "redispatched": 1}


def test_router_kill_totals_sum_the_kills_it_printed():
    """Two kills as bench.router_kill printed them (2026-12-03, before the retry fix): the
    totals are their sums, and a state seen in one kill only is still counted."""
    from blockserve.bench.router_kill import totals

    kills = [
        {"router": "a", "in_flight": 13, "requests": 36, "lost_before_a_response": 1,
         "started_and_cut": 11, "haproxy_log": {"200 ----": 24, "502 SH--": 1, "redispatched": 3}},
        {"router": "b", "in_flight": 9, "requests": 36, "lost_before_a_response": 0,
         "started_and_cut": 9, "haproxy_log": {"200 ----": 27, "200 SD--": 9}},
    ]
    assert totals(kills) == {
        "kills": 2, "requests": 72, "in_flight_at_kill": [13, 9], "lost_before_a_response": 1,
        "started_and_cut": 20,
        "haproxy_log": {"200 ----": 51, "502 SH--": 1, "redispatched": 3, "200 SD--": 9}}


def test_router_floor_times_the_same_echo_answer_from_uvicorn_alone():
    """`router_rate --floor`'s first front end: FastAPI under uvicorn alone answers the
    completion every echo answers, and is timed one request at a time."""
    import httpx

    from blockserve.bench import router_rate

    with router_rate.FRONT_ENDS["uvicorn alone"]() as url:
        answer = httpx.post(f"{url}/v1/completions", json={"model": "m", "max_tokens": 3}).json()
        events = httpx.post(f"{url}/v1/completions",
                            json={"model": "m", "max_tokens": 3, "stream": True}).text
        figures = router_rate.one_at_a_time(url, 0.5)
        streamed = router_rate.one_at_a_time(url, 0.5, stream=True)
    assert answer["choices"][0]["text"] == " x" * 3 and answer["usage"]["completion_tokens"] == 3
    data = [line.removeprefix("data: ") for line in events.split("\n\n") if line]
    assert data[-1] == "[DONE]" and len(data) == 3 + 2
    assert "".join(json.loads(d)["choices"][0]["text"] for d in data[:3]) == " x" * 3
    assert json.loads(data[3])["usage"] == answer["usage"]
    for timed in (figures, streamed):
        assert timed["requests"] > 10 and 0 < timed["latency_p50_ms"] <= timed["latency_p99_ms"]


def test_board_call_times_one_round_trip_to_the_board_per_call():
    """bench/board_call.py's caller makes as many board reads as asked, one after another,
    through a handle (here the real RouterBoard in process) and times each."""
    import asyncio

    from blockserve.bench.board_call import Caller
    from blockserve.router.board import RouterBoard
    from router_parts import InProcess

    board = RouterBoard()
    reads = []
    read = board.read

    async def counted(fresh_s):
        reads.append(fresh_s)
        return await read(fresh_s)

    board.read = counted
    seconds = asyncio.run(Caller.func_or_class(InProcess(board))(3))
    assert len(seconds) == len(reads) == 3 and all(s >= 0 for s in seconds)
