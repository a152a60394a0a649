"""Stream coalescing in the replica: first item at once, later items batched."""

import asyncio
import time

from blockserve.replica.coalesce import coalesce


async def ticks(n, gap_s):
    for i in range(n):
        await asyncio.sleep(gap_s)
        yield f"{i},"


def test_first_item_passes_at_once_and_the_rest_are_batched():
    async def run():
        started, out = time.monotonic(), []
        async for batch in coalesce(ticks(20, 0.005), window_s=lambda: 0.05):
            out.append((time.monotonic() - started, batch))
        return out

    out = asyncio.run(run())
    assert out[0][1] == "0," and out[0][0] < 0.04  # not held back by the window
    assert "".join(b for _, b in out) == "".join(f"{i}," for i in range(20))  # all, in order
    assert len(out) < 10  # later tokens travel together


def test_closing_the_consumer_closes_the_source():
    closed = []

    async def source():
        try:
            for i in range(100):
                await asyncio.sleep(0.001)
                yield str(i)
        finally:
            closed.append(True)

    async def run():
        stream = coalesce(source(), window_s=lambda: 0.01)
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(run())
    assert closed == [True]  # a client disconnect reaches vLLM's generator (abort)


def test_the_window_widens_to_keep_a_replicas_streams_within_the_message_budget():
    from blockserve.protocol.config import ReplicaConfig
    from blockserve.replica.deployment import VLLMReplica

    replica = object.__new__(VLLMReplica)  # the window needs no engine
    replica.config = ReplicaConfig(model="m", stream_coalesce_ms=50, stream_messages_per_s=200)
    replica.streams = 2
    assert replica._stream_window() == 0.05  # light load: the configured window
    replica.streams = 40
    assert replica._stream_window() == 0.2  # 40 streams x 5 messages/s = 200 messages/s
    replica.config = replica.config.model_copy(update={"stream_messages_per_s": 0})
    assert replica._stream_window() == 0.05  # budget off: fixed window


def test_only_streams_that_send_share_the_budget_and_chunks_carry_the_snapshot_alone():
    """A request still in vLLM's waiting queue sends nothing: counting it would widen
    every sending stream's window (fewer, later messages) for no saving."""
    from types import SimpleNamespace

    from blockserve.protocol.config import ReplicaConfig
    from blockserve.protocol.snapshot import SNAPSHOT_FIELDS, BlockSnapshot
    from blockserve.replica.deployment import VLLMReplica

    replica = object.__new__(VLLMReplica)  # generate() needs no engine for this
    replica.config = ReplicaConfig(model="m", stream_coalesce_ms=10)
    replica.replica_id, replica.dead, replica.streams, replica.responses = "r", False, 0, 0
    replica.engine = SimpleNamespace(errored=False, shutdown=lambda: None)
    replica.channel = SimpleNamespace(read=lambda: BlockSnapshot(total_blocks=8),
                                      close=lambda unlink: None)
    started = asyncio.Event()

    async def serve(endpoint, body):
        async def tokens():
            if body["queued"]:
                await started.wait()  # waits in the engine's queue until released
            for i in range(3):
                await asyncio.sleep(0.001)
                yield f"data: {i}\n\n"
        return tokens()

    replica._serve = serve

    async def run():
        async def read(body):
            return [chunk async for chunk in replica.generate("chat", body)]

        queued = asyncio.ensure_future(read({"queued": True}))
        sending = replica.generate("chat", {"queued": False})
        first = await sending.__anext__()
        counted_while_one_waits = replica.streams
        rest = [chunk async for chunk in sending]
        started.set()
        return first, rest, counted_while_one_waits, await queued

    first, rest, counted, queued = asyncio.run(run())
    assert counted == 1  # the sending stream, not the queued one
    assert replica.streams == 0 and replica.responses == 0
    assert set(first.snapshot) == set(SNAPSHOT_FIELDS) | {"engine_dead"}
    assert "".join(c.payload for c in [first, *rest]) == "".join(
        f"data: {i}\n\n" for i in range(3))
    assert queued
