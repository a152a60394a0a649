"""Seeded workloads, generated locally. Prompts are token ids (completions API), so every
configuration sees exactly the same prompt lengths and shared prefixes.

A `RequestSpec` carries each request's true output length; a `Lengths` (length mode)
decides what the request tells the server about it:

- `known`: `max_tokens` = the true length L with `ignore_eos`. The router and every
  replica policy are told each output length in advance (an oracle no client gives).
- `unknown` (the default for comparisons): `max_tokens` = what the context allows
  (max_model_len - prompt tokens), as a client that sets no cap of its own gets. The
  request still ends at L: `min_tokens` = L - 1, one stop id (`end_token_id`, the
  vocabulary's last id) and `logit_bias` +100 on it. vLLM masks the stop id (-inf,
  which the bias cannot lift) until L - 1 tokens are out; token L is the first that may
  be it, and the bias makes it so: the request ends at exactly L, `finish_reason:
  stop` (the harness counts it: `length_check`). A large set of stop ids does the same
  within a few tokens, but vLLM rebuilds its min_tokens mask in Python from every id of
  every request whenever the batch changes (MinTokensLogitsProcessor.update_state),
  which would slow every configuration. `ignore_eos` is off, as a real client leaves
  it (min_tokens masks EOS too). No policy may read `min_tokens`, the stop ids or the
  bias (tests/test_length_blind.py).
Real traces scaled to the deployment are in bench/traces.py.
"""

from __future__ import annotations

import enum
import functools
import random
from dataclasses import dataclass

from blockserve.bench import traces
from blockserve.bench.request_spec import RequestSpec, random_tokens
from blockserve.tools.launch import EngineShape

END_BIAS = 100.0  # the largest logit bias vLLM accepts


class LengthMode(str, enum.Enum):
    KNOWN = "known"
    UNKNOWN = "unknown"


def end_token_id(vocab_size: int) -> int:
    """The unknown mode's stop id: the vocabulary's last."""
    return vocab_size - 1


@dataclass(frozen=True)
class Lengths:
    """What a request tells the server about its output length (module docstring)."""

    mode: LengthMode = LengthMode.KNOWN
    max_model_len: int | None = None  # the unknown mode's loose cap is what it leaves
    end_token_id: int | None = None  # ends requests in the unknown mode

    def __post_init__(self) -> None:
        if self.mode is LengthMode.UNKNOWN and self.end_token_id is None:
            raise ValueError("the unknown length mode needs an end_token_id to end requests")
        if self.mode is LengthMode.UNKNOWN and self.max_model_len is None:
            raise ValueError("the unknown length mode needs the model's max_model_len")

    def fields(self, spec: RequestSpec) -> dict:
        """The OpenAI request-body fields that set the output length."""
        if self.mode is LengthMode.KNOWN:
            return {"max_tokens": spec.output_tokens, "ignore_eos": True}
        return {"max_tokens": self.max_model_len - spec.prompt_tokens,
                "min_tokens": spec.output_tokens - 1, "ignore_eos": False,
                "stop_token_ids": [self.end_token_id],
                "logit_bias": {str(self.end_token_id): END_BIAS}}


KNOWN = Lengths()


@functools.cache
def deployed_max_model_len() -> int:
    """deploy/deploy.yaml's context length, which every generated request fits."""
    return EngineShape.of().max_model_len


def lognormal_lengths(rng: random.Random, prompt_mu: float, output_mu: float
                      ) -> tuple[int, int]:
    """Long-tailed (log-normal) prompt and output lengths that fit the deployment's
    max_model_len."""
    prompt = min(700, int(rng.lognormvariate(prompt_mu, 0.6)) + 16)
    output = min(deployed_max_model_len() - prompt - 1,
                 int(rng.lognormvariate(output_mu, 0.7)) + 8)
    return prompt, output


def pressure(n: int = 96, seed: int = 0, burst_s: float = 2.0) -> list[RequestSpec]:
    """A burst whose KV demand far exceeds every replica's cache."""
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        prompt, output = lognormal_lengths(rng, 5.2, 4.6)
        specs.append(RequestSpec(rng.uniform(0, burst_s), random_tokens(rng, prompt),
                                 output))
    return sorted(specs, key=lambda s: s.arrival_s)


