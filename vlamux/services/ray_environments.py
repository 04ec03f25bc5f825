"""The driver's side of the Environment Service replicas on Ray.

Several replicas may run; each prefixes its session and dataset ids with its name, so a call that
names an id goes straight to the replica holding it, an `open_*` to the least loaded serving
replica, and a question about a tenant to every replica, answers merged. `RayEnvironments` is the
runtime's `environment` (the contract's `Environments`): each method has `EnvironmentService`'s
signature, defaults included (tests/test_runtime_contract.py compares them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray

from vlamux.envs.base import EnvSpec
from vlamux.services import shipping
from vlamux.services.env_inputs import check_dataset_root
from vlamux.services.handles import DatasetNotFound, NotFound, SessionNotFound
from vlamux.services.ray_actors import CALL_TIMEOUT_S


def _get(ref):
    return ray.get(ref, timeout=CALL_TIMEOUT_S)


class RayEnvironments:
    def __init__(self, allowed_dataset_roots: Sequence[str] | None = None):
        self._allowed = None if allowed_dataset_roots is None else \
            [Path(a).expanduser().resolve() for a in allowed_dataset_roots]
        self._lock = threading.RLock()
        self.replicas: dict[str, ray.actor.ActorHandle] = {}
        self._draining: set[str] = set()
        self._shipped: dict[tuple, ray.ObjectRef] = {}

    # ---- the replicas ---------------------------------------------------------------------------
    def add(self, name: str, handle: ray.actor.ActorHandle) -> None:
        with self._lock:
            self.replicas[name] = handle

    def drain(self, name: str, timeout_s: float = 60.0) -> ray.actor.ActorHandle:
        """A replica takes no new sessions or datasets; once its open ones are closed (by their tenants
        or the idle reaper) it is dropped and returned. Raises TimeoutError, leaving it draining and
        serving, if they are still open after `timeout_s`."""
        with self._lock:
            if name not in self.replicas:
                raise KeyError(f"no environment replica {name!r}")
            if len(self.replicas) - len(self._draining - {name}) <= 1:
                raise ValueError("cannot remove the last environment replica")
            self._draining.add(name)
            handle = self.replicas[name]
        end = time.monotonic() + timeout_s
        while True:
            m = _get(handle.metrics.remote())
            if m["open_sessions"] + m["open_datasets"] == 0:
                break
            if time.monotonic() > end:
                raise TimeoutError(f"environment replica {name!r} still holds {m['open_sessions']} sessions and "
                                   f"{m['open_datasets']} datasets after {timeout_s:.0f}s; it keeps draining")
            time.sleep(0.2)
        with self._lock:
            self.replicas.pop(name)
            self._draining.discard(name)
        return handle

    def clear(self) -> list[ray.actor.ActorHandle]:
        with self._lock:
            handles, self.replicas = list(self.replicas.values()), {}
        return handles

    def actor_of(self, handle_id: str, missing: type[NotFound] = SessionNotFound) -> ray.actor.ActorHandle:
        """The replica that holds a session or dataset id; `missing` (the service's own answer to an
        unknown id) when none does."""
        owner = handle_id.split(".", 1)[0] if isinstance(handle_id, str) else None
        with self._lock:
            if owner in self.replicas:
                return self.replicas[owner]
            if len(self.replicas) == 1:  # the service names what is wrong with the id
                return next(iter(self.replicas.values()))
        raise missing(f"no environment replica holds {handle_id!r}")

    def _open_on(self) -> ray.actor.ActorHandle:
        """The serving (not draining) replica holding the fewest simulators and datasets."""
        with self._lock:
            serving = {n: h for n, h in self.replicas.items() if n not in self._draining}
        if len(serving) == 1:
            return next(iter(serving.values()))
        names = list(serving)
        loads = ray.get([serving[n].metrics.remote() for n in names], timeout=CALL_TIMEOUT_S)
        best = min(range(len(names)), key=lambda i: (loads[i]["open_envs"] + loads[i]["open_datasets"], i))
        return serving[names[best]]

    def _all(self, method: str, *args) -> list:
        with self._lock:
            handles = list(self.replicas.values())
        return ray.get([getattr(h, method).remote(*args) for h in handles], timeout=CALL_TIMEOUT_S)

    def replica_metrics(self) -> dict[str, dict]:
        """Each replica's own metrics, by name."""
        with self._lock:
            refs = {n: h.metrics.remote() for n, h in self.replicas.items()}
        return {n: _get(r) for n, r in refs.items()}

    def check_workers(self, timeout_s: float = 5.0) -> dict:
        """Every replica replaces its dead simulator workers: {session: workers replaced}."""
        out: dict = {}
        for replaced in self._all("check_workers", timeout_s):
            out.update(replaced)
        return out

    def shipped(self, root) -> ray.ObjectRef:
        """A dataset on the driver's disk, in the object store (put once per content: reopening it, or
        opening it on another replica, sends no bytes again)."""
        path = check_dataset_root(root, self._allowed)
        key = (str(path.resolve()), shipping.identity(path))
        with self._lock:
            ref = self._shipped.get(key)
        if ref is None:
            ref = ray.put(shipping.pack(path))
            with self._lock:
                self._shipped[key] = ref
        return ref

    # ---- sessions ---------------------------------------------------------------------------------
    def open_session(self, tenant: str, spec: EnvSpec | Mapping, n_envs: int, seed: int | None = None,
                     n_workers: int | None = None, idle_timeout_s: float | None = 300.0, *,
                     timeout_s: float | None = None, start_timeout_s: float | None = None,
                     as_observation: bool = False, render_device: int | None = None) -> str:
        return _get(self._open_on().open_session.remote(
            tenant, spec, n_envs, seed, n_workers, idle_timeout_s, timeout_s=timeout_s,
            start_timeout_s=start_timeout_s, as_observation=as_observation, render_device=render_device))

    def reset_refs(self, tenant: str, session_id: str, seed: int | None = None,
                   indices: Sequence[int] | None = None) -> tuple[ray.ObjectRef, ray.ObjectRef]:
        """`reset`'s (observations, infos) left in the object store: the observations can go on to a
        replica's predict by reference."""
        return self.actor_of(session_id).reset.remote(tenant, session_id, seed, indices)

    def step_refs(self, tenant: str, session_id: str, actions) -> tuple[ray.ObjectRef, ray.ObjectRef]:
        """`step`'s (observations, (reward, terminated, truncated, infos)) left in the object store."""
        return self.actor_of(session_id).step.remote(tenant, session_id, actions)

    def reset(self, tenant: str, session_id: str, seed: int | None = None, indices: Sequence[int] | None = None):
        return tuple(ray.get(list(self.reset_refs(tenant, session_id, seed, indices)), timeout=CALL_TIMEOUT_S))

    def step(self, tenant: str, session_id: str, actions):
        obs, rest = ray.get(list(self.step_refs(tenant, session_id, actions)), timeout=CALL_TIMEOUT_S)
        return (obs, *rest)

    def resize_session(self, tenant: str, session_id: str, n_workers: int) -> int:
        return _get(self.actor_of(session_id).resize_session.remote(tenant, session_id, n_workers))

    def close_session(self, tenant: str, session_id: str) -> None:
        return _get(self.actor_of(session_id).close_session.remote(tenant, session_id))

    def session_info(self, tenant: str, session_id: str) -> dict:
        return _get(self.actor_of(session_id).session_info.remote(tenant, session_id))

    def action_spec(self, tenant: str, session_id: str):
        return _get(self.actor_of(session_id).action_spec.remote(tenant, session_id))

    def worker_pids(self, tenant: str, session_id: str) -> list[int | None]:
        return _get(self.actor_of(session_id).worker_pids.remote(tenant, session_id))

    def list_sessions(self, tenant: str) -> list[dict]:
        return [s for answer in self._all("list_sessions", tenant) for s in answer]

    # ---- datasets ---------------------------------------------------------------------------------
    def open_dataset(self, tenant: str, root: str | Path, horizon: int, batch_size: int,
                     camera_map: Mapping[str, str], state_key: str | None = "observation.state",
                     action_key: str = "action", seed: int = 0, *, idle_timeout_s: float | None = 3600.0,
                     episodes: Sequence[int] | None = None, cache_mb: float = 512.0,
                     options: Mapping[str, Any] | None = None) -> str:
        return _get(self._open_on().open_shipped_dataset.remote(
            tenant, self.shipped(root), horizon, batch_size, camera_map, state_key, action_key, seed,
            idle_timeout_s=idle_timeout_s, episodes=episodes, cache_mb=cache_mb, options=options))

    def sample(self, tenant: str, dataset_id: str):
        return _get(self.actor_of(dataset_id, DatasetNotFound).sample.remote(tenant, dataset_id))

    def dataset_stats(self, tenant: str, dataset_id: str, mode: str = "mean_std") -> dict:
        return _get(self.actor_of(dataset_id, DatasetNotFound).dataset_stats.remote(tenant, dataset_id, mode))

    def dataset_info(self, tenant: str, dataset_id: str) -> dict:
        return _get(self.actor_of(dataset_id, DatasetNotFound).dataset_info.remote(tenant, dataset_id))

    def close_dataset(self, tenant: str, dataset_id: str) -> None:
        return _get(self.actor_of(dataset_id, DatasetNotFound).close_dataset.remote(tenant, dataset_id))

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
        answers = self._all("metrics")
        return answers[0] if len(answers) == 1 else sum_numbers(answers)


def sum_numbers(dicts: list[dict]) -> dict:
    """Several environment replicas' metrics as one: numbers add up (utilisation averages)."""
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    for k in ("utilization", "concurrency"):
        if k in out:
            out[k] /= len(dicts)
    return out
