"""More than one router (issue 28), as pure code: each router has its own queue and
ledger, reads every replica's snapshots and keeps only its own reservations."""

import asyncio

from blockserve.protocol.queue_orders import FirstComeFirstServed
from blockserve.protocol.snapshot import BlockSnapshot
from blockserve.router.admission import AdmissionQueue, AdmissionSequence
from blockserve.router.demand import Demand
from blockserve.router.ledger import Ledger
from blockserve.router.placement import MostFreeBlocks
from router_parts import InProcess


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def router(clock: Clock) -> AdmissionQueue:
    ledger = Ledger(clock=clock)
    ledger.report("a", BlockSnapshot(timestamp=clock.now, total_blocks=100, block_size=1,
                                     free_blocks=100, max_model_len=10_000))
    return AdmissionQueue(ledger, MostFreeBlocks(), FirstComeFirstServed(), max_requests=10,
                          max_tokens=10_000, timeout_s=5.0, clock=clock)


def demand(blocks: int) -> Demand:
    return Demand(prompt_tokens=blocks, expected_output=0, sequences=1, block_size=1)


def test_admission_numbers_are_time_ordered_across_routers_and_restarts():
    clock = Clock(1000.0)
    first, second = AdmissionSequence(clock), AdmissionSequence(clock)
    a1 = first.next()
    assert first.next() > a1  # strictly increasing within a router, even in one tick
    clock.now += 0.001
    b1 = second.next()  # a router that has admitted less numbers later admissions higher
    assert b1 > a1
    clock.now += 1.0  # a router's restart takes seconds
    restarted = AdmissionSequence(clock)
    assert restarted.next() > b1  # it does not count again from 1


def test_a_replica_that_received_another_routers_earlier_admission_reflects_none_of_mine():
    async def scenario():
        clock = Clock(1000.0)
        one, two = router(clock), router(clock)
        for _ in range(5):  # the first router admits more: a per-router count would be ahead
            await one.admit(demand(1))
        received = one.ledger.replicas["a"].reservations
        last_seen = max(r.seq for r in received.values())
        clock.now += 0.01
        mine = await two.admit(demand(30))
        clock.now += 0.01
        # The replica has the first router's five, not the second router's request yet.
        two.ledger.report("a", BlockSnapshot(timestamp=clock.now, total_blocks=100,
                                             block_size=1, free_blocks=95, held_blocks=5,
                                             last_admission_seq=last_seen,
                                             max_model_len=10_000))
        entry = two.ledger.replicas["a"]
        assert mine.reservation.request_id in entry.unreflected
        assert entry.blocks.available == 100 - 5 - 30
        # ... and only its own reservations: the other router's are in the snapshot.
        assert entry.reserved_blocks == 30

    asyncio.run(scenario())


def test_simulated_routers_each_take_their_share_and_hear_every_replica(model_dir):
    import dataclasses

    from blockserve.bench.simulated_cluster import SimulatedCluster
    from blockserve.bench.step_time import PRESETS
    from blockserve.bench.workloads import pressure
    from blockserve.tools.launch import EngineShape

    specs = pressure(n=48, seed=2)
    cluster = SimulatedCluster(3, dataclasses.replace(EngineShape.of(), model=model_dir),
                               placement="best_fit", queue_order="fcfs", scheduler={},
                               step_time=PRESETS["cpu-tiny"], routers=2)
    flights = asyncio.run(cluster.run(specs))
    assert all(f.status == 200 and f.tokens == f.spec.output_tokens for f in flights)
    assert cluster.leftover() == (0, 0)
    first, second = cluster.routers
    assert [f.router for f in flights] == [first, second] * 24  # as HAProxy spreads them
    assert second.snapshot_delay_s > first.snapshot_delay_s
    final = {r: replica.scheduler.snapshot for r, replica in cluster.replicas.items()}
    assert any(snapshot.step > 0 for snapshot in final.values())
    for router in cluster.routers:  # every router heard every replica's last snapshot
        assert {r: e.snapshot for r, e in router.ledger.replicas.items()} == final