def poisson(n: int = 120, rate: float = 4.0, seed: int = 0) -> list[RequestSpec]:
    """Open-loop Poisson arrivals with heterogeneous lengths."""
    rng = random.Random(seed)
    t, specs = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        prompt, output = lognormal_lengths(rng, 4.8, 4.2)
        specs.append(RequestSpec(t, random_tokens(rng, prompt), output))
    return specs


def shared_prefix(n: int = 120, tenants: int = 4, prefix_tokens: int = 384, rate: float = 6.0,
                  seed: int = 0) -> list[RequestSpec]:
    """Multi-tenant: each tenant's requests share a long system prompt."""
    rng = random.Random(seed)
    prefixes = {f"tenant-{i}": random_tokens(rng, prefix_tokens)
                for i in range(tenants)}
    t, specs = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        tenant = rng.choice(sorted(prefixes))
        suffix = random_tokens(rng, rng.randint(16, 128))
        specs.append(RequestSpec(t, prefixes[tenant] + suffix, rng.randint(16, 96), tenant))
    return specs


def cross_tenant(n: int = 120, tenants: int = 8, shared_prefixes: int = 2,
                 shared_tokens: int = 256, tenant_tokens: int = 128, rate: float = 6.0,
                 seed: int = 0) -> list[RequestSpec]:
    """Prefixes shared across tenants: tenant i's prompts open with common prefix
    i % `shared_prefixes` (instructions several tenants use), then its own prefix, then
    a question of its own; cache value that no tenant holds alone."""
    rng = random.Random(seed)
    common = [random_tokens(rng, shared_tokens) for _ in range(shared_prefixes)]
    own = [random_tokens(rng, tenant_tokens) for _ in range(tenants)]
    t, specs = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        tenant = rng.randrange(tenants)
        prompt = common[tenant % shared_prefixes] + own[tenant] + random_tokens(
            rng, rng.randint(16, 128))
        specs.append(RequestSpec(t, prompt, rng.randint(16, 96), f"tenant-{tenant}"))
    return specs


def ramp(n: int = 400, start_rate: float = 0.5, end_rate: float = 8.0, seed: int = 0
         ) -> list[RequestSpec]:
    """Arrival rate rising linearly from `start_rate` to `end_rate` over the run."""
    rng = random.Random(seed)
    t, specs = 0.0, []
    for i in range(n):
        rate = start_rate + (end_rate - start_rate) * i / max(1, n - 1)
        t += rng.expovariate(rate)
        prompt, output = lognormal_lengths(rng, 5.0, 4.6)
        specs.append(RequestSpec(t, random_tokens(rng, prompt), output))
    return specs


def latency(n: int = 60, gap_s: float = 0.25, seed: int = 0) -> list[RequestSpec]:
    """One small request at a time: end-to-end latency is the serving path's overhead."""
    rng = random.Random(seed)
    return [RequestSpec(i * gap_s, random_tokens(rng, 32), 2)
            for i in range(n)]


def steady(n: int = 64, rate: float = 10.0, prompt_tokens: int = 256, output_tokens: int = 96,
           seed: int = 0) -> list[RequestSpec]:
    """Fixed lengths at a constant rate: a shape other load generators reproduce exactly."""
    rng = random.Random(seed)
    return [RequestSpec(i / rate, random_tokens(rng, prompt_tokens),
                        output_tokens) for i in range(n)]


def azure_code(n: int = 300, seed: int = 0) -> list[RequestSpec]:
    """A seeded window of Azure's 2023 code trace, scaled to the deployment (bench/traces.py)."""
    return traces.azure_code(n, seed).specs


def mooncake(n: int = 300, seed: int = 0) -> list[RequestSpec]:
    """A seeded window of Mooncake's trace, shared prefix blocks kept (bench/traces.py)."""
    return traces.mooncake(n, seed).specs


def sharegpt(n: int = 300, seed: int = 0) -> list[RequestSpec]:
    """A seeded window of ShareGPT's conversation lengths, Poisson arrivals (bench/traces.py)."""
    return traces.sharegpt(n, seed).specs


WORKLOADS = {"pressure": pressure, "poisson": poisson, "shared_prefix": shared_prefix,
             "cross_tenant": cross_tenant,
             "ramp": ramp, "latency": latency, "steady": steady,
             "azure_code": azure_code, "mooncake": mooncake, "sharegpt": sharegpt}
