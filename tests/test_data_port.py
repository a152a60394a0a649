"""The direct data path over real local sockets: DataPort (replica) <-> DirectDispatch
(router), and the router's failover over it. The served generator stands in for vLLM;
no Ray, no engine."""

import asyncio
import json

import pytest

from blockserve.protocol.chunks import DEAD, ReplicaChunk
from blockserve.protocol.queue_orders import FirstComeFirstServed
from blockserve.protocol.snapshot import BlockSnapshot
from blockserve.replica.data_port import DataPort
from blockserve.router.admission import AdmissionQueue
from blockserve.router.demand import Demand
from blockserve.router.dispatch import DirectDispatch, ReplicaUnavailable
from blockserve.router.failover import Failover, Unserved, stream_error
from blockserve.router.ledger import Ledger
from blockserve.router.placement import BestFitBlocks


class Served:
    """Streams `count` chunks, one every `interval_s`; records what happened."""

    def __init__(self, count: int = 3, interval_s: float = 0.0, dies_after: int | None = None,
                 replica_id: str = "r1"):
        self.count, self.interval_s, self.dies_after = count, interval_s, dies_after
        self.replica_id = replica_id
        self.started = self.finished = self.cancelled = 0

    async def __call__(self, endpoint: str, body: dict):
        self.started += 1
        try:
            for i in range(self.count):
                if i == self.dies_after:  # what the replica sends once its engine died
                    yield ReplicaChunk(DEAD, 503, {"error": {"code": 503}},
                                       {"engine_dead": True}, self.replica_id)
                    return
                await asyncio.sleep(self.interval_s)
                yield ReplicaChunk("sse", 200, f"{body['prompt']}-{i}", {"free": 7},
                                   self.replica_id)
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


async def _pair(served: Served, dispatch: DirectDispatch | None = None):
    port = RecordingPort(served)
    dispatch = dispatch or DirectDispatch(replicas=None)
    dispatch.ports[served.replica_id] = await port.start("127.0.0.1")
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
        with pytest.raises(ReplicaUnavailable):
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


def test_an_unknown_replica_is_unavailable():
    async def main():
        dispatch = DirectDispatch(replicas=None)
        with pytest.raises(ReplicaUnavailable):
            await dispatch.generate("nowhere", "chat", {}).__anext__()

    asyncio.run(main())


@pytest.mark.parametrize("how", ["close", "reset"])
def test_the_replica_side_dying_mid_stream_breaks_the_stream_after_its_chunks(how):
    """The router's broken-stream path: chunks already read stay read, then the stream
    raises `ReplicaUnavailable` (the router ends the client's stream with an error event)
    instead of ending as if complete."""
    async def main():
        served = Served(count=100, interval_s=0.02)
        port, dispatch = await _pair(served)
        stream = dispatch.generate("r1", "completions", {"prompt": "x"})
        received = [(await stream.__anext__()).payload for _ in range(3)]
        server_end = port.connections[0]
        if how == "reset":
            server_end.transport.abort()  # RST, as when the replica process is killed
        else:
            port.close()  # what a replica whose engine died does after its drain
        with pytest.raises(ReplicaUnavailable) as failure:
            async for chunk in stream:
                received.append(chunk.payload)
        assert not failure.value.dead
        assert received[:3] == ["x-0", "x-1", "x-2"] and len(received) < 100
        await _eventually(lambda: served.cancelled == 1)  # the replica side aborted
        port.close()

    asyncio.run(main())


def test_the_dead_engine_chunk_is_a_dead_replica_not_a_response():
    async def main():
        served = Served(count=5, dies_after=2)
        port, dispatch = await _pair(served)
        stream = dispatch.generate("r1", "completions", {"prompt": "x"})
        assert [(await stream.__anext__()).payload for _ in range(2)] == ["x-0", "x-1"]
        with pytest.raises(ReplicaUnavailable) as failure:
            await stream.__anext__()
        assert failure.value.dead and failure.value.replica_id == "r1"
        port.close()

    asyncio.run(main())


def test_the_broken_stream_error_event_is_openai_format_then_done():
    events = stream_error(503, "The stream broke off").split("\n\n")
    assert events[0].startswith("data: ") and events[1] == "data: [DONE]" and events[2] == ""
    error = json.loads(events[0][len("data: "):])["error"]
    assert error == {"message": "The stream broke off", "type": "ServiceUnavailableError",
                     "param": None, "code": 503}


def _failover_over(dispatch: DirectDispatch, replica_ids, retries: int = 2,
                   timeout_s: float = 2.0):
    ledger = Ledger()
    for replica_id in replica_ids:
        ledger.report(replica_id, BlockSnapshot(timestamp=1.0, total_blocks=100, block_size=1,
                                                free_blocks=100, max_model_len=1000))
    queue = AdmissionQueue(ledger, BestFitBlocks(), FirstComeFirstServed(), max_requests=10,
                           max_tokens=10_000, timeout_s=timeout_s)
    return Failover(queue, ledger, dispatch.on_removed, retries), queue, ledger


