"""Replicas that answer at once, to measure the router alone (bench/router_rate.py): the
replica API the router calls (snapshot, data port, models), with no engine behind it.
Each completion is answered with one whole response of `max_tokens` tokens, or with
`stream` those tokens as server-sent events, one per token, all at once; each with a
snapshot of an idle replica of the config's engine shape.

    import_path: blockserve.tools.echo_replica:build_echo_app

For the floor under any router (bench/router_rate.py `--floor`), the same answer with no
router at all: `echo_api`, a FastAPI app that uvicorn serves alone, and `plain_echo`, the
same app as one Serve deployment behind Serve's HAProxy.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve

from blockserve.controller.app import bind
from blockserve.protocol.chunks import ReplicaChunk
from blockserve.protocol.config import ReplicaConfig, checked
from blockserve.protocol.snapshot import BlockSnapshot
from blockserve.replica.data_port import DataPort


def echo_completion(model: str, tokens: int) -> dict:
    """One whole completion of `tokens` tokens, as every echo answers."""
    return {"id": "cmpl-echo", "object": "text_completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "text": " x" * tokens, "finish_reason": "length",
                         "logprobs": None}],
            "usage": {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens}}


def echo_events(model: str, tokens: int) -> list[str]:
    """The same completion streamed: one event per token, its usage, then `[DONE]`."""
    whole = echo_completion(model, tokens)
    chunk = {key: whole[key] for key in ("id", "object", "created", "model")}
    events = [dict(chunk, choices=[{"index": 0, "text": " x", "logprobs": None,
                                    "finish_reason": "length" if i == tokens - 1 else None}])
              for i in range(tokens)]
    events.append(dict(chunk, choices=[], usage=whole["usage"]))
    return [f"data: {json.dumps(event)}\n\n" for event in events] + ["data: [DONE]\n\n"]


echo_api = FastAPI()


@echo_api.get("/v1/models")
async def plain_models() -> dict:
    return {"object": "list", "data": [{"id": "echo", "object": "model"}]}


@echo_api.post("/v1/completions")
async def plain_completion(request: Request):
    body = await request.json()
    model, tokens = body.get("model", "echo"), int(body.get("max_tokens") or 16)
    if body.get("stream"):
        async def events() -> AsyncIterator[str]:
            for event in echo_events(model, tokens):
                yield event
        return StreamingResponse(events(), media_type="text/event-stream")
    return echo_completion(model, tokens)


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(echo_api)
class PlainEcho:
    """`echo_api` as one Serve deployment: Serve's ingress and HAProxy, no router."""


plain_echo = PlainEcho.bind()


class EchoReplica:
    async def __init__(self, config: dict):
        self.config = checked(ReplicaConfig, config)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        engine = self.config.engine_args
        self.idle = BlockSnapshot(total_blocks=engine["num_gpu_blocks_override"] - 1,
                                  block_size=engine["block_size"],
                                  free_blocks=engine["num_gpu_blocks_override"] - 1,
                                  max_model_len=engine["max_model_len"])
        self.data_port = DataPort(self.generate)
        await self.data_port.start(ray.util.get_node_ip_address())

    def _snapshot(self) -> dict:
        return {**self.idle.to_dict(), "timestamp": time.time()}

    def snapshot(self, replica_id: str | None = None,
                 router_queued_blocks: float | None = None) -> dict:
        return {"replica_id": self.replica_id, "pid": os.getpid(), **self._snapshot()}

    def kv_event_source(self, replica_id: str | None = None) -> None:
        return None

    def data_port_info(self, replica_id: str | None = None) -> dict:
        return self.data_port.address

    async def models(self, replica_id: str | None = None) -> dict:
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model"}]}

    async def generate(self, endpoint: str, body: dict, replica_id: str | None = None
                       ) -> AsyncIterator[ReplicaChunk]:
        tokens = int(body.get("max_tokens") or 16)
        if body.get("stream"):  # the first token's event alone, as vLLM's first message
            first, *rest = echo_events(self.config.model_name, tokens)
            for text in (first, "".join(rest)):
                yield ReplicaChunk("sse", 200, text, self._snapshot(), self.replica_id)
            return
        payload = echo_completion(self.config.model_name, tokens)
        yield ReplicaChunk("json", 200, payload, self._snapshot(), self.replica_id)

    async def check_health(self) -> None:
        return None


def build_echo_app(args: dict[str, Any]) -> serve.Application:
    return bind(args, EchoReplica)
