"""`NewestKept`: a bounded map of what the service keeps built (the store's records and parsed specs,
the API's serialized answers), dropping what was added longest ago."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

V = TypeVar("V")


class NewestKept(Generic[V]):
    """At most `capacity` values by key: adding one (or adding a key again) makes it the newest and drops
    the oldest beyond the capacity. Thread-safe; lookups take no lock, so a reader racing a writer sees
    the value before or after, and at worst builds it again."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self._capacity = capacity
        self._values: dict[str, V] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: str) -> V | None:
        return self._values.get(key)

    def add(self, key: str, value: V) -> V:
        """Keep `value` under `key` as the newest; returns it."""
        with self._lock:
            self._values.pop(key, None)
            self._values[key] = value
            while len(self._values) > self._capacity:
                del self._values[next(iter(self._values))]
        return value
