"""The replica directory: which replicas of the application exist, as Ray Serve sees them.

Ray Serve reports membership to the request router of each process that holds a handle
(router/dispatch.py); the directory hands it to the router's event loop, where the ledger
adds a replica once it has reported its real capacity and drops it at once when it
leaves. Lives in its own module because Ray pickles the request router class by value:
state must sit in a module that is imported, not copied.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable

Listener = Callable[[set, set], None]  # (added replica ids, removed replica ids)


class ReplicaDirectory:
    """Replica ids reachable from this process; Ray's router loop may run in another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.replica_ids: set[str] = set()
        self._listeners: list[tuple[asyncio.AbstractEventLoop, Listener]] = []

    def subscribe(self, loop: asyncio.AbstractEventLoop, listener: Listener) -> None:
        with self._lock:
            self._listeners.append((loop, listener))
            current = set(self.replica_ids)
        if current:
            loop.call_soon_threadsafe(listener, current, set())

    def update(self, replica_ids: set[str]) -> None:
        with self._lock:
            added, removed = replica_ids - self.replica_ids, self.replica_ids - replica_ids
            self.replica_ids = set(replica_ids)
            listeners = list(self._listeners)
        if added or removed:
            for loop, listener in listeners:
                loop.call_soon_threadsafe(listener, added, removed)

    def remove(self, replica_id: str) -> None:
        with self._lock:
            remaining = self.replica_ids - {replica_id}
        self.update(remaining)


_directories: dict[str, ReplicaDirectory] = {}
_directories_lock = threading.Lock()


def directory(app_name: str) -> ReplicaDirectory:
    with _directories_lock:
        return _directories.setdefault(app_name, ReplicaDirectory())
