"""Schema-based fuzzing of the OpenAI routes: request bodies that schemathesis generates
from the router's /openapi.json (vLLM's own request models, router/openapi.py), sent to
a deployment and checked the way a client would see them.

Positive cases fit the schema; negative ones break it (wrong types, missing or extra
fields, other JSON). Each answer must be a success or a well-formed OpenAI error below
500, streamed or not; tests/test_fuzz.py and the soak (bench/soak.py) use this.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

ROUTES = ("/v1/chat/completions", "/v1/completions")
MODES = ("positive", "negative")
TIMEOUT_S = 120.0  # an answer later than this, even to a valid case, is a hang


def generate(spec: dict, path: str, mode: str, count: int, seed: int) -> list[Any]:
    """`count` request bodies for `path`'s POST, drawn by schemathesis from `spec`
    (reproducible for a seed: hypothesis's derandomized engine, no example database)."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, reject, settings
    from hypothesis import seed as seeded
    from hypothesis import strategies as st

    operation = schemathesis.openapi.from_dict(spec)[path]["POST"]
    strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))
    bodies: list[Any] = []

    @st.composite
    def drawable(draw: Any) -> Any:
        """A case, or hypothesis's next try where schemathesis cannot draw one: its
        negative mode raises "Unsupported type: 'Binary'" on some mutations of vLLM's
        `format: binary` field (prompt_embeds), for seeds 1, 13, 20 and 22 of 24 here."""
        try:
            return draw(strategy)
        except ValueError as error:
            if "Unsupported type" not in str(error):
                raise
            reject()

    @seeded(seed)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(drawable())
    def collect(case: Any) -> None:
        bodies.append(case.body)

    collect()
    return bodies


def affordable(body: Any, index: int, tokens: int) -> Any:
    """A case the engines serve in a moment: a cap above `tokens`, or none, becomes
    `tokens` (vLLM's default is the whole context, minutes of a loaded CPU per case);
    where the case leaves `stream` out, every other case streams, so both kinds reach
    the engines. Every other value, invalid ones included, stays as drawn."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = tokens
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > tokens:
            body[key] = tokens
    body.setdefault("stream", index % 2 == 1)
    return body


@dataclass
class Outcome:
    """What the client saw of one fuzzed request."""

    path: str
    body: Any
    streamed: bool
    status: int  # 0: no answer within the client's timeout
    text: str  # the body, or the stream's events up to where the client stopped
    cancelled: bool = False  # the client closed the stream after its first event

    def problem(self) -> str | None:
        """Why this answer is wrong (none in time, a 5xx, a 4xx that is not an OpenAI
        error, a stream that reports a server error), or None."""
        if self.status == 0:
            return self.text
        if self.status >= 500:
            return f"HTTP {self.status}"
        if self.status >= 400:
            return _error_problem(self.text, self.status)
        for line in self.text.splitlines() if self.streamed else ():
            event = line.removeprefix("data: ")
            if event != line and event.startswith('{"error"'):
                if problem := _error_problem(event, None):
                    return f"stream error event: {problem}"
                if json.loads(event)["error"]["code"] >= 500:
                    return f"stream error event {event[:200]}"
        return None

    def report(self) -> str:
        body = json.dumps(self.body, default=repr)
        return f"{self.path} {self.problem()}: {body[:400]} -> {self.text[:300]}"


def _error_problem(text: str, status: int | None) -> str | None:
    """Why `text` is not an OpenAI error object (with `status` as its code), or None."""
    try:
        error = json.loads(text)["error"]
        fine = (isinstance(error["message"], str) and error["message"]
                and isinstance(error["type"], str)
                and (status is None or error["code"] == status))
    except (ValueError, KeyError, TypeError):
        fine = False
    return None if fine else f"not an OpenAI error: {text[:200]!r}"


def send(http: httpx.Client, path: str, body: Any, cancel: bool = False,
         timeout_s: float = TIMEOUT_S) -> Outcome:
    """POST one fuzzed body as JSON; a streamed success is read to its end, or closed
    after its first event when `cancel`."""
    streamed = isinstance(body, dict) and body.get("stream") is True
    try:
        return _send(http, path, body, streamed, cancel, timeout_s)
    except httpx.TimeoutException as exc:
        return Outcome(path, body, streamed, 0, f"no answer within {timeout_s:g} s: {exc!r}")


def _send(http: httpx.Client, path: str, body: Any, streamed: bool, cancel: bool,
          timeout_s: float) -> Outcome:
    content = json.dumps(body, default=repr).encode()
    headers = {"content-type": "application/json"}
    if not streamed:
        response = http.post(path, content=content, headers=headers, timeout=timeout_s)
        return Outcome(path, body, False, response.status_code, response.text)
    with http.stream("POST", path, content=content, headers=headers,
                     timeout=timeout_s) as response:
        if response.status_code != 200:
            return Outcome(path, body, True, response.status_code,
                           response.read().decode(errors="replace"))
        events = []
        for line in response.iter_lines():
            events.append(line)
            if cancel and line.startswith("data: "):
                return Outcome(path, body, True, 200, "\n".join(events), cancelled=True)
        return Outcome(path, body, True, 200, "\n".join(events))
