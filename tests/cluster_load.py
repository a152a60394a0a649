"""Load with a known block demand, for tests that need requests waiting in the router's
queue of the real deployment (deploy/deploy.yaml: two replicas of 160 blocks of 32).

A fill request is a completion of FILL_PROMPT_TOKENS unique token ids (30 full blocks and
one token) and at most FILL_MAX_TOKENS output tokens. Whatever output length the router
predicts for it (predictions stay within max_tokens), its demand is FILL_BLOCKS blocks,
and PER_REPLICA of them fill a replica: the ones after those wait in the router's queue.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx

MODEL = "tiny-llama"
BLOCK = 32
FILL_PROMPT_TOKENS = 30 * BLOCK + 1
FILL_MAX_TOKENS = BLOCK - 1
FILL_BLOCKS = 31
PER_REPLICA = 160 // FILL_BLOCKS  # 5: 155 of 160 blocks; a sixth does not fit
PRIORITY_HEADER, TENANT_HEADER = "x-blockserve-priority", "x-blockserve-tenant"


def fill_body(rng: random.Random, prompt_tokens: int = FILL_PROMPT_TOKENS,
              max_tokens: int = FILL_MAX_TOKENS) -> dict:
    """A completion whose prompt shares no block with any other (no prefix credit)."""
    return {"model": MODEL, "prompt": [rng.randrange(10, 4000) for _ in range(prompt_tokens)],
            "max_tokens": max_tokens, "ignore_eos": True}


class Router:
    """The router's admissions and queue as the tests watch them, over one async client."""

    def __init__(self, http: httpx.AsyncClient):
        self.http = http

    async def admitted(self) -> float:
        """Admissions so far (the decisions counter, summed over replicas and policies)."""
        text = (await self.http.get("/metrics")).text
        return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                   if line.startswith("blockserve_decisions_total{"))

    async def state(self) -> dict:
        return (await self.http.get("/admin/state")).json()

    async def all_arrived(self, since: float, sent: int, timeout_s: float = 30
                          ) -> tuple[int, int]:
        """Poll until every one of `sent` requests (sent after `since` admissions) was
        admitted or is queued; returns (admitted, queued) at that moment. Admissions are
        read first, so a pair that adds up was not split by an admission."""
        deadline = time.monotonic() + timeout_s
        while True:
            admitted = round(await self.admitted() - since)
            queued = (await self.state())["queue"]["requests"]
            if admitted + queued == sent:
                return admitted, queued
            assert time.monotonic() < deadline, (
                f"{sent} sent, {admitted} admitted, {queued} queued after {timeout_s}s")
            await asyncio.sleep(0.02)


async def finished_at(http: httpx.AsyncClient, body: dict, headers: dict | None = None
                      ) -> float:
    """Send a whole (non-streamed) completion; when it ended, after checking it."""
    response = await http.post("/v1/completions", json=body, headers=headers or {})
    assert response.status_code == 200, response.text[:300]
    assert response.json()["usage"]["completion_tokens"] == body["max_tokens"]
    return time.perf_counter()
