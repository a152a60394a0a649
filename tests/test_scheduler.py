"""The block-aware scheduler on vLLM's REAL scheduler, KV cache manager and block pool.

No model runs: tools/engine_less.py fabricates one sampled token per scheduled request,
so block allocation, prefix caching and preemption are vLLM's own.
"""

import random

import pytest

from blockserve.protocol.hints import Hints
from blockserve.protocol.policies import AdmissionGate, PreemptionOrder, RequestView
from blockserve.replica.scheduler import BlockAwareScheduler
from blockserve.tools.engine_less import EngineLessReplica
from scheduler_runs import pipelined_run

PRESSURE = dict(num_blocks=65, block_size=32)  # 64 usable blocks


def pressure_workload(replica, n=32, prompt=200, output=64, seed=0):
    rng = random.Random(seed)
    for i in range(n):
        replica.add(f"r{i}", [rng.randrange(1, 4000) for _ in range(prompt)], output)


def test_block_accounting_is_exact(model_dir):
    replica = EngineLessReplica(model_dir, BlockAwareScheduler, **PRESSURE)
    pressure_workload(replica, n=12)
    sched, seen_busy = replica.scheduler, False
    while sched.has_unfinished_requests():
        replica.step()
        snap, pool = sched.snapshot, sched.kv_cache_manager.block_pool
        assert snap.total_blocks == 64
        assert snap.free_blocks == pool.get_num_free_blocks()
        assert snap.held_blocks + snap.free_blocks == snap.total_blocks
        assert snap.held_blocks / snap.total_blocks == pytest.approx(sched.get_kv_cache_usage())
        assert snap.held_blocks == len({b.block_id for r in sched.running
                                        for b in replica.scheduler.kv_cache_manager
                                        .coordinator.get_blocks(r.request_id)[0]})
        assert snap.running == len(sched.running) and snap.waiting == len(sched.waiting)
        seen_busy |= snap.held_blocks > 0
    assert seen_busy
    snap = sched.snapshot
    assert snap.held_blocks == 0 and snap.growth_blocks == 0 and snap.requests_added_total == 12
    assert snap.cached_blocks > 0  # finished prompts stay cached, evictable


def test_reservation_gate_prevents_preemption_where_vllm_preempts(model_dir):
    def preemptions(scheduler):
        replica = EngineLessReplica(model_dir, BlockAwareScheduler, **PRESSURE,
                                    scheduler=scheduler)
        pressure_workload(replica)
        records = replica.run_until_idle()
        assert all(r.num_output_tokens == 64 for r in replica.requests.values())
        return sum(len(r.preempted) for r in records), replica.scheduler.snapshot

    default, _ = preemptions({})
    gated, snap = preemptions({"admission_gate": "reservation"})
    assert default > 0
    assert gated == 0 and snap.preemptions_total == 0


def test_reservation_gate_admits_what_fits_at_the_peak_not_the_sum(model_dir):
    replica = EngineLessReplica(model_dir, BlockAwareScheduler, **PRESSURE,
                                scheduler={"admission_gate": "reservation"})
    for i in range(5):  # 10 prompt blocks each, done after 8 tokens: 11 blocks at the end
        replica.add(f"short{i}", [100 + i] * 320, 8)
    replica.add("long", [7] * 32, 600)  # grows to 20 blocks, long after the others end
    # Whole reservations add up to 75 blocks of 64; at most 57 are ever held at once.
    first = replica.step()
    assert len(first.scheduled) == 6
    records = replica.run_until_idle()
    assert not any(r.preempted for r in records)
    assert all(r.num_output_tokens == r.max_tokens for r in replica.requests.values())


def test_reservation_gate_uses_the_router_hint(model_dir):
    replica = EngineLessReplica(model_dir, BlockAwareScheduler, **PRESSURE,
                                scheduler={"admission_gate": "reservation"})
    # 8 tokens of output each, but the router reserved 40 blocks for each: together
    # they would peak at 80 of 64.
    replica.add("a", list(range(1, 65)), 8, hints=Hints(demand_blocks=40))
    replica.add("b", list(range(100, 164)), 8, hints=Hints(demand_blocks=40))
    replica.step()
    assert [r.request_id for r in replica.scheduler.running] == ["a"]
    assert replica.scheduler.snapshot.growth_blocks == 40 - 2  # 2 prompt blocks held
    assert replica.scheduler.snapshot.waiting_blocks == 40
    replica.run_until_idle()


