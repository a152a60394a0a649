"""The router board: what every router must hear from the others (issue 28).

Routers share no routing state: each reads every replica's snapshots itself and keeps
only its own reservations. Two things must still cross routers, and both go through one
small Ray Serve deployment (`RouterBoard`, one replica; Serve restarts it and it dies with
the application), never through a protocol of our own:

- the live policies: a switch posted to one router is numbered here, and every router
  waits on the number (a long poll) and applies what it missed;
- each router's own report (its metrics and state, posted every poll interval), so that
  `/metrics` and `/admin/state` at any router show every router, and every router's
  output predictor learns the lengths the others saw finish (router/shared_lengths.py).

Neither is on a request's path. A board that restarted has forgotten both: routers post
their reports again at the next interval, and the router with the newest switch posts it
again (`Peers`).
"""

from __future__ import annotations

import asyncio
import time

# A long poll for a new switch returns after this long at the latest, so that a router
# notices a restarted board (its number went back) within it.
LONG_POLL_S = 10.0


class RouterBoard:
    """One replica's memory of the latest switch and of every router's latest report."""

    def __init__(self) -> None:
        self.version = 0
        self.policies: dict | None = None
        self.reports: dict[str, dict] = {}
        self._changed = asyncio.Event()

    async def switch(self, policies: dict, version: int | None = None) -> int:
        """Record a switch; returns its number. `version`: a router re-posting the switch
        it applied last (the board restarted): kept only if newer than the board's."""
        if version is not None and version <= self.version:
            return self.version
        self.version = version if version is not None else self.version + 1
        self.policies = policies
        self._changed.set()
        self._changed = asyncio.Event()
        return self.version

    async def after(self, version: int, wait_s: float = LONG_POLL_S) -> tuple[int, dict | None]:
        """The latest switch once its number differs from `version` (or after `wait_s`)."""
        if self.version == version:
            try:
                await asyncio.wait_for(self._changed.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        return self.version, self.policies

    async def post(self, router_id: str, report: dict) -> None:
        self.reports[router_id] = {**report, "posted_at": time.time()}

    async def read(self, fresh_s: float) -> dict[str, dict]:
        """Reports posted within `fresh_s`: a router that stopped posting has died."""
        oldest = time.time() - fresh_s
        self.reports = {r: report for r, report in self.reports.items()
                        if report["posted_at"] >= oldest}
        return self.reports
