"""Routing regret: the prefix hit the router predicted for a request, against the hit
its engine reported.

The prediction is the prefix credit the ledger's index gave the chosen replica when the
request was placed (`Reservation.predicted_hit_blocks`). The engine's report is vLLM's
own count of the request's prompt tokens served from its prefix cache,
`usage.prompt_tokens_details.cached_tokens` (the replicas turn vLLM's
`enable_prompt_tokens_details` on). vLLM always computes a prompt's last token, so a
fully cached prompt reports one block less when its length is a multiple of the block
size; the prediction is capped the same way before the two are compared.
"""

from __future__ import annotations

from typing import Any

from blockserve.router.usage import usage_event


def predicted_hit_tokens(credit_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens a prefix credit says vLLM will find cached."""
    return min(credit_blocks, max(0, prompt_tokens - 1) // block_size) * block_size


def reported_hit(payload: Any) -> tuple[int, int] | None:
    """(prompt tokens, cached prompt tokens) from a whole response (a dict) or from the
    stream message that carries the usage event (text); None if it says nothing."""
    if isinstance(payload, str):
        payload = usage_event(payload)
    usage = payload.get("usage") if isinstance(payload, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    if not isinstance(details, dict) or not isinstance(details.get("cached_tokens"), int):
        return None
    return usage.get("prompt_tokens") or 0, details["cached_tokens"]
