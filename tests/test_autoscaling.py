"""The KV-block autoscaling policy as pure code."""

import pytest

from blockserve.controller.autoscaling import BlockDemandAutoscaler, block_demand


def metrics(held, growth=0, waiting=0, queued=0, replicas=2, total=160):
    ids = [f"r{i}" for i in range(replicas)]
    return {"total_blocks": {i: total for i in ids}, "held_blocks": {i: held for i in ids},
            "growth_blocks": {i: growth for i in ids},
            "waiting_blocks": {i: waiting for i in ids},
            "router_queued_blocks": {i: queued for i in ids}}


def test_block_demand_counts_replicas_and_the_router_queue_once():
    assert block_demand(metrics(held=100, growth=20, queued=50)) == (290, 320)
    assert block_demand({}) is None


def test_scale_up_needs_sustained_demand_and_goes_to_the_needed_count():
    policy = BlockDemandAutoscaler(target_utilization=0.75, upscale_delay_s=5)
    demand = block_demand(metrics(held=150, queued=400))  # 700 of 320 blocks
    n, state = policy.decide(2, demand, 1, 8, {}, now=0.0)
    assert n == 2 and "above_since" in state  # not yet: hysteresis
    n, state = policy.decide(2, demand, 1, 8, state, now=6.0)
    assert n == 6  # ceil(700 / (0.75 * 160))
    n, _ = policy.decide(2, demand, 1, 4, {"above_since": 0.0}, now=6.0)
    assert n == 4  # max_replicas holds


def test_scale_down_one_at_a_time_after_the_delay_and_not_below_min():
    policy = BlockDemandAutoscaler(scale_down_utilization=0.3, downscale_delay_s=30)
    idle = block_demand(metrics(held=5, replicas=3))
    n, state = policy.decide(3, idle, 1, 8, {}, now=0.0)
    assert n == 3
    n, state = policy.decide(3, idle, 1, 8, state, now=31.0)
    assert n == 2
    assert policy.decide(1, block_demand(metrics(held=1, replicas=1)), 1, 8,
                         {"below_since": 0.0}, now=100.0)[0] == 1


def test_demand_in_the_band_resets_the_timers():
    policy = BlockDemandAutoscaler()
    _, state = policy.decide(2, block_demand(metrics(held=150)), 1, 8, {}, now=0.0)
    assert "above_since" in state
    _, state = policy.decide(2, block_demand(metrics(held=80)), 1, 8, state, now=1.0)
    assert "above_since" not in state and "below_since" not in state


def test_no_metrics_keeps_the_current_count_within_bounds():
    assert BlockDemandAutoscaler().decide(3, None, 1, 2, {}, now=0.0)[0] == 2


def test_invalid_thresholds_are_rejected():
    with pytest.raises(ValueError):
        BlockDemandAutoscaler(target_utilization=0.2, scale_down_utilization=0.5)


def test_called_by_serve_with_an_autoscaling_context():
    class Context:  # the attributes of Ray Serve's AutoscalingContext the policy reads
        current_num_replicas = 1
        capacity_adjusted_min_replicas = 1
        capacity_adjusted_max_replicas = 3
        policy_state = {"above_since": 0.0}
        current_time = 10.0

        @staticmethod
        def aggregated_metrics():
            return metrics(held=150, queued=200, replicas=1)

    decision, state = BlockDemandAutoscaler(upscale_delay_s=5)(Context())
    assert decision == 3  # ceil(350 / (0.75 * 160)) = 3, within max_replicas
    assert state["utilization"] > 2
