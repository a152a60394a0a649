"""Generated bad input: the published request schema, the validator on schemathesis's
cases without a deployment, and the fuzzer against the real deployment (issue 30).

BLOCKSERVE_FUZZ_SEED picks another draw of the same cases (default 0)."""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import schemathesis

from blockserve.bench.fuzz import MODES, ROUTES, Outcome, affordable, generate, send
from blockserve.protocol.chunks import CHAT, COMPLETIONS
from blockserve.router.validation import Invalid, RequestValidator
from conftest import SHAPE

SEED = int(os.environ.get("BLOCKSERVE_FUZZ_SEED", "0"))
# The issue's 500: vLLM's model accepts it, its own structured-outputs check then trips.
TRIPS_VLLM = {"model": SHAPE.model_name, "max_tokens": 4, "structured_outputs": [None, None]}
BODIES = {CHAT: {"messages": [{"role": "user", "content": "hi"}]}, COMPLETIONS: {"prompt": "hi"}}
ENDPOINTS = dict(zip(ROUTES, (CHAT, COMPLETIONS)))
# Cases per route and mode against the deployment: about 1,000 in all. Drawing a chat
# case takes schemathesis ~0.3 s here (vLLM's message schema is large), a completion
# one ~0.03 s, so completions get the larger share of the test's few minutes.
DEPLOYED_CASES = {ROUTES[0]: 125, ROUTES[1]: 375}
CONCURRENCY = 8
CANCEL_EVERY = 5  # every fifth streamed case: the client leaves after the first event
MAX_TOKENS = 32  # what a case may ask the engines for (bench/fuzz.py affordable)


@pytest.fixture(scope="module")
def spec() -> dict:
    from blockserve.router.ingress import app
    from blockserve.router.openapi import describe

    return describe(app, keyed=True)


@pytest.fixture(scope="module")
def validator() -> RequestValidator:
    return RequestValidator(SHAPE.model_name, 1 << 22)


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_a_value_vllm_trips_over_is_a_400_naming_the_field(validator, endpoint):
    with pytest.raises(Invalid) as invalid:
        validator.check({**TRIPS_VLLM, **BODIES[endpoint]}, endpoint)
    error = invalid.value.response
    assert error.status_code == 400
    assert b'"param":"structured_outputs"' in error.body, error.body


