"""The replica deployment: one vLLM `AsyncLLM` served through vLLM's own OpenAI layer.

The router calls `generate()` over this replica's data port (replica/data_port.py), or
through a Ray Serve handle pinned to this replica (router.transport). Each call yields
`ReplicaChunk`s: one `json` chunk for a whole response (or an error), or a
series of `sse` chunks for a stream, coalesced (replica/coalesce.py) so that one
message carries many tokens: over `stream_coalesce_ms`, widened under load so that the
streams sending tokens together send at most `stream_messages_per_s` messages (a request
still in vLLM's waiting queue sends none and takes no share). Every chunk carries the
replica's latest block snapshot, so the router's ledger is refreshed whenever traffic
flows; vLLM's counters come with the router's polls.

When the engine dies (its EngineCore process exits, or vLLM flags it dead; the replica
looks every `ENGINE_WATCH_S`), every response in flight and every new one ends with one
`dead` chunk instead of vLLM's HTTP 500, the replica's snapshots say `engine_dead`, its
health check fails (Ray Serve replaces it) and after `DEAD_DRAIN_S` its data port
closes. The EngineCore kills itself and its workers if the replica dies first
(replica/watchdog.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, AsyncIterator

import ray
from ray import serve
from starlette.datastructures import State

from blockserve.protocol.chunks import CHAT, COMPLETIONS, DEAD, ReplicaChunk
from blockserve.protocol.config import ReplicaConfig, checked
from blockserve.protocol.path_trace import mark
from blockserve.protocol.snapshot import BLOCK_POLICY_KINDS, SnapshotChannel
from blockserve.replica.coalesce import coalesce
from blockserve.replica.cpu_binding import engine_processes_on
from blockserve.replica.data_port import DataPort
from blockserve.replica.engine_stats import EngineCounters, stat_logger_factory
from blockserve.replica.kv_events import event_source, publisher_engine_args
from blockserve.replica.watchdog import ExitWatch

logger = logging.getLogger("blockserve.replica")

ENGINE_WATCH_S = 0.05
DEAD_DRAIN_S = 1.0  # responses in flight get their dead chunk before the port closes
_ERROR_EVENT = 'data: {"error"'  # how vLLM's stream generators report an exception


class VLLMReplica:
    """A Ray Serve replica hosting one vLLM engine and its OpenAI serving layer."""

    async def __init__(self, config: dict):
        self.config = checked(ReplicaConfig, config)  # validated by build_app already
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        binds = self.config.omp_threads_bind
        bind = binds[context.rank.rank % len(binds)] if binds else None
        if bind:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
        self.channel = SnapshotChannel.create()
        scheduler = self.config.scheduler
        self.block_policy_names = {kind: getattr(scheduler, f"block_{kind}").cls
                                   for kind in BLOCK_POLICY_KINDS}
        self.counters = EngineCounters()
        self.router_queued_blocks = 0.0
        # Streams that have sent their first message: they share the message budget. One
        # still in vLLM's waiting queue sends nothing and takes no share of it.
        self.streams = 0
        self.responses = 0  # responses in flight, streamed or not
        self.dead = False  # the engine died: this replica only waits to be replaced
        started = time.time()
        with engine_processes_on(bind):
            self.engine, self.state = await _start_engine(self.config, self.channel.name,
                                                          self.counters)
        self.engine_pid = _engine_pid(self.engine)
        self.data_port = DataPort(self.generate)
        await self.data_port.start(ray.util.get_node_ip_address())
        self._watcher = asyncio.get_running_loop().create_task(self._watch_engine())
        logger.info("replica %s: engine ready in %.1fs, data port %s", self.replica_id,
                    time.time() - started, self.data_port.address["port"])

    # --- called by the router --------------------------------------------------------
    def snapshot(self, replica_id: str | None = None,
                 router_queued_blocks: float | None = None) -> dict:
        """The latest block snapshot written by the scheduler in the EngineCore process.
        The router's poll also tells the replica its queue demand, for autoscaling."""
        if router_queued_blocks is not None:
            self.router_queued_blocks = router_queued_blocks
        return {"replica_id": self.replica_id, "pid": os.getpid(),
                "engine_pid": self.engine_pid, "block_policies": self.block_policy_names,
                **self._blocks(), **self.counters.to_dict()}

    def _blocks(self) -> dict:
        """What every response chunk carries: the block snapshot and whether the engine
        died. vLLM's counters and the rest come with polls (`snapshot`): a chunk is sent
        many times a second, and each field costs JSON both here and at the router."""
        return {"engine_dead": self.dead, **self.channel.read().to_dict()}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom-autoscaling hook (controller/autoscaling.py reads these)."""
        snap = self.channel.read()
        return {"total_blocks": snap.total_blocks, "held_blocks": snap.held_blocks,
                "growth_blocks": snap.growth_blocks, "waiting_blocks": snap.waiting_blocks,
                "router_queued_blocks": self.router_queued_blocks}

    def kv_event_source(self, replica_id: str | None = None) -> dict | None:
        """Where this engine publishes its KV cache events (replica/kv_events.py)."""
        return event_source(self.engine) if self.config.publish_kv_events else None

    def data_port_info(self, replica_id: str | None = None) -> dict:
        """Where the router connects for the direct data path, and its token."""
        return self.data_port.address

    async def models(self, replica_id: str | None = None) -> dict:
        listing = await self.state.openai_serving_models.show_available_models()
        return listing.model_dump()

    async def generate(self, endpoint: str, body: dict, replica_id: str | None = None
                       ) -> AsyncIterator[ReplicaChunk]:
        if replica_id is not None and replica_id != self.replica_id:
            logger.warning("request for %s served by %s", replica_id, self.replica_id)
        self.responses += 1
        mark("replica: request read")
        try:
            result = None if self._engine_failed() else await self._serve(endpoint, body)
            mark("replica: vLLM request made")
            if result is None:
                yield self._dead_chunk()
                return
            if isinstance(result, tuple):
                status, payload = result
                yield self._chunk("json", status, payload)
                return
            cut: list[bool] = []
            producing = False  # counted in `streams` from its first message on
            try:
                async for text in coalesce(self._until_engine_death(result, cut),
                                           self._stream_window):
                    if not producing:
                        mark("replica: first text from vLLM")
                        producing = True
                        self.streams += 1
                    yield self._chunk("sse", 200, text)
            finally:
                self.streams -= producing
            if cut:
                yield self._dead_chunk()
        finally:
            self.responses -= 1

    async def check_health(self) -> None:
        if self.dead:
            raise RuntimeError(f"the vLLM engine of replica {self.replica_id} died")
        await self.engine.check_health()

    def __del__(self):
        port = getattr(self, "data_port", None)
        if port is not None:
            port.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        channel = getattr(self, "channel", None)
        if channel is not None:
            channel.close(unlink=True)

    # --- internals ---------------------------------------------------------------------
    def _engine_failed(self) -> bool:
        return self.dead or self.engine.errored

    async def _watch_engine(self) -> None:
        """Notice the engine's death, end the requests waiting on it, close the port."""
        from vllm.v1.engine.exceptions import EngineDeadError

        process = ExitWatch(self.engine_pid) if self.engine_pid is not None else None
        while not (self.engine.errored or (process is not None and process.exited())):
            await asyncio.sleep(ENGINE_WATCH_S)
        self.dead = True
        logger.error("replica %s: the vLLM engine (pid %s) died; failing over",
                     self.replica_id, self.engine_pid)
        # vLLM would tell its requests only once the engine's workers have exited too.
        self.engine.output_processor.propagate_error(EngineDeadError())
        if process is not None:
            process.close()
        deadline = time.monotonic() + DEAD_DRAIN_S
        while self.responses and time.monotonic() < deadline:
            await asyncio.sleep(ENGINE_WATCH_S)
        self.data_port.close()

    async def _until_engine_death(self, stream: AsyncIterator[str], cut: list[bool]
                                  ) -> AsyncIterator[str]:
        """vLLM's stream, ended (and `cut` set) before the error event it sends when the
        engine died: the replica sends its `dead` chunk instead."""
        try:
            async for text in stream:
                if text.startswith(_ERROR_EVENT) and self._engine_failed():
                    cut.append(True)
                    return
                yield text
        finally:
            await stream.aclose()

    def _dead_chunk(self) -> ReplicaChunk:
        message = f"The vLLM engine of replica {self.replica_id} died."
        return self._chunk(DEAD, 503, {"error": {
            "message": message, "type": "ServiceUnavailableError", "param": None,
            "code": 503}})

    def _stream_window(self) -> float:
        """Seconds a stream gathers tokens per message: the configured window, widened so
        that all streams together stay within the replica's message budget (each message
        costs milliseconds of CPU on the way to the client; tokens cost far less)."""
        window = self.config.stream_coalesce_ms / 1000
        budget = self.config.stream_messages_per_s
        return max(window, self.streams / budget) if budget else window

    def _chunk(self, kind: str, status: int, payload: Any) -> ReplicaChunk:
        return ReplicaChunk(kind, status, payload, self._blocks(), self.replica_id)

    async def _serve(self, endpoint: str, body: dict
                     ) -> tuple[int, dict] | AsyncIterator[str] | None:
        """Run vLLM's serving layer: (status, json), an SSE string generator, or None
        when the engine died under the request."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response)
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            if endpoint == CHAT:
                request = ChatCompletionRequest.model_validate(body)
                result = await self.state.openai_serving_chat.create_chat_completion(
                    request, None)
            elif endpoint == COMPLETIONS:
                request = CompletionRequest.model_validate(body)
                result = await self.state.openai_serving_completion.create_completion(
                    request, None)
            else:
                raise ValueError(f"unknown endpoint {endpoint!r}")
        except EngineDeadError:
            return None
        except Exception as exc:  # vLLM's api_server maps these the same way
            result = create_error_response(exc)
        if isinstance(result, ErrorResponse):
            if result.error.code >= 500 and self._engine_failed():
                return None
            return result.error.code, result.model_dump()
        if hasattr(result, "model_dump"):
            return 200, result.model_dump()
        return result


async def _start_engine(config: ReplicaConfig, snapshot_channel: str,
                        counters: EngineCounters) -> tuple[Any, State]:
    """Start AsyncLLM and vLLM's OpenAI serving state exactly as `vllm serve` does."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM

    kwargs = config.engine_kwargs(snapshot_channel, owner_pid=os.getpid())
    if config.publish_kv_events:
        kwargs = publisher_engine_args(kwargs)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs),
                                       stat_loggers=[stat_logger_factory(counters.record)])
    frontend_args = make_arg_parser(FlexibleArgumentParser()).parse_args([])
    frontend_args.model = config.model
    frontend_args.served_model_name = [config.model_name]
    # Usage reports the prompt tokens served from the prefix cache: the router's routing
    # regret compares its prediction with them (router/regret.py).
    frontend_args.enable_prompt_tokens_details = True
    state = State()
    await init_app_state(engine, state, frontend_args, await engine.get_supported_tasks())
    return engine, state


def _engine_pid(engine: Any) -> int | None:
    """The EngineCore process's pid (None when vLLM runs the engine in this process)."""
    manager = getattr(engine.engine_core, "resources", None)
    manager = getattr(manager, "engine_manager", None)
    processes = getattr(manager, "processes", None)
    return processes[0].pid if processes else None
