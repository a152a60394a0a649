"""Opt-in timestamps at fixed points along a request's path, to see where its latency goes.

With `BLOCKSERVE_PATH_TRACE` set to a directory in the environment of `serve run` (Ray's
workers inherit it), the router and every replica append one line per point passed,
`<unix time> <point>`, to `<dir>/<pid>.log`. bench/latency_path.py sends one request at
a time and lines them up with its own client's points. Unset (the default), `mark` only
tests a module constant: the points stay in the data path at no measurable cost.
`POINTS` lists them in path order; each is passed once per request.
"""

from __future__ import annotations

import os
import time
from typing import TextIO

POINTS = (
    "client: sent",
    "router: handler entered",       # HAProxy, uvicorn and Serve's direct ingress before it
    "router: request validated",     # vLLM's protocol model (router/validation.py)
    "router: demand sized",          # tokenized, output predicted (router/demand.py)
    "router: admitted",              # queue, ledger, placement (router/admission.py)
    "replica: request read",         # off the data port, into VLLMReplica.generate
    "replica: vLLM request made",    # vLLM's serving layer validated and started it
    "replica: first text from vLLM",
    "router: first chunk read",
    "router: first text relayed",    # handed to the response; Serve, HAProxy after it
    "client: first event",
)
DIRECTORY = os.environ.get("BLOCKSERVE_PATH_TRACE") or None
_log: TextIO | None = None


def mark(point: str) -> None:
    """Record that this process passed `point` now (a no-op unless tracing is on)."""
    global _log
    if DIRECTORY is None:
        return
    if _log is None:
        os.makedirs(DIRECTORY, exist_ok=True)
        _log = open(os.path.join(DIRECTORY, f"{os.getpid()}.log"), "a", buffering=1)
    _log.write(f"{time.time():.6f} {point}\n")
