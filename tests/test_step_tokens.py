"""Step tokens (protocol/policies.py's StepTokens): the token budget of each engine step,
on vLLM's REAL scheduler (engine-less, a virtual clock), and `itl_target`'s learned step
time as pure logic."""

import random

import pytest

from blockserve.bench.step_time import PRESETS, StepBatch
from blockserve.protocol.config import SchedulerConfig
from blockserve.protocol.policies import StepState, StepTokens
from blockserve.replica.scheduler import BlockAwareScheduler
from blockserve.replica.scheduler_builtins import ItlTarget, StepTimeFit, TpotPace
from blockserve.tools.engine_less import EngineLessReplica

H100 = PRESETS["h100-llama2-7b"]


def h100_seconds(decoding: int, prefill: int, context: int) -> float:
    """The H100 preset's step time for a batch of that shape (one prompt chunk)."""
    per_decode = context // max(decoding, 1)
    return H100(StepBatch(prefill=((prefill, 0),) if prefill else (),
                          decode_contexts=(per_decode,) * decoding))


def trained(policy: ItlTarget, steps: int = 400, seed: int = 0) -> ItlTarget:
    rng = random.Random(seed)
    for _ in range(steps):
        decoding, prefill = rng.randrange(0, 400), rng.choice([0, 0, rng.randrange(1, 8192)])
        context = decoding * rng.randrange(200, 1500)
        step = StepState(8192, decoding, context)
        policy.on_step(step, decoding + prefill, h100_seconds(decoding, prefill, context))
    return policy


def test_the_fit_recovers_a_linear_step_time():
    fit = StepTimeFit(half_life_steps=1000)
    truth = (0.007, 5e-6, 2.8e-5, 2e-7)
    rng = random.Random(1)
    for _ in range(200):
        x = (rng.randrange(400), rng.randrange(8192), rng.randrange(300_000))
        fit.add(*x, truth[0] + sum(c * v for c, v in zip(truth[1:], x)))
    assert fit.coefficients() == pytest.approx(truth, rel=1e-3)


def test_itl_target_keeps_vllms_budget_until_it_has_learned_and_while_nothing_decodes():
    policy = ItlTarget(seconds=0.04, min_steps=32)
    busy = StepState(8192, decoding=200, context_tokens=200 * 800)
    assert policy.tokens(busy) == 8192  # nothing learned yet
    trained(policy)
    assert policy.tokens(StepState(8192, decoding=0, context_tokens=0)) == 8192
    assert policy.tokens(busy) < 8192


@pytest.mark.parametrize("decoding, context_per_request", [(50, 500), (200, 800), (400, 300)])
def test_itl_target_budgets_steps_that_take_about_its_seconds(decoding, context_per_request):
    """On the H100 preset's step times (with its knee and prefill attention, which the
    linear fit lacks) the budgeted step lands within 20% of the target."""
    policy = trained(ItlTarget(seconds=0.04))
    step = StepState(8192, decoding, decoding * context_per_request)
    budget = policy.tokens(step)
    assert decoding < budget < 8192
    seconds = h100_seconds(decoding, budget - decoding, step.context_tokens)
    assert seconds == pytest.approx(0.04, rel=0.2)


def test_itl_target_always_leaves_room_for_every_decode_and_some_prompt():
    policy = trained(ItlTarget(seconds=0.001, min_prefill_tokens=256))  # unreachable
    assert policy.tokens(StepState(8192, decoding=300, context_tokens=300_000)) == 300 + 256
    assert policy.tokens(StepState(400, decoding=300, context_tokens=300_000)) == 400


def test_itl_target_steps_at_a_share_of_the_tpot_promised_unless_told_its_seconds():
    assert ItlTarget(tpot_s=0.1).seconds == pytest.approx(ItlTarget.STEP_SHARE * 0.1)
    assert ItlTarget(seconds=0.03, tpot_s=0.1).seconds == 0.03


def test_tpot_pace_spends_the_time_in_hand_of_the_request_with_least():
    policy = TpotPace(tpot_s=0.05)  # a pace of 45 ms, a floor of 40 ms
    pace = TpotPace.PACE_SHARE * 0.05
    ahead = (10, 0.2)  # 10 tokens in 200 ms: 250 ms in hand
    just_started, behind = (0, 0.0), (10, 0.6)
    assert policy.step_seconds(StepState(8192, 0, 0)) == policy.seconds
    a_little_ahead = (10, 10 * pace - 0.002)
    assert policy.step_seconds(StepState(8192, 1, 800, (a_little_ahead,))) == pytest.approx(
        pace + 0.002)
    assert policy.step_seconds(StepState(8192, 1, 800, (ahead,))) == 0.05  # at most tpot_s
    assert policy.step_seconds(StepState(8192, 2, 1600, (ahead, just_started))) == pace
    assert policy.step_seconds(StepState(8192, 2, 1600, (ahead, behind))) == policy.seconds


