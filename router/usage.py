"""How many tokens a finished request generated, read from its response's `usage`.

This is the output predictor's only feedback (router/predictors.py), and the channel a
production router has too: a whole response carries `usage`; a stream carries it in a
last event when `stream_options.include_usage` is set. The router sets it on every
stream it forwards and removes that event again for a client that did not ask for it.
"""

from __future__ import annotations

import json
from typing import Any

# vLLM's usage event in a stream: no choices, then the usage object.
_USAGE_EVENT = '"choices":[],"usage":'


def request_stream_usage(body: dict) -> bool:
    """Make a streamed request report its usage; True if the client did not ask for it
    (the router must then strip the usage event)."""
    if not body.get("stream"):
        return False
    options = body.get("stream_options") or {}
    if options.get("include_usage"):
        return False
    # Per-chunk usage only comes with include_usage, which this client did not ask for.
    body["stream_options"] = {**options, "include_usage": True,
                              "continuous_usage_stats": False}
    return True


def completion_tokens(response: Any) -> int | None:
    """`usage.completion_tokens` of a whole response (None if it has none)."""
    usage = response.get("usage") if isinstance(response, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) else None


def _is_usage(event: str) -> bool:
    return _USAGE_EVENT in event and event.startswith("data: ")


def usage_event(text: str) -> dict | None:
    """The response object of the usage event in one SSE message (None if it has none)."""
    if _USAGE_EVENT not in text:
        return None
    for event in text.split("\n\n"):
        if _is_usage(event):
            try:
                return json.loads(event[len("data: "):])
            except ValueError:
                return None
    return None


def stream_usage(text: str, strip: bool) -> tuple[int | None, str]:
    """(completion tokens, text to relay) for one message of an SSE stream: the tokens
    if the message holds the usage event, and the text without that event if `strip`."""
    tokens = completion_tokens(usage_event(text))
    if tokens is None or not strip:
        return tokens, text
    return tokens, "\n\n".join(event for event in text.split("\n\n") if not _is_usage(event))
