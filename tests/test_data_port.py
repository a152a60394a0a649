"""The direct data path over real local sockets: DataPort (replica) <-> DirectDispatch
(router). The served generator stands in for vLLM; no Ray, no engine."""

import asyncio

import pytest

from replica.data_port import DataPort
from replica.deployment import ReplicaChunk
from router.dispatch import DirectDispatch


class Served:
    """Streams `count` chunks, one every `interval_s`; records what happened."""

    def __init__(self, count: int = 3, interval_s: float = 0.0):
        self.count, self.interval_s = count, interval_s
        self.started = self.finished = self.cancelled = 0

    async def __call__(self, endpoint: str, body: dict):
        self.started += 1
        try:
            for i in range(self.count):
                await asyncio.sleep(self.interval_s)
                yield ReplicaChunk("sse", 200, f"{body['prompt']}-{i}", {"free": 7}, "r1")
            self.finished += 1
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


class RecordingPort(DataPort):
    """A DataPort that keeps the server end of every connection it accepted."""

    def __init__(self, served: Served):
        super().__init__(served)
        self.connections: list[asyncio.StreamWriter] = []

    async def _connection(self, reader, writer):
        self.connections.append(writer)
        await super()._connection(reader, writer)


async def _pair(served: Served):
    port = RecordingPort(served)
    dispatch = DirectDispatch(replicas=None)
    dispatch.ports["r1"] = await port.start("127.0.0.1")
    return port, dispatch


async def _eventually(condition, timeout_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def test_chunks_arrive_in_order_and_the_connection_is_reused():
    async def main():
        served = Served()
        port, dispatch = await _pair(served)
        for prompt in ("a", "b"):
            chunks = [c async for c in dispatch.generate("r1", "completions",
                                                         {"prompt": prompt})]
            assert [c.payload for c in chunks] == [f"{prompt}-{i}" for i in range(3)]
            assert chunks[0] == ReplicaChunk("sse", 200, f"{prompt}-0", {"free": 7}, "r1")
        assert served.finished == 2 and len(port.connections) == 1
        port.close()

    asyncio.run(main())


def test_closing_the_stream_early_cancels_the_replica_side():
    async def main():
        served = Served(count=100, interval_s=0.05)
        port, dispatch = await _pair(served)
        stream = dispatch.generate("r1", "completions", {"prompt": "x"})
        assert (await stream.__anext__()).payload == "x-0"
        await stream.aclose()  # what the router does when its client disconnects
        await _eventually(lambda: served.cancelled == 1)
        assert served.finished == 0 and not dispatch._idle["r1"]
        # The next request opens a fresh connection and is served in full.
        assert len([c async for c in dispatch.generate("r1", "chat", {"prompt": "y"})]) == 100
        port.close()

    asyncio.run(main())


def test_a_wrong_token_is_refused_without_serving():
    async def main():
        served = Served()
        port, dispatch = await _pair(served)
        dispatch.ports["r1"] = dict(dispatch.ports["r1"], token="guess")
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            async for _ in dispatch.generate("r1", "completions", {"prompt": "x"}):
                pass
        assert served.started == 0
        port.close()

    asyncio.run(main())


def test_an_idle_connection_the_replica_closed_is_replaced():
    async def main():
        served = Served()
        port, dispatch = await _pair(served)
        assert len([c async for c in dispatch.generate("r1", "chat", {"prompt": "a"})]) == 3
        (reader, writer), = dispatch._idle["r1"]
        port.connections[0].close()  # the replica side drops the pooled connection
        await _eventually(reader.at_eof)
        assert len([c async for c in dispatch.generate("r1", "chat", {"prompt": "b"})]) == 3
        assert served.finished == 2 and len(port.connections) == 2
        port.close()

    asyncio.run(main())


def test_an_unknown_replica_is_a_connection_error():
    async def main():
        dispatch = DirectDispatch(replicas=None)
        with pytest.raises(ConnectionError):
            await dispatch.generate("nowhere", "chat", {}).__anext__()

    asyncio.run(main())
