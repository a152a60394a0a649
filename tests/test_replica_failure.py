"""A replica process killed under load (runs after the other deployment tests: it takes a
replica away until Ray Serve has restarted it)."""

import asyncio
import os
import signal
import time

import openai
import pytest

from test_deployment import MODEL, PROMPT, wait_until_idle

pytestmark = pytest.mark.deployment


def replicas(deployment) -> dict[str, dict]:
    return {r["replica_id"]: r for r in deployment.get("/admin/state").json()["replicas"]}


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.time() + timeout_s
    while not (result := predicate()):
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)
    return result


def test_killed_replica_leaves_the_ledger_and_rejoins_with_its_capacity(deployment):
    before = replicas(deployment)
    assert len(before) == 2
    victim_id, victim = sorted(before.items())[0]
    client = openai.AsyncOpenAI(base_url=f"{deployment.base_url}/v1",
                                api_key=deployment.api_key, max_retries=0, timeout=120)

    async def under_load():
        async def one(i):
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"{i} {PROMPT}"}],
                max_tokens=300, stream=True, extra_body={"ignore_eos": True})
            return len([c async for c in stream])

        tasks = [asyncio.ensure_future(one(i)) for i in range(16)]
        await asyncio.sleep(1.5)
        os.kill(victim["engine"]["pid"], signal.SIGKILL)
        # Every in-flight request ends (completed or with an error); none hangs.
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 150)

    outcomes = asyncio.run(under_load())
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    print(f"in flight at the kill: {len(outcomes)}, ended with an error: {len(failed)}")
    wait_for(lambda: victim_id not in replicas(deployment), 60, "the ledger to drop the replica")

    survivor = openai.OpenAI(base_url=f"{deployment.base_url}/v1", api_key=deployment.api_key,
                             max_retries=0, timeout=60)
    for _ in range(3):  # new requests go to the survivor
        assert survivor.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}],
            max_tokens=4).usage.completion_tokens == 4

    current = wait_for(lambda: len(replicas(deployment)) == 2 and replicas(deployment), 300,
                       "Ray Serve to restart the replica")
    newcomer = (set(current) - set(before)).pop()
    assert current[newcomer]["snapshot"]["total_blocks"] == 160  # its real capacity
    wait_until_idle(deployment)
