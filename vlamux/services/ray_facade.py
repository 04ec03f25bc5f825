"""The Ray runtime behind the embedded runtime's surface.

The Master Service, the workflows and the API host call services as the embedded runtime offers
them: `services.environment.step(...)` returns a value, `services.training.version(t)` too. Here
those calls become Ray calls on the actors (a blocking `ray.get` with a bound), so the same jobs run
unchanged when `vlamux serve --ray ADDRESS` places the services on a cluster.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import ray

from vlamux.services.ray_runtime import CALL_TIMEOUT_S, RayRuntime

# Environment calls that name no session or dataset: asked of every replica, answers merged.
_ALL_REPLICAS = {"list_sessions": "list", "list_datasets": "list", "tenants": "set"}


def _get(ref):
    return ray.get(ref, timeout=CALL_TIMEOUT_S)


class _Environment:
    def __init__(self, rt: RayRuntime):
        self._rt = rt

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        merge = _ALL_REPLICAS.get(method)

        def call(*args, **kwargs):
            if merge is None:
                return _get(self._rt.env(method, *args, **kwargs))
            answers = [_get(r) for r in self._rt.env_all(method, *args, **kwargs).values()]
            out = [x for a in answers for x in a]
            return sorted(set(out)) if merge == "set" else out

        return call

    def usage(self, tenant: str) -> dict:
        answers = [_get(r) for r in self._rt.env_all("usage", tenant).values()]
        return {"env_steps": sum(a.get("env_steps", 0) for a in answers)}

    def env_steps(self) -> dict[str, int]:
        """Every tenant's env steps, summed over the replicas: one call to each."""
        out: dict[str, int] = {}
        for answer in [_get(r) for r in self._rt.env_all("env_steps").values()]:
            for tenant, n in answer.items():
                out[tenant] = out.get(tenant, 0) + n
        return out


class _Accounting:
    def __init__(self, actor):
        self._actor = actor

    def snapshot(self) -> dict:
        return _get(self._actor.accounting.remote())


class _Training:
    def __init__(self, rt: RayRuntime):
        self._rt = rt

    def version(self, tenant: str) -> int:
        return self._rt.version(tenant)

    def tenants(self) -> list[str]:
        return _get(self._rt.training.tenants.remote())

    @property
    def accounting(self) -> _Accounting:
        return _Accounting(self._rt.training)


class _Replica:
    def __init__(self, actor):
        self.accounting = _Accounting(actor)


class _Publisher:
    def __init__(self, rt: RayRuntime):
        self._rt = rt

    def flush(self, timeout_s: float = 30.0) -> bool:
        return self._rt.flush(timeout_s)


class RayServices:
    """`RayRuntime` as the Master Service and the API host use a runtime. Everything not defined
    here (create_slot, predict, metrics, stop, ...) is the runtime's own.

    A tenant's training calls keep their order: in process, the Training Queue receives them in the
    order they are made; a threaded Ray actor may start two calls in either order, so here each
    tenant's call is sent only once its previous one has finished."""

    def __init__(self, rt: RayRuntime):
        self.rt = rt
        self.environment = _Environment(rt)
        self.training = _Training(rt)
        self.publisher = _Publisher(rt)
        self._last: dict[str, Future] = {}
        self._lock = threading.Lock()

    def _in_order(self, tenant: str, send) -> Future:
        out: Future = Future()
        with self._lock:
            prev, self._last[tenant] = self._last.get(tenant), out

        def go(_=None) -> None:
            try:
                inner = send()
            except Exception as e:  # noqa: BLE001 - the caller's future carries it
                out.set_exception(e)
                return
            inner.add_done_callback(lambda f: out.set_exception(f.exception()) if f.exception() is not None
                                    else out.set_result(f.result()))

        if prev is None:
            go()
        else:
            prev.add_done_callback(go)  # after it, whether it failed or not
        return out

    def forward_backward(self, tenant: str, *args, **kwargs) -> Future:
        return self._in_order(tenant, lambda: self.rt.forward_backward(tenant, *args, **kwargs))

    def optim_step(self, tenant: str, *args, **kwargs) -> Future:
        return self._in_order(tenant, lambda: self.rt.optim_step(tenant, *args, **kwargs))

    def set_lr(self, tenant: str, lr: float, fresh_moments: bool = False) -> Future:
        return self._in_order(tenant, lambda: self.rt.set_lr(tenant, lr, fresh_moments))

    def save_state(self, tenant: str, path) -> Future:
        return self._in_order(tenant, lambda: self.rt.save_state(tenant, path))

    def load_state(self, tenant: str, path) -> Future:
        return self._in_order(tenant, lambda: self.rt.load_state(tenant, path))

    def remove_slot(self, tenant: str) -> Future:
        """After the tenant's calls; then it holds no place in the call order either."""
        out = self._in_order(tenant, lambda: self.rt.remove_slot(tenant))

        def forget(_) -> None:
            with self._lock:
                if self._last.get(tenant) is out:
                    del self._last[tenant]

        out.add_done_callback(forget)
        return out

    @property
    def replicas(self) -> dict[str, _Replica]:
        return {name: _Replica(actor) for name, actor in dict(self.rt.replicas).items()}

    def __getattr__(self, name: str):
        return getattr(self.rt, name)
