"""The exact prefix index on the real deployment: real vLLM engines publish their KV
cache events, the router hashes prompts as vLLM does, and its predicted prefix hits equal
the hits vLLM reports request by request."""

import random
import time

import pytest

from blockserve.tools.launch import load_config, with_args

pytestmark = pytest.mark.deployment

BLOCK = 32


def test_predicted_hits_equal_what_the_engines_report(launch):
    config = with_args(load_config(), router={"placement": "cache_aware",
                                              "prefix_index": "exact"},
                       replica={"publish_kv_events": True})
    rng = random.Random(7)
    prefixes = [[rng.randrange(10, 4000) for _ in range(10 * BLOCK)] for _ in range(3)]
    with launch(config) as deployment:
        deployment.wait_for_replicas(2)
        reported = []
        for i in range(18):
            prompt = prefixes[i % 3] + [rng.randrange(10, 4000) for _ in range(40)]
            response = deployment.post("/v1/completions", json={
                "model": "tiny-llama", "prompt": prompt, "max_tokens": 2})
            assert response.status_code == 200, response.text
            reported.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        time.sleep(1.0)
        assert sum(reported) >= 12 * 10 * BLOCK  # every repeat of a prefix hit it
        counters = {kind: deployment.metric_sum(f"blockserve_prefix_{kind}_tokens_total")
                    for kind in ("prompt", "predicted_hit", "reported_hit", "regret")}
        assert counters["reported_hit"] == sum(reported)
        assert counters["predicted_hit"] == counters["reported_hit"]
        assert counters["regret"] == 0, counters
        streams = deployment.get("/admin/state").json()["kv_events"]
        assert len(streams) == 2 and all(s["gaps"] == 0 and s["lost_batches"] == 0
                                         for s in streams.values()), streams
        assert sum(s["batches"] for s in streams.values()) > 0
