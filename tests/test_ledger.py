"""The block ledger as pure code: reservations add up, reconcile and release exactly once."""

from blockserve.protocol.snapshot import BlockSnapshot
from blockserve.router.ledger import Ledger
from blockserve.router.prefix_cache import ApproximatePrefixIndex


class Clock:
    def __init__(self, now=100.0):
        self.now = now

    def __call__(self):
        return self.now


def snap(ts, held=0, growth=0, waiting_blocks=0, total=100, free=None, seq=0):
    free = total - held if free is None else free
    return BlockSnapshot(timestamp=ts, total_blocks=total, block_size=32, free_blocks=free,
                         held_blocks=held, growth_blocks=growth,
                         waiting_blocks=waiting_blocks, max_model_len=1024,
                         last_admission_seq=seq)


def test_a_responses_snapshot_does_not_bring_back_a_failed_replica_but_a_poll_does():
    ledger = Ledger(clock=Clock())
    ledger.report("a", snap(99.0))
    ledger.fail("a", dead=False)
    ledger.report("a", snap(99.5), joins=False)  # a chunk in flight when it failed
    assert "a" not in ledger.replicas
    ledger.report("a", snap(99.6))  # the poll: a transient failure comes back
    assert "a" in ledger.replicas
    ledger.report("a", snap(99.7, held=10), joins=False)  # and chunks refresh it again
    assert ledger.replicas["a"].snapshot.held_blocks == 10


def test_capacity_is_learned_from_the_first_report():
    ledger = Ledger(clock=Clock())
    ledger.report("a", snap(99.0, total=0))
    assert "a" not in ledger.replicas  # no capacity yet: not routable
    ledger.report("a", snap(99.0))
    assert ledger.replicas["a"].total_blocks == 100


def test_reservation_counts_until_reflected_then_snapshot_counts_it():
    clock = Clock(100.0)
    ledger = Ledger(reflect_after_s=0.5, clock=clock)
    ledger.report("a", snap(100.0))
    r = ledger.reserve("a", 30)
    assert ledger.replicas["a"].blocks.available == 70
    # A snapshot taken before the request could have arrived: still in flight.
    ledger.report("a", snap(100.2))
    assert ledger.replicas["a"].blocks.available == 70
    # The replica now reports it (held + growth); no double counting.
    clock.now = 101.0
    ledger.report("a", snap(101.0, held=10, growth=20))
    assert ledger.replicas["a"].blocks.available == 70
    assert ledger.replicas["a"].drift_blocks == 0
    assert ledger.release(r) is True
    assert ledger.release(r) is False  # exactly once
    assert ledger.reserved_blocks() == 0 and ledger.in_flight() == 0


def test_acknowledged_reservation_is_reflected_at_once():
    ledger = Ledger(reflect_after_s=10, clock=Clock())
    ledger.report("a", snap(100.0))
    r = ledger.reserve("a", 30)
    ledger.acknowledge(r)
    ledger.report("a", snap(100.1, held=30))
    assert ledger.replicas["a"].blocks.available == 70


def test_a_snapshot_that_reports_the_admission_sequence_reflects_the_reservation():
    clock = Clock(100.0)
    ledger = Ledger(reflect_after_s=10, clock=clock)
    ledger.report("a", snap(100.0))
    first = ledger.reserve("a", 30, seq=7)
    ledger.reserve("a", 20, seq=8)
    clock.now = 100.05
    # The replica has added request 7 (waiting for admission there), not yet 8.
    ledger.report("a", snap(100.05, waiting_blocks=30, seq=7))
    assert ledger.replicas["a"].blocks.available == 50  # 30 reported + 20 in flight
    ledger.release(first)
    # A snapshot taken before a dispatch cannot include it, whatever sequence it reports
    # (a restarted router numbers from 1 again).
    clock.now = 100.1
    late = ledger.reserve("a", 10, seq=5)
    ledger.report("a", snap(100.06, waiting_blocks=20, seq=8))
    assert late.request_id in ledger.replicas["a"].unreflected
    assert ledger.replicas["a"].blocks.available == 70


def test_drift_measures_prediction_error():
    clock = Clock(100.0)
    ledger = Ledger(reflect_after_s=0.0, clock=clock)
    ledger.report("a", snap(100.0))
    clock.now = 100.5
    ledger.reserve("a", 30)
    ledger.report("a", snap(101.0, held=10))  # the replica holds fewer than predicted
    assert ledger.replicas["a"].drift_blocks == 20


def test_out_of_order_reports_are_ignored():
    ledger = Ledger(clock=Clock())
    ledger.report("a", snap(101.0, held=50))
    ledger.report("a", snap(100.0, held=10))
    assert ledger.replicas["a"].snapshot.held_blocks == 50


def test_a_polls_counters_are_kept_even_when_traffic_overtook_its_snapshot():
    """Under steady traffic every poll's snapshot is older than the last streamed one;
    vLLM's counters come only with polls, so dropping them would freeze them."""
    clock = Clock(100.0)
    ledger = Ledger(clock=clock)
    ledger.report("a", snap(100.0), engine={"vllm_preemptions_total": 1})
    ledger.report("a", snap(102.0, held=50))  # streamed: no counters
    clock.now = 103.0
    ledger.report("a", snap(101.0, held=10), engine={"vllm_preemptions_total": 4})
    entry = ledger.replicas["a"]
    assert entry.snapshot.held_blocks == 50
    assert (entry.engine, entry.engine_read_at) == ({"vllm_preemptions_total": 4}, 103.0)


