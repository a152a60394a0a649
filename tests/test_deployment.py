"""The real application from deploy/deploy.yaml: Ray Serve, two vLLM CPU replicas, the
router, driven with the official `openai` client."""

import asyncio
import json
import statistics
import time

import httpx
import openai
import pytest

from blockserve.protocol.config import RouterConfig
from blockserve.tools.launch import load_config
from conftest import SHAPE
from deployed import ABORT_BOUND_S, LONG_STREAM, MODEL, PROMPT, wait_until_idle

pytestmark = pytest.mark.deployment


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


def test_chat_streaming_streams_every_token_usage_counts(client):
    """Each streamed token carries its logprob entry, so the tokens the client received
    are counted exactly and must be the ones `usage` reports."""
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=20,
        stream=True, stream_options={"include_usage": True}, logprobs=True,
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    streamed = [entry for c in chunks if c.choices and c.choices[0].logprobs
                for entry in c.choices[0].logprobs.content]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage.completion_tokens == 20 == len(streamed)
    assert text == "".join(entry.token for entry in streamed)
    assert usage.total_tokens == usage.prompt_tokens + 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completions_non_streaming_and_streaming(client):
    response = client.completions.create(model=MODEL, prompt="def main():", max_tokens=10,
                                         extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 10 and response.choices[0].text
    stream = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=8,
                                       stream=True, stream_options={"include_usage": True},
                                       logprobs=0, extra_body={"ignore_eos": True})
    chunks = list(stream)
    streamed = [token for c in chunks if c.choices for token in c.choices[0].logprobs.tokens]
    assert chunks[-1].usage.completion_tokens == 8 == len(streamed)
    assert chunks[-1].usage.prompt_tokens == 4
    # Without include_usage, no usage event reaches the client.
    plain = list(client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3,
                                           stream=True, extra_body={"ignore_eos": True}))
    assert all(c.usage is None for c in plain) and plain[-1].choices


def test_router_counts_the_prompt_tokens_vllm_counts(deployment, client, model_dir):
    """The router sizes every request with router/demand.py and the model's tokenizer
    (the same code and files as the deployed router, run here): its prompt tokens must be
    vLLM's `usage.prompt_tokens` for chat (rendered through the chat template) and
    completions (text and token ids), or reservations are off by whole blocks."""
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from blockserve.router.demand import DemandEstimator, MaxTokensPredictor

    estimator = DemandEstimator(AutoTokenizer.from_pretrained(model_dir), MaxTokensPredictor())
    chats = [
        [{"role": "user", "content": "hello"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}],
        [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
         {"role": "user", "content": [{"type": "text", "text": "three "},
                                      {"type": "text", "text": "four"}]}],
    ]
    for messages in chats:
        body = {"model": MODEL, "messages": messages, "max_tokens": 1}
        response = deployment.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        demand = estimator.chat(ChatCompletionRequest.model_validate(body), 32, 1024)
        assert demand.prompt_tokens == response.json()["usage"]["prompt_tokens"], messages
    for prompt in ["def main():\n    return 1", PROMPT, list(range(10, 77))]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        response = client.completions.create(**body)
        demand = estimator.completion(CompletionRequest.model_validate(body), 32, 1024)
        assert demand.prompt_tokens == response.usage.prompt_tokens, prompt


CHAT_PRESSURE_PROMPT = "the quick brown fox jumps over a lazy dog " * 12  # ~230 tokens


