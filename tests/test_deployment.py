"""The real application from deploy/deploy.yaml: Ray Serve, two vLLM CPU replicas, the
router, driven with the official `openai` client."""

import asyncio
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.deployment
MODEL = "tiny-llama"
PROMPT = "the quick brown fox " * 30  # ~150 tokens: 5 blocks of prompt


@pytest.fixture(scope="module")
def client(deployment):
    return openai.OpenAI(base_url=f"{deployment.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def aclient(deployment):
    return openai.AsyncOpenAI(base_url=f"{deployment.base_url}/v1", api_key="unused",
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
        return await asyncio.gather(*(one(i) for i in range(32)))

    assert asyncio.run(burst()) == [64] * 32
    for replica, before in decisions_before.items():
        assert deployment.metric_sum("blockserve_decisions_total", replica=replica) > before
    assert deployment.metric_sum("blockserve_replica_preemptions_total") == 0
    wait_until_idle(deployment)


def test_streaming_client_that_disconnects_frees_its_blocks(deployment):
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 600, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{deployment.base_url}/v1/chat/completions", json=body,
                      timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data:")
        assert deployment.metric_sum("blockserve_ledger_reserved_blocks") > 0
    # Closed after the first chunk: the router cancels, vLLM aborts, blocks come back.
    wait_until_idle(deployment)


ERROR_CASES = [
    # (description, request kwargs for httpx.post, expected status)
    ("malformed JSON", dict(content=b'{"model": ', headers={"content-type": "application/json"}),
     400),
    ("unknown model", dict(json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
     404),
    ("missing messages", dict(json={"model": MODEL}), 400),
    ("negative max_tokens", dict(json={"model": MODEL, "max_tokens": -5,
                                       "messages": [{"role": "user", "content": "x"}]}), 400),
    ("absurd max_tokens", dict(json={"model": MODEL, "max_tokens": 10**9,
                                     "messages": [{"role": "user", "content": "x"}]}), 400),
    ("prompt longer than max_model_len",
     dict(json={"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}]}), 400),
    ("needs more blocks than any replica has",
     dict(json={"model": MODEL, "n": 12, "max_tokens": 900,
                "messages": [{"role": "user", "content": "x"}]}), 400),
]


@pytest.mark.parametrize("description, request_kwargs, status", ERROR_CASES,
                         ids=[case[0] for case in ERROR_CASES])
def test_bad_requests_get_openai_errors(deployment, description, request_kwargs, status):
    response = httpx.post(f"{deployment.base_url}/v1/chat/completions", timeout=60,
                          **request_kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["code"] == status


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=-1)
    # and the server keeps serving
    assert client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2).choices
