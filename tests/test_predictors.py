"""Output-length predictors, their config and their feedback channel, as pure code."""

import pytest

from blockserve.protocol.config import RouterConfig, parse_app_config
from blockserve.router.demand import DemandEstimator
from blockserve.router.predictors import FixedPredictor, MaxTokensPredictor, OnlineQuantilePredictor
from blockserve.router.usage import completion_tokens, request_stream_usage, stream_usage


def test_max_tokens_predictor_takes_the_cap_as_truth():
    predictor = MaxTokensPredictor(default_tokens=100)
    assert predictor.predict(50, 700, room=974) == 700
    assert predictor.predict(50, None, room=974) == 100
    assert predictor.predict(950, None, room=74) == 74


def test_fixed_predictor_ignores_a_loose_cap_but_keeps_a_tight_one():
    predictor = FixedPredictor(tokens=64)
    assert predictor.predict(50, 974, room=974) == 64
    assert predictor.predict(50, 10, room=974) == 10
    with pytest.raises(ValueError):
        FixedPredictor(tokens=0)


def test_online_predictor_uses_the_prior_until_it_has_data_then_the_quantile():
    predictor = OnlineQuantilePredictor(quantile=0.8, prior_tokens=128, min_samples=5)
    assert predictor.predict(200, 824, room=824) == 128
    for tokens in (10, 20, 30, 40, 50, 60, 70, 80, 90, 100):
        predictor.on_finished(200, "a", tokens)
    assert predictor.predict(200, 824, room=824, tenant="a") == 90  # the 80th percentile
    assert predictor.predict(200, 40, room=824, tenant="a") == 40  # a tight cap still holds


def test_online_predictor_learns_per_tenant_and_prompt_bucket_with_fallbacks():
    predictor = OnlineQuantilePredictor(quantile=0.5, prior_tokens=128, min_samples=4)
    for _ in range(4):
        predictor.on_finished(100, "short", 10)  # prompt bucket of 64-127 tokens
        predictor.on_finished(600, "long", 500)  # bucket of 512-1023
    assert predictor.predict(100, None, room=900, tenant="short") == 10
    assert predictor.predict(600, None, room=400, tenant="long") == 400  # capped by room
    assert predictor.predict(600, None, room=900, tenant="long") == 500
    # A tenant's other prompt bucket falls back to the tenant; a new tenant to everyone.
    assert predictor.predict(10, None, room=900, tenant="short") == 10
    assert predictor.predict(100, None, room=900, tenant="new") in (10, 500)
    for _ in range(4):
        predictor.on_finished(20, "short", 30)  # bucket 16-31 now has its own data
    assert predictor.predict(20, None, room=900, tenant="short") == 30


def test_online_predictor_follows_a_changing_workload_and_bounds_its_memory():
    predictor = OnlineQuantilePredictor(quantile=0.5, min_samples=2, window=4, max_groups=6)
    for tokens in (500, 500, 500, 500, 20, 20, 20, 20):
        predictor.on_finished(100, "a", tokens)
    assert predictor.predict(100, None, room=900, tenant="a") == 20  # the old 500s forgotten
    for i in range(10):
        predictor.on_finished(100, f"tenant-{i}", 5)
    assert len(predictor._groups) <= 6
    predictor = OnlineQuantilePredictor(quantile=0.5, min_samples=2, window=4)
    for tokens in (500, 500):
        predictor.on_finished(600, "a", tokens)  # a prompt bucket seen rarely
    for _ in range(2):
        predictor.on_finished(100, "a", 20)
    assert predictor.predict(600, None, room=900, tenant="a") == 500  # within the last 4
    predictor.on_finished(100, "a", 20)
    # One 500 is older than the last 4 finished requests: too few left, the tenant's
    # recent lengths speak for the bucket.
    assert predictor.predict(600, None, room=900, tenant="a") == 20
    assert len(predictor._groups[()].ordered) == 4  # a fallback forgets as it learns
    with pytest.raises(ValueError):
        OnlineQuantilePredictor(quantile=1.0)


def test_the_estimator_gives_the_predictor_the_tenant_and_the_cap_only():
    seen = []

    class Recording(MaxTokensPredictor):
        def predict(self, prompt_tokens, max_tokens, room, tenant="default"):
            seen.append((prompt_tokens, max_tokens, room, tenant))
            return 7

    demand = DemandEstimator(None, Recording()).of_tokens([[1] * 40], 1, 900, 32, 1024,
                                                          tenant="t")
    assert seen == [(40, 900, 984, "t")]
    assert demand.expected_output == 7 and demand.blocks == 2


def test_config_builds_and_checks_the_output_predictor():
    assert isinstance(RouterConfig().output_predictor.build(), OnlineQuantilePredictor)
    ref = RouterConfig(output_predictor={"cls": "fixed",
                                         "kwargs": {"tokens": 64}}).output_predictor
    assert ref.build().predict(10, None, room=100) == 64
    with pytest.raises(ValueError,
                       match="router.output_predictor.*does not implement .*OutputPredictor"):
        parse_app_config({"replica": {"model": "m"},
                          "router": {"output_predictor": "blockserve.router.placement:BestFitBlocks"}})
    with pytest.raises(ValueError, match="router.output_predictor.*cannot build"):
        parse_app_config({"replica": {"model": "m"}, "router": {"output_predictor": {
            "cls": "online_quantile", "kwargs": {"quantile": 2}}}})


def test_usage_reaches_the_predictor_from_whole_responses_and_streams():
    from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    assert completion_tokens({"usage": {"completion_tokens": 42}}) == 42
    assert completion_tokens({"error": {}}) is None
    # The usage event exactly as vLLM's serving layer writes it.
    event = CompletionStreamResponse(
        id="c", created=0, model="m", choices=[],
        usage=UsageInfo(prompt_tokens=5, completion_tokens=17, total_tokens=22),
    ).model_dump_json(exclude_unset=False, exclude_none=True)
    message = f'data: {{"choices":[{{"text":"x"}}]}}\n\ndata: {event}\n\ndata: [DONE]\n\n'
    assert stream_usage(message, strip=False) == (17, message)
    tokens, relayed = stream_usage(message, strip=True)
    assert tokens == 17 and "usage" not in relayed and relayed.endswith("data: [DONE]\n\n")
    assert stream_usage('data: {"choices":[{"text":"x"}]}\n\n', strip=True)[0] is None


def test_the_router_asks_streams_for_usage_and_remembers_who_did_not():
    body = {"stream": True}
    assert request_stream_usage(body) is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    quirky = {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    assert request_stream_usage(quirky) is True
    assert quirky["stream_options"]["continuous_usage_stats"] is False
    asked = {"stream": True, "stream_options": {"include_usage": True}}
    assert request_stream_usage(asked) is False
    assert request_stream_usage({"stream": False}) is False