def test_behind_several_routers_the_reservation_gate_preempts_less_than_vllms(model_dir):
    """Four routers blind to each other over-grant two replicas; only the replica sees
    every grant, so its gate is where the preemptions are stopped (docs/routers.md)."""
    from types import SimpleNamespace

    from blockserve.bench import routers_sim
    from blockserve.bench.variants import parse_entry
    from blockserve.bench.workloads import pressure

    slo = SimpleNamespace(slo_ttft=2.0, slo_itl=0.1)
    figures = {gate: routers_sim.run(4, 2, pressure(n=80, seed=1), "cpu-tiny-deployed", slo,
                                     parse_entry(f"scheduler.admission_gate={gate}",
                                                 {"blockserve"}))
               for gate in ("vllm", "reservation")}
    for gate, run in figures.items():
        assert run["ok"] == 80, gate
        assert sum(step["preempted"] for step in run["preempting_steps"]) == run["preemptions"]
    assert figures["vllm"]["preemptions"] > 0
    assert figures["reservation"]["preemptions"] < figures["vllm"]["preemptions"]


def test_a_switch_reaches_every_router_and_survives_a_board_restart():
    from blockserve.router.board import RouterBoard
    from blockserve.router.peers import Peers

    async def scenario():
        handle = InProcess(RouterBoard())
        applied = {"a": [], "b": []}
        peers = {name: Peers(handle, name, 0.01, applied[name].append, lambda: {},
                             long_poll_s=0.02)
                 for name in applied}
        tasks = [t for p in peers.values() for t in p.start(asyncio.get_running_loop())]
        await peers["a"].switch({"placement": "best_fit"})
        await asyncio.sleep(0.05)
        assert applied == {"a": [], "b": [{"placement": "best_fit"}]}  # a applied its own
        assert peers["b"].version == peers["a"].version == 1
        handle.instance = RouterBoard()  # Serve restarted the board: it forgot the switch
        await asyncio.sleep(0.1)  # a long poll later
        assert (handle.instance.version, handle.instance.policies) == (1, {"placement":
                                                                           "best_fit"})
        await peers["b"].switch({"placement": "round_robin"})
        await asyncio.sleep(0.05)
        assert applied["a"] == [{"placement": "round_robin"}]
        assert peers["a"].version == peers["b"].version == 2
        for task in tasks:
            task.cancel()

    asyncio.run(scenario())


def test_a_router_that_stops_posting_leaves_the_others_lists_even_with_the_board_gone():
    from blockserve.router.board import RouterBoard
    from blockserve.router.peers import Peers

    class Unreachable:  # the board's node was lost: every call fails
        def __getattr__(self, name):
            raise ConnectionError("board unreachable")

    async def scenario():
        handle = InProcess(RouterBoard())
        a = Peers(handle, "a", 0.01, lambda _: None, lambda: {"router": "a"})
        b = Peers(handle, "b", 0.01, lambda _: None, lambda: {"router": "b"})
        tasks = [*a.start(asyncio.get_running_loop()), *b.start(asyncio.get_running_loop())]
        await asyncio.sleep(0.05)
        assert list(a.others) == ["b"]
        for task in tasks[2:]:
            task.cancel()  # b dies ...
        a.board = Unreachable()  # ... and a can no longer read the board either
        await asyncio.sleep(0.05)  # past the 3 intervals a report stays fresh
        assert a.others == {}
        for task in tasks[:2]:
            task.cancel()

    asyncio.run(scenario())


def test_every_router_is_in_one_exposition_and_every_replica_once():
    from prometheus_client.parser import text_string_to_metric_families

    from blockserve.router.metrics import RouterMetrics

    clock = Clock(1000.0)
    first, second = router(clock), router(clock)
    metrics = {name: RouterMetrics("app", "MostFreeBlocks", queue, router=name)
               for name, queue in (("a", first), ("b", second))}
    metrics["a"].admitted("a", 0.1)
    metrics["b"].admitted("a", 0.2)
    metrics["b"].admitted("a", 0.3)
    text = metrics["a"].exposition([metrics["b"].own()]).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert text.count("# TYPE blockserve_decisions_total counter") == 1
    decisions = {s.labels["router"]: s.value for s in families["blockserve_decisions"].samples
                 if s.name == "blockserve_decisions_total"}
    assert decisions == {"a": 1, "b": 2}
    reserved = [s.labels["router"] for s in families["blockserve_ledger_reserved_blocks"].samples]
    assert sorted(reserved) == ["a", "b"]
    capacity = families["blockserve_replica_kv_blocks_capacity"].samples
    assert [s.labels for s in capacity] == [{"app": "app", "replica": "a"}]  # once, no router


