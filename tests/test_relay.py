"""router/relay.py without an engine: the real queue, ledger, failover and metrics
(tests/router_parts.py), with a transport that plays back a replica's chunks."""

import asyncio
import json

import pytest

from blockserve.protocol.chunks import ReplicaChunk
from blockserve.router.demand import Demand, DemandEstimator
from blockserve.router.dispatch import ReplicaUnavailable
from blockserve.router.predictors import OnlineQuantilePredictor
from blockserve.router.relay import Relay
from router_parts import SNAPSHOT, PlayedBack, router_parts

USAGE = {"prompt_tokens": 40, "completion_tokens": 7, "total_tokens": 47}


def chunk(kind, payload, status=200):
    return ReplicaChunk(kind, status, payload, SNAPSHOT.to_dict(), "a")


def respond(transport, body, clock=None, **router):
    """The response to `body`, its streamed parts, and the parts it went through (with
    `router`'s policies, and the queue on `clock` if given)."""
    parts = router_parts(transport, **router)
    if clock is not None:
        parts.queue.clock = clock
    estimator = DemandEstimator(None, OnlineQuantilePredictor(min_samples=1))
    reported = []
    relay = Relay(transport, parts.queue, parts.ledger, parts.failover, parts.metrics,
                  estimator, lambda replica_id, data: reported.append(replica_id))

    async def go():
        lease = await parts.queue.admit(Demand(40, 16, 1, 16))
        response = await relay.respond("completions", body, lease, arrived=0.0)
        streamed = [part async for part in response.body_iterator] \
            if hasattr(response, "body_iterator") else []
        return response, streamed
    response, streamed = asyncio.run(go())
    return response, streamed, parts, estimator.predictor, reported


def test_a_whole_response_is_relayed_released_learned_from_and_counted():
    transport = PlayedBack(chunks=[chunk("json", {"choices": [], "usage": USAGE})])
    response, _, parts, predictor, reported = respond(transport, {"prompt": "x", "priority": 5})
    assert response.status_code == 200 and json.loads(response.body)["usage"] == USAGE
    assert parts.ledger.reserved_blocks() == 0  # the lease is released
    assert reported == ["a"]  # the chunk's snapshot went to membership
    sent = transport.bodies[0]
    assert sent["priority"] == 0 and sent["vllm_xargs"]  # vLLM's priority off, hints on
    assert predictor.predict(40, None, 900) == 7  # the usage trained the predictor
    assert parts.metric("blockserve_request_duration_seconds_count", status="200") == 1
    assert parts.metric("blockserve_time_to_first_token_seconds_count") == 1


def test_a_stream_strips_the_usage_the_client_did_not_ask_for_and_still_learns():
    compact = json.dumps({"choices": [], "usage": USAGE}, separators=(",", ":"))  # vLLM's
    transport = PlayedBack(chunks=[chunk("sse", 'data: {"choices":[{"text":"hi"}]}\n\n'),
                                   chunk("sse", f"data: {compact}\n\ndata: [DONE]\n\n")])
    _, streamed, parts, predictor, _ = respond(transport, {"prompt": "x", "stream": True})
    text = "".join(streamed)
    assert '"hi"' in text and "[DONE]" in text and '"usage"' not in text
    assert transport.bodies[0]["stream_options"]["include_usage"] is True
    assert predictor.predict(40, None, 900) == 7
    assert parts.ledger.reserved_blocks() == 0
    assert parts.metric("blockserve_request_duration_seconds_count", status="200") == 1


def test_a_replica_that_fails_before_answering_is_a_503_with_retry_after():
    transport = PlayedBack(error=ReplicaUnavailable("a", "connection refused"))
    response, _, parts, _, _ = respond(transport, {"prompt": "x"})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert json.loads(response.body)["error"]["code"] == 503
    assert "a" not in parts.ledger.replicas and transport.removed == ["a"]
    assert parts.metric("blockserve_request_duration_seconds_count", status="503") == 1


def test_a_stream_that_breaks_after_its_tokens_ends_with_an_error_event():
    class BreaksMidway(PlayedBack):
        async def generate(self, replica_id, endpoint, body):
            yield chunk("sse", 'data: {"choices":[{"text":"hi"}]}\n\n')
            raise ReplicaUnavailable("a", "data port closed mid-response")

    _, streamed, parts, _, _ = respond(BreaksMidway(), {"prompt": "x", "stream": True})
    assert '"hi"' in streamed[0]
    assert '"error"' in streamed[-1] and streamed[-1].endswith("data: [DONE]\n\n")
    assert parts.ledger.reserved_blocks() == 0
    assert parts.metric("blockserve_request_duration_seconds_count", status="503") == 1


def test_a_stream_trains_the_placement_on_the_ttft_and_tpot_it_measured():
    """predicted_latency hears the TTFT (admission to the first chunk) and the TPOT (the
    first chunk to the usage at the end, over the tokens after the first)."""
    now = [0.0]
    compact = json.dumps({"choices": [], "usage": USAGE}, separators=(",", ":"))

    class Timed(PlayedBack):
        async def generate(self, replica_id, endpoint, body):
            for at, text in ((0.3, 'data: {"choices":[{"text":"hi"}]}\n\n'),
                             (0.9, f"data: {compact}\n\ndata: [DONE]\n\n")):
                now[0] = at
                yield chunk("sse", text)

    _, _, parts, _, _ = respond(Timed(), {"prompt": "x", "stream": True},
                                clock=lambda: now[0], placement="predicted_latency")
    placement = parts.queue.placement
    assert (placement.ttft.samples, placement.tpot.samples) == (1, 1)
    # The first feature is the bias (1.0), so its running sum x y is the latency heard.
    assert placement.ttft.xty[0] == pytest.approx(0.3)
    assert placement.tpot.xty[0] == pytest.approx((0.9 - 0.3) / (USAGE["completion_tokens"] - 1))
