"""A router's side of the router board (router/board.py): it follows the live policy
switches every router posts, and posts its own report for the others to show."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from blockserve.router.board import LONG_POLL_S

logger = logging.getLogger("blockserve.router")

# A report older than this many poll intervals is a router that died.
FRESH_INTERVALS = 3


class Peers:
    def __init__(self, board: Any, router_id: str, interval_s: float,
                 apply: Callable[[dict], None], report: Callable[[], dict],
                 long_poll_s: float = LONG_POLL_S,
                 on_read: Callable[[dict[str, dict]], None] = lambda others: None) -> None:
        """`board`: the RouterBoard deployment's handle; `apply(policies)` installs a
        switch another router took; `report()` is this router's own state and series;
        `on_read(others)` hears the other live routers' reports after each read of the
        board."""
        self.board, self.router_id, self.interval_s = board, router_id, interval_s
        self.long_poll_s = long_poll_s
        self.apply, self.report, self.on_read = apply, report, on_read
        self.version = 0  # the number of the latest switch applied here
        self.policies: dict | None = None
        self._others: dict[str, dict] = {}  # the other routers' reports, as last read

    def start(self, loop: asyncio.AbstractEventLoop) -> list[asyncio.Task]:
        return [loop.create_task(self._follow()), loop.create_task(self._exchange())]

    @property
    def others(self) -> dict[str, dict]:
        """The other routers' reports that are still fresh. Filtered here too, not only
        on the board: while the board is unreachable (its node lost, Serve restarting
        it) the last read would otherwise keep a dead router listed."""
        oldest = time.time() - FRESH_INTERVALS * self.interval_s
        return {r: report for r, report in self._others.items()
                if report["posted_at"] >= oldest}

    async def switch(self, policies: dict) -> int:
        """Post a switch this router has applied; returns its number."""
        self.version = await self.board.switch.remote(policies)
        self.policies = policies
        return self.version

    async def _follow(self) -> None:
        while True:
            try:
                version, policies = await self.board.after.remote(self.version, self.long_poll_s)
                if version < self.version and self.policies is not None:
                    await self.board.switch.remote(self.policies, self.version)  # restarted
                elif version > self.version and policies is not None:
                    if policies != self.policies:  # not this router's own, already in
                        self.apply(policies)
                    self.version, self.policies = version, policies
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the board restarting: asked again
                logger.warning("router board unreachable: %r", exc)
                await asyncio.sleep(self.interval_s)

    async def _exchange(self) -> None:
        while True:
            try:
                await self.board.post.remote(self.router_id, self.report())
                reports = await self.board.read.remote(FRESH_INTERVALS * self.interval_s)
                self._others = {r: report for r, report in reports.items()
                                if r != self.router_id}
                self.on_read(self.others)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("router board unreachable: %r", exc)
            await asyncio.sleep(self.interval_s)