def test_shortest_demand_first_admits_small_requests_first(model_dir):
    replica = EngineLessReplica(
        model_dir, BlockAwareScheduler, **PRESSURE, max_num_seqs=1,
        scheduler={"queue_order": "shortest_demand"})
    for i, output in enumerate([300, 20, 100]):
        replica.add(f"r{i}", [7] * 32, output)
    finished = [f for record in replica.run_until_idle() for f in record.finished]
    assert finished == ["r1", "r2", "r0"]


def test_router_order_follows_admission_sequence_hint(model_dir):
    replica = EngineLessReplica(model_dir, BlockAwareScheduler, **PRESSURE, max_num_seqs=1,
                                scheduler={"queue_order": "router_order"})
    for request_id, seq in (("a", 3), ("b", 1), ("c", 2)):
        replica.add(request_id, [5] * 40, 4, hints=Hints(admission_seq=seq))
    finished = [f for record in replica.run_until_idle() for f in record.finished]
    assert finished == ["b", "c", "a"]


def test_cheapest_recompute_preempts_the_least_computed_request(model_dir):
    replica = EngineLessReplica(model_dir, BlockAwareScheduler, num_blocks=9, block_size=32,
                                scheduler={"preemption": "cheapest_recompute"})
    replica.add("long", [3] * 150, 60)  # 5 prompt blocks
    replica.step()
    replica.add("short", [4] * 40, 60)  # 2 prompt blocks
    victims = [v for record in replica.run_until_idle() for v in record.preempted]
    # vLLM's default would preempt "short" too (last admitted) - so also check the order
    # is by computed tokens: the long request is never the victim.
    assert victims and "long" not in victims


def test_cheapest_recompute_differs_from_vllm_default(model_dir):
    def first_victim(scheduler):
        replica = EngineLessReplica(model_dir, BlockAwareScheduler, num_blocks=9, block_size=32,
                                    scheduler=scheduler)
        replica.add("early_short", [3] * 30, 100)
        replica.step()
        replica.add("late_long", [4] * 150, 100)
        for record in replica.run_until_idle():
            if record.preempted:
                return record.preempted[0]

    assert first_victim({}) == "late_long"  # vLLM: the most recently admitted
    assert first_victim({"preemption": "cheapest_recompute"}) == "early_short"


def test_async_block_aware_scheduler_keeps_the_gate_under_async_scheduling(model_dir):
    """The GPU variant (AsyncScheduler base, deploy-gpu.yaml) on vLLM's real async
    scheduler: with outputs a step behind, every running request still decodes each step
    (a synchronous Scheduler would alternate, about twice the steps), the gate still
    prevents preemption, and every request ends with all its tokens."""
    from blockserve.replica.scheduler import AsyncBlockAwareScheduler

    gate = {"admission_gate": "reservation"}
    steps = {}
    for name, cls, pipelined in (("sync", BlockAwareScheduler, False),
                                 ("async", AsyncBlockAwareScheduler, True)):
        replica = EngineLessReplica(model_dir, cls, **PRESSURE, scheduler=gate)
        pressure_workload(replica)
        steps[name] = pipelined_run(replica) if pipelined else len(replica.run_until_idle())
        assert all(r.num_output_tokens == 64 for r in replica.requests.values()), name
        snap = replica.scheduler.snapshot
        assert snap.preemptions_total == 0 and snap.held_blocks == 0, (name, snap)
        assert snap.requests_added_total == 32
    assert steps["async"] <= steps["sync"] * 1.1, steps


STOP_ID = 4000  # the unknown length mode: min_tokens masks it until the true length


def add_unknown_length(replica, request_id, prompt, true_output, cap, expected=None):
    """A request with a loose cap that still ends at `true_output` (bench/workloads.py)."""
    hints = Hints(expected_output=expected) if expected is not None else None
    return replica.add(request_id, prompt, cap, hints=hints, min_tokens=true_output - 1,
                       ignore_eos=False, stop_token_ids=[STOP_ID])


def stop_at_min_tokens(request):
    """The simulated model: the stop id once min_tokens no longer masks it."""
    return STOP_ID if request.num_output_tokens >= request.sampling_params.min_tokens \
        else 1 + request.num_output_tokens % 3999


