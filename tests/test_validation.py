"""router/validation.py without an engine: a bad request gets its 4xx in OpenAI's error
format before it costs a tokenizer call (vLLM's own request models, real Starlette
requests; tests/test_fuzz.py covers what vLLM's checks trip over)."""

import asyncio
import json

import pytest

from blockserve.protocol.chunks import CHAT, COMPLETIONS
from blockserve.router.validation import Invalid, RequestValidator
from router_parts import http_request

JSON = {"content-type": "application/json"}
CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def parse(body: bytes, endpoint=CHAT, headers=JSON, limit=1024):
    validator = RequestValidator("m", max_body_bytes=limit)
    return asyncio.run(validator.parse(http_request(body, headers), endpoint))


@pytest.mark.parametrize("body, headers, endpoint, status, message", [
    (b"{}", {"content-type": "text/plain"}, CHAT, 415, "Only 'application/json'"),
    (b"{}", {**JSON, "content-length": "5000"}, CHAT, 413, "larger than 1024 bytes"),
    (b"x" * 2000, JSON, CHAT, 413, "larger than 1024 bytes"),  # no length header: read
    (b'{"model": ', JSON, CHAT, 400, "not valid JSON"),
    (b"[1, 2]", JSON, CHAT, 400, "must be a JSON object"),
    (json.dumps({**CHAT_BODY, "temprature": 1}).encode(), JSON, CHAT, 400,
     "Unrecognized request argument supplied: temprature"),
    (json.dumps({**CHAT_BODY, "messages": []}).encode(), JSON, CHAT, 400,
     "'messages' must contain at least one message"),
    (json.dumps({**CHAT_BODY, "model": "other"}).encode(), JSON, CHAT, 404,
     "The model `other` does not exist"),
    (json.dumps({"model": "m", "prompt": "x", "max_tokens": "many"}).encode(), JSON,
     COMPLETIONS, 400, "max_tokens"),
])
def test_a_bad_request_is_refused_with_its_openai_error(body, headers, endpoint, status,
                                                         message):
    with pytest.raises(Invalid) as refused:
        parse(body, endpoint, headers)
    response = refused.value.response
    error = json.loads(response.body)["error"]
    assert response.status_code == status == error["code"] and message in error["message"]


def test_a_good_request_comes_back_as_its_body_and_vllms_model_of_it():
    body, request = parse(json.dumps(CHAT_BODY).encode())
    assert body == CHAT_BODY and type(request).__name__ == "ChatCompletionRequest"
    assert request.messages[0]["content"] == "hi"


def test_a_value_vllm_trips_over_is_a_400_that_names_its_field(monkeypatch):
    """vLLM's conversion raising what it does not map to a 4xx: the field without which
    it passes is named (each probe validated anew; the body as a whole validated once)."""
    from blockserve.router import validation

    def trips_over_seed_13(request):
        if request.seed == 13:
            raise ZeroDivisionError("vLLM tripped")
        return "params"

    monkeypatch.setattr(validation, "sampling_params", trips_over_seed_13)
    body = {"model": "m", "prompt": "x", "seed": 13, "max_tokens": 4}
    with pytest.raises(Invalid) as refused:
        RequestValidator("m", max_body_bytes=1024).check(body, COMPLETIONS)
    error = json.loads(refused.value.response.body)["error"]
    assert error["code"] == 400 and error["param"] == "seed"
    assert "Invalid value for seed" in error["message"]
