"""The real application from deploy/deploy.yaml: Ray Serve, two vLLM CPU replicas, the
router, driven with the official `openai` client."""

import asyncio
import time

import httpx
import openai
import pytest

from controller.launch import load_config

pytestmark = pytest.mark.deployment
MODEL = "tiny-llama"
PROMPT = "the quick brown fox " * 30  # ~150 tokens: 5 blocks of prompt
# A stream that outlasts the checks made while it runs (about a thousand engine steps).
LONG_STREAM = {"model": MODEL, "prompt": [7, 8, 9, 10], "max_tokens": 1000, "stream": True,
               "ignore_eos": True}


@pytest.fixture(scope="module")
def client(deployment_session):
    return openai.OpenAI(base_url=f"{deployment_session.base_url}/v1",
                         api_key=deployment_session.api_key, max_retries=0)


@pytest.fixture
def aclient(deployment):
    """Per test: an async client is bound to the event loop of one asyncio.run(), and is
    closed inside it (`async with aclient`)."""
    return openai.AsyncOpenAI(base_url=f"{deployment.base_url}/v1", api_key=deployment.api_key,
                              max_retries=0, timeout=120)


def wait_until_idle(deployment, timeout_s=30):
    """The ledger holds no reservation and no replica holds blocks for a request."""
    deadline = time.time() + timeout_s
    while True:
        reserved = deployment.metric_sum("blockserve_ledger_reserved_blocks")
        held = deployment.metric_sum("blockserve_replica_kv_blocks", state="held")
        in_flight = deployment.metric_sum("blockserve_ledger_in_flight_requests")
        if reserved == held == in_flight == 0:
            return
        if time.time() > deadline:
            raise AssertionError(f"not idle: reserved={reserved} held={held} "
                                 f"in_flight={in_flight}")
        time.sleep(0.5)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_non_streaming_usage_adds_up(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=12,
        extra_body={"ignore_eos": True})
    usage = response.usage
    assert response.choices[0].finish_reason == "length"
    assert usage.completion_tokens == 12
    assert usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=20,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text
    assert usage.completion_tokens == 20
    assert usage.total_tokens == usage.prompt_tokens + 20


def test_completions_non_streaming_and_streaming(client):
    response = client.completions.create(model=MODEL, prompt="def main():", max_tokens=10,
                                         extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 10 and response.choices[0].text
    stream = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=8,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == 4


def test_burst_overfilling_both_caches_uses_both_replicas_without_preemption(
        deployment, aclient):
    """32 requests x ~7 blocks = ~220 blocks against 2 x 160: both replicas fill up."""
    decisions_before = {r: deployment.metric_sum("blockserve_decisions_total", replica=r)
                        for r in deployment.metrics_replicas()}

    async def one(i):
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": f"{i} {PROMPT}"}],
                      max_tokens=64, extra_body={"ignore_eos": True})
        if i % 2:
            response = await aclient.chat.completions.create(**kwargs)
            return response.usage.completion_tokens
        stream = await aclient.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True})
        return [c async for c in stream][-1].usage.completion_tokens

    async def burst():
        async with aclient:
            return await asyncio.gather(*(one(i) for i in range(32)))

    assert asyncio.run(burst()) == [64] * 32
    for replica, before in decisions_before.items():
        assert deployment.metric_sum("blockserve_decisions_total", replica=replica) > before
    assert deployment.metric_sum("blockserve_replica_preemptions_total") == 0
    wait_until_idle(deployment)


@pytest.mark.parametrize("placement, goes_to", [("MostFreeBlocks", "idle"),
                                                ("BestFitBlocks", "busy")])
def test_routing_follows_free_blocks(deployment, placement, goes_to):
    """A long request takes blocks on one replica; where the next one goes follows the
    ledger's free blocks: the emptier replica when spreading, the tighter fit when packing."""
    original = deployment.get("/admin/state").json()["policies"]
    assert deployment.post("/admin/policies", json={
        "placement": f"router.placement:{placement}"}).status_code == 200
    replicas = sorted(deployment.metrics_replicas())
    before = {r: deployment.metric_sum("blockserve_decisions_total", replica=r)
              for r in replicas}
    try:
        with deployment.stream("/v1/completions", LONG_STREAM) as response:
            assert response.status_code == 200, response.read()
            lines = response.iter_lines()  # kept: a dropped iterator closes the connection
            assert next(lines).startswith("data:")
            # Only two calls while the long request runs, so it is still running.
            state = deployment.get("/admin/state").json()["replicas"]
            assert deployment.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4}).status_code == 200
        busy = [r["replica_id"] for r in state if r["reserved_blocks"] > 0]
        assert len(busy) == 1, [(r["replica_id"], r["reserved_blocks"]) for r in state]
        idle = [r for r in replicas if r not in busy]
        delta = {r: deployment.metric_sum("blockserve_decisions_total", replica=r) - before[r]
                 for r in replicas}
        # The long request's own admission counts on the busy replica.
        expected = {busy[0]: 2, idle[0]: 0} if goes_to == "busy" else \
            {busy[0]: 1, idle[0]: 1}
        assert delta == expected
    finally:
        deployment.post("/admin/policies", json=original)
    wait_until_idle(deployment)