def test_extended_lease_doubles_what_a_request_outgrew_up_to_its_cap():
    from blockserve.replica.trajectory import extended_lease

    assert extended_lease(300, 100, 250, 1000, 32) == 300  # within its lease
    assert extended_lease(300, 100, 300, 1000, 32) == 500  # outgrown: 200 more
    assert extended_lease(300, 290, 300, 1000, 32) == 332  # at least one block more
    assert extended_lease(300, 100, 900, 1000, 32) == 1000  # never past the cap
    assert extended_lease(300, 100, 1000, 1000, 32) == 1000


def test_a_lease_that_runs_out_is_extended_and_the_snapshot_counts_it(model_dir):
    replica = EngineLessReplica(model_dir, BlockAwareScheduler, **PRESSURE,
                                sample=stop_at_min_tokens,
                                scheduler={"admission_gate": "reservation"})
    add_unknown_length(replica, "a", [3] * 64, true_output=200, cap=900, expected=16)
    sched, request = replica.scheduler, replica.requests["a"]
    reserved = []
    while sched.has_unfinished_requests():
        replica.step()
        expected = sched.book.expected_tokens(request)
        assert expected >= min(request.num_tokens + 1, 64 + 900)  # never run out
        reserved.append((request.num_output_tokens, sched.snapshot.growth_blocks))
    assert request.num_output_tokens == 200  # ended at its true length, far below the cap
    # Within the lease (64 + 16 tokens: 3 blocks, held from the first decode on) nothing
    # more is reserved; after it, each extension is reserved ahead of the growth (output
    # 16 -> 32 -> 64 -> 128 -> 256 tokens).
    assert all(blocks == 0 for out, blocks in reserved if 2 <= out < 16)
    assert any(blocks >= 2 for out, blocks in reserved if 130 <= out < 190)
    assert sched.snapshot.growth_blocks == 0 and sched.snapshot.held_blocks == 0


def test_predicted_leases_admit_more_than_worst_case_leases_and_grow_without_preempting(
        model_dir):
    def run(expected):
        replica = EngineLessReplica(model_dir, BlockAwareScheduler, **PRESSURE,
                                    sample=stop_at_min_tokens, scheduler={
                                        "admission_gate": "reservation",
                                        "preemption": "cheapest_recompute"})
        for i in range(8):  # 4 prompt blocks each, 40 tokens out, cap: the whole context
            add_unknown_length(replica, f"r{i}", [10 + i] * 128, 40, 1024 - 128, expected)
        first = replica.step()
        records = [first] + replica.run_until_idle()
        assert all(r.num_output_tokens == 40 for r in replica.requests.values())
        return len(first.scheduled), sum(len(r.preempted) for r in records)

    worst_admitted, worst_preempted = run(expected=None)  # max_tokens: 28 blocks each
    predicted_admitted, predicted_preempted = run(expected=32)  # 5 blocks each
    assert worst_admitted == 2 and worst_preempted == 0
    assert predicted_admitted == 8 and predicted_preempted == 0


def test_reservation_gate_headroom_keeps_blocks_free_but_never_starves_the_head(model_dir):
    def admitted(headroom, prompt_blocks):
        replica = EngineLessReplica(model_dir, BlockAwareScheduler, **PRESSURE, scheduler={
            "admission_gate": {"cls": "reservation",
                               "kwargs": {"headroom": headroom}}})
        for i in range(4):  # each ends at prompt_blocks + 1 blocks
            replica.add(f"r{i}", [20 + i] * (32 * prompt_blocks), 8)
        return len(replica.step().scheduled)

    assert admitted(0.0, 15) == 4  # 64 of 64 blocks at the peak
    assert admitted(0.1, 15) == 3  # 58 blocks allowed: 48 fit, 64 do not
    assert admitted(0.5, 40) == 1  # larger than the limit, but nothing runs: admitted
    with pytest.raises(ValueError, match="headroom"):
        EngineLessReplica(model_dir, BlockAwareScheduler, **PRESSURE, scheduler={
            "admission_gate": {"cls": "reservation",
                               "kwargs": {"headroom": 1.5}}})


class AtMostTwoPerStep(AdmissionGate):
    """A user gate on protocol/policies.py alone: at most two requests start per step."""

    def __init__(self):
        self.asked = []  # (request, admitted before it), for the test to read

    def may_admit(self, request, admitted, pool):
        self.asked.append((request, tuple(admitted)))
        return len(admitted) < 2


class GoldLast(PreemptionOrder):
    """A user preemption order: tenant "gold" is preempted last."""

    def key(self, request, now):
        return 0 if request.tenant == "gold" else 1