def test_chat_burst_overfilling_both_caches_uses_both_replicas_and_finishes(
        deployment, aclient):
    """48 chat requests (half streamed) whose blocks, counted from vLLM's own usage, add
    up to more than both caches hold (2 x 160 here): some wait (in the router's queue or an
    engine's), both replicas fill, every request gets all its tokens, and the ledger's
    prediction of each replica's committed blocks matches what the replica then reports
    (drift) in most reports. Preemptions are printed, not forbidden: with an output
    predictor (deploy.yaml) a lease may outgrow its prediction, and vLLM then preempts."""
    decisions_before = {r: deployment.metric_sum("blockserve_decisions_total", replica=r)
                        for r in deployment.metrics_replicas()}
    preempted_before = deployment.metric_sum("blockserve_replica_preemptions_total")
    samples = []

    async def one(i):
        kwargs = dict(model=MODEL, max_tokens=64, extra_body={"ignore_eos": True},
                      messages=[{"role": "user", "content": f"{i} {CHAT_PRESSURE_PROMPT}"}])
        if i % 2:
            return (await aclient.chat.completions.create(**kwargs)).usage
        stream = await aclient.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True})
        return [c async for c in stream][-1].usage

    async def burst():
        async with aclient, httpx.AsyncClient(base_url=deployment.base_url, timeout=60,
                                              headers=deployment.headers) as http:
            task = asyncio.gather(*(one(i) for i in range(48)))
            while not task.done():
                samples.append((await http.get("/admin/state")).json())
                await asyncio.sleep(0.02)
            return await task

    usages = asyncio.run(burst())
    assert [u.completion_tokens for u in usages] == [64] * 48
    blocks = sum(-(-u.total_tokens // SHAPE.block_size) for u in usages)
    assert blocks > 2 * SHAPE.usable_blocks, f"the burst needs only {blocks} blocks"
    for replica, before in decisions_before.items():
        assert deployment.metric_sum("blockserve_decisions_total", replica=replica) > before
    waited = max(s["queue"]["requests"] + sum(r["snapshot"]["waiting"] for r in s["replicas"])
                 for s in samples)
    peak_held = {}
    for state in samples:
        for r in state["replicas"]:
            peak_held[r["replica_id"]] = max(peak_held.get(r["replica_id"], 0),
                                             r["snapshot"]["held_blocks"])
    drift = sorted(abs(r["drift_blocks"]) for s in samples for r in s["replicas"])
    preempted = deployment.metric_sum("blockserve_replica_preemptions_total") - preempted_before
    print(f"burst: {blocks} blocks, at most {waited} waiting, peak held {peak_held}, "
          f"{preempted:.0f} preemptions; |drift| median {statistics.median(drift)}, "
          f"90th {drift[len(drift) * 9 // 10]}, max {drift[-1]} over {len(drift)} samples")
    assert waited > 0, "no request ever waited"
    assert len(peak_held) == 2 and min(peak_held.values()) > 100, peak_held
    # A report that includes finished requests drifts by their blocks (10 each), so
    # allow two of them; a ledger that mispredicts every report fails the median.
    assert statistics.median(drift) == 0 and drift[len(drift) * 9 // 10] <= 20, drift
    wait_until_idle(deployment)


@pytest.mark.parametrize("placement, goes_to", [("most_free", "idle"),
                                                ("best_fit", "busy")])
def test_routing_follows_free_blocks(deployment, placement, goes_to):
    """A long request takes blocks on one replica; where the next one goes follows the
    ledger's free blocks: the emptier replica when spreading, the tighter fit when packing."""
    original = deployment.get("/admin/state").json()["policies"]
    assert deployment.post("/admin/policies", json={
        "placement": placement}).status_code == 200
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
        busy = [r["replica_id"] for r in state if r["blocks"]["reserved"] > 0]
        assert len(busy) == 1, [(r["replica_id"], r["blocks"]["reserved"]) for r in state]
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


def test_streaming_client_that_disconnects_frees_its_blocks_at_once(deployment):
    """Closed after a few tokens of a 1,000-token stream: the router closes its side,
    the replica aborts the request in vLLM, and the blocks are free within
    ABORT_BOUND_S, far sooner than the stream would have ended by itself."""
    wait_until_idle(deployment)
    with deployment.stream("/v1/completions", {**LONG_STREAM, "logprobs": 0}) as response:
        assert response.status_code == 200
        lines, tokens, started = response.iter_lines(), 0, None
        while tokens < 50:  # past the first messages: the stream's own pace shows
            line = next(lines)
            if line.startswith("data: {"):
                started = started or time.monotonic()
                tokens += len(json.loads(line[6:])["choices"][0]["logprobs"]["tokens"])
        per_token_s = (time.monotonic() - started) / max(1, tokens - 1)
        assert deployment.metric_sum("blockserve_ledger_reserved_blocks") > 0
        held = deployment.metric_sum("blockserve_replica_kv_blocks", state="held")
        assert held > 0
    # Streamed messages batch tokens, so this pace is, if anything, too fast: the stream
    # really has at least this long to go. Idle, it is ~3 s; busy, 5-9 s.
    remaining_s = (LONG_STREAM["max_tokens"] - tokens) * per_token_s
    assert remaining_s > ABORT_BOUND_S, f"the stream would end by itself in {remaining_s}s"
    freed_after_s = wait_until_idle(deployment, timeout_s=ABORT_BOUND_S, poll_s=0.05)
    print(f"blocks free {freed_after_s:.2f}s after the close; the stream had "
          f"{remaining_s:.1f}s to go")


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
    # vLLM's counters come with polls only, with the snapshot read in the same call.
    pairs = [(r["engine"]["held_fraction_at_read"], r["engine"]["vllm_kv_cache_usage"])
             for r in busy]
    assert max(ours for ours, _ in pairs) > 0, "vLLM's counters were not read under load"
    gaps = sorted(abs(ours - vllm) for ours, vllm in pairs)
    assert gaps[len(gaps) // 2] < 0.1, gaps  # one call, yet a step or two apart under load
    wait_until_idle(deployment)
    # Idle, after a poll read both views in one call (every counters_interval_s), they
    # agree exactly.
    deadline = time.time() + 3 * RouterConfig().counters_interval_s
    while True:
        state = deployment.get("/admin/state").json()
        if all(r["engine"]["held_fraction_at_read"] == 0 for r in state["replicas"]) \
                or time.time() > deadline:
            break
        time.sleep(0.2)
    for replica in state["replicas"]:
        snap = replica["snapshot"]
        assert snap["held_blocks"] / snap["total_blocks"] == replica["engine"]["vllm_kv_cache_usage"]
        assert (snap["total_blocks"], snap["block_size"]) == (SHAPE.usable_blocks,
                                                              SHAPE.block_size)


def test_status_command_shows_replicas(deployment, capsys):
    from blockserve.controller.cli import main

    assert main(["status", "--url", deployment.base_url, "--api-key", deployment.api_key]) == 0
    output = capsys.readouterr().out
    placement = load_config()["applications"][0]["args"]["router"]["placement"]
    assert placement.rpartition(":")[2] in output
    assert len([line for line in output.splitlines() if line.strip().endswith(
        tuple("0123456789"))]) >= 2
