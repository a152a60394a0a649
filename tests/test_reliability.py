"""Faults against the real deployment: bad input, auth, disconnects, overload."""

import asyncio
import random
import time
import uuid

import httpx
import openai
import pytest

from cluster_load import Router, fill_body, finished_at
from deployed import MODEL, PROMPT, TOO_MANY_BLOCKS, wait_until_idle

pytestmark = pytest.mark.deployment

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
JSON = {"content-type": "application/json"}
HELLO = [{"role": "user", "content": "hello"}]

# (name, path, httpx.post keyword arguments, expected status). Add a row to add a case.
BAD_INPUT = [
    ("malformed JSON", CHAT, dict(content=b'{"model": ', headers=JSON), 400),
    ("invalid UTF-8", CHAT, dict(content=b'{"model": "\xff\xfe"}', headers=JSON), 400),
    ("JSON that is not an object", CHAT, dict(json=[1, 2]), 400),
    ("wrong content type", CHAT, dict(content=b"hello", headers={"content-type": "text/plain"}),
     415),
    ("body of several MB", CHAT, dict(json={"model": MODEL, "messages": [
        {"role": "user", "content": "x" * (6 * 1024 * 1024)}]}), 413),
    ("unknown model", CHAT, dict(json={"model": "nope", "messages": HELLO}), 404),
    ("missing messages", CHAT, dict(json={"model": MODEL}), 400),
    ("empty messages", CHAT, dict(json={"model": MODEL, "messages": []}), 400),
    ("messages of the wrong type", CHAT, dict(json={"model": MODEL, "messages": "hello"}), 400),
    ("max_tokens not a number", CHAT, dict(json={"model": MODEL, "messages": HELLO,
                                                  "max_tokens": "many"}), 400),
    ("negative max_tokens", CHAT, dict(json={"model": MODEL, "messages": HELLO,
                                              "max_tokens": -5}), 400),
    ("zero max_tokens", CHAT, dict(json={"model": MODEL, "messages": HELLO, "max_tokens": 0}),
     400),
    ("absurd max_tokens", CHAT, dict(json={"model": MODEL, "messages": HELLO,
                                            "max_tokens": 10**9}), 400),
    ("temperature out of range", CHAT, dict(json={"model": MODEL, "messages": HELLO,
                                                   "temperature": -1, "max_tokens": 4}), 400),
    ("unknown field", CHAT, dict(json={"model": MODEL, "messages": HELLO, "max_tokens": 4,
                                        "frobnicate": True}), 400),
    ("prompt longer than max_model_len", CHAT, dict(json={"model": MODEL, "messages": [
        {"role": "user", "content": "word " * 3000}]}), 400),
    ("needs more blocks than any replica has", CHAT, dict(json=TOO_MANY_BLOCKS), 400),
    ("completion without prompt", COMPLETIONS, dict(json={"model": MODEL}), 400),
    ("completion prompt of the wrong type", COMPLETIONS, dict(json={
        "model": MODEL, "prompt": {"text": "x"}}), 400),
    ("completion token ids beyond max_model_len", COMPLETIONS, dict(json={
        "model": MODEL, "prompt": list(range(2000)), "max_tokens": 4}), 400),
]


@pytest.mark.parametrize("name, path, kwargs, status", BAD_INPUT,
                         ids=[case[0] for case in BAD_INPUT])
def test_bad_input_gets_an_openai_error(deployment, name, path, kwargs, status):
    response = deployment.post(path, **kwargs)
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert error["code"] == status and error["type"]
    assert len(error["message"]) > 10  # says what was wrong


def test_server_keeps_serving_after_bad_input(deployment):
    response = deployment.post(CHAT, json={"model": MODEL, "messages": HELLO, "max_tokens": 3})
    assert response.status_code == 200
    wait_until_idle(deployment)