def test_streaming_client_that_disconnects_frees_its_blocks(deployment):
    body = LONG_STREAM
    with deployment.stream("/v1/completions", body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data:")
        assert deployment.metric_sum("blockserve_ledger_reserved_blocks") > 0
    # Closed after the first chunk: the router cancels, vLLM aborts, blocks come back.
    wait_until_idle(deployment)


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=-1)
    # and the server keeps serving
    assert client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2).choices


def test_snapshot_reaches_the_router_and_agrees_with_vllm(deployment):
    """The block-aware scheduler runs in the real engine: its snapshot changes under load,
    stays fresh while the engine is busy, and matches vLLM's own kv_cache_usage."""
    samples = []

    async def sample_while_busy():
        async with httpx.AsyncClient(base_url=deployment.base_url, timeout=60,
                                     headers=deployment.headers) as http:
            async def one(i):
                body = {"model": MODEL, "max_tokens": 400, "stream": True, "ignore_eos": True,
                        "messages": [{"role": "user", "content": f"{i} {PROMPT}"}]}
                # Read raw bytes: parsing 16 streams would starve this sampling loop.
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    async for _ in response.aiter_raw():  # chunks carry fresh snapshots
                        pass

            task = asyncio.gather(*(one(i) for i in range(16)))
            while not task.done():
                samples.append((await http.get("/admin/state")).json())
                await asyncio.sleep(0.05)
            await task

    asyncio.run(sample_while_busy())
    busy = [r for state in samples for r in state["replicas"] if r["snapshot"]["running"] > 0]
    assert busy, f"none of {len(samples)} samples saw a running request"
    assert max(r["snapshot"]["held_blocks"] for r in busy) > 0
    # Age of the engine's own report when the router answered (this client's clock, on
    # a saturated machine, would measure its own scheduling delays too).
    ages = sorted(r["snapshot_age_s"] for r in busy)
    assert ages[len(ages) // 2] < 0.5, ages
    for replica in busy:
        snap, engine = replica["snapshot"], replica["engine"]
        assert abs(snap["held_blocks"] / snap["total_blocks"] - engine["vllm_kv_cache_usage"]) \
            < 0.25  # sampled a step or two apart under load
    wait_until_idle(deployment)
    state = deployment.get("/admin/state").json()
    for replica in state["replicas"]:  # idle: both views agree exactly
        snap = replica["snapshot"]
        assert snap["held_blocks"] / snap["total_blocks"] == replica["engine"]["vllm_kv_cache_usage"]
        assert snap["total_blocks"] == 160 and snap["block_size"] == 32


def test_policy_switch_under_load_loses_no_request(deployment, aclient):
    url = f"{deployment.base_url}/admin/policies"
    original = deployment.get("/admin/state").json()["policies"]

    async def scenario():
        async def one(i):
            response = await aclient.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"{i} {PROMPT}"}],
                max_tokens=32, extra_body={"ignore_eos": True})
            return response.usage.completion_tokens

        async with aclient, httpx.AsyncClient(timeout=30, headers=deployment.headers) as http:
            tasks = [asyncio.ensure_future(one(i)) for i in range(24)]
            await asyncio.sleep(0.3)
            switched = await http.post(url, json={
                "placement": "router.placement:RoundRobin",
                "queue_order": {"cls": "router.ordering:ShortestDemandFirst",
                                "kwargs": {"max_wait_s": 5}}})
            results = await asyncio.gather(*tasks)
            restored = await http.post(url, json={"placement": original["placement"],
                                                  "queue_order": original["queue_order"]})
        return switched, results, restored

    switched, results, restored = asyncio.run(scenario())
    assert switched.status_code == 200
    assert switched.json()["policies"]["placement"]["cls"] == "router.placement:RoundRobin"
    assert results == [32] * 24
    assert restored.json()["policies"] == original
    assert deployment.post("/admin/policies",
                           json={"placement": "no.such:Policy"}).status_code == 400
    wait_until_idle(deployment)


def test_status_command_shows_replicas(deployment, capsys):
    from controller.cli import main

    assert main(["status", "--url", deployment.base_url, "--api-key", deployment.api_key]) == 0
    output = capsys.readouterr().out
    placement = load_config()["applications"][0]["args"]["router"]["placement"]
    assert placement.rpartition(":")[2] in output
    assert len([line for line in output.splitlines() if line.strip().endswith(
        tuple("0123456789"))]) >= 2
