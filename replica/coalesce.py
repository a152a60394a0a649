"""Streamed chunks joined over a short window: one message to the router carries many
tokens (the replica's `stream_coalesce_ms`, widened under load; replica/deployment.py)."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable


async def coalesce(stream: AsyncIterator[str], window_s: Callable[[], float]
                   ) -> AsyncIterator[str]:
    """Pass the first item on at once (time to first token), then join what `stream`
    produces within `window_s()` of each batch's first item: one message, many tokens."""
    iterator = stream.__aiter__()
    pending: asyncio.Future | None = None
    first = True
    try:
        while True:
            pending = pending or asyncio.ensure_future(iterator.__anext__())
            try:
                batch = [await pending]
            except StopAsyncIteration:
                return
            pending = None
            deadline = time.monotonic() + (0.0 if first else window_s())
            first = False
            while (remaining := deadline - time.monotonic()) > 0:
                pending = asyncio.ensure_future(iterator.__anext__())
                done, _ = await asyncio.wait({pending}, timeout=remaining)
                if not done:
                    break
                try:
                    batch.append(pending.result())
                except StopAsyncIteration:
                    yield "".join(batch)
                    return
                pending = None
            yield "".join(batch)
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()
