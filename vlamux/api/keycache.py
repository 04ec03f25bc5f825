"""Who a key is, and a tenant's quotas, kept in memory for a few seconds.

Every request resolves its key and its tenant's rate before anything else; reading the store for
that on the event loop made even a refused request expensive (issue 16: one flooding tenant took the
others from 155 to 16 requests/s). Entries live `ttl_s`: a change made through this host (a revoked
key, a disabled tenant, new quotas) drops them at once, one made elsewhere (another process on the
same store) takes effect within `ttl_s`. Unknown keys are remembered too, so a flood of bad keys does
not reach the store either; the cache holds digests of secrets, never the secrets.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import cachetools

_MISSING = object()


class TTLCache:
    """At most `max_entries` values, each for `ttl_s` seconds (least recently written dropped first):
    cachetools' TTL cache, behind a lock (the server's threads share it)."""

    def __init__(self, ttl_s: float, max_entries: int = 10_000):
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._items = cachetools.TTLCache(maxsize=max_entries, ttl=ttl_s, timer=time.monotonic)
        self._lock = threading.Lock()

    def get(self, key, default=_MISSING):
        """The value, or `default` (a sentinel unless given) when absent or expired."""
        with self._lock:
            return self._items.get(key, default)

    def put(self, key, value) -> None:
        with self._lock:
            self._items[key] = value

    def drop(self, matches: Callable[[Any, Any], bool]) -> None:
        """Forget every entry whose (key, value) `matches`."""
        with self._lock:
            for k in [k for k, v in self._items.items() if matches(k, v)]:
                self._items.pop(k, None)  # expired meanwhile: gone already

    @staticmethod
    def missing(value) -> bool:
        return value is _MISSING
