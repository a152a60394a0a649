"""A user's policy module deploys through Ray's runtime_env, and its bug does not take
the engine down (docs/block-policies.md, "6. Deploy a module of your own").

One small deployment of deploy/deploy.yaml (one replica) whose eviction policy is
tests/user_policies/raising_policies.py, copied to a folder outside the repo that
reaches the workers only as `runtime_env: {py_modules: ["local://<folder>"]}`: it
raises on every prefix hit, free and eviction. Every request must still complete with
vLLM's LRU order standing in, the engine (vLLM's
EngineCore, a child process of the replica) must have imported the module (its errors
are counted there), and the count must rise with the traffic."""

import random
import re
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from blockserve.tools.launch import load_config, serve_run, with_args

from conftest import API_KEY, SHAPE

USER_MODULE = "raising_policies"
POLICY = f"{USER_MODULE}:RaisingEviction"


def config_with_user_module(module_path) -> dict:
    config = load_config()
    scheduler = {**config["applications"][0]["args"]["replica"]["scheduler"],
                 "block_eviction": {"cls": POLICY, "kwargs": {
                     "raise_in": ["may_evict", "on_hit", "on_free"]}}}
    config = with_args(config, replica={"scheduler": scheduler})
    app = config["applications"][0]
    app["runtime_env"] = {"py_modules": [f"local://{module_path.parent}"]}
    for deployment in app["deployments"]:
        if deployment["name"] == "Replica":
            deployment["num_replicas"] = 1
    return config


def errors_counted(http: httpx.Client) -> tuple[float, dict]:
    text = http.get("/metrics").text
    counted = sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                  if line.startswith("blockserve_replica_policy_errors_total{")
                  and 'policy="block_eviction"' in line)
    return counted, http.get("/admin/state").json()["replicas"][0]["block_policies"]


def send(client: openai.OpenAI, rng: random.Random, prompts: list[str], n: int) -> None:
    """`n` completions: new long prompts (more blocks than the pool holds: evictions)
    and repeats (prefix hits); each must end at its max_tokens."""
    for _ in range(n):
        if prompts and rng.random() < 0.4:
            prompt = rng.choice(prompts)
        else:
            prompt = " ".join(f"w{rng.randrange(10_000)}" for _ in range(150))  # ~600 tokens
            prompts.append(prompt)
        done = client.completions.create(model=SHAPE.model_name, prompt=prompt,
                                         max_tokens=16, extra_body={"ignore_eos": True})
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 16


@pytest.mark.deployment
@pytest.mark.own_deployment  # it calls serve_run itself: conftest runs it before the shared one
def test_a_raising_policy_from_a_runtime_env_module_deploys_and_the_engine_keeps_serving(
        model_dir, tmp_path):
    module = Path(shutil.copy(Path(__file__).parent / "user_policies" / f"{USER_MODULE}.py",
                              tmp_path))  # outside the repo
    with serve_run(config_with_user_module(module), expected_replicas=1,
                   env={"BLOCKSERVE_API_KEY": API_KEY}) as run:
        client = openai.OpenAI(base_url=f"{run.base_url}/v1", api_key=API_KEY, max_retries=0)
        http = httpx.Client(base_url=run.base_url, timeout=30,
                            headers={"Authorization": f"Bearer {API_KEY}"})
        rng, prompts = random.Random(0), []
        send(client, rng, prompts, 12)
        first, policies = errors_counted(http)
        assert policies["eviction"] == POLICY and policies["installed"]
        # /admin/state is read after /metrics: a snapshot may have come in between.
        assert first > 0 and policies["policy_errors"]["block_eviction"] >= first
        send(client, rng, prompts, 12)
        second, policies = errors_counted(http)
        assert second > first and policies["cached_blocks_evicted"] > 0
        http.close()
        log = run.log_path.read_text(errors="replace")
    # Logged once by the engine, with the policy's name and the traceback's last line.
    logged = re.findall(r"block_eviction policy raising_policies:RaisingEviction raised "
                        r"ZeroDivisionError", log)
    assert len(logged) == 1, log[-3000:]
    assert "ZeroDivisionError: a bug in RaisingEviction." in log
    print(f"\npolicy errors counted: {first:.0f} after 12 requests, {second:.0f} after 24")
