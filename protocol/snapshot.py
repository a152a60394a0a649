"""Block occupancy of one replica, and the shared-memory channel that carries it.

The scheduler runs in vLLM's EngineCore process and writes a snapshot after every
engine step; the replica deployment (another process) reads the latest one whenever it
answers or is asked. No RPC per step: one fixed-size shared-memory record guarded by a
sequence counter (a seqlock: odd while a write is in progress).
"""

from __future__ import annotations

import struct
import time
import uuid
from dataclasses import asdict, dataclass, fields
from multiprocessing import shared_memory

# The block policies a replica reports (its config's `block_<kind>` fields), and what they
# did: the snapshot's `<effect>_total` counters.
BLOCK_POLICY_KINDS = ("eviction", "retention", "budget")
BLOCK_POLICY_EFFECTS = ("cached_blocks_evicted", "blocks_spared", "blocks_sent_first",
                        "admissions_refused")
# Every policy of a replica's scheduler (its config's field names): the snapshot's
# `<field>_errors_total` counts the exceptions each raised (replica/policy_errors.py).
SCHEDULER_POLICIES = ("queue_order", "admission_gate", "preemption", "block_eviction",
                      "block_retention", "block_budget", "step_tokens")
# Bucket bounds (seconds) of the latency histograms a replica counts (replica/engine_stats.py)
# and the router exports (router/metrics.py): both sides must bin alike.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)


@dataclass(frozen=True)
class BlockSnapshot:
    """Where a replica's KV blocks are, as its scheduler last saw them. The words are
    protocol/blocks.py's (`BlockStates` derives the rest); blocks exclude vLLM's null
    block, and cached blocks are part of the free ones."""

    step: int = 0
    timestamp: float = 0.0  # time.time() of the write
    total_blocks: int = 0
    block_size: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    held_blocks: int = 0
    growth_blocks: int = 0
    running: int = 0
    waiting: int = 0
    waiting_blocks: int = 0
    preemptions_total: int = 0
    requests_added_total: int = 0
    last_admission_seq: int = 0  # highest router admission sequence among added requests
    max_model_len: int = 0
    # The block policies (replica/block_adapter.py): 1 if installed over vLLM's pool (0:
    # vLLM's own, nothing installed), and what they did since start-up (counted only
    # while installed).
    block_policies_installed: int = 0
    cached_blocks_evicted_total: int = 0  # cached blocks reused for new work
    blocks_spared_total: int = 0  # the eviction policy kept a cached block for later
    blocks_sent_first_total: int = 0  # the retention policy put a freed block next in line
    admissions_refused_total: int = 0  # the budget kept a request waiting (per step asked)
    # Exceptions each policy raised; vLLM's answer stood for each (SCHEDULER_POLICIES).
    queue_order_errors_total: int = 0
    admission_gate_errors_total: int = 0
    preemption_errors_total: int = 0
    block_eviction_errors_total: int = 0
    block_retention_errors_total: int = 0
    block_budget_errors_total: int = 0
    step_tokens_errors_total: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def policy_errors(self) -> dict[str, int]:
        """Exceptions raised per scheduler policy (its config field) since start-up."""
        return {field: getattr(self, f"{field}_errors_total") for field in SCHEDULER_POLICIES}

    @classmethod
    def from_dict(cls, data: dict) -> "BlockSnapshot":
        return cls(**{k: v for k, v in data.items() if k in _FIELD_SET})


SNAPSHOT_FIELDS = tuple(f.name for f in fields(BlockSnapshot))
_FIELD_SET = frozenset(SNAPSHOT_FIELDS)
_FORMATS = {"timestamp": "d"}
_SEQ = struct.Struct("<Q")
# Fields are packed into bytes first and copied after the sequence number: packing in
# place (struct.pack_into) zero-fills the region first, sequence number included.
_BODY = struct.Struct("<" + "".join(_FORMATS.get(name, "q") for name in SNAPSHOT_FIELDS))
_SIZE = _SEQ.size + _BODY.size
# A reader that sees a write in progress retries at once this many times (a write is a
# few hundred bytes), then backs off, so a descheduled writer does not cost it a core.
_SPIN_READS = 10
_BACKOFF_S = 0.0001
# The writer writes after every engine step; a reader waits for it at most this long,
# then keeps the snapshot it read before (its timestamp shows its age).
READ_TIMEOUT_S = 0.1


class SnapshotChannel:
    """A single-writer, many-reader shared-memory slot holding the latest snapshot."""

    def __init__(self, name: str, create: bool = False):
        self.name = name
        self._shm = shared_memory.SharedMemory(name=name, create=create, size=_SIZE)
        # The creator (the replica) unlinks the segment. An attaching process (vLLM's
        # EngineCore, spawned by the replica) shares the creator's resource tracker, so
        # its registration is the same entry and its exit unlinks nothing.
        if create:
            self._shm.buf[:_SIZE] = _SEQ.pack(0) + _BODY.pack(*astuple_of(BlockSnapshot()))
        self._seq = 0
        self._last_read = BlockSnapshot()

    @classmethod
    def create(cls) -> "SnapshotChannel":
        return cls(f"blockserve-{uuid.uuid4().hex[:16]}", create=True)

    def write(self, snapshot: BlockSnapshot) -> None:
        buf, body = self._shm.buf, _BODY.pack(*astuple_of(snapshot))
        self._seq += 1  # odd: write in progress
        buf[:_SEQ.size] = _SEQ.pack(self._seq)
        buf[_SEQ.size:_SIZE] = body
        self._seq += 1
        buf[:_SEQ.size] = _SEQ.pack(self._seq)

    def read(self, timeout_s: float = READ_TIMEOUT_S) -> BlockSnapshot:
        """The latest consistent snapshot. If the writer stays mid-write (descheduled)
        past `timeout_s`, the previous one read here; its timestamp shows its age."""
        buf, deadline, attempt = self._shm.buf, time.monotonic() + timeout_s, 0
        while True:
            (seq_before,) = _SEQ.unpack_from(buf, 0)
            values = _BODY.unpack(bytes(buf[_SEQ.size:_SIZE]))
            (seq_after,) = _SEQ.unpack_from(buf, 0)
            if seq_before % 2 == 0 and seq_before == seq_after:
                self._last_read = BlockSnapshot(*values)
                return self._last_read
            attempt += 1
            if attempt > _SPIN_READS:  # let the writer finish
                if time.monotonic() > deadline:
                    return self._last_read
                time.sleep(_BACKOFF_S)

    def close(self, unlink: bool = False) -> None:
        self._shm.close()
        if unlink:
            self._shm.unlink()


def astuple_of(snapshot: BlockSnapshot) -> tuple:
    return tuple(getattr(snapshot, name) for name in SNAPSHOT_FIELDS)
