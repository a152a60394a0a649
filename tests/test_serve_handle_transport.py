"""`router.transport: serve_handle` on a real deployment: requests reach the replicas
through a pinned Ray Serve handle call instead of the data port (router/dispatch.py).

Its own short-lived deployment of deploy/deploy.yaml with only the transport changed; the
ordering in conftest.py runs it before the shared deployment starts, never beside it.
"""

import json
import time

import pytest

from blockserve.tools.launch import load_config, with_args
from deployed import ABORT_BOUND_S, LONG_STREAM, MODEL, wait_until_idle

pytestmark = pytest.mark.deployment


@pytest.fixture(scope="module")
def handle_deployment(launch):
    with launch(with_args(load_config(), router={"transport": "serve_handle"})) as deployment:
        yield deployment


def test_requests_and_streams_travel_through_the_serve_handle(handle_deployment):
    deployment = handle_deployment
    chat = deployment.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6,
        "ignore_eos": True})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 6
    tokens, usage = 0, None
    with deployment.stream("/v1/completions", {
            "model": MODEL, "prompt": [5, 6, 7], "max_tokens": 12, "stream": True,
            "logprobs": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if event["choices"]:
                    tokens += len(event["choices"][0]["logprobs"]["tokens"])
                usage = event.get("usage") or usage
    assert tokens == usage["completion_tokens"] == 12
    assert deployment.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "max_tokens": -1}).status_code == 400
    assert deployment.get("/admin/state").json()["policies"]  # the router answers
    wait_until_idle(deployment)


def test_a_closed_stream_is_aborted_through_the_handle(handle_deployment):
    """Cancelling the handle call must abort the request in vLLM, as closing the data
    port's connection does."""
    deployment = handle_deployment
    with deployment.stream("/v1/completions", LONG_STREAM) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data:")
        assert deployment.metric_sum("blockserve_ledger_reserved_blocks") > 0
        closed = time.monotonic()
    freed_after_s = wait_until_idle(deployment, timeout_s=ABORT_BOUND_S, poll_s=0.05)
    assert freed_after_s < ABORT_BOUND_S
    print(f"serve_handle: blocks free {time.monotonic() - closed:.2f}s after the close")