def test_a_gate_is_asked_in_queue_order_and_a_refusal_holds_back_the_rest(model_dir):
    replica = EngineLessReplica(model_dir, BlockAwareScheduler, **PRESSURE, scheduler={
        "admission_gate": "tests.test_scheduler:AtMostTwoPerStep"})
    for i in range(6):
        replica.add(f"r{i}", [10 + i] * 40, 8, hints=Hints(tenant=f"t{i}", admission_seq=i))
    running = []
    for _ in range(3):
        replica.step()
        running.append(len(replica.scheduler.running))
    assert running == [2, 4, 6]  # vLLM alone starts all six in the first step
    first_step = replica.scheduler.admission_gate.asked[:3]
    assert [(r.request_id, [a.request_id for a in before]) for r, before in first_step] == [
        ("r0", []), ("r1", ["r0"]), ("r2", ["r0", "r1"])]  # asked until the first refusal
    view = first_step[0][0]
    assert isinstance(view, RequestView) and view.tenant == "t0" and view.seq == 0
    assert view.prompt_blocks == 2 and view.demand_blocks == 2 and view.computed_tokens == 0
    replica.run_until_idle()


def test_a_preemption_order_key_decides_the_victim(model_dir):
    def first_victim(preemption):
        replica = EngineLessReplica(model_dir, BlockAwareScheduler, num_blocks=9, block_size=32,
                                    scheduler={"preemption": preemption})
        replica.add("early", [3] * 30, 100)
        replica.step()
        replica.add("late_gold", [4] * 150, 100, hints=Hints(tenant="gold"))
        for record in replica.run_until_idle():
            if record.preempted:
                return record.preempted[0]

    assert first_victim("vllm") == "late_gold"  # vLLM: the most recently admitted
    assert first_victim("tests.test_scheduler:GoldLast") == "early"


def test_a_policy_on_the_old_duck_typed_shape_is_refused_naming_the_field():
    from blockserve.protocol.config import SchedulerConfig

    with pytest.raises(ValueError, match=r"(?s)admission_gate.*does not implement "
                                         r"blockserve\.protocol\.policies:AdmissionGate"):
        SchedulerConfig.model_validate({"admission_gate": "tests.test_scheduler:OldStyleGate"})


class OldStyleGate:
    """The shape before protocol/policies.py: a count of admissible requests."""

    def admit(self, waiting, book):
        return len(waiting)


def test_the_engine_core_imports_no_router_code():
    """What a replica's EngineCore loads - the scheduler and every replica-side built-in
    policy, built from its config - contains no module of the router."""
    import subprocess
    import sys

    code = """
import sys
from blockserve.protocol.config import SchedulerConfig
from blockserve.protocol.registry import KINDS
import blockserve.replica.scheduler
for field, kind in KINDS.items():
    if field.startswith("replica.scheduler."):
        for name in kind.names:
            SchedulerConfig.model_validate({field.rpartition(".")[2]: name}).model_dump()
print(sorted(m for m in sys.modules if m.startswith("blockserve.router")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("prefix_tokens", [0, 96])
def test_growth_is_the_same_whether_or_not_the_shared_blocks_are_counted(model_dir,
                                                                        prefix_tokens):
    """The snapshot skips counting shared blocks when none is shared; it must never skip
    one that is (a shared prefix of 3 blocks), nor change the growth it reports."""
    replica = EngineLessReplica(model_dir, BlockAwareScheduler, **PRESSURE)
    rng = random.Random(1)
    prefix = [rng.randrange(1, 4000) for _ in range(prefix_tokens)]
    for i in range(8):
        replica.add(f"r{i}", prefix + [rng.randrange(1, 4000) for _ in range(100)], 40)
    sched, book, seen_shared = replica.scheduler, replica.scheduler.book, False
    blocks = sched.kv_cache_manager.coordinator.get_blocks
    while sched.has_unfinished_requests():
        replica.step()
        shared = any(b.ref_cnt > 1 for r in sched.running for b in blocks(r.request_id)[0])
        assert book._any_shared(book.held_blocks()) == shared
        counted = type(book).peak_blocks(_CountingAlways(book))
        assert book.peak_blocks() == counted
        seen_shared |= shared
    assert seen_shared == bool(prefix_tokens)


class _CountingAlways:
    """A BlockBook that always counts shared blocks one by one (the reference)."""

    def __init__(self, book):
        self._book = book

    def __getattr__(self, name):
        return getattr(self._book, name)

    def _any_shared(self, held):
        return True
