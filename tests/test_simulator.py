"""The simulator's fidelity: the engine-less replica schedules exactly like the real engine,
and the simulated cluster runs the production router code without leaking."""

import asyncio
import dataclasses
import json
import random
from types import SimpleNamespace

import pytest

from blockserve.bench.client import replay
from blockserve.bench.harness import summarise
from blockserve.bench.simulated_cluster import SimulatedCluster, records_of
from blockserve.bench.simulator import simulate
from blockserve.bench.step_costs import StepCosts
from blockserve.bench.step_time import PRESETS, StepBatch
from blockserve.bench.workloads import pressure
from blockserve.replica.scheduler import BlockAwareScheduler
from blockserve.tools.engine_less import EngineLessReplica
from blockserve.tools.launch import EngineShape, load_config

ENGINE = dict(block_size=32, max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=2048)


def shape(model_dir: str) -> EngineShape:
    """deploy/deploy.yaml's engine, on the tests' model."""
    return dataclasses.replace(EngineShape.of(), model=model_dir)


def workload(seed=0, n=24):
    rng = random.Random(seed)
    return [([rng.randrange(10, 4000) for _ in range(rng.randint(40, 300))],
             rng.randint(8, 80)) for _ in range(n)]


def engine_less_trace(model_dir, requests, scheduler):
    replica = EngineLessReplica(model_dir, BlockAwareScheduler, num_blocks=65,
                                scheduler=scheduler, **ENGINE)
    for i, (prompt, max_tokens) in enumerate(requests):
        replica.add(str(i), prompt, max_tokens)
    return [(r.scheduled, r.preempted) for r in replica.run_until_idle()]


def real_engine_trace(model_dir, requests, scheduler):
    """vLLM's offline engine in this process (the caller sets
    VLLM_ENABLE_V1_MULTIPROCESSING=0 for the test only), our scheduler recording each step."""
    from vllm import LLM, SamplingParams

    from blockserve.protocol.config import ADDITIONAL_CONFIG_KEY, SCHEDULER_CLS

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, num_gpu_blocks_override=65,
              kv_cache_memory_bytes=16 * 1024 * 1024, scheduler_cls=SCHEDULER_CLS,
              additional_config={ADDITIONAL_CONFIG_KEY: scheduler}, seed=0,
              enable_prefix_caching=True, **{k: v for k, v in ENGINE.items()})
    core = llm.llm_engine.engine_core.engine_core
    trace, original = [], core.scheduler.schedule

    def recording_schedule(*args, **kwargs):
        output = original(*args, **kwargs)
        if output.total_num_scheduled_tokens:
            trace.append((dict(output.num_scheduled_tokens), sorted(output.preempted_req_ids)))
        return output

    core.scheduler.schedule = recording_schedule
    prompts = [{"prompt_token_ids": prompt} for prompt, _ in requests]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in requests]
    llm.generate(prompts, params, use_tqdm=False)
    ids = {}  # the engine's request ids in order of arrival -> "0", "1", ...

    def rename(request_id):
        return ids.setdefault(request_id, str(len(ids)))

    for scheduled, _ in trace:  # first appearance order is arrival order under FCFS
        for request_id in scheduled:
            rename(request_id)
    trace = [({rename(r): n for r, n in scheduled.items()}, sorted(rename(r) for r in pre))
             for scheduled, pre in trace]
    del llm
    return trace


# vLLM's queue order and step sizes: the defaults (on-time-first, tpot_pace) read the wall
# clock, and the real engine here runs far slower than the engine-less one (slower still
# on a busy machine), so their steps may differ by timing alone.
UNTIMED = {"queue_order": "fcfs", "step_tokens": "vllm"}


@pytest.mark.parametrize("scheduler", [UNTIMED, {**UNTIMED, "admission_gate": "reservation"}],
                         ids=["vllm-default", "reservation-gate"])
def test_engine_less_replica_schedules_exactly_like_the_real_engine(model_dir, scheduler,
                                                                    monkeypatch):
    # The engine core in this process, for this test only: a later `serve run` inherits
    # os.environ and must start its engines as deploy.yaml does, in their own processes.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    requests = workload()
    simulated = engine_less_trace(model_dir, requests, scheduler)
    real = real_engine_trace(model_dir, requests, scheduler)
    # memory pressure is real: vLLM's gate preempts (the reservation gate admits by peaks)
    assert any(pre for _, pre in simulated) or "admission_gate" in scheduler
    assert simulated == real


