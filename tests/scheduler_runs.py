"""Driving the engine-less scheduler (tools/engine_less.py) as vLLM's async scheduling
does, for the scheduler and block-policy tests."""

from __future__ import annotations


def pipelined_run(replica, depth=2):
    """Drive the scheduler as vLLM's async scheduling does: the next step is scheduled
    before the previous step's output comes back (a batch queue of `depth`). Returns the
    number of steps; checks the snapshot against vLLM's block pool after every update."""
    from collections import deque

    from vllm.v1.outputs import ModelRunnerOutput

    sched, in_flight, steps = replica.scheduler, deque(), 0
    while sched.has_unfinished_requests() or in_flight:
        if sched.has_unfinished_requests():
            output = sched.schedule()
            ids = list(output.num_scheduled_tokens)
            sampled = [[] if sched.requests[r].is_prefill_chunk else [1 + steps % 3999]
                       for r in ids]
            in_flight.append((output, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=sampled)))
            steps += 1
            assert steps < 5_000, "the scheduler did not drain"
        if len(in_flight) >= depth or not sched.has_unfinished_requests():
            sched.update_from_output(*in_flight.popleft())
            snap = sched.snapshot
            assert snap.free_blocks == sched.kv_cache_manager.block_pool.get_num_free_blocks()
            assert snap.held_blocks + snap.free_blocks == snap.total_blocks
    return steps
