"""Seeded workloads, generated locally. Prompts are token ids (completions API), so every
configuration sees exactly the same prompt lengths and shared prefixes."""

from __future__ import annotations

import random
from dataclasses import dataclass

VOCAB = range(10, 4000)
MAX_MODEL_LEN = 1024


@dataclass(frozen=True)
class RequestSpec:
    arrival_s: float
    prompt: list[int] | str  # token ids; text where a target cannot take ids
    max_tokens: int
    tenant: str = "default"


def _lengths(rng: random.Random, prompt_mu: float, output_mu: float) -> tuple[int, int]:
    """Long-tailed (log-normal) prompt and output lengths that fit max_model_len."""
    prompt = min(700, int(rng.lognormvariate(prompt_mu, 0.6)) + 16)
    output = min(MAX_MODEL_LEN - prompt - 1, int(rng.lognormvariate(output_mu, 0.7)) + 8)
    return prompt, output


def pressure(n: int = 96, seed: int = 0, burst_s: float = 2.0) -> list[RequestSpec]:
    """A burst whose KV demand far exceeds every replica's cache."""
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        prompt, output = _lengths(rng, 5.2, 4.6)
        specs.append(RequestSpec(rng.uniform(0, burst_s), [rng.choice(VOCAB) for _ in range(prompt)],
                                 output))
    return sorted(specs, key=lambda s: s.arrival_s)


def poisson(n: int = 120, rate: float = 4.0, seed: int = 0) -> list[RequestSpec]:
    """Open-loop Poisson arrivals with heterogeneous lengths."""
    rng = random.Random(seed)
    t, specs = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        prompt, output = _lengths(rng, 4.8, 4.2)
        specs.append(RequestSpec(t, [rng.choice(VOCAB) for _ in range(prompt)], output))
    return specs


def shared_prefix(n: int = 120, tenants: int = 4, prefix_tokens: int = 384, rate: float = 6.0,
                  seed: int = 0) -> list[RequestSpec]:
    """Multi-tenant: each tenant's requests share a long system prompt."""
    rng = random.Random(seed)
    prefixes = {f"tenant-{i}": [rng.choice(VOCAB) for _ in range(prefix_tokens)]
                for i in range(tenants)}
    t, specs = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        tenant = rng.choice(sorted(prefixes))
        suffix = [rng.choice(VOCAB) for _ in range(rng.randint(16, 128))]
        specs.append(RequestSpec(t, prefixes[tenant] + suffix, rng.randint(16, 96), tenant))
    return specs


def ramp(n: int = 400, start_rate: float = 0.5, end_rate: float = 8.0, seed: int = 0
         ) -> list[RequestSpec]:
    """Arrival rate rising linearly from `start_rate` to `end_rate` over the run."""
    rng = random.Random(seed)
    t, specs = 0.0, []
    for i in range(n):
        rate = start_rate + (end_rate - start_rate) * i / max(1, n - 1)
        t += rng.expovariate(rate)
        prompt, output = _lengths(rng, 5.0, 4.6)
        specs.append(RequestSpec(t, [rng.choice(VOCAB) for _ in range(prompt)], output))
    return specs


def latency(n: int = 60, gap_s: float = 0.25, seed: int = 0) -> list[RequestSpec]:
    """One small request at a time: end-to-end latency is the serving path's overhead."""
    rng = random.Random(seed)
    return [RequestSpec(i * gap_s, [rng.choice(VOCAB) for _ in range(32)], 2)
            for i in range(n)]


def steady(n: int = 64, rate: float = 10.0, prompt_tokens: int = 256, output_tokens: int = 96,
           seed: int = 0) -> list[RequestSpec]:
    """Fixed lengths at a constant rate: a shape other load generators reproduce exactly."""
    rng = random.Random(seed)
    return [RequestSpec(i / rate, [rng.choice(VOCAB) for _ in range(prompt_tokens)],
                        output_tokens) for i in range(n)]


WORKLOADS = {"pressure": pressure, "poisson": poisson, "shared_prefix": shared_prefix,
             "ramp": ramp, "latency": latency, "steady": steady}