def test_the_engine_less_replica_keeps_vllms_watermark_free(model_dir):
    """deploy.yaml's `watermark` reaches the simulated engine: with half the pool kept
    free of admissions, fewer of the same prompts start in the first step."""
    requests = [([7] * 256, 16) for _ in range(8)]  # 8 blocks each, 64 usable blocks

    def started(watermark):
        replica = EngineLessReplica(model_dir, BlockAwareScheduler, num_blocks=65,
                                    watermark=watermark, **ENGINE)
        for i, (prompt, max_tokens) in enumerate(requests):
            replica.add(str(i), [i] + prompt[1:], max_tokens)
        return len(replica.step().scheduled)

    assert started(0.0) == 8 and started(0.5) < 8
    engine_args = load_config()["applications"][0]["args"]["replica"]["engine_args"]
    assert EngineShape.of().watermark == engine_args.get("watermark", 0.0)


def test_an_engine_override_turns_vllms_prefix_caching_off(model_dir):
    """`engine.enable_prefix_caching=false` (a published run with caching off) reaches the
    simulated engine: the same prompt sent twice is computed twice."""
    from blockserve.bench.simulator import SIM_CONFIGS, resolve
    from blockserve.bench.variants import parse_entry

    def second_prompt_computed(entry):
        _, _, shape = resolve(parse_entry(entry, SIM_CONFIGS), EngineShape.of())
        replica = EngineLessReplica(model_dir, BlockAwareScheduler,
                                    **shape.engine_less_kwargs())
        prompt = [7] * 256
        replica.add("first", prompt, 4)
        replica.run_until_idle()
        replica.add("second", prompt, 4)
        return replica.step().scheduled["second"]

    assert second_prompt_computed("round robin") < 256  # vLLM's default: the prefix hits
    assert second_prompt_computed("round robin + engine.enable_prefix_caching=false") == 256


def test_simulated_cluster_drains_without_leaks(model_dir):
    specs = pressure(n=64, seed=1)
    cluster = SimulatedCluster(3, shape(model_dir), placement="best_fit",
                               queue_order="fcfs",
                               scheduler={"admission_gate": "reservation"},
                               step_time=PRESETS["cpu-tiny"])
    flights = asyncio.run(cluster.run(specs))
    records = records_of(flights)
    assert all(r.status == 200 and r.output_tokens == s.output_tokens
               for r, s in zip(records, specs))
    assert cluster.leftover() == (0, 0)
    assert sum(r.scheduler.preemptions_total for r in cluster.replicas.values()) == 0
    assert all(r.scheduler.snapshot.held_blocks == 0 for r in cluster.replicas.values())


def test_a_simulation_is_reproducible_random_placements_included(model_dir):
    """The contest compares single runs, so the same run must give the same figures:
    power of two's draws come from the cluster's seeded generator."""
    def run():
        cluster = SimulatedCluster(4, shape(model_dir), placement="power_of_two",
                                   queue_order="fcfs", scheduler={},
                                   step_time=PRESETS["cpu-tiny"])
        records = records_of(asyncio.run(cluster.run(pressure(n=48, seed=3))))
        placed = [r.scheduler.requests_added_total for r in cluster.replicas.values()]
        return placed, [(r.ttft_s, r.e2e_s) for r in records]
    first = run()
    assert sorted(first[0]) != [0, 0, 0, 48] and first == run()


def test_the_first_token_acknowledges_the_reservation_and_trains_the_placement(model_dir):
    """As router/relay.py: a request's first token takes its prompt out of the replica's
    queued prefill (its reservation is acknowledged), and the placement hears each
    request's TTFT and, past one token, its TPOT."""
    specs = pressure(n=16, seed=2)
    cluster = SimulatedCluster(2, shape(model_dir), placement="predicted_latency",
                               queue_order="fcfs", scheduler={},
                               step_time=PRESETS["cpu-tiny"])
    flights = asyncio.run(cluster.run(specs))
    # Only a first token acknowledges (a release does not), and before the release.
    assert all(f.lease.reservation.acknowledged for f in flights)
    assert all(ledger.prefill_blocks == 0
               for ledger in cluster.routers[0].ledger.replicas.values())
    placement = cluster.routers[0].queue.placement
    assert placement.ttft.samples == len(specs)
    assert placement.tpot.samples == sum(f.tokens > 1 for f in flights) > 0
    assert cluster.leftover() == (0, 0)


def test_a_cluster_that_learned_earlier_requests_predicts_from_them(model_dir):
    """`learn`: as on a deployment that replayed another workload before (the harness
    replays a seed's workloads on one deployment), every router's predictor starts from
    those requests' output lengths, not from its prior."""
    cluster = SimulatedCluster(2, shape(model_dir), placement="cache_aware",
                               queue_order="fcfs", scheduler={},
                               output_predictor={"cls": "online_quantile",
                                                 "kwargs": {"prior_tokens": 128}},
                               step_time=PRESETS["cpu-tiny"], routers=2)
    earlier = [dataclasses.replace(spec, output_tokens=300) for spec in pressure(n=16, seed=1)]
    cluster.learn(earlier)
    for router in cluster.routers:
        assert router.estimator.predictor.predict(len(earlier[0].prompt), None, 900) == 300


