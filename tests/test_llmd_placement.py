"""llm-d's schedulers as in-tree peers (router/llmd_placement.py): each chooses as its
docstring says, without Ray or vLLM."""

from __future__ import annotations

import random

import pytest

from blockserve.protocol.config import RouterConfig
from blockserve.protocol.router_policies import Candidate
from blockserve.router.demand import Demand
from blockserve.router.llmd_placement import (LlmdLoad, LlmdScorers, OnlineRidge,
                                              PredictedLatency, solve)

DEMAND = Demand(prompt_tokens=160, expected_output=32, sequences=1, block_size=16)  # 10 blocks


def replica(name, usage=0.0, ongoing=0, credit=0, prefill_blocks=0):
    return Candidate(name, 1000, int(1000 * (1 - usage)), credit, ongoing, usage, 0,
                     prefill_blocks)


@pytest.mark.parametrize("name, cls", [("llmd_precise", LlmdScorers), ("llmd_load", LlmdLoad),
                                       ("predicted_latency", PredictedLatency)])
def test_each_short_name_builds_its_class(name, cls):
    assert type(RouterConfig.policy_ref("placement", name).policy) is cls


def test_precise_prefers_the_cached_prefix_until_the_load_outweighs_it():
    cached = replica("a", usage=0.5, ongoing=4, credit=10)
    idle = replica("b", usage=0.0, ongoing=0)
    # prefix 2 x 1.0 + kv 1 x 0.5 + queue 0 = 2.5 against kv 1 + queue 1 = 2
    assert LlmdScorers().choose(DEMAND, [cached, idle]) == "a"
    half = cached.with_credit(2)  # prefix 2 x 0.2 = 0.4 + 0.5 < 2
    assert LlmdScorers().choose(DEMAND, [half, idle]) == "b"


def test_load_scorers_ignore_the_prefix_and_normalise_the_queue():
    cached = replica("a", usage=0.2, ongoing=9, credit=10)
    light = replica("b", usage=0.3, ongoing=1)
    middle = replica("c", usage=0.2, ongoing=5)
    # queue scores 0, 1, 0.5: b wins on 0.7 + 1 against c's 0.8 + 0.5
    assert LlmdLoad().choose(DEMAND, [cached, light, middle]) == "b"


def test_ties_are_broken_at_random_like_llmds_picker():
    same = [replica(name) for name in "abcd"]
    policy = LlmdScorers(seed=1)
    assert len({policy.choose(DEMAND, same) for _ in range(40)}) > 1


def test_the_ridge_recovers_a_linear_law_and_solve_solves():
    assert solve([[2.0, 1.0], [1.0, 3.0]], [3.0, 5.0]) == pytest.approx([0.8, 1.4])
    model, rng = OnlineRidge(3, forget=1.0), random.Random(0)
    for _ in range(200):
        x = (1.0, rng.random(), rng.random())
        model.add(x, 0.5 + 2 * x[1] - 3 * x[2])
    assert model.weights == pytest.approx([0.5, 2.0, -3.0], abs=0.01)


def test_a_weight_of_the_wrong_sign_is_held_at_zero_and_the_rest_refitted():
    """Data where busier looks faster (y falls with x[1]) still gives x[1] no negative
    weight when its sign is constrained; x[2] then carries the fit."""
    model, rng = OnlineRidge(3, signs=(0, 1, 1), forget=1.0), random.Random(0)
    for _ in range(200):
        x = (1.0, rng.random(), rng.random())
        model.add(x, 1.0 - 0.5 * x[1] + 2 * x[2])
    assert model.weights[1] == 0.0
    assert model.weights[2] == pytest.approx(2.0, abs=0.05)
    assert PredictedLatency.SIGNS[PredictedLatency.FEATURES.index("in_flight")] == 1


def test_untrained_it_spreads_by_requests_in_flight():
    policy = PredictedLatency(explore=0.0)
    assert policy.choose(DEMAND, [replica("a", ongoing=3), replica("b", ongoing=1)]) == "b"


def test_the_affinity_gate_keeps_a_prefix_holder_unless_exploring():
    holder = replica("a", ongoing=9, credit=8)  # 0.8 of the prompt: at tau
    other = replica("b", ongoing=0)
    assert PredictedLatency(explore=0.0).choose(DEMAND, [holder, other]) == "a"
    assert PredictedLatency(tau=0.9, explore=0.0).choose(DEMAND, [holder, other]) == "b"
    assert PredictedLatency(explore=1.0).choose(DEMAND, [holder, other]) == "b"


def test_trained_on_outcomes_it_routes_to_the_lowest_predicted_latency():
    """TTFT grows with queued prompt tokens, TPOT with requests in flight; the replica
    with fewer requests in flight but a long prefill queue loses once that is learned."""
    policy, rng = PredictedLatency(explore=0.0, min_samples=32), random.Random(0)
    for i in range(300):
        c = replica(f"r{i}", usage=rng.random() * 0.5, ongoing=rng.randrange(20),
                    prefill_blocks=rng.randrange(200))
        assert policy.choose(DEMAND, [c]) == c.replica_id
        x = PredictedLatency.features(DEMAND, c)
        policy.on_outcome(DEMAND, c, 0.05 + 0.1 * x[3], 0.01 + 0.001 * x[2])
    queued = replica("a", ongoing=2, prefill_blocks=190)  # TTFT ~0.35 s, TPOT ~12 ms
    busy = replica("b", ongoing=12, prefill_blocks=0)  # TTFT ~0.05 s, TPOT ~22 ms
    # 32 output tokens: a ~0.73 s, b ~0.75 s; with 8 output tokens b is clearly better
    short = Demand(prompt_tokens=160, expected_output=8, sequences=1, block_size=16)
    assert policy.choose(short, [queued, busy]) == "b"
    assert policy.choose(DEMAND, [queued, busy]) == "a"
    assert policy.ttft.predict(PredictedLatency.features(DEMAND, queued)) == pytest.approx(
        0.35, abs=0.02)


def test_its_inlined_score_is_the_dot_product_of_the_weights_and_the_features():
    """`choose` scores each replica without building `features` (decision time); on
    random trained weights and replicas it picks what the features' dot product picks."""
    policy, rng = PredictedLatency(explore=0.0, tau=1.0, min_samples=1), random.Random(3)
    for _ in range(200):
        x = [1.0] + [rng.random() for _ in range(6)]
        policy.ttft.add(x, rng.random())
        policy.tpot.add(x, rng.random() / 50)
    output = DEMAND.blocks * DEMAND.block_size - DEMAND.prompt_tokens
    weights = [a + output * b for a, b in zip(policy.ttft.weights, policy.tpot.weights)]
    assert any(weights[1:])
    for _ in range(200):
        pool = [replica(f"r{i}", usage=rng.random(), ongoing=rng.randrange(20),
                        credit=rng.randrange(9), prefill_blocks=rng.randrange(200))
                for i in range(16)]
        expected = min(pool, key=lambda c: (sum(w * f for w, f in zip(
            weights, PredictedLatency.features(DEMAND, c))), c.ongoing, c.replica_id))
        assert policy.choose(DEMAND, pool) == expected.replica_id
