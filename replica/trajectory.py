"""The peak of a replica's future block use, from each admitted request's trajectory.

Adding up every request's whole reservation assumes they all reach full size at once.
They do not: running requests decode one token per step together, and each frees its
blocks when it finishes, so a long request grows into blocks a short one has freed. What
admission must keep within the pool is the most blocks held at any one future step (the
idea of LightLLM's past-future scheduler). It is reached just before some request
finishes, so only those steps are evaluated. Pure integer arithmetic; no vLLM.

A request's expected length is its lease: the router's prediction, not the client's
cap. One that reaches its lease and keeps going gets it extended (`extended_lease`), so
the trajectories and the snapshot's reserved blocks count the growth from then on.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence


class Trajectory(NamedTuple):
    """One request's expected future, in the units the pool counts."""

    tokens: int  # tokens it has now (prompt + generated)
    remaining: int  # steps until it finishes (one token per step; at least 1)
    counted: int  # of its blocks, those already among the replica's held blocks
    kept: int  # of its blocks, those still held by others once it finishes


def peak_blocks(held: int, block_size: int, trajectories: Sequence[Trajectory]) -> int:
    """The most blocks held at once from now on, if every request runs as expected.

    At step s a request still running holds ceil((tokens + s) / block_size) blocks; one
    that finished holds only its `kept` ones. Shared blocks a finishing request keeps
    are never counted as freed, so the estimate errs on the side of more blocks.

    O(n log n + n * block_size), not O(n^2): this runs at every step, over every running
    request (hundreds on a GPU). Requests are taken in the order they finish, with sums
    over those still running; with tokens + block_size - 1 = q * block_size + r and
    s = Q * block_size + R, ceil((tokens + s) / block_size) = q + Q + (r + R >= block_size),
    so the running requests' blocks at s are their sum of q, Q per request, and the
    number whose r is at least block_size - R.
    """
    ordered = sorted(trajectories, key=lambda t: t.remaining)
    quotients = counted = 0  # sums over the requests still running
    residues = [0] * block_size  # requests still running, by r
    parts = []
    for t in ordered:
        q, r = divmod(t.tokens + block_size - 1, block_size)
        parts.append((q, r))
        quotients += q
        counted += t.counted
        residues[r] += 1
    peak, finished, i, n = held, 0, 0, len(ordered)  # finished: sum of kept - counted
    while i < n:
        s = ordered[i].remaining
        whole, rest = divmod(s, block_size)
        at_s = (held + finished + quotients + (n - i) * whole + sum(residues[block_size - rest:])
                - counted)
        peak = max(peak, at_s)
        while i < n and ordered[i].remaining == s:  # they finish at s: held no longer
            t, (q, r) = ordered[i], parts[i]
            quotients -= q
            counted -= t.counted
            residues[r] -= 1
            finished += t.kept - t.counted
            i += 1
    return peak


def extended_lease(lease_tokens: int, prompt_tokens: int, tokens_now: int, limit_tokens: int,
                   block_size: int) -> int:
    """The tokens a request is expected to reach, given its lease and where it is now.

    Within its lease: the lease. Outgrown: as many more tokens as it has generated so
    far (at least one block), up to `limit_tokens` (prompt + max_tokens). Output lengths
    are heavy-tailed: a request that has outlived its prediction is likely to run about
    as long again, and doubling needs only a few extensions for any length.
    """
    if tokens_now < lease_tokens or tokens_now >= limit_tokens:
        return max(lease_tokens, min(tokens_now, limit_tokens))
    generated = max(0, tokens_now - prompt_tokens)
    return min(limit_tokens, tokens_now + max(block_size, generated))