def _demand(blocks: int) -> Demand:
    return Demand(prompt_tokens=blocks, expected_output=0, sequences=1, block_size=1)


def _start(dispatch: DirectDispatch):
    return lambda lease: dispatch.generate(lease.replica_id, "completions", {"prompt": "p"})


@pytest.mark.parametrize("failure", ["refused", "dead_engine"])
def test_a_request_its_replica_failed_before_answering_is_served_by_another(failure):
    """A closed data port (connection refused) or a dead-engine chunk before any output:
    the replica leaves placement with its reservations, the request goes elsewhere."""
    async def main():
        dispatch = DirectDispatch(replicas=None)
        broken_port, _ = await _pair(Served(dies_after=0, replica_id="r0"), dispatch)
        good_port, _ = await _pair(Served(replica_id="r1"), dispatch)
        if failure == "refused":
            broken_port.close()
            await broken_port.server.wait_closed()
        failover, queue, ledger = _failover_over(dispatch, ["r0", "r1"])
        ledger.reserve("r0", 60)  # best fit now prefers r0: the request goes there first
        lease = await queue.admit(_demand(10))
        assert lease.replica_id == "r0"
        lease, first, stream = await failover.first_chunk(lease, _start(dispatch))
        assert lease.replica_id == "r1" and first.payload == "p-0"
        assert [c.payload async for c in stream] == ["p-1", "p-2"]
        queue.release(lease)
        assert "r0" not in ledger.replicas and "r0" not in dispatch.ports
        assert failover.retried == 1 and ledger.reserved_blocks() == 0  # r0's went too
        # A dead engine never comes back; a refused connection may, with a snapshot.
        ledger.report("r0", BlockSnapshot(timestamp=2.0, total_blocks=100, block_size=1))
        assert ("r0" in ledger.replicas) == (failure == "refused")
        good_port.close()

    asyncio.run(main())


def test_when_no_replica_is_left_the_request_is_unserved_with_retry_after():
    async def main():
        dispatch = DirectDispatch(replicas=None)
        port, _ = await _pair(Served(dies_after=0, replica_id="r0"), dispatch)
        failover, queue, ledger = _failover_over(dispatch, ["r0"], timeout_s=0.2)
        lease = await queue.admit(_demand(10))
        with pytest.raises(Unserved) as unserved:
            await failover.first_chunk(lease, _start(dispatch))
        assert unserved.value.retry_after_s >= 1
        assert not ledger.replicas and not queue.waiting and failover.retried == 0
        port.close()

    asyncio.run(main())


def test_retries_are_bounded():
    async def main():
        dispatch = DirectDispatch(replicas=None)
        ports = [(await _pair(Served(dies_after=0, replica_id=f"r{i}"), dispatch))[0]
                 for i in range(4)]
        failover, queue, ledger = _failover_over(dispatch, [f"r{i}" for i in range(4)],
                                                 retries=2)
        lease = await queue.admit(_demand(10))
        with pytest.raises(Unserved):
            await failover.first_chunk(lease, _start(dispatch))
        assert failover.retried == 2 and len(ledger.replicas) == 1  # 3 tried, 1 untouched
        assert ledger.reserved_blocks() == 0
        for port in ports:
            port.close()

    asyncio.run(main())


def test_requests_queued_when_a_replica_dies_go_to_the_survivor_only():
    """The engine dies while requests wait in the router's queue: none is placed on the
    dead replica; they, and the request it failed, are served by the survivor as it frees
    room, in queue order."""
    async def main():
        dispatch = DirectDispatch(replicas=None)
        dead_port, _ = await _pair(Served(dies_after=0, replica_id="r0"), dispatch)
        good_port, _ = await _pair(Served(replica_id="r1"), dispatch)
        failover, queue, ledger = _failover_over(dispatch, ["r0", "r1"], timeout_s=5)
        busy = ledger.reserve("r1", 95)  # the survivor is nearly full
        failed = await queue.admit(_demand(95))
        assert failed.replica_id == "r0"
        queued = asyncio.ensure_future(queue.admit(_demand(50)))
        await asyncio.sleep(0.01)
        assert not queued.done()  # no room anywhere
        retried = asyncio.ensure_future(failover.first_chunk(failed, _start(dispatch)))
        await _eventually(lambda: "r0" not in ledger.replicas)
        await asyncio.sleep(0.05)
        assert not queued.done() and not retried.done()  # r0's room is not theirs
        ledger.release(busy)
        queue.pump()
        lease = await asyncio.wait_for(queued, 1)
        assert lease.replica_id == "r1" and not retried.done()  # first come, first served
        queue.release(lease)
        retried_lease, first, stream = await asyncio.wait_for(retried, 1)
        assert retried_lease.replica_id == "r1" and first.payload == "p-0"
        await stream.aclose()
        queue.release(retried_lease)
        assert ledger.reserved_blocks() == 0 and failover.retried == 1
        dead_port.close()
        good_port.close()

    asyncio.run(main())
