"""A replica's vLLM engine killed under streaming load, measured as a user sees it.

    flock /tmp/blockserve-heavy.lock python -m blockserve.bench.engine_kill \
        [--requests 300] [--interval-s 0.08] [--kill-at-s 6] [--fault sigkill|sigstop]

`serve run deploy/deploy.yaml` (controller/launch.py, as `make serve`), then one
streamed completion every `interval_s` through the real openai client. `kill_at_s` in,
the EngineCore process of the replica with the most requests in flight gets SIGKILL
(`--fault sigstop`: it is frozen for `--freeze-s` instead, then continued). Every
request's outcome is classified (`Outcome.kind`); the JSON in docs/results/ holds the
counts, the first success after the fault, how long until the victim left the ledger
and its replacement joined, and the ledger at the end. The tests reuse the load and
outcome helpers (tests/test_engine_failure.py, tests/test_replica_failure.py).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from blockserve.bench.targets import API_KEY
from blockserve.tools.launch import app_config, load_config, replica_count, serve_run

PROMPT = "the quick brown fox jumps over the lazy dog " * 4
RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


@dataclass
class Outcome:
    """One streamed request as the client saw it (times from the run's start)."""

    sent_at: float
    max_tokens: int
    tokens: int = 0  # token events received (a token may decode to no text)
    answered: bool = False  # the response's status and headers arrived: it had started
    first_token_at: float | None = None
    ended_at: float | None = None
    finished: bool = False  # the usage event reports all max_tokens generated
    status: int | None = None  # the HTTP error status, when the request was refused
    error: str | None = None  # an error event in the stream, or a broken connection
    disconnected: bool = False  # the connection broke without an error event

    @property
    def kind(self) -> str:
        """completed | error_event (after tokens) | http_<status> | disconnect | short."""
        if self.status is not None:
            return f"http_{self.status}"
        if self.disconnected:
            return "disconnect"
        if self.error is not None:
            return "error_event"
        return "completed" if self.finished else "short"


@functools.cache
def served_model() -> str:
    """deploy/deploy.yaml's served model name, what requests ask for."""
    return app_config().replica.model_name


def client(base_url: str, api_key: str = API_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0,
                              timeout=120)


async def stream_one(api: openai.AsyncOpenAI, t0: float, max_tokens: int,
                     prompt: str = PROMPT) -> Outcome:
    outcome = Outcome(time.monotonic() - t0, max_tokens)
    try:
        stream = await api.completions.create(
            model=served_model(), prompt=prompt, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        outcome.answered = True
        async for chunk in stream:
            if chunk.choices:
                outcome.tokens += 1
                if outcome.first_token_at is None:
                    outcome.first_token_at = time.monotonic() - t0
            if chunk.usage is not None:
                outcome.finished = chunk.usage.completion_tokens == max_tokens
    except openai.APIStatusError as exc:
        outcome.status = exc.status_code
    except openai.APIConnectionError as exc:
        outcome.disconnected, outcome.error = True, repr(exc)
    except openai.APIError as exc:  # the stream's own error event
        outcome.error = str(exc)
    outcome.ended_at = time.monotonic() - t0
    return outcome


def replicas(base_url: str, api_key: str = API_KEY) -> dict[str, dict]:
    state = httpx.get(f"{base_url}/admin/state", timeout=10,
                      headers={"Authorization": f"Bearer {api_key}"}).json()
    return {r["replica_id"]: r for r in state["replicas"]}


def busiest(base_url: str) -> tuple[str, dict]:
    """The replica with the most requests in flight (the worst one to lose)."""
    return max(replicas(base_url).items(), key=lambda item: item[1]["in_flight_requests"])


def summary(outcomes: list[Outcome], fault_at: float) -> dict[str, Any]:
    kinds = collections.Counter(o.kind for o in outcomes)
    after = [o.ended_at - fault_at for o in outcomes
             if o.kind == "completed" and o.ended_at > fault_at and o.sent_at >= fault_at]
    first_tokens = [o.first_token_at - fault_at for o in outcomes if o.sent_at >= fault_at
                    and o.first_token_at is not None and o.kind == "completed"]
    return {
        "requests": len(outcomes), "outcomes": dict(kinds),
        "completed_pct": round(100 * kinds["completed"] / len(outcomes), 1),
        "http_500": kinds["http_500"],
        "short_without_error": kinds["short"],
        "errors_before_any_token": sum(1 for o in outcomes
                                       if o.kind != "completed" and o.tokens == 0),
        "first_success_after_fault_s": round(min(after), 3) if after else None,
        "first_token_after_fault_s": round(min(first_tokens), 3) if first_tokens else None,
    }


def wait_for(predicate, timeout_s: float, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while not (result := predicate()):
        if time.monotonic() > deadline:
            return None
        time.sleep(poll_s)
    return result


async def load_with_fault(base_url: str, requests: int, interval_s: float, kill_at_s: float,
                          max_tokens: int, fault: str, freeze_s: float) -> dict[str, Any]:
    api = client(base_url)
    t0 = time.monotonic()
    tasks = []
    victim: dict[str, Any] = {}

    async def inject() -> None:
        await asyncio.sleep(kill_at_s)
        victim_id, entry = busiest(base_url)
        pid = entry["engine"]["engine_pid"]
        victim.update(replica_id=victim_id, engine_pid=pid,
                      in_flight_at_fault=entry["in_flight_requests"])
        os.kill(pid, signal.SIGSTOP if fault == "sigstop" else signal.SIGKILL)
        victim["fault_at"] = time.monotonic() - t0
        if fault == "sigstop":
            victim["suspect_after_s"] = await asyncio.to_thread(wait_for, lambda: replicas(
                base_url).get(victim_id, {}).get("suspect"), freeze_s)
            victim["suspect_after_s"] = (round(time.monotonic() - t0 - victim["fault_at"], 3)
                                         if victim["suspect_after_s"] else None)
            await asyncio.sleep(max(0.0, victim["fault_at"] + freeze_s
                                    - (time.monotonic() - t0)))
            os.kill(pid, signal.SIGCONT)
        else:
            gone = await asyncio.to_thread(
                wait_for, lambda: victim_id not in replicas(base_url), 30, 0.05)
            victim["left_ledger_after_s"] = (round(time.monotonic() - t0 - victim["fault_at"],
                                                   3) if gone else None)

    injector = asyncio.ensure_future(inject())
    for _ in range(requests):
        tasks.append(asyncio.ensure_future(stream_one(api, t0, max_tokens)))
        await asyncio.sleep(interval_s)
    outcomes = await asyncio.gather(*tasks)
    await injector
    await api.close()
    return {"victim": victim, **summary(outcomes, victim["fault_at"]),
            "outcome_list": [asdict(o) | {"kind": o.kind} for o in outcomes]}


def in_flight(base_url: str, api_key: str = API_KEY) -> int:
    """Requests that the answering router has placed on a replica and not yet seen end."""
    return sum(r["in_flight_requests"] for r in replicas(base_url, api_key).values())


async def load_and_fault(base_url: str, fault, *, api_key: str = API_KEY, burst: int = 24,
                         max_tokens: int = 128, probes: int = 10, fault_by_s: float = 1.5,
                         loaded=None):
    """`burst` streams, then `fault()` once `loaded()` (by default: a third of them in
    flight at replicas) or at `fault_by_s` at the latest, long prompts just before it (in
    prefill then) and `probes` new requests one every 0.2 s from the fault on. The fault
    waits for load it can see, not for a fixed time: on a faster CI machine the burst had
    ended by 1.5 s and the kill found nothing in flight."""
    def a_third_in_flight() -> bool:
        return in_flight(base_url, api_key) >= burst // 3

    api = client(base_url, api_key)
    t0 = time.monotonic()
    tasks = []
    for _ in range(burst):
        tasks.append(asyncio.ensure_future(stream_one(api, t0, max_tokens)))
        await asyncio.sleep(0.03)
    await asyncio.to_thread(wait_for, loaded or a_third_in_flight,
                            max(0.0, fault_by_s - 0.1 - (time.monotonic() - t0)), 0.02)
    tasks += [asyncio.ensure_future(stream_one(api, t0, 16, prompt="a long prompt " * 200))
              for _ in range(2)]
    await asyncio.sleep(0.1)
    fault_at = time.monotonic() - t0
    info = await asyncio.to_thread(fault)
    probe_tasks = []
    for _ in range(probes):
        probe_tasks.append(asyncio.ensure_future(stream_one(api, t0, 16)))
        await asyncio.sleep(0.2)
    # 150 s > the client's 120 s timeout: a hung request ends as a timeout, classified
    # as a disconnect, which fails the outcome check.
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 150)
    probe_outcomes = await asyncio.wait_for(asyncio.gather(*probe_tasks), 150)
    await api.close()
    return fault_at, info, outcomes, probe_outcomes


def ledger_state(base_url: str) -> dict[str, Any]:
    return {rid: {"reserved_blocks": r["blocks"]["reserved"],
                  "in_flight_requests": r["in_flight_requests"],
                  "held_blocks": r["snapshot"]["held_blocks"],
                  "total_blocks": r["snapshot"]["total_blocks"]}
            for rid, r in replicas(base_url).items()}


def idle(base_url: str) -> bool:
    return all(r["reserved_blocks"] == r["in_flight_requests"] == r["held_blocks"] == 0
               for r in ledger_state(base_url).values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--interval-s", type=float, default=0.08)
    parser.add_argument("--kill-at-s", type=float, default=6.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--fault", choices=["sigkill", "sigstop"], default="sigkill")
    parser.add_argument("--freeze-s", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or RESULTS / f"engine_{args.fault}.json"
    config = load_config()
    with serve_run(config, expected_replicas=replica_count(config),
                   env={"BLOCKSERVE_API_KEY": API_KEY}) as run:
        result = asyncio.run(load_with_fault(run.base_url, args.requests, args.interval_s,
                                             args.kill_at_s, args.max_tokens, args.fault,
                                             args.freeze_s))
        result["idle_within_30s_after_load"] = bool(wait_for(lambda: idle(run.base_url), 30))
        result["ledger_after_load"] = ledger_state(run.base_url)
        started = time.monotonic()
        rejoined = wait_for(lambda: len(replicas(run.base_url)) == 2, 300, 0.5)
        result["replacement_joined_after_load_s"] = (round(time.monotonic() - started, 1)
                                                     if rejoined else None)
        result["ledger_at_end"] = ledger_state(run.base_url)
    result["config"] = vars(args) | {"out": str(out)}
    result["command"] = ("python -m blockserve.bench.engine_kill " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "outcome_list"}, indent=1))


if __name__ == "__main__":
    main()
