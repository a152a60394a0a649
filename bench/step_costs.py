"""What each simulated engine step computes, and what it computes again: the step-time
model's `StepBatch` and the recompute tax, from vLLM's own scheduler output.

vLLM counts a prefix-cache hit as computed before it schedules a request, so a hit skips
its tokens' prefill (a chunk starts after it). A preempted request loses its KV and
comes back with only what still hits: the chunk it is scheduled again covers positions
it had computed before, and those are recomputed. The recompute tax is vLLM RFC #54644's:
recomputed tokens / all computed tokens, where a request's recomputed tokens are those
scheduled again for positions below the furthest it had computed.
"""

from __future__ import annotations

from blockserve.bench.step_time import StepBatch


class StepCosts:
    """Per request, the furthest position it has computed; per step, its `StepBatch`."""

    def __init__(self) -> None:
        self.furthest: dict[str, int] = {}
        self.computed_tokens = 0  # every token scheduled, all steps
        self.recomputed_tokens = 0

    def batch(self, scheduled: dict[str, int], computed_before: dict[str, int],
              prompt_tokens) -> StepBatch:
        """One step's batch (`prompt_tokens(request_id)`: its prompt length). A request
        decodes when it computes one token past both its prompt and all it had computed."""
        prefill, decode = [], []
        for request_id, n in scheduled.items():
            before = computed_before[request_id]
            furthest = self.furthest.get(request_id, 0)
            if before < furthest:
                self.recomputed_tokens += min(before + n, furthest) - before
            if before + n > furthest:
                self.furthest[request_id] = before + n
            if n == 1 and before >= furthest and before >= prompt_tokens(request_id):
                decode.append(before + 1)
            else:
                prefill.append((n, before))
            self.computed_tokens += n
        return StepBatch(tuple(prefill), tuple(decode))

    def forget(self, request_id: str) -> None:
        self.furthest.pop(request_id, None)

    @property
    def recompute_tax(self) -> float:
        return self.recomputed_tokens / self.computed_tokens if self.computed_tokens else 0.0
