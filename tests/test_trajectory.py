"""The future-peak arithmetic of the admission gate, as pure code."""

import random

from blockserve.replica.trajectory import Trajectory, peak_blocks


def test_a_short_request_frees_blocks_a_long_one_grows_into():
    short = Trajectory(tokens=4, remaining=4, counted=1, kept=0)  # ends at 2 blocks
    long = Trajectory(tokens=4, remaining=12, counted=1, kept=0)  # ends at 4 blocks
    # Summing whole reservations says 6; at no step are more than 4 held.
    assert peak_blocks(held=2, block_size=4, trajectories=[short, long]) == 4


def test_blocks_shared_with_others_are_not_counted_as_freed():
    short = Trajectory(tokens=4, remaining=4, counted=1, kept=1)
    long = Trajectory(tokens=4, remaining=12, counted=1, kept=0)
    assert peak_blocks(held=2, block_size=4, trajectories=[short, long]) == 5


def test_no_requests_peak_at_what_is_held():
    assert peak_blocks(held=7, block_size=16, trajectories=[]) == 7


def _step_by_step_peak(held, block_size, trajectories):
    """The definition: the most blocks held at any step until the last request ends."""
    def held_at(step):
        return held + sum(-(-(t.tokens + step) // block_size) - t.counted
                          if t.remaining >= step else t.kept - t.counted
                          for t in trajectories)

    horizon = max(t.remaining for t in trajectories)
    return max(held, *(held_at(s) for s in range(horizon + 2)))


def _random_trajectories(rng, block_size, n, max_remaining):
    trajectories = []
    for _ in range(n):
        tokens = rng.randint(1, 300)
        counted = -(-tokens // block_size) - rng.randint(0, 1)
        trajectories.append(Trajectory(tokens, rng.randint(1, max_remaining), max(counted, 0),
                                       rng.randint(0, 1)))
    return trajectories


def test_evaluating_only_where_requests_finish_finds_the_step_by_step_peak():
    rng = random.Random(0)
    for _ in range(200):
        block_size = rng.choice([4, 16, 32])
        trajectories = _random_trajectories(rng, block_size, rng.randint(1, 12), 200)
        held = sum(t.counted for t in trajectories)
        assert peak_blocks(held, block_size, trajectories) == \
            _step_by_step_peak(held, block_size, trajectories)


def test_hundreds_of_requests_finishing_at_the_same_steps_give_the_step_by_step_peak():
    rng = random.Random(1)
    for _ in range(30):
        block_size = rng.choice([1, 16, 32])
        trajectories = _random_trajectories(rng, block_size, rng.randint(100, 300), 40)
        held = sum(t.counted for t in trajectories) + rng.randint(0, 50)  # others' blocks
        assert peak_blocks(held, block_size, trajectories) == \
            _step_by_step_peak(held, block_size, trajectories)
