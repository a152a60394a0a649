"""The load client: replays a workload open-loop against OpenAI endpoints and records
per-request TTFT, inter-token latency, end-to-end latency and status."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import asdict, dataclass

import httpx
import openai

from blockserve.bench.workloads import KNOWN, Lengths, RequestSpec


@dataclass
class RequestRecord:
    index: int
    tenant: str
    status: int
    ttft_s: float | None
    itl_s: float | None
    e2e_s: float
    output_tokens: int
    prompt_tokens: int | None  # as the server counted them
    finish_reason: str | None = None
    cached_tokens: int | None = None  # prompt tokens the engine served from its prefix cache

    def to_dict(self) -> dict:
        return asdict(self)


async def replay(specs: list[RequestSpec], base_urls: list[str], api_key: str, model: str,
                 progress=None, lengths: Lengths = KNOWN) -> tuple[list[RequestRecord], float]:
    """Client-side round robin over `base_urls` (one URL: the router does the routing);
    `lengths` decides what each request says about its output length."""
    clients = [openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0,
                                  timeout=600,
                                  http_client=httpx.AsyncClient(
                                      limits=httpx.Limits(max_connections=1000), timeout=600))
               for url in base_urls]
    turn = itertools.cycle(clients)
    started = time.perf_counter()

    async def one(index: int, spec: RequestSpec, client) -> RequestRecord:
        await asyncio.sleep(max(0.0, spec.arrival_s - (time.perf_counter() - started)))
        sent = time.perf_counter()
        first, tokens, prompt_tokens, status, finish = None, 0, None, 200, None
        cached = None
        fields = lengths.fields(spec)
        try:
            stream = await client.completions.create(
                model=model, prompt=spec.prompt, max_tokens=fields.pop("max_tokens"),
                stream=True, stream_options={"include_usage": True}, user=spec.tenant,
                extra_body=fields)
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.perf_counter() - sent
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
                    prompt_tokens = chunk.usage.prompt_tokens
                    details = getattr(chunk.usage, "prompt_tokens_details", None)
                    cached = getattr(details, "cached_tokens", None)
        except openai.APIStatusError as exc:
            status = exc.status_code
        except (openai.APIError, httpx.HTTPError):
            status = 599
        e2e = time.perf_counter() - sent
        itl = (e2e - first) / (tokens - 1) if first is not None and tokens > 1 else None
        if progress is not None:
            progress.update(1)
        return RequestRecord(index, spec.tenant, status, first, itl, e2e, tokens,
                             prompt_tokens, finish, cached)

    records = await asyncio.gather(*(one(i, spec, next(turn)) for i, spec in enumerate(specs)))
    makespan = time.perf_counter() - started
    for client in clients:
        await client.close()
    return list(records), makespan