def test_a_length_finished_at_one_router_trains_every_routers_predictor_once():
    from blockserve.router.board import RouterBoard
    from blockserve.router.peers import Peers
    from blockserve.router.predictors import OnlineQuantilePredictor
    from blockserve.router.shared_lengths import SharedLengths

    def predictor() -> OnlineQuantilePredictor:
        return OnlineQuantilePredictor(quantile=0.5, prior_tokens=7, min_samples=2, window=8)

    async def scenario():
        handle = InProcess(RouterBoard())
        lengths = {name: SharedLengths(predictor(), posted=4) for name in "ab"}
        peers = {name: Peers(handle, name, 0.01, lambda _: None,
                             lambda name=name: {"finished_lengths": lengths[name].posted()},
                             on_read=lambda others, name=name: lengths[name].hear(
                                 {r: report["finished_lengths"]
                                  for r, report in others.items()}))
                 for name in "ab"}
        tasks = [t for p in peers.values() for t in p.start(asyncio.get_running_loop())]
        for _ in range(6):  # more than a posts: b hears the last 4 of them
            lengths["a"].learn(100, "t", 300)
        await asyncio.sleep(0.05)  # several exchanges: each length is learned once
        for task in tasks:
            task.cancel()
        return lengths

    lengths = asyncio.run(scenario())
    assert lengths["a"].heard == 0 and lengths["b"].heard == 4
    assert lengths["b"].predictor.predict(100, None, 1000, "t") == 300  # not the prior 7
    assert [n for n, *_ in lengths["a"].posted()] == [2, 3, 4, 5]


def test_routers_that_shared_every_grant_would_over_grant_as_one_router_does(model_dir):
    """The `shared_grants` oracle (one ledger for all routers): four routers then
    over-grant a replica by no more blocks than one router does, where four blind ones
    over-grant by more; one router is the same run with or without it."""
    from types import SimpleNamespace

    from blockserve.bench import routers_sim
    from blockserve.bench.variants import parse_entry
    from blockserve.bench.workloads import pressure

    slo = SimpleNamespace(slo_ttft=2.0, slo_itl=0.1)
    vllm_gate = parse_entry("scheduler.admission_gate=vllm", {"blockserve"})

    def run(routers, shared):
        return routers_sim.run(routers, 2, pressure(n=80, seed=1), "cpu-tiny-deployed", slo,
                               vllm_gate, shared_grants=shared)

    one, one_shared = run(1, False), run(1, True)
    assert {k: v for k, v in one.items() if k != "wall_s"} == \
        {k: v for k, v in one_shared.items() if k != "wall_s"}
    blind, shared = run(4, False), run(4, True)
    assert blind["ok"] == shared["ok"] == 80
    assert shared["over_grant_max_blocks"] <= one["over_grant_max_blocks"] \
        < blind["over_grant_max_blocks"]


def test_simulated_routers_learn_the_lengths_that_finished_at_the_others(model_dir):
    import dataclasses

    from blockserve.bench.simulated_cluster import SimulatedCluster
    from blockserve.bench.step_time import PRESETS
    from blockserve.bench.workloads import pressure
    from blockserve.tools.launch import EngineShape

    specs = pressure(n=48, seed=2)
    cluster = SimulatedCluster(3, dataclasses.replace(EngineShape.of(), model=model_dir),
                               placement="best_fit", queue_order="fcfs", scheduler={},
                               step_time=PRESETS["cpu-tiny"], routers=2)
    asyncio.run(cluster.run(specs))
    heard = [router.estimator.lengths.heard for router in cluster.routers]
    assert 0 < sum(heard) <= len(specs) and all(heard), heard
