"""The Ray runtime behind the embedded runtime's surface.

The Master Service, the workflows and the API host call services as the embedded runtime offers
them: `services.environment.step(...)` returns a value, `services.training.version(t)` too. Here
those calls become Ray calls on the actors (a blocking `ray.get` with a bound), so the same jobs run
unchanged when `vlamux serve --ray ADDRESS` places the services on a cluster.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import ray

from vlamux.envs.base import EnvSpec
from vlamux.services.ray_runtime import CALL_TIMEOUT_S, RayRuntime, sum_numbers


def _get(ref):
    return ray.get(ref, timeout=CALL_TIMEOUT_S)


class RayEnvironments:
    """Every environment replica behind the Environment Service's own methods (the contract's
    `Environments`): an `open_*` goes to the least loaded replica, a call that names a session or
    dataset to the replica holding it, and a question about a tenant to every replica, answers merged.
    Each method has `EnvironmentService`'s signature, defaults included
    (tests/test_runtime_contract.py compares them)."""

    def __init__(self, rt: RayRuntime):
        self._rt = rt

    def _one(self, method: str, *args, **kwargs):
        return _get(self._rt.env(method, *args, **kwargs))

    def _all(self, method: str, *args) -> list:
        return [_get(r) for r in self._rt.env_all(method, *args).values()]

    # ---- sessions ---------------------------------------------------------------------------------
    def open_session(self, tenant: str, spec: EnvSpec | Mapping, n_envs: int, seed: int | None = None,
                     n_workers: int | None = None, idle_timeout_s: float | None = 300.0, *,
                     timeout_s: float | None = None, start_timeout_s: float | None = None,
                     as_observation: bool = False, render_device: int | None = None) -> str:
        return self._one("open_session", tenant, spec, n_envs, seed, n_workers, idle_timeout_s, timeout_s=timeout_s,
                         start_timeout_s=start_timeout_s, as_observation=as_observation,
                         render_device=render_device)

    def reset(self, tenant: str, session_id: str, seed: int | None = None, indices: Sequence[int] | None = None):
        return self._one("reset", tenant, session_id, seed, indices)

    def step(self, tenant: str, session_id: str, actions):
        return self._one("step", tenant, session_id, actions)

    def resize_session(self, tenant: str, session_id: str, n_workers: int) -> int:
        return self._one("resize_session", tenant, session_id, n_workers)

    def close_session(self, tenant: str, session_id: str) -> None:
        return self._one("close_session", tenant, session_id)

    def session_info(self, tenant: str, session_id: str) -> dict:
        return self._one("session_info", tenant, session_id)

    def action_spec(self, tenant: str, session_id: str):
        return self._one("action_spec", tenant, session_id)

    def list_sessions(self, tenant: str) -> list[dict]:
        return [s for answer in self._all("list_sessions", tenant) for s in answer]

    # ---- datasets ---------------------------------------------------------------------------------
    def open_dataset(self, tenant: str, root: str | Path, horizon: int, batch_size: int,
                     camera_map: Mapping[str, str], state_key: str | None = "observation.state",
                     action_key: str = "action", seed: int = 0, *, idle_timeout_s: float | None = 3600.0,
                     episodes: Sequence[int] | None = None, cache_mb: float = 512.0,
                     options: Mapping[str, Any] | None = None) -> str:
        return self._one("open_dataset", tenant, root, horizon, batch_size, camera_map, state_key, action_key, seed,
                         idle_timeout_s=idle_timeout_s, episodes=episodes, cache_mb=cache_mb, options=options)

    def sample(self, tenant: str, dataset_id: str):
        return self._one("sample", tenant, dataset_id)

    def dataset_stats(self, tenant: str, dataset_id: str, mode: str = "mean_std") -> dict:
        return self._one("dataset_stats", tenant, dataset_id, mode)

    def dataset_info(self, tenant: str, dataset_id: str) -> dict:
        return self._one("dataset_info", tenant, dataset_id)

    def close_dataset(self, tenant: str, dataset_id: str) -> None:
        return self._one("close_dataset", tenant, dataset_id)

    def list_datasets(self, tenant: str) -> list[dict]:
        return [d for answer in self._all("list_datasets", tenant) for d in answer]

    # ---- accounting -------------------------------------------------------------------------------
    def tenants(self) -> list[str]:
        return sorted({t for answer in self._all("tenants") for t in answer})

    def usage(self, tenant: str) -> dict:
        return {"env_steps": sum(a.get("env_steps", 0) for a in self._all("usage", tenant))}

    def env_steps(self) -> dict[str, int]:
        """Every tenant's env steps, summed over the replicas: one call to each."""
        out: dict[str, int] = {}
        for answer in self._all("env_steps"):
            for tenant, n in answer.items():
                out[tenant] = out.get(tenant, 0) + n
        return out

    def utilization(self) -> dict:
        return sum_numbers(self._all("utilization"))

    def metrics(self) -> dict:
        return sum_numbers(self._all("metrics"))


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
        self.environment = RayEnvironments(rt)
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
