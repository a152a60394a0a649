"""Block demand of a request, computed at the router with the model's own tokenizer.

demand = blocks for (prompt tokens + expected output tokens) per sequence. The prompt
is tokenized through the model's chat template; the expected output comes from a
pluggable predictor (router/predictors.py) that sees the `max_tokens` cap, if any. The prompt's
block hashes (chained per full block, like vLLM's prefix cache) let placement credit
replicas that probably hold the prefix already.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from blockserve.protocol.blocks import blocks_for
from blockserve.protocol.router_policies import OutputPredictor
from blockserve.router.predictors import MaxTokensPredictor
from blockserve.router.shared_lengths import SharedLengths


class Rejected(Exception):
    """The router will not serve a request: 400 (it can never be served as asked), 429
    (queue full or waited too long, with a Retry-After forecast), 503 (no replica)."""

    def __init__(self, status: int, reason: str, message: str,
                 retry_after_s: int | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.param = param


@dataclass(frozen=True)
class Demand:
    prompt_tokens: int
    expected_output: int
    sequences: int
    block_size: int
    prefix_hashes: tuple[int, ...] = ()
    priority: int = 0
    tenant: str = "default"

    @cached_property
    def prompt_blocks(self) -> int:
        return blocks_for(self.prompt_tokens, self.block_size)

    @cached_property
    def blocks(self) -> int:
        per_sequence = blocks_for(self.prompt_tokens + self.expected_output, self.block_size)
        # Sequences of one request share the prompt's blocks and grow their own outputs.
        return per_sequence + (self.sequences - 1) * (per_sequence - self.prompt_blocks + 1)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.expected_output * self.sequences


def prefix_hashes(token_ids: list[int], block_size: int) -> tuple[int, ...]:
    hashes, parent = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return tuple(hashes)


class DemandEstimator:
    def __init__(self, tokenizer: Any, predictor: OutputPredictor | None = None):
        self.tokenizer = tokenizer
        self.predictor = predictor or MaxTokensPredictor()
        # Finished requests' lengths: the predictor learns them, this router's and the
        # other routers' (router/shared_lengths.py).
        self.lengths = SharedLengths(self.predictor)
        # (token ids, block size) -> the prompt's block hashes; the exact prefix index
        # swaps in vLLM's own (router/kv_events.py).
        self.block_hasher = prefix_hashes

    def chat(self, request: Any, block_size: int, max_model_len: int, **labels: Any) -> Demand:
        messages = [{"role": m.get("role", "user"), "content": _text(m.get("content"))}
                    for m in (dict(m) for m in request.messages)]
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys")
                       else ids)
        except Exception:  # a template this tokenizer cannot render: count the text
            ids = self.tokenizer.encode("\n".join(m["content"] for m in messages))
        max_tokens = request.max_completion_tokens or request.max_tokens
        return self.of_tokens([ids], request.n or 1, max_tokens, block_size, max_model_len,
                              **labels)

    def completion(self, request: Any, block_size: int, max_model_len: int,
                   **labels: Any) -> Demand:
        prompts = request.prompt if isinstance(request.prompt, list) else [request.prompt]
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        ids = [p if isinstance(p, list) else self.tokenizer.encode(p or "") for p in prompts]
        return self.of_tokens(ids, (request.n or 1) * max(1, len(ids)), request.max_tokens,
                              block_size, max_model_len, **labels)

    def of_tokens(self, prompts: list[list[int]], sequences: int, max_tokens: int | None,
                  block_size: int, max_model_len: int, **labels: Any) -> Demand:
        """The demand of tokenized prompts (the simulator's entry point too)."""
        prompt_tokens = max((len(p) for p in prompts), default=0)
        if prompt_tokens >= max_model_len:
            raise Rejected(400, "invalid", f"This model's maximum context length is "
                           f"{max_model_len} tokens; the prompt has {prompt_tokens} tokens.",
                           param="messages")
        if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
            raise Rejected(400, "invalid", f"max_tokens={max_tokens} plus the prompt's "
                           f"{prompt_tokens} tokens exceeds this model's maximum context "
                           f"length of {max_model_len} tokens.", param="max_tokens")
        expected = self.predictor.predict(prompt_tokens, max_tokens, max_model_len - prompt_tokens,
                                          labels.get("tenant", "default"))
        return Demand(prompt_tokens, expected, sequences, block_size,
                      self.block_hasher(prompts[0], block_size) if prompts else (), **labels)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # text parts: joined as vLLM joins them, by newlines
        return "\n".join(part["text"] for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""