def test_step_costs_charge_a_recompute_less_what_still_hits():
    costs, prompt = StepCosts(), {"a": 100, "b": 40}.__getitem__
    assert costs.batch({"a": 64, "b": 8}, {"a": 0, "b": 32}, prompt) == StepBatch(
        ((64, 0), (8, 32)))  # b's first 32 tokens were a prefix hit: not computed
    assert costs.batch({"a": 36, "b": 1}, {"a": 64, "b": 40}, prompt) == StepBatch(
        ((36, 64),), (41,))  # a's last chunk; b decodes
    costs.batch({"a": 1}, {"a": 100}, prompt)  # a decodes: computed up to 101
    # a preempted; back with 32 tokens still cached: 32..101 again, then one new token
    assert costs.batch({"a": 70}, {"a": 32}, prompt) == StepBatch(((70, 32),))
    assert costs.recomputed_tokens == 101 - 32 - 0
    assert costs.computed_tokens == 64 + 8 + 36 + 1 + 1 + 70
    assert costs.recompute_tax == 69 / 180


def test_the_recompute_tax_counts_exactly_the_positions_computed_twice(model_dir):
    """One replica behind a memory-blind router, a burst its cache cannot hold, prompts
    sharing nothing: every token computed that is not recomputed is one of each request's
    positions, computed once."""
    specs = pressure(n=48, seed=3)
    cluster = SimulatedCluster(1, shape(model_dir), placement="round_robin", queue_order="fcfs",
                               scheduler={}, step_time=PRESETS["cpu-tiny"])
    flights = asyncio.run(cluster.run(specs))
    figures = cluster.figures(flights, 2.0, 0.1)
    assert figures["preemptions"] > 0 and figures["recomputed_tokens"] > 0
    assert figures["computed_tokens"] - figures["recomputed_tokens"] == sum(
        len(s.prompt) + s.output_tokens - 1 for s in specs)
    assert 0 < figures["recompute_tax"] < 1 and figures["ok"] == len(specs)
    assert figures["token_itl_p50_s"] <= figures["token_itl_p99_s"]
    assert figures["ttft_p50_s"] <= figures["ttft_p90_s"] <= figures["ttft_p99_s"]


def test_the_simulator_replays_a_trace_file_and_writes_one_entry_per_configuration(
        model_dir, tmp_path, monkeypatch):
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:17:{i // 10:02d}.{i % 10}000000,{200 + 37 * i % 500},{5 + i % 40}\n"
        for i in range(60)))
    out = tmp_path / "sim"
    monkeypatch.setattr("sys.argv", [
        "simulator", "--trace", str(trace), "--rate-scale", "4", "--max-requests", "50",
        "--replicas", "2", "--configs", "blockserve", "power of two",
        "--sweep", "engine.watermark=0,0.1", "--model-dir", model_dir, "--jobs", "1",
        "--out", str(out)])
    from blockserve.bench.simulator import main

    main()
    written = json.loads(out.with_suffix(".json").read_text())
    assert written["workload"]["requests"] == 50 and written["workload"]["rate_scale"] == 4
    assert list(written["results"]) == [
        f"{name}, engine.watermark={w} x2" for name in ("blockserve", "power of two")
        for w in (0, 0.1)]
    for run in written["results"].values():
        assert run["summary"]["ok"] == 50 and run["policies"]["block_eviction"]
        for key in ("preemptions", "prefix_hit_rate", "token_itl_p99_s", "ttft_p90_s",
                    "output_tokens_per_s", "goodput_rps", "recompute_tax", "shed"):
            assert run["summary"][key] is not None, key
    assert written["deploy_yaml"].endswith("deploy/deploy.yaml") and written["code_dir"]


def test_simulated_queue_timeout_answers_429_in_virtual_time(model_dir):
    """The router's queue timeout runs on the simulation's clock (AdmissionQueue.expire):
    a burst one replica cannot serve in time gets 429s, each after the timeout, and
    nothing they reserved or queued is left behind."""
    timeout_s = 0.5
    specs = pressure(n=64, seed=1)
    cluster = SimulatedCluster(1, shape(model_dir), placement="best_fit",
                               queue_order="fcfs",
                               scheduler={}, step_time=PRESETS["cpu-tiny"],
                               queue_timeout_s=timeout_s)
    flights = asyncio.run(cluster.run(specs))
    expired = [f for f in flights if f.status == 429]
    served = [f for f in flights if f.status == 200]
    assert expired and served and len(expired) + len(served) == len(specs)
    assert all(f.finished - f.arrival >= timeout_s and f.lease is None for f in expired)
    assert all(f.tokens == f.spec.output_tokens for f in served)
    assert cluster.leftover() == (0, 0)


