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
from multiprocessing import resource_tracker, shared_memory


@dataclass(frozen=True)
class BlockSnapshot:
    """Where a replica's KV blocks are. Blocks exclude vLLM's reserved null block.

    free = empty + cached (cached blocks no request holds are evictable, so free);
    held = blocks referenced by requests; reserved = blocks admitted requests are
    expected to grow into but have not allocated yet.
    """

    step: int = 0
    timestamp: float = 0.0  # time.time() of the write
    total_blocks: int = 0
    block_size: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    held_blocks: int = 0
    reserved_blocks: int = 0
    running: int = 0
    waiting: int = 0
    waiting_blocks: int = 0  # demand of the requests in the engine's waiting queue
    preemptions_total: int = 0
    requests_added_total: int = 0
    max_model_len: int = 0

    @property
    def usage(self) -> float:
        return self.held_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def committed_blocks(self) -> int:
        """Blocks spoken for: held now, growth of admitted work, and engine-side waiting."""
        return self.held_blocks + self.reserved_blocks + self.waiting_blocks

    def age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.timestamp

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "BlockSnapshot":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


_FIELDS = [f.name for f in fields(BlockSnapshot)]
_FORMATS = {"timestamp": "d"}
_RECORD = struct.Struct("<Q" + "".join(_FORMATS.get(name, "q") for name in _FIELDS))


class SnapshotChannel:
    """A single-writer, many-reader shared-memory slot holding the latest snapshot."""

    def __init__(self, name: str, create: bool = False):
        self.name = name
        self._shm = shared_memory.SharedMemory(name=name, create=create, size=_RECORD.size)
        if not create:
            # Python < 3.13 would unlink the segment when this attaching process exits.
            resource_tracker.unregister(self._shm._name, "shared_memory")
        else:
            _RECORD.pack_into(self._shm.buf, 0, 0, *astuple_of(BlockSnapshot()))
        self._seq = 0

    @classmethod
    def create(cls) -> "SnapshotChannel":
        return cls(f"blockserve-{uuid.uuid4().hex[:16]}", create=True)

    def write(self, snapshot: BlockSnapshot) -> None:
        buf = self._shm.buf
        self._seq += 1  # odd: write in progress
        struct.pack_into("<Q", buf, 0, self._seq)
        _RECORD.pack_into(buf, 0, self._seq, *astuple_of(snapshot))
        self._seq += 1
        struct.pack_into("<Q", buf, 0, self._seq)

    def read(self, timeout_s: float = 1.0) -> BlockSnapshot:
        buf, deadline, attempt = self._shm.buf, time.monotonic() + timeout_s, 0
        while True:
            values = _RECORD.unpack_from(buf, 0)
            (seq_after,) = struct.unpack_from("<Q", buf, 0)
            if values[0] % 2 == 0 and values[0] == seq_after:
                return BlockSnapshot(*values[1:])
            attempt += 1
            if attempt > 10:  # the writer was descheduled mid-write: let it finish
                if time.monotonic() > deadline:
                    raise TimeoutError(f"snapshot channel {self.name} stayed busy")
                time.sleep(0.0001)

    def close(self, unlink: bool = False) -> None:
        self._shm.close()
        if unlink:
            self._shm.unlink()


def astuple_of(snapshot: BlockSnapshot) -> tuple:
    return tuple(getattr(snapshot, name) for name in _FIELDS)
