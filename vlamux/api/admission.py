"""Admission at the front door: a tenant over its request rate is refused before FastAPI sees the
request (no routing, no body parsing, no thread), and its refusal is held back for a moment.

A client that floods without back-off (issue 16: 8 connections, no pause) would otherwise get its
429s as fast as it can ask, and each costs the server a little; holding each refusal for
`hold_s` on the event loop (a sleeping coroutine, no thread) turns N such connections into about
N / hold_s requests per second, whatever the client does. At most `max_held` of one tenant's
refusals are held at once; past that they are answered at once.

Only keys the cache already knows are admitted here; anything else goes on to the routes, whose
dependency reads the store on a worker thread and applies the same limit.
"""

from __future__ import annotations

import asyncio
import math

from vlamux.api.errors import error_response
from vlamux.api.keycache import TTLCache

ADMITTED = "vlamux_admitted"  # scope["state"] key: the principal this middleware already counted


class Admission:
    def __init__(self, app, host, hold_s: float = 1.0, max_held: int = 64):
        self.app, self.host, self.hold_s, self.max_held = app, host, hold_s, max_held
        self._held: dict[str, int] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1/"):
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        p = None
        if auth[:7].lower() == b"bearer ":
            p = self.host.access.cached_principal(auth[7:].decode("latin-1").strip())
        if TTLCache.missing(p) or p is None or p.is_admin or not self.host.access.quotas_cached(p.tenant_id):
            return await self.app(scope, receive, send)  # the route's dependency decides, off the loop
        wait = self.host.access.take_rate(p.tenant_id)
        if wait <= 0:
            scope.setdefault("state", {})[ADMITTED] = p
            return await self.app(scope, receive, send)
        held = self._held.get(p.tenant_id, 0)
        if held < self.max_held:
            self._held[p.tenant_id] = held + 1
            try:
                await asyncio.sleep(self.hold_s)  # a whole hold_s even when a token comes sooner
            finally:
                self._held[p.tenant_id] -= 1
        rate = float(self.host.access.quotas(p.tenant_id)["requests_per_s"])
        refusal = error_response(429, "rate_limited", f"rate limited: more than {rate:g} requests/s",
                                 headers={"Retry-After": str(max(1, math.ceil(wait)))})
        await refusal(scope, receive, send)