# One check of the simulation against a real run of the same burst, and one measurement.
# Time scale: the machine's speed is measured first, by a calibration burst (another
# seed) run for real and simulated with the `cpu-tiny-deployed` preset; then, with the
# preset scaled by that ratio, the simulated / real makespan of the checked burst must
# fall within MAKESPAN_BAND (throughput is tokens / makespan, the same check again, so it
# is only printed). So the check is that one calibration carries over to a new burst on
# the same machine, not the preset's absolute speed: CI's machine ran the burst in
# 11.2 s where the preset, fitted here, simulated 5.7 s (0.50x, a failure of the old,
# uncalibrated band). The band allows this shared machine's run-to-run spread (real
# throughput of one burst moved 1,250-1,525 tok/s between runs). Order: the rank
# correlation of each request's finish time in the real run and in that calibrated
# simulation. Arrivals keep their wall-clock times, so a machine that runs faster or
# slower interleaves the burst differently. The order is printed, not checked: it also
# follows the output predictor that the shared deployment's router learned from the
# tests before this one (the simulated router starts without), and a clean-clone run on
# a slower machine (2026-12-02 17:40) gave 0.68 at that run's own speed (0.98x) where
# another had given 0.99; it is a measurement of the simulator, not a property a test
# can hold on every machine. ITL and TTFT are printed, not checked: ITL p50 moved
# 5.4-9.8 ms between real runs, and the simulation has no front-end CPU (HTTP, router,
# replica actors), which TTFT includes.
MAKESPAN_BAND = (0.6, 1.6)


def rank_correlation(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho (no ties among finish times measured in seconds)."""
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        rank = [0] * len(values)
        for position, index in enumerate(order):
            rank[index] = position
        return rank

    n, rx, ry = len(xs), ranks(xs), ranks(ys)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def test_rank_correlation():
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == 1
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == -1


@pytest.mark.deployment
def test_a_small_real_run_and_its_simulation_agree(deployment, model_dir):
    """Cluster level: seeded bursts, one to measure the machine's speed and one to check,
    on the real deployment (deploy/deploy.yaml) and on two simulated replicas of the same
    configuration (the simulator reads deploy.yaml's policies). The simulation has no HTTP
    or Ray; its step-time preset stands in for their CPU use. Preemptions are printed, not
    compared: they follow the output predictor's history, which the shared deployment's
    router learned from the tests before this one and the simulated router starts
    without."""
    model = load_config()["applications"][0]["args"]["replica"]["served_model_name"]

    def real_run(specs) -> tuple[dict, list]:
        preempted = deployment.metric_sum("blockserve_replica_preemptions_total")
        records, makespan = asyncio.run(replay(specs, [deployment.base_url],
                                               deployment.api_key, model))
        preemptions = deployment.metric_sum("blockserve_replica_preemptions_total") - preempted
        return summarise(records, makespan, preemptions, 2.0, 0.1), records

    def simulated_run(specs, speed: float) -> dict:
        return simulate("blockserve", 2, specs, SimpleNamespace(
            preset=PRESETS["cpu-tiny-deployed"].scaled(speed), slo_ttft=2.0, slo_itl=0.1,
            length_mode="known"), shape(model_dir))

    calibration = pressure(n=48, seed=3)
    machine = (real_run(calibration)[0]["makespan_s"]
               / simulated_run(calibration, 1.0)["summary"]["makespan_s"])
    specs = pressure(n=48, seed=2)
    real, records = real_run(specs)
    run = simulated_run(specs, machine)
    simulated = run["summary"]

    def finish_times(rows):
        by_index = {row["index"]: row["e2e_s"] for row in rows}
        return [spec.arrival_s + by_index[i] for i, spec in enumerate(specs)]

    correlation = rank_correlation(finish_times([r.to_dict() for r in records]),
                                   finish_times(run["records"]))
    print({key: (real[key], simulated[key]) for key in
           ["makespan_s", "output_tokens_per_s", "itl_p50_s", "ttft_p50_s", "preemptions"]},
          f"finish-order correlation {correlation:.2f}, this machine {machine:.2f}x the preset")
    assert real["ok"] == simulated["ok"] == len(specs)
    low, high = MAKESPAN_BAND
    assert low <= simulated["makespan_s"] / real["makespan_s"] <= high, (
        real["makespan_s"], simulated["makespan_s"])
