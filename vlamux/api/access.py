"""Who is calling, and how much they may: API keys to principals, tenants' quotas, request rates.

Keys and quotas are read from the store and cached for `cache_s` (changes made through this host
are forgotten at once; others take effect within `cache_s`), so the common request touches no store.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlamux.api.faults import QuotaExceeded
from vlamux.api.keycache import TTLCache
from vlamux.api.metering import RateLimiter
from vlamux.store import Store, secret_digest


@dataclass(frozen=True)
class Principal:
    key_id: str
    tenant_id: str | None  # None: the admin

    @property
    def is_admin(self) -> bool:
        return self.tenant_id is None


class Access:
    def __init__(self, store: Store, default_quotas: dict, cache_s: float):
        self.store, self.default_quotas = store, default_quotas
        self.limiter = RateLimiter()
        self._principals = TTLCache(cache_s)  # secret digest -> Principal | None
        self._quotas = TTLCache(cache_s)  # tenant id -> quotas

    def authenticate(self, secret: str) -> Principal | None:
        """The key's principal (None: unknown, revoked or disabled), from the cache or the store."""
        d = secret_digest(secret)
        p = self._principals.get(d)
        if TTLCache.missing(p):
            key = self.store.authenticate(secret)
            p = None if key is None else Principal(key.id, key.tenant_id)
            self._principals.put(d, p)
        return p

    def cached_principal(self, secret: str):
        """The principal if the cache knows the key (None for a known-bad one), else the cache's
        sentinel (`TTLCache.missing`): a check that never touches the store, for the event loop."""
        return self._principals.get(secret_digest(secret))

    def quotas(self, tenant_id: str) -> dict:
        q = self._quotas.get(tenant_id)
        if TTLCache.missing(q):
            t = self.store.get_tenant(tenant_id)
            q = {**self.default_quotas, **((t.quotas if t else None) or {})}
            self._quotas.put(tenant_id, q)
        return q

    def quotas_cached(self, tenant_id: str) -> bool:
        return not TTLCache.missing(self._quotas.get(tenant_id))

    def forget(self, tenant_id: str | None = None, key_id: str | None = None) -> None:
        """A tenant's or a key's cached principal and quotas are stale (changed through this host)."""
        # unknown keys are forgotten too: one refused while its tenant was disabled is valid once enabled
        self._principals.drop(lambda _, p: p is None or p.tenant_id == tenant_id or p.key_id == key_id)
        if tenant_id is not None:
            self._quotas.drop(lambda t, _: t == tenant_id)

    def take_rate(self, tenant_id: str) -> float:
        """Count one request against the tenant's rate: 0 if admitted, else the seconds to wait."""
        return self.limiter.take(tenant_id, float(self.quotas(tenant_id)["requests_per_s"]))

    def admit(self, p: Principal) -> None:
        """Per-tenant request rate (the admin is not limited). In memory: cheap enough for the event loop
        once the tenant's quotas are cached."""
        if p.is_admin:
            return
        wait = self.take_rate(p.tenant_id)
        if wait > 0:
            rate = float(self.quotas(p.tenant_id)["requests_per_s"])
            raise QuotaExceeded(f"rate limited: more than {rate:g} requests/s", retry_after_s=wait)