def test_tpot_pace_gives_a_longer_step_more_prompt_tokens():
    policy = trained(TpotPace(tpot_s=0.05))
    fresh = StepState(8192, 100, 100 * 800, ((0, 0.0),) * 100)
    ahead = StepState(8192, 100, 100 * 800, ((10, 0.44),) * 100)  # 10 ms in hand
    assert 100 < policy.tokens(fresh) < policy.tokens(ahead)


def test_bad_itl_target_settings_are_refused_by_the_config():
    with pytest.raises(ValueError, match="cannot build itl_target"):
        SchedulerConfig.model_validate({"step_tokens": {"cls": "itl_target",
                                                        "kwargs": {"seconds": 0}}})


class Recording(StepTokens):
    """At most `limit` tokens per step while anything decodes; records what it is told."""

    def __init__(self, limit: int = 96):
        self.limit = limit
        self.states: list[StepState] = []
        self.steps: list[tuple[int, float]] = []

    def tokens(self, step):
        self.states.append(step)
        return min(self.limit, step.max_tokens) if step.decoding else step.max_tokens

    def on_step(self, step, tokens, seconds):
        self.steps.append((tokens, seconds))


def busy_replica(model_dir, scheduler_cls, clock):
    replica = EngineLessReplica(model_dir, scheduler_cls, num_blocks=200, block_size=32,
                                clock=clock,
                                scheduler={"step_tokens": "tests.test_step_tokens:Recording"})
    rng = random.Random(0)
    for i in range(6):
        replica.add(f"r{i}", [rng.randrange(1, 4000) for _ in range(300)], 20)
    return replica


def test_the_scheduler_applies_the_budget_and_times_each_busy_step(model_dir):
    """vLLM schedules no more than the policy's tokens while requests decode, its own
    budget otherwise, and restores it after each step; each step's tokens and seconds
    reach on_step (on a virtual clock: a step of n tokens lasts n ms)."""
    now = [0.0]
    replica = busy_replica(model_dir, BlockAwareScheduler, lambda: now[0])
    sched = replica.scheduler
    vllm_budget = sched.max_num_scheduled_tokens
    totals = []
    while sched.has_unfinished_requests():
        record = replica.step()
        totals.append(sum(record.scheduled.values()))
        assert sched.max_num_scheduled_tokens == vllm_budget
        now[0] += 0.001 * totals[-1]
    policy = sched.step_tokens
    assert policy.states[0].decoding == 0 and totals[0] > policy.limit  # vLLM's budget
    limited = [total for state, total in zip(policy.states, totals) if state.decoding]
    assert limited and max(limited) <= policy.limit
    assert policy.steps == [(t, pytest.approx(0.001 * t)) for t in totals[:-1]]
    # Each decoding request's pace: n tokens since it was first seen decoding, in the
    # time of the n steps before this one.
    assert any(tokens for state in policy.states for tokens, _ in state.decode_pace)
    for i, state in enumerate(policy.states):
        assert len(state.decode_pace) == state.decoding
        for tokens, seconds in state.decode_pace:
            assert seconds == pytest.approx(0.001 * sum(totals[i - tokens:i]))


def test_under_async_scheduling_each_step_is_timed_by_the_interval_it_ran_in(model_dir):
    """vLLM's async scheduling schedules step k+1 while step k runs: between two
    schedule() calls the step that ran is the one begun a call earlier."""
    from vllm.v1.outputs import ModelRunnerOutput

    from blockserve.replica.scheduler import AsyncBlockAwareScheduler

    now = [0.0]
    replica = busy_replica(model_dir, AsyncBlockAwareScheduler, lambda: now[0])
    sched, in_flight, totals = replica.scheduler, [], []
    while sched.has_unfinished_requests() or in_flight:
        if sched.has_unfinished_requests():
            output = sched.schedule()
            ids = list(output.num_scheduled_tokens)
            totals.append(output.total_num_scheduled_tokens)
            in_flight.append((output, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[] if sched.requests[r].is_prefill_chunk else [7]
                                   for r in ids])))
        if len(in_flight) >= 2 or not sched.has_unfinished_requests():
            output, result = in_flight.pop(0)
            now[0] += 0.001 * output.total_num_scheduled_tokens  # it ran until now
            sched.update_from_output(output, result)
    steps = sched.step_tokens.steps
    assert len(steps) > 10
    assert steps == [(t, pytest.approx(0.001 * t)) for t in totals[:len(steps)]]