def test_stale_replicas_are_not_routable_and_dropped_ones_return_reservations():
    clock = Clock(100.0)
    ledger = Ledger(stale_after_s=5, clock=clock)
    ledger.report("a", snap(100.0))
    ledger.report("b", snap(100.0))
    clock.now = 104.0
    ledger.report("b", snap(104.0))
    clock.now = 106.0
    assert [r.replica_id for r in ledger.routable()] == ["b"]
    r = ledger.reserve("b", 5)
    assert ledger.drop("b") == [r]
    assert ledger.release(r) is True  # releasing after the replica left is safe
    assert ledger.reserved_blocks() == 0


def test_routable_is_kept_between_changes_and_follows_the_clock():
    """routable() keeps its answer per decision, yet a replica still leaves it when its
    report ages past the window, comes back when it reports, and leaves when suspect;
    a clock that steps back lets an aged one in again, as without the cache."""
    clock = Clock(100.0)
    ledger = Ledger(stale_after_s=5, clock=clock)
    ledger.report("a", snap(100.0))
    clock.now = 104.0
    ledger.report("b", snap(104.0))
    ids = lambda: [r.replica_id for r in ledger.routable()]
    assert ids() == ["a", "b"] and ledger.routable() is ledger.routable()
    clock.now = 103.0
    ledger.report("a", snap(100.5))  # an included replica's report keeps the answer
    clock.now = 106.0
    assert ids() == ["a", "b"]  # a's report at 103 is fresh
    clock.now = 108.5
    assert ids() == ["b"]
    clock.now = 103.0
    assert ids() == ["a", "b"]  # the clock stepped back
    clock.now = 108.5
    ledger.report("a", snap(108.5))
    assert ids() == ["a", "b"]
    clock.now = 110.0
    ledger.report("b", snap(110.0))
    ledger.reserve("b", 5)
    clock.now = 112.5
    assert ledger.find_suspects(suspect_after_s=2) and ids() == ["a"]
    ledger.report("b", snap(112.5))  # a new snapshot clears the suspicion
    assert ids() == ["a", "b"]


def test_prefix_index_credits_leading_blocks_and_is_bounded():
    owners = {}
    index = ApproximatePrefixIndex("a", capacity=3, owners=owners)
    index.on_dispatched([1, 2, 3])
    assert index.credit([1, 2, 9]) == 2
    assert index.credit([9, 1]) == 0
    index.on_dispatched([4])
    assert index.credit([1]) == 0  # least recently used went first
    assert owners == {2: {"a"}, 3: {"a"}, 4: {"a"}}
    index.on_removed()
    assert owners == {}


def test_candidates_carry_prefix_credit_only_where_the_prefix_went():
    ledger = Ledger(clock=Clock())
    for replica in ("a", "b"):
        ledger.report(replica, snap(100.0))
    ledger.reserve("a", 5, prefix_hashes=(11, 12))
    views = {c.replica_id: c for c in ledger.candidates((11, 12, 13))}
    assert views["a"].prefix_credit == 2 and views["b"].prefix_credit == 0
    assert views["a"].available_blocks == 95 and views["a"].ongoing == 1


def test_a_replica_unlisted_briefly_keeps_its_reservations():
    clock = Clock(100.0)
    ledger = Ledger(clock=clock)
    ledger.report("a", snap(100.0))
    r = ledger.reserve("a", 5)
    ledger.mark_missing("a")
    assert ledger.routable() == []  # no new work while unlisted
    clock.now = 101.0
    assert ledger.drop_missing(grace_s=3) == []
    ledger.mark_listed("a")  # back in Ray Serve's list
    assert [x.replica_id for x in ledger.routable()] == ["a"]
    assert ledger.reserved_blocks() == 5
    ledger.mark_missing("a")
    clock.now = 105.0
    assert ledger.drop_missing(grace_s=3) == ["a"]
    assert ledger.release(r) is True and ledger.reserved_blocks() == 0


def test_an_extended_lease_is_counted_once_from_the_snapshot():
    """The router reserved the predicted 5 blocks; the replica extended the lease of the
    request that outgrew them. Once a snapshot includes the request, the ledger counts
    the replica's figure (extension included) instead of its own reservation."""
    clock = Clock(100.0)
    ledger = Ledger(reflect_after_s=10, clock=clock)
    ledger.report("a", snap(100.0))
    r = ledger.reserve("a", 5, seq=1)
    assert ledger.replicas["a"].blocks.available == 95
    clock.now = 100.1
    ledger.report("a", snap(100.1, held=5, growth=0, seq=1))  # running, within its lease
    assert ledger.replicas["a"].blocks.available == 95
    clock.now = 101.0
    ledger.report("a", snap(101.0, held=6, growth=4, seq=1))  # outgrown: extended to 10
    assert ledger.replicas["a"].blocks.available == 90
    assert ledger.replicas["a"].drift_blocks == -5  # the prediction was 5 blocks short
    ledger.release(r)
    ledger.report("a", snap(101.5, seq=1))
    assert ledger.replicas["a"].blocks.available == 100 and ledger.reserved_blocks() == 0
