"""One workload request (`RequestSpec`: its arrival, prompt and true output length) and
random prompts that share nothing by chance: what the generated workloads
(bench/workloads.py) and the trace readers (bench/traces.py) both build, below both."""

from __future__ import annotations

import random
from dataclasses import dataclass

VOCAB = range(10, 4000)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    """`n` token ids drawn from `VOCAB`: prompts that share nothing by chance."""
    return [rng.choice(VOCAB) for _ in range(n)]


@dataclass(frozen=True)
class RequestSpec:
    arrival_s: float
    prompt: list[int] | str  # token ids; text where a target cannot take ids
    output_tokens: int  # the true output length; the length mode decides what is sent
    tenant: str = "default"
    text_prompt_tokens: int | None = None  # a text prompt's length as the server counts it
    session: str | None = None  # a conversation's id, where a workload file names one

    @property
    def prompt_tokens(self) -> int:
        if isinstance(self.prompt, str):
            if self.text_prompt_tokens is None:
                raise ValueError("a text prompt needs text_prompt_tokens")
            return self.text_prompt_tokens
        return len(self.prompt)
