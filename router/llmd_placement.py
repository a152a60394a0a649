"""Placements that copy llm-d's schedulers: peers that blockserve is measured against
(bench/contest.py), usable as any placement.

- `LlmdScorers` (`llmd_precise`, `llmd_load`): llm-d's scorer stack, a weighted sum of a
  prefix score (prompt blocks cached there / prompt blocks, from the router's prefix index:
  on the exact index this is llm-d's precise prefix-cache scorer), a KV-utilisation score
  (1 - usage) and a queue score (min-max normalised over the candidates, as llm-d's queue
  scorer), the highest sum winning, ties at random (llm-d's max-score picker). Weights 2,
  1, 1 as in llm-d's published example configs for precise prefix routing; `llmd_load` has
  prefix weight 0 (its load scorers alone). llm-d's queue scorer reads vLLM's waiting-queue
  gauge; a `Candidate` has no waiting count, so the queue is the router's requests in
  flight there (`ongoing`).
- `PredictedLatency` (`predicted_latency`): llm-d's predicted-latency scheduler. A model,
  fitted online as requests finish, predicts each replica's TTFT and TPOT from its state
  (KV use, requests in flight, queued prompt tokens, prefix match, the prompt's uncached
  tokens); the request goes to the lowest predicted TTFT + TPOT x its predicted output.
  An affinity gate keeps only replicas whose prefix match is at least `tau` when any is,
  except for an `explore` share of decisions. llm-d's model is XGBoost; this one is an
  online ridge regression (`OnlineRidge`), pure Python, on the same features, each weight
  held to the sign its feature can have.
"""

from __future__ import annotations

import random
from typing import Sequence

from blockserve.protocol.router_policies import Candidate, DemandView, Placement


def prefix_match(demand: DemandView, c: Candidate) -> float:
    """Share of the prompt's blocks cached on the replica (llm-d's prefix score)."""
    prompt = demand.prompt_blocks
    if not prompt:
        return 0.0
    match = c.prefix_credit / prompt
    return match if match < 1.0 else 1.0  # min(1.0, match) without a call, per replica


class LlmdScorers(Placement):
    """`llmd_precise`: llm-d's weighted scorers (module docstring); every replica is a
    candidate, as llm-d routes whether or not a request fits."""

    def __init__(self, prefix_weight: float = 2.0, kv_weight: float = 1.0,
                 queue_weight: float = 1.0, seed: int | None = 0):
        if min(prefix_weight, kv_weight, queue_weight) < 0:
            raise ValueError("scorer weights must be >= 0")
        self.weights = (prefix_weight, kv_weight, queue_weight)
        self._rng = random.Random(seed)

    def choose(self, demand: DemandView, candidates: Sequence[Candidate]) -> str | None:
        if not candidates:
            return None
        wp, wk, wq = self.weights
        ongoing = [c.ongoing for c in candidates]  # min/max over a list loop in C
        low = min(ongoing)
        spread = max(ongoing) - low
        best, ties = float("-inf"), []
        for c in candidates:
            queue = 1.0 if spread == 0 else 1.0 - (c.ongoing - low) / spread
            score = wp * prefix_match(demand, c) + wk * (1.0 - c.usage) + wq * queue
            if score > best:
                best, ties = score, [c.replica_id]
            elif score == best:
                ties.append(c.replica_id)
        return ties[0] if len(ties) == 1 else self._rng.choice(ties)


class LlmdLoad(LlmdScorers):
    """`llmd_load`: llm-d's load-aware scorers alone (KV utilisation and queue)."""

    def __init__(self, kv_weight: float = 1.0, queue_weight: float = 1.0, seed: int | None = 0):
        super().__init__(0.0, kv_weight, queue_weight, seed)


class OnlineRidge:
    """Least squares with a ridge penalty and exponential forgetting, refitted every
    `refit_every` samples by Gaussian elimination: d is a handful of features, so pure
    Python suffices and keeps numpy out of the router. `signs` constrains each weight
    (+1: >= 0, -1: <= 0, 0: free), as XGBoost's monotone constraints do: a weight fitted
    with the wrong sign is fixed at 0 and the rest refitted."""

    def __init__(self, features: int, signs: Sequence[int] | None = None, ridge: float = 1e-3,
                 forget: float = 0.999, refit_every: int = 16):
        self.d, self.ridge, self.forget, self.refit_every = features, ridge, forget, refit_every
        self.signs = tuple(signs) if signs is not None else (0,) * features
        self.xtx = [[0.0] * features for _ in range(features)]
        self.xty = [0.0] * features
        self.weights = [0.0] * features
        self.samples = 0

    def add(self, x: Sequence[float], y: float) -> None:
        f, xtx, xty = self.forget, self.xtx, self.xty
        for i, xi in enumerate(x):
            row = xtx[i]
            for j, xj in enumerate(x):
                row[j] = f * row[j] + xi * xj
            xty[i] = f * xty[i] + xi * y
        self.samples += 1
        if self.samples % self.refit_every == 0:
            self.refit()

    def refit(self) -> None:
        free = list(range(self.d))
        while True:
            fitted = solve([[self.xtx[i][j] + (self.ridge if i == j else 0.0) for j in free]
                            for i in free], [self.xty[i] for i in free])
            wrong = {i for i, w in zip(free, fitted) if self.signs[i] * w < 0}
            if not wrong:
                break
            free = [i for i in free if i not in wrong]
        self.weights = [0.0] * self.d
        for i, w in zip(free, fitted):
            self.weights[i] = w

    def predict(self, x: Sequence[float]) -> float:
        return sum(w * v for w, v in zip(self.weights, x))


def solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b (partial pivoting); a is positive definite here (ridge)."""
    n = len(b)
    for k in range(n):
        p = max(range(k, n), key=lambda i: abs(a[i][k]))
        a[k], a[p], b[k], b[p] = a[p], a[k], b[p], b[k]
        for i in range(k + 1, n):
            m = a[i][k] / a[k][k]
            for j in range(k, n):
                a[i][j] -= m * a[k][j]
            b[i] -= m * b[k]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (b[i] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return x


class PredictedLatency(Placement):
    """`predicted_latency`: llm-d's predicted-latency placement (module docstring).
    Until `min_samples` outcomes were seen it picks the replica with the fewest requests
    in flight; `on_outcome` (router/relay.py, bench/simulated_cluster.py) trains it."""

    FEATURES = ("bias", "kv_usage", "in_flight", "queued_prompt_ktokens", "prefix_match",
                "new_prompt_ktokens", "in_flight_x_new_prompt")
    # Latency never falls with load or uncached prompt, nor rises with a prefix match:
    # without this a weight of the wrong sign sends every request to the busiest replica,
    # whose slow answers come back too late to correct it (a first run did so).
    SIGNS = (0, 1, 1, 1, -1, 1, 1)

    def __init__(self, tau: float = 0.8, explore: float = 0.01, min_samples: int = 32,
                 seed: int | None = 0):
        if not 0 <= tau <= 1 or not 0 <= explore <= 1:
            raise ValueError("tau and explore are shares, within [0, 1]")
        self.tau, self.explore, self.min_samples = tau, explore, min_samples
        self.ttft = OnlineRidge(len(self.FEATURES), self.SIGNS)
        self.tpot = OnlineRidge(len(self.FEATURES), self.SIGNS)
        self._rng = random.Random(seed)

    @staticmethod
    def features(demand: DemandView, c: Candidate) -> tuple[float, ...]:
        match = prefix_match(demand, c)
        new = demand.prompt_tokens * (1.0 - match) / 1000
        return (1.0, c.usage, float(c.ongoing), c.prefill_blocks * demand.block_size / 1000,
                match, new, c.ongoing * new)

    def choose(self, demand: DemandView, candidates: Sequence[Candidate]) -> str | None:
        if not candidates:
            return None
        pool, prompt = candidates, demand.prompt_blocks
        if self._rng.random() >= self.explore and prompt:
            floor = self.tau * prompt  # prefix_match >= tau, without a call per replica
            pool = [c for c in candidates if c.prefix_credit >= floor] or candidates
        output = max(1, demand.blocks * demand.block_size - demand.prompt_tokens)
        trained = min(self.ttft.samples, self.tpot.samples) >= self.min_samples
        # TTFT + output x TPOT is linear in the features: one weight vector per decision.
        _, w1, w2, w3, w4, w5, w6 = \
            [a + output * b for a, b in zip(self.ttft.weights, self.tpot.weights)] \
            if trained else [0.0] * len(self.FEATURES)
        # The weights' dot product with `features(demand, c)` less its bias (the same for
        # every replica), inlined, with the terms of a replica without prefix credit
        # folded: this runs per replica and decision (bench/decision_time.py).
        per_block = w3 * demand.block_size / 1000
        tokens = demand.prompt_tokens / 1000  # a replica's new prompt ktokens without credit
        per_request, uncached = w2 + w6 * tokens, w5 * tokens
        scores = []
        for c in pool:
            credit = c.prefix_credit
            if credit and prompt:
                match = credit / prompt
                if match > 1.0:
                    match = 1.0
                new = tokens * (1.0 - match)
                scores.append(w1 * c.usage + (w2 + w6 * new) * c.ongoing
                              + per_block * c.prefill_blocks + w4 * match + w5 * new)
            else:
                scores.append(w1 * c.usage + per_request * c.ongoing
                              + per_block * c.prefill_blocks + uncached)
        best = min(scores)
        if scores.count(best) == 1:
            return pool[scores.index(best)].replica_id
        return min((c.ongoing, c.replica_id) for c, s in zip(pool, scores) if s == best)[1]

    def on_outcome(self, demand: DemandView, chosen: Candidate, ttft_s: float | None,
                   tpot_s: float | None) -> None:
        features = self.features(demand, chosen)
        if ttft_s is not None:
            self.ttft.add(features, ttft_s)
        if tpot_s is not None:
            self.tpot.add(features, tpot_s)
