"""What a replica sends back for one request: `ReplicaChunk`s, and the endpoints it serves.

One `json` chunk carries a whole response (or an error); a stream is a series of `sse`
chunks; a `DEAD` chunk ends a response that the replica's dead engine could not finish.
Every chunk carries the replica's latest block snapshot (protocol/snapshot.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

CHAT, COMPLETIONS = "chat", "completions"  # the OpenAI endpoints a replica serves
DEAD = "dead"  # the chunk kind that ends a response the dead engine could not finish


class ReplicaChunk(NamedTuple):
    kind: str  # "json" (whole response or error), "sse" (stream text) or DEAD
    status: int
    payload: Any  # dict for json, str for sse
    snapshot: dict
    replica_id: str
