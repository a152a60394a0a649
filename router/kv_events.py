"""vLLM's KV cache events at the router: the one adapter to vLLM's event stream and hashing.

Each replica's engine publishes its prefix-cache changes over ZMQ (`kv_events_config`,
replica/kv_events.py): messages (topic, 8-byte sequence number, msgpack `KVEventBatch`)
on a PUB socket, and a ROUTER socket that replays buffered batches from a sequence
number on. `KvEventStream` follows one replica into its `ExactPrefixIndex`
(router/prefix_cache.py):

- it subscribes first, then replays from sequence 0, so nothing published before it
  connected is missed (a late subscriber), and skips live batches the replay covered;
- a gap in the sequence (ZMQ dropped batches at its high-water mark) triggers a replay
  from the first missing number; if the publisher's buffer no longer reaches back that
  far, the index is cleared and rebuilt from what the buffer and later events say;
- a sequence that starts over (a new publisher at the same address) clears the index.
Until the first resync completes the index answers from its approximate fallback.

`VllmBlockHasher` computes the hashes a prompt's full blocks get in vLLM, with vLLM's
own functions, the replica's hash algorithm and its NONE_HASH seed (which the replica
reports, replica/kv_events.py), so router lookups match the published hashes exactly.
`InProcessEvents` keeps an engine-less scheduler's batches in memory instead, for the
simulator (bench/simulated_cluster.py), which applies them with `apply_batch`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from blockserve.router.predictors import quantile
from blockserve.router.prefix_cache import ExactPrefixIndex

logger = logging.getLogger("blockserve.router.kv_events")

END_SEQ = -1  # the replay's end-of-batches marker (vLLM's ZmqEventPublisher.END_SEQ)
REPLAY_TIMEOUT_S = 5.0


class VllmBlockHasher:
    """vLLM's prefix-cache hashes of a prompt's full blocks, as its KV events carry them
    (ints, the low 64 bits, unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""

    def __init__(self, hash_algo: str, seed: str):
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

        self.hash_algo, self.seed = hash_algo, seed
        self._hash_fn = get_hash_fn_by_name(hash_algo)
        self._none_hash = self._hash_fn(seed)  # vLLM's init_none_hash
        self._hash_block, self._external = hash_block_tokens, maybe_convert_block_hash

    def __call__(self, token_ids: Sequence[int], block_size: int) -> tuple:
        hashes, parent = [], self._none_hash
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            parent = self._hash_block(self._hash_fn, parent, token_ids[start:start + block_size])
            hashes.append(self._external(parent))
        return tuple(hashes)


@dataclass
class StreamStats:
    """What a stream saw: how lossy and how late the events were."""

    batches: int = 0
    events: int = 0
    gaps: int = 0  # sequence gaps found on the live stream
    lost_batches: int = 0  # batches neither the stream nor a replay delivered
    restarts: int = 0
    resyncs: int = 0
    delays_s: list[float] = field(default_factory=list)  # publish ts -> applied, recent

    def to_dict(self) -> dict:
        delays = sorted(self.delays_s)
        pick = (lambda q: quantile(delays, q)) if delays else (lambda q: None)
        return {"batches": self.batches, "events": self.events, "gaps": self.gaps,
                "lost_batches": self.lost_batches, "restarts": self.restarts,
                "resyncs": self.resyncs, "delay_p50_s": pick(0.5), "delay_p99_s": pick(0.99)}


class KvEventStream:
    """One replica's event stream applied to its index (module docstring)."""

    def __init__(self, replica_id: str, source: dict, index: ExactPrefixIndex,
                 context: Any = None):
        import msgspec
        import zmq.asyncio
        from vllm.distributed.kv_events import KVEventBatch

        self.replica_id, self.source, self.index = replica_id, source, index
        self.context = context or zmq.asyncio.Context.instance()
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self.last_seq = -1
        self._pending_gap: int | None = None  # the first batch a gap lost
        self.stats = StreamStats()

    async def run(self) -> None:
        import zmq

        topic = self.source.get("topic", "").encode()
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        sub.connect(self.source["endpoint"])
        try:
            await asyncio.sleep(0.2)  # ZMQ's slow joiner: be subscribed before replaying
            await self.resync(0)
            self.index.start()
            while True:
                _, seq_bytes, payload = await sub.recv_multipart()
                self._receive(int.from_bytes(seq_bytes, "big", signed=True), payload)
                if self._pending_gap is not None:
                    await self.resync(self._pending_gap)
        finally:
            sub.close(linger=0)

    def _receive(self, seq: int, payload: bytes) -> None:
        expected = self.last_seq + 1
        if seq < expected:
            if seq == 0 and self.last_seq > 0:  # the publisher started over
                self.stats.restarts += 1
                self.index.reset()
                self.last_seq = -1
            else:
                return  # a batch the replay delivered already
        elif seq > expected:
            self.stats.gaps += 1
            self._pending_gap = expected
            return  # the replay brings it, and this one after it
        self._apply(seq, payload)

    async def resync(self, start: int) -> None:
        """Replay batches from `start` on; what the buffer no longer holds is lost, and
        the index restarts from what it does hold."""
        import zmq

        self._pending_gap = None
        self.stats.resyncs += 1
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(self.source["replay_endpoint"])
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            first = True
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return
                if first and seq > start:  # older batches left the replay buffer
                    self.stats.lost_batches += seq - start
                    self.index.reset()
                first = False
                if seq > self.last_seq:
                    self._apply(seq, frames[3])
        finally:
            dealer.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = self._decode(payload)
        apply_batch(self.index, batch)
        self.last_seq = seq
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        delays = self.stats.delays_s
        delays.append(max(0.0, time.time() - batch.ts))
        if len(delays) > 2000:
            del delays[:1000]


def apply_batch(index: ExactPrefixIndex, batch: Any) -> None:
    """One `KVEventBatch` into the index, in order."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    for event in batch.events:
        if isinstance(event, BlockStored):
            index.stored_blocks(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            index.removed_blocks(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            index.reset()


class InProcessEvents:
    """A scheduler's KV event batches kept in memory instead of sent over ZMQ, for a
    simulation that delivers them itself (the same batches vLLM would publish). The
    scheduler must have been built with KV cache events enabled (publisher "null")."""

    def __init__(self, scheduler: Any):
        from vllm.distributed.kv_events import EventPublisher

        class Collector(EventPublisher):
            def __init__(self) -> None:
                super().__init__()
                self.batches: list = []

            def publish(self, events) -> None:
                self.batches.append(events)

            def shutdown(self) -> None:
                pass

        self._collector = Collector()
        scheduler.kv_event_publisher = self._collector

    def take(self) -> list:
        batches, self._collector.batches = self._collector.batches, []
        return batches


class KvEventFollower:
    """The router's streams, one per replica that publishes (started and stopped with
    ledger membership). Runs on the router's event loop, which owns the ledger."""

    def __init__(self) -> None:
        self.streams: dict[str, tuple[KvEventStream, asyncio.Task]] = {}
        self.refused: set[str] = set()  # replicas whose hashes the router cannot match
        self.hasher: VllmBlockHasher | None = None

    def settled(self, replica_id: str, index: ExactPrefixIndex) -> bool:
        """Nothing to do: the replica is followed into this very index, or refused."""
        stream = self.streams.get(replica_id)
        return replica_id in self.refused or (stream is not None and stream[0].index is index)

    def follow(self, replica_id: str, source: dict | None, index: ExactPrefixIndex) -> bool:
        """Follow a replica's events into `index` (a new index replaces an old stream).
        False when its hashes cannot match the router's (it publishes nothing, its seed
        is not reproducible, or it hashes otherwise than the first replica): it keeps
        the approximate fallback."""
        if self.settled(replica_id, index):
            return replica_id not in self.refused
        self.forget(replica_id)
        if not source or not source.get("seed"):
            self.refused.add(replica_id)
            return False
        if self.hasher is None:
            self.hasher = VllmBlockHasher(source["hash_algo"], source["seed"])
        elif (self.hasher.hash_algo, self.hasher.seed) != (source["hash_algo"], source["seed"]):
            logger.warning("replica %s hashes blocks differently; approximate index", replica_id)
            self.refused.add(replica_id)
            return False
        stream = KvEventStream(replica_id, source, index)
        task = asyncio.get_running_loop().create_task(stream.run())
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or
                               logger.warning("KV events of %s stopped: %r", replica_id,
                                              t.exception()))
        self.streams[replica_id] = (stream, task)
        return True

    def forget(self, replica_id: str) -> None:
        stream = self.streams.pop(replica_id, None)
        if stream is not None:
            stream[1].cancel()

    def retain(self, replica_ids) -> None:
        """Stop following replicas that left the ledger."""
        for replica_id in [r for r in self.streams if r not in replica_ids]:
            self.forget(replica_id)

    def stats(self) -> dict[str, dict]:
        return {rid: stream.stats.to_dict() for rid, (stream, _) in self.streams.items()}