def test_a_value_the_conversion_to_sampling_params_refuses_is_a_400(validator):
    """vLLM's model takes min_tokens above max_tokens; only its SamplingParams refuses
    it, which the replica used to be the first to build."""
    with pytest.raises(Invalid) as invalid:
        validator.check({"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, COMPLETIONS)
    assert invalid.value.response.status_code == 400
    assert b"min_tokens" in invalid.value.response.body


def test_the_schema_publishes_both_request_bodies_and_the_bearer_key(spec):
    """What a client generator reads: each OpenAI route's JSON body is vLLM's model,
    resolvable in the document; the API and admin routes need the bearer scheme."""
    loaded = schemathesis.openapi.from_dict(spec)
    for path, model in zip(ROUTES, ("ChatCompletionRequest", "CompletionRequest")):
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"}
        assert "max_tokens" in spec["components"]["schemas"][model]["properties"]
        assert [b.media_type for b in loaded[path]["POST"].body] == ["application/json"]
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for path in ROUTES + ("/v1/models", "/admin/state", "/admin/policies"):
        for operation in spec["paths"][path].values():
            assert operation["security"] == [{"bearer": []}], path
    assert "security" not in spec["paths"]["/health"]["get"]


@pytest.mark.parametrize("mode", MODES)
def test_the_validator_answers_every_generated_case_with_a_4xx_or_a_request(
        spec, validator, mode):
    """Without a deployment: whatever schemathesis draws, the validator either returns
    vLLM's request or raises `Invalid` with a 4xx in OpenAI's format."""
    for path, count in zip(ROUTES, (10, 100)):
        for body in generate(spec, path, mode, count, SEED):
            if not isinstance(body, dict):
                continue  # the router answers a non-object itself, before the validator
            try:
                validator.check(body, ENDPOINTS[path])
            except Invalid as invalid:
                response = invalid.response
                outcome = Outcome(path, body, False, response.status_code,
                                  response.body.decode())
                assert outcome.problem() is None, outcome.report()


def test_a_draw_schemathesis_cannot_make_is_skipped_not_raised(spec):
    """Seed 1's negative completions hit schemathesis's "Unsupported type: 'Binary'"
    (vLLM's prompt_embeds is `format: binary`); CI's run of seed 0 did too. The fuzzer
    draws its full count anyway."""
    assert len(generate(spec, ROUTES[1], "negative", 375, 1)) == 375


# --- against the real deployment --------------------------------------------------------
@pytest.mark.deployment
def test_served_schema_is_the_published_one(deployment, spec):
    served = deployment.get("/openapi.json").json()
    for path in ROUTES:
        assert served["paths"][path]["post"]["requestBody"] == \
            spec["paths"][path]["post"]["requestBody"]
    assert served["components"]["schemas"].keys() == spec["components"]["schemas"].keys()


@pytest.mark.deployment
@pytest.mark.parametrize("path", ROUTES)
def test_the_issues_500_is_a_400_naming_the_field(deployment, path):
    body = {**TRIPS_VLLM, **BODIES[ENDPOINTS[path]]}
    response = deployment.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "structured_outputs"


@pytest.mark.deployment
def test_fuzzed_requests_get_no_5xx_and_leave_nothing_behind(deployment):
    """About 1,000 schemathesis cases from the served /openapi.json, positive and
    negative, at most 32 tokens each, streamed and not (a fifth of the streams cancelled
    after their first event), 8 at a time while the next are drawn: no 5xx and no hang,
    an OpenAI error on every 4xx, then the ledger at 0 blocks and both engines as they
    were (no replica restarted, none dead)."""
    from deployed import wait_until_idle

    spec = deployment.get("/openapi.json").json()
    engines_before = _engines(deployment)
    started = time.monotonic()
    with ThreadPoolExecutor(CONCURRENCY) as pool:  # sends while the next cases are drawn
        sent = [pool.submit(send, deployment.http, path, affordable(body, index, MAX_TOKENS),
                            index % CANCEL_EVERY == 0)
                for path, count in DEPLOYED_CASES.items() for mode in MODES
                for index, body in enumerate(generate(spec, path, mode, count, SEED))]
        outcomes = [future.result() for future in sent]
    elapsed = time.monotonic() - started
    wrong = [o.report() for o in outcomes if o.problem()]
    served = [o for o in outcomes if o.status == 200]
    print(f"\n{len(outcomes)} fuzzed requests in {elapsed:.0f}s: {len(served)} served "
          f"({sum(o.streamed for o in served)} streamed, "
          f"{sum(o.cancelled for o in served)} cancelled), "
          f"{sum(400 <= o.status < 500 for o in outcomes)} 4xx, {len(wrong)} wrong")
    assert not wrong, "\n".join(wrong[:10])
    assert {o.streamed for o in served} == {True, False}  # both kinds reached an engine
    wait_until_idle(deployment, timeout_s=60)
    assert _engines(deployment) == engines_before


def _engines(deployment) -> dict[str, tuple]:
    """Each replica in the router's ledger (a dead engine's replica leaves it; Ray
    Serve's replacement has a new id) with its actor's and its EngineCore's pids."""
    deployment.wait_for_replicas(2)
    replicas = deployment.get("/admin/state").json()["replicas"]
    assert all(r["engine"].get("engine_pid") for r in replicas), replicas
    return {r["replica_id"]: (r["engine"]["pid"], r["engine"]["engine_pid"]) for r in replicas}
