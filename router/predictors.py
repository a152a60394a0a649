"""Output-length predictors: how many tokens the router expects a request to generate.

The reservation of every admitted request (router/demand.py) and the replica's lease
(replica/scheduler.py) start from this prediction. A predictor sees only what a
production router sees: the prompt's length, the tenant, the client's `max_tokens` cap
(if any), the room left in the context, and, afterwards, how many tokens finished
requests really generated (the `usage` of their responses, router/usage.py). It never
sees `min_tokens`, stop ids or anything else a load generator uses to end a request.

Each is protocol/router_policies.py's `OutputPredictor`, chosen as
`router.output_predictor` by short name (`online_quantile`, `fixed`,
`max_tokens`; protocol/registry.py) or import path.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from typing import Sequence

from blockserve.protocol.router_policies import OutputPredictor


def _within(tokens: int, max_tokens: int | None, room: int) -> int:
    cap = room if max_tokens is None else min(max_tokens, room)
    return max(1, min(tokens, cap))


class MaxTokensPredictor(OutputPredictor):
    """Expect `max_tokens` when given (exact only when the client sets the true length,
    e.g. under `ignore_eos`), else a default. The worst case under a loose cap."""

    def __init__(self, default_tokens: int = 256):
        self.default_tokens = default_tokens

    def predict(self, prompt_tokens: int, max_tokens: int | None, room: int,
                tenant: str = "default") -> int:
        return _within(max_tokens if max_tokens is not None else self.default_tokens,
                       max_tokens, room)


class FixedPredictor(OutputPredictor):
    """Expect the same `tokens` of every request (capped by `max_tokens` and the room);
    the lease grows on the replica if a request needs more."""

    def __init__(self, tokens: int = 128):
        if tokens < 1:
            raise ValueError("tokens must be at least 1")
        self.tokens = tokens

    def predict(self, prompt_tokens: int, max_tokens: int | None, room: int,
                tenant: str = "default") -> int:
        return _within(self.tokens, max_tokens, room)


def quantile(ordered: Sequence[float], q: float) -> float:
    """The `q` quantile of values sorted ascending (the value at rank q * n; not
    interpolated): the one definition the predictors, the router's stats and the
    benchmarks' percentiles share."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Window:
    """One group's lengths among the predictor's most recent finished requests (each with
    its number in the predictor's order of finishing), kept sorted for quantiles."""

    def __init__(self) -> None:
        self.arrival: deque[tuple[int, int]] = deque()
        self.ordered: list[int] = []

    def add(self, number: int, value: int) -> None:
        self.arrival.append((number, value))
        bisect.insort(self.ordered, value)

    def forget_before(self, number: int) -> None:
        """Drop the lengths of requests that finished before the `number`th."""
        arrival, ordered = self.arrival, self.ordered
        while arrival and arrival[0][0] < number:
            del ordered[bisect.bisect_left(ordered, arrival.popleft()[1])]

    def quantile(self, q: float) -> int:
        return quantile(self.ordered, q)


class OnlineQuantilePredictor(OutputPredictor):
    """Learned from finished requests: the `quantile` of the output lengths most recently
    seen for the same tenant and prompt-length bucket (powers of two), falling back to the
    tenant's, then everyone's, while a group has fewer than `min_samples`; before any
    data, `prior_tokens`. Only the last `window` finished requests count, in every
    group: a group's own last lengths could be old where its traffic is rare, and a
    workload that changed would keep the old one's leases there. At most `max_groups`
    groups are kept. A quantile above the median errs towards larger leases; the
    replica extends the ones that still run out (replica/trajectory.py)."""

    def __init__(self, quantile: float = 0.8, prior_tokens: int = 128, min_samples: int = 8,
                 window: int = 64, max_groups: int = 4096):
        if not 0 < quantile < 1:
            raise ValueError("quantile must be between 0 and 1 (exclusive)")
        if prior_tokens < 1 or min_samples < 1 or window < min_samples:
            raise ValueError("need prior_tokens >= 1 and 1 <= min_samples <= window")
        self.quantile = quantile
        self.prior_tokens = prior_tokens
        self.min_samples = min_samples
        self.window = window
        self.max_groups = max_groups  # tenants are client-chosen: forget the oldest groups
        self._groups: OrderedDict[tuple, _Window] = OrderedDict()
        self._finished = 0  # finished requests seen: the next one's number

    def predict(self, prompt_tokens: int, max_tokens: int | None, room: int,
                tenant: str = "default") -> int:
        for key in self._keys(prompt_tokens, tenant):
            group = self._groups.get(key)
            if group is None:
                continue
            group.forget_before(self._oldest_counted())
            if len(group.ordered) >= self.min_samples:
                return _within(group.quantile(self.quantile), max_tokens, room)
        return _within(self.prior_tokens, max_tokens, room)

    def on_finished(self, prompt_tokens: int, tenant: str, output_tokens: int) -> None:
        if output_tokens < 1:
            return
        number, self._finished = self._finished, self._finished + 1
        for key in self._keys(prompt_tokens, tenant):
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = _Window()
            self._groups.move_to_end(key)
            group.add(number, output_tokens)
            # Here too: a group `predict` never reaches (a fallback) must not grow.
            group.forget_before(self._oldest_counted())
        while len(self._groups) > self.max_groups:
            self._groups.popitem(last=False)

    def _oldest_counted(self) -> int:
        """The number of the oldest finished request that still counts."""
        return self._finished - self.window

    @staticmethod
    def _keys(prompt_tokens: int, tenant: str) -> tuple[tuple, ...]:
        """Most specific first: (tenant, prompt bucket), (tenant,), ()."""
        return (tenant, max(prompt_tokens, 1).bit_length()), (tenant,), ()