def test_api_key_is_checked_on_the_api_and_admin_but_not_health_or_metrics(deployment):
    """Reading state and switching policies need the key, like the API."""
    for path in ("/v1/models", "/admin/state"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = httpx.get(f"{deployment.base_url}{path}", headers=headers, timeout=10)
            assert response.status_code == 401, path
            assert response.json()["error"]["code"] == 401
    unauthorised = openai.OpenAI(base_url=f"{deployment.base_url}/v1", api_key="wrong",
                                 max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        unauthorised.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    before = deployment.get("/admin/state").json()["policies"]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(f"{deployment.base_url}/admin/policies", headers=headers,
                              json={"placement": "round_robin"}, timeout=10)
        assert response.status_code == 401 and response.json()["error"]["code"] == 401
    assert deployment.get("/admin/state").json()["policies"] == before  # not switched
    assert httpx.get(f"{deployment.base_url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{deployment.base_url}/metrics", timeout=10).status_code == 200


def test_clients_that_disconnect_while_queued_leave_nothing_behind(deployment):
    """Both caches full of fills (tests/cluster_load.py), so the probes wait in the
    router's queue; each gives up before its first token. Their places go at once (the
    queue then holds only fills), exactly the requests still connected are admitted (a
    leaked queue entry would be admitted once blocks free up, and counted), every fill
    gets all its tokens, and no reservation is left. Several probes, because a close
    that never reaches the router was intermittent (deploy/haproxy)."""
    fills, probes = 30, 8  # 10 fills admitted at once, 20 queued ahead of the probes

    async def scenario():
        rng = random.Random(uuid.uuid4().int)
        async with httpx.AsyncClient(base_url=deployment.base_url, timeout=120,
                                     headers=deployment.headers) as http:
            router = Router(http)
            since = await router.admitted()
            retried_before = (await router.state())["retried_requests"]
            filling = [asyncio.ensure_future(finished_at(http, fill_body(rng)))
                       for _ in range(fills)]
            await router.all_arrived(since, fills)
            waiting = [asyncio.ensure_future(http.post(CHAT, json={
                "model": MODEL, "messages": [{"role": "user", "content": f"{i} {PROMPT}"}],
                "max_tokens": 8, "stream": True})) for i in range(probes)]
            admitted, queued = await router.all_arrived(since, fills + probes)
            assert not any(p.done() for p in waiting) and admitted < fills  # FCFS: queued
            for probe in waiting:
                probe.cancel()  # gives up: its connection closes
            await asyncio.gather(*waiting, return_exceptions=True)
            # Gone from the queue within seconds, none admitted: only fills are counted.
            await router.all_arrived(since, fills, timeout_s=3)
            finished = await asyncio.gather(*filling)
            retried = (await router.state())["retried_requests"] - retried_before
        return finished, since, retried

    finished, since, retried = asyncio.run(scenario())
    assert len(finished) == fills
    wait_until_idle(deployment)
    # A request placed again after a replica failed (router/failover.py) is decided twice.
    admitted = deployment.metric_sum("blockserve_decisions_total") - since - retried
    assert admitted == fills, (f"{admitted} admitted for {fills} connected requests "
                               f"({retried} placed again after a failure)")
    assert deployment.metric_sum("blockserve_queue_requests") == 0


def test_overload_gets_429_with_retry_after_and_admitted_requests_finish(deployment):
    """Far more requests than KV capacity plus the queue bound (256), each long enough
    (64 tokens) that the queue fills before the admitted ones finish."""

    async def scenario():
        async with httpx.AsyncClient(timeout=300, headers=deployment.headers,
                                     limits=httpx.Limits(max_connections=500)) as http:
            async def one(i):
                response = await http.post(f"{deployment.base_url}{CHAT}", json={
                    "model": MODEL, "max_tokens": 64, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"{i} {PROMPT}"}]})
                return response

            return await asyncio.gather(*(one(i) for i in range(400)))

    started = time.time()
    responses = asyncio.run(scenario())
    statuses = [r.status_code for r in responses]
    rejected = [r for r in responses if r.status_code == 429]
    assert set(statuses) <= {200, 429}, set(statuses)
    assert rejected, "the queue bound never bit"
    assert all(int(r.headers["Retry-After"]) >= 1 for r in rejected)
    assert all(r.json()["error"]["code"] == 429 for r in rejected)
    served = [r for r in responses if r.status_code == 200]
    assert all(r.json()["usage"]["completion_tokens"] == 64 for r in served)
    assert len(served) >= 256
    print(f"overload: {len(served)} served, {len(rejected)} rejected with 429 in "
          f"{time.time() - started:.1f}s")
    wait_until_idle(deployment)
    assert deployment.metric_sum("blockserve_rejections_total", reason="queue_full") >= \
        len(rejected)
