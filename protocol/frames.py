"""The data port's wire format: frames of a 4-byte big-endian length and a JSON document.

The router sends one request frame {"token", "endpoint", "body"} and reads response
frames (a `ReplicaChunk` as a list, protocol/chunks.py) until an `END` frame.
"""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

_LENGTH = struct.Struct(">I")
END = None  # the frame that ends a response


def write_frame(writer: asyncio.StreamWriter, document: Any) -> None:
    data = json.dumps(document, separators=(",", ":")).encode()
    writer.write(_LENGTH.pack(len(data)) + data)


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next document; raises `asyncio.IncompleteReadError` when the peer hung up."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return json.loads(await reader.readexactly(length))
