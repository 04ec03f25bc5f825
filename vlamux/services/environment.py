"""The Environment Service: tenants' simulator sessions and offline-dataset handles.

A plain, thread-safe class with no transport inside; a runtime places it in-process or as an
actor. Every operation names the tenant, and a tenant only ever reaches its own handles: another
tenant's session or dataset id is answered exactly like an id that never existed (`SessionNotFound`,
`DatasetNotFound`), and ids are random (uuid4), so they can be neither guessed nor probed.

Sessions. ``open_session`` starts a `VectorEnv` (the simulators run in worker processes with
deadlines; a hung or dead worker is replaced and the call raises `EnvTimeoutError` /
`EnvWorkerCrashed` with ``.partial`` / ``.failed_envs``). A simulator error goes to the calling
tenant only; the session stays open and works again once the failed sub-envs are reset. Calls on
one session run one at a time (a per-session lock), calls on different sessions run concurrently.
A session unused for its ``idle_timeout_s`` is closed by `reap` (run it periodically, or
`start_reaper`); a later call on it raises `SessionNotFound` saying it expired.

Datasets. ``open_dataset`` opens a LeRobot dataset directory (or a robomimic/LIBERO HDF5 file) and a
`ChunkSampler` over it; ``sample`` hands out the next batch, epoch after epoch, in the sampler's
seeded order. Dataset handles have idle timeouts too.

Accounting. Env steps are counted as *actions dispatched to sub-envs*: each sub-env that answered
a step call counts ``min(H, spec.n_action_steps)`` steps for an [n, H, A] chunk (1 for [n, A]).
A sub-env whose episode ends inside a chunk stops early, so for ``n_action_steps > 1`` this is an
upper bound (by at most n_action_steps - 1 per episode end). Busy time is the time spent inside
simulator calls: ``sim_s`` sums every call's duration (concurrent sessions overlap), ``busy_s`` is
the wall time during which at least one simulator call was in flight.

Bounded time: simulator calls are bounded by the VectorEnv's deadlines (``timeout_s`` per call,
``start_timeout_s`` for starting a worker); waiting for another call on the same session is bounded
by their sum (`SessionBusy` past it).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vlamux.envs.base import EnvError, EnvSpec
from vlamux.envs.workers import VectorEnv
from vlamux.errors import InvalidInputError
from vlamux.model.batch import obs_to_observation
from vlamux.services import env_inputs as check
from vlamux.services.env_datasets import DatasetHandles, close_quietly
from vlamux.services.handles import (DatasetNotFound, Handle, Handles, NotFound, QuotaExceeded, ServiceClosed,
                                     SessionBusy, SessionNotFound)

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class _Session(Handle):
    KIND = "session"

    spec: EnvSpec
    n_envs: int
    n_workers: int
    seed: int | None
    as_observation: bool
    timeout_s: float
    start_timeout_s: float
    render_device: int | None
    vec: Any  # VectorEnv (or a stand-in with its interface)
    was_reset: bool = False

    @property
    def wait_bound_s(self) -> float:
        """How long a call may wait for an earlier call on this session (its worst case, plus slack)."""
        return self.timeout_s + self.n_workers * self.start_timeout_s + 10.0

    @property
    def resource(self):
        return self.vec


# ---- the service ----------------------------------------------------------------------------------

class EnvironmentService(DatasetHandles):
    """Simulator sessions and dataset handles of many tenants. See the module docstring.

    Quotas (None = no limit): ``max_sessions_per_tenant``, ``max_envs_per_tenant`` (sub-envs over the
    tenant's open sessions), ``max_datasets_per_tenant``, ``max_envs_total`` (the whole service).
    ``allowed_dataset_roots``: if given, datasets may only be opened under these directories.
    ``env_timeout_s`` / ``start_timeout_s``: defaults of the VectorEnv deadlines.
    ``vector_env_factory(spec, n_envs, n_workers=, timeout_s=, start_timeout_s=)`` builds a session's
    vectorised env (VectorEnv by default; ``render_device=`` is added when a session has one). ``name``:
    prefixes every session and dataset id, so a runtime running several environment replicas can tell
    from an id which one holds it. ``render_devices``: GPUs that sessions naming no ``render_device``
    are given round-robin, for their EGL rendering (ignored where rendering is not on EGL).
    """

    def __init__(self, *, max_sessions_per_tenant: int | None = None, max_envs_per_tenant: int | None = None,
                 max_datasets_per_tenant: int | None = None, max_envs_total: int | None = None,
                 env_timeout_s: float = 30.0, start_timeout_s: float = 120.0,
                 allowed_dataset_roots: Sequence[str | Path] | None = None,
                 vector_env_factory: Callable[..., Any] = VectorEnv, name: str = "",
                 render_devices: Sequence[int] | None = None, worker_cpus: Sequence[int] | None = None):
        self.max_sessions_per_tenant = check.quota("max_sessions_per_tenant", max_sessions_per_tenant)
        self.max_envs_per_tenant = check.quota("max_envs_per_tenant", max_envs_per_tenant)
        self.max_datasets_per_tenant = check.quota("max_datasets_per_tenant", max_datasets_per_tenant)
        self.max_envs_total = check.quota("max_envs_total", max_envs_total)
        self.env_timeout_s = check.seconds("env_timeout_s", env_timeout_s)
        self.start_timeout_s = check.seconds("start_timeout_s", start_timeout_s)
        self.allowed_dataset_roots = None if allowed_dataset_roots is None else \
            [Path(r).expanduser().resolve() for r in allowed_dataset_roots]
        self._factory = vector_env_factory
        self.render_devices = check.gpu_indices(render_devices)
        self.worker_cpus = tuple(worker_cpus) if worker_cpus else None  # the simulators' cores (placement)
        self._data_threads = None  # with worker_cpus: datasets decode there too, not on the callers' cores
        self._next_device = 0  # round-robin position in render_devices
        self.name = name
        self._id_prefix = f"{name}." if name else ""  # a runtime with several replicas routes an id by it

        self._handles = Handles()  # its lock guards the tables and quotas; never held across a simulator call
        self._lock = threading.Lock()  # the busy-time figures, the render device round robin, the data threads
        self._start_mono = time.monotonic()
        self._inflight = 0
        self._busy_since = 0.0
        self._busy_s = 0.0
        self._sim_s = 0.0

        self._reaper: threading.Thread | None = None
        self._reaper_stop: threading.Event | None = None

    # ---- sessions --------------------------------------------------------------------------------
    def open_session(self, tenant: str, spec: EnvSpec | Mapping, n_envs: int, seed: int | None = None,
                     n_workers: int | None = None, idle_timeout_s: float | None = 300.0, *,
                     timeout_s: float | None = None, start_timeout_s: float | None = None,
                     as_observation: bool = False, render_device: int | None = None) -> str:
        """Start `n_envs` simulators of `spec` for `tenant`; returns the session id.

        seed: used by the first `reset` that gives no seed of its own (sub-env i gets seed + i).
        n_workers: worker processes (default: VectorEnv's, min(n_envs, CPUs)). idle_timeout_s: the
        session is closed after this long without a call (None: never). timeout_s / start_timeout_s:
        the VectorEnv's per-call and worker-start deadlines. as_observation: `reset`/`step` return
        observations as `Observation`s instead of numpy dicts. render_device: the GPU the session's
        simulators render on with EGL (default: the next of the service's ``render_devices``, if any).
        """
        tenant = check.tenant_name(tenant)
        spec = check.env_spec(spec)
        n_envs = check.count("n_envs", n_envs)
        if n_workers is not None:
            n_workers = check.count("n_workers", n_workers)
        seed = check.seed_value(seed)
        idle_timeout_s = check.idle_seconds("idle_timeout_s", idle_timeout_s)
        timeout_s = self.env_timeout_s if timeout_s is None else check.seconds("timeout_s", timeout_s)
        start_timeout_s = self.start_timeout_s if start_timeout_s is None else \
            check.seconds("start_timeout_s", start_timeout_s)
        render_device = None if render_device is None else check.gpu_index("render_device", render_device)

        handles = self._handles
        with handles.lock:
            handles.check_open()
            mine = handles.owned("session", tenant)
            pending = handles.pending[tenant]
            if self.max_sessions_per_tenant is not None and len(mine) + pending[0] + 1 > self.max_sessions_per_tenant:
                raise QuotaExceeded(f"tenant {tenant!r}: session quota reached ({self.max_sessions_per_tenant} open "
                                    f"sessions at most); close one first")
            envs = sum(s.n_envs for s in mine) + pending[1]
            if self.max_envs_per_tenant is not None and envs + n_envs > self.max_envs_per_tenant:
                raise QuotaExceeded(f"tenant {tenant!r}: env quota is {self.max_envs_per_tenant} envs; "
                                    f"{envs} in use, {n_envs} requested")
            total = sum(s.n_envs for s in handles.tables["session"].values()) + \
                sum(p[1] for p in handles.pending.values())
            if self.max_envs_total is not None and total + n_envs > self.max_envs_total:
                raise QuotaExceeded(f"the environment service is at capacity ({self.max_envs_total} envs); "
                                    f"{n_envs} requested, {max(0, self.max_envs_total - total)} free")
            pending[0] += 1
            pending[1] += n_envs
            if render_device is None and self.render_devices:
                render_device = self.render_devices[self._next_device % len(self.render_devices)]
                self._next_device += 1
        vec = None
        try:
            # only when set: a custom factory written before render devices need not accept it
            device_kw = {} if render_device is None else {"render_device": render_device}
            if self.worker_cpus:
                device_kw["cpus"] = self.worker_cpus
            vec = self._factory(spec, n_envs, n_workers=n_workers, timeout_s=timeout_s,
                                start_timeout_s=start_timeout_s, **device_kw)
            now, wall = time.monotonic(), time.time()
            s = _Session(id=self._id_prefix + uuid.uuid4().hex, tenant=tenant, spec=spec, n_envs=n_envs,
                         n_workers=int(getattr(vec, "n_workers", n_workers or 1)), seed=seed,
                         idle_timeout_s=idle_timeout_s, as_observation=bool(as_observation), timeout_s=timeout_s,
                         start_timeout_s=start_timeout_s, render_device=render_device, vec=vec, created=wall,
                         last_used_mono=now, last_used=wall)
            with handles.lock:
                handles.add(s)
                vec = None  # the service owns it now
            log.info("tenant %s opened env session %s (%s/%s x%d)", tenant, s.id, spec.backend, spec.task, n_envs)
            return s.id
        finally:
            with handles.lock:
                pending[0] -= 1
                pending[1] -= n_envs
            if vec is not None:  # opened, but the service closed meanwhile (or bookkeeping failed)
                close_quietly(vec)

    def reset(self, tenant: str, session_id: str, seed: int | None = None, indices: Sequence[int] | None = None):
        """Reset sub-envs (all by default; sub-env i gets seed + i). Returns (obs, infos) for `indices`."""
        s = self._acquire("session", tenant, session_id)
        try:
            seed = check.seed_value(seed)
            if indices is not None:
                indices = check.env_indices(indices, s.n_envs)
            if seed is None and not s.was_reset:
                seed = s.seed
            n = s.n_envs if indices is None else len(indices)

            def partial_resets(e):
                self._handles.count(s, reset_calls=1, episodes_started=len(getattr(e, "partial", None) or {}))

            obs, infos = self._sim_call(s, lambda: s.vec.reset(seed=seed, indices=indices), partial_resets)
            s.n_workers = int(getattr(s.vec, "n_workers", s.n_workers))  # a pending resize applies at a full reset
            s.was_reset = True
            self._handles.count(s, reset_calls=1, episodes_started=n)
            return (obs_to_observation(obs) if s.as_observation else obs), infos
        finally:
            self._handles.release(s)

    def step(self, tenant: str, session_id: str, actions):
        """One vectorised step. actions: [n_envs, A] or a chunk [n_envs, H, A] (its first
        `spec.n_action_steps` actions run). Returns (obs, reward [n], terminated [n], truncated [n], infos)."""
        s = self._acquire("session", tenant, session_id)
        try:
            a = check.actions_array(actions, s.n_envs, s.vec.action_spec.dim, s.spec.n_action_steps)
            per_env = min(a.shape[1], s.spec.n_action_steps)

            def partial_steps(e):
                done = len(getattr(e, "partial", None) or {})
                self._handles.count(s, env_steps=done * per_env, step_calls=1)

            out = self._sim_call(s, lambda: s.vec.step(a), partial_steps)
            self._handles.count(s, env_steps=s.n_envs * per_env, step_calls=1)
            if s.as_observation:
                out = (obs_to_observation(out[0]),) + tuple(out[1:])
            return out
        finally:
            self._handles.release(s)

    def resize_session(self, tenant: str, session_id: str, n_workers: int) -> int:
        """Elastic simulators: give a running session `n_workers` worker processes. It takes effect at
        the session's next reset of all envs (a sub-env's state lives in its worker), so no call and no
        running episode is dropped. Returns the worker count that will apply."""
        n_workers = check.count("n_workers", n_workers)
        s = self._acquire("session", tenant, session_id)
        try:
            if not hasattr(s.vec, "resize"):
                raise InvalidInputError(f"session {session_id!r}: its env cannot change its worker count")
            return s.vec.resize(n_workers)
        finally:
            self._handles.release(s)

    def close_session(self, tenant: str, session_id: str) -> None:
        """Close a session and stop its simulators. Its id is then unknown (SessionNotFound)."""
        s = self._acquire("session", tenant, session_id)
        self._handles.close(s)
        close_quietly(s.vec)

    def list_sessions(self, tenant: str) -> list[dict]:
        """`session_info` of each of the tenant's open sessions, oldest first."""
        return [self._session_info(s) for s in self._handles.mine("session", check.tenant_name(tenant))]

    def session_info(self, tenant: str, session_id: str) -> dict:
        """spec, n_envs, created/last_used (wall-clock seconds), idle time, env steps so far, needs_reset, ..."""
        return self._session_info(self._lookup("session", tenant, session_id))

    def action_spec(self, tenant: str, session_id: str):
        """The session's `ActionSpace` (dimensions, bounds, control mode)."""
        return self._lookup("session", tenant, session_id).vec.action_spec

    def worker_pids(self, tenant: str, session_id: str) -> list:
        """The process ids of the session's simulator workers (None where one is being replaced)."""
        return self._lookup("session", tenant, session_id).vec.worker_pids()

    obs_to_observation = staticmethod(obs_to_observation)

    # ---- idle timeouts ---------------------------------------------------------------------------
    def reap(self, now: float | None = None) -> list[str]:
        """Close every session and dataset unused for longer than its idle timeout; returns their ids.
        A handle with a call in progress is in use, never idle. `now`: a time.monotonic() value."""
        victims = self._handles.expired(time.monotonic() if now is None else now)
        for h in victims:
            log.info("reaped idle %s %s of tenant %s", h.KIND, h.id, h.tenant)
            close_quietly(h.resource)
        return [h.id for h in victims]

    def check_workers(self, timeout_s: float = 5.0) -> dict[str, list[int]]:
        """Health check of every idle session's simulator workers (busy sessions are being checked by
        their own calls): dead or hung workers are replaced. Returns session id -> replaced workers."""
        with self._handles.lock:
            sessions = [s for s in self._handles.tables["session"].values() if not s.closed]
        replaced = {}
        for s in sessions:
            if not s.lock.acquire(blocking=False):
                continue
            try:
                workers = s.vec.check_workers(timeout_s)
                if workers:
                    replaced[s.id] = workers
            except Exception:  # noqa: BLE001 - a failed check is retried next round
                log.exception("health check of session %s failed", s.id)
            finally:
                s.lock.release()
        return replaced

    def start_reaper(self, interval_s: float = 5.0) -> None:
        """Run `reap` every `interval_s` seconds in a daemon thread (until `stop` or `close`)."""
        interval_s = check.seconds("interval_s", interval_s)
        with self._lock:
            self._handles.check_open()
            if self._reaper is not None and self._reaper.is_alive():
                return
            stop = threading.Event()
            self._reaper_stop = stop
            self._reaper = threading.Thread(target=self._reap_loop, args=(interval_s, stop), daemon=True,
                                            name="vlamux-env-reaper")
            self._reaper.start()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the background reaper (the sessions stay open; `close` shuts everything down)."""
        with self._lock:
            thread, stop = self._reaper, self._reaper_stop
            self._reaper = self._reaper_stop = None
        if stop is not None:
            stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _reap_loop(self, interval_s: float, stop: threading.Event) -> None:
        while not stop.wait(interval_s):
            try:
                self.reap()
            except Exception:  # noqa: BLE001 - the reaper must outlive one bad close
                log.exception("environment service: reap failed")

    # ---- accounting ------------------------------------------------------------------------------
    def tenants(self) -> list[str]:
        """Every tenant that has used this service (for metering)."""
        return self._handles.tenants()

    def env_steps(self) -> dict[str, int]:
        """Every tenant's env steps since the service started, in one call (what metering reads)."""
        return self._handles.env_steps()

    def usage(self, tenant: str) -> dict:
        """The tenant's totals since the service started (closed sessions included) and per open handle."""
        return {**self._handles.usage_of(check.tenant_name(tenant)),
                "env_steps_counted_as": "actions dispatched to sub-envs (min(H, n_action_steps) per sub-env "
                                        "and step call)"}

    def utilization(self) -> dict:
        """Simulator busy time against wall time since the service started.

        busy_s: wall time with at least one simulator call in flight; utilization = busy_s / wall_s (<= 1).
        sim_s: the sum of all simulator calls' durations; concurrency = sim_s / wall_s (may exceed 1).
        """
        with self._lock:
            now = time.monotonic()
            busy = self._busy_s + (now - self._busy_since if self._inflight else 0.0)
            sim = self._sim_s
        wall = max(now - self._start_mono, 1e-9)
        return {"wall_s": wall, "busy_s": busy, "sim_s": sim, "utilization": busy / wall,
                "concurrency": sim / wall}

    def metrics(self) -> dict:
        """Service-wide figures: open handles, totals over all tenants, lifecycle events, utilization."""
        return {**self._handles.totals(), **self.utilization()}

    # ---- lifecycle -------------------------------------------------------------------------------
    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the reaper and close every session (all simulators) and dataset. Idempotent."""
        handles = self._handles.close_all()
        if handles is None:
            return
        with self._lock:
            pool, self._data_threads = self._data_threads, None
        self.stop()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

        def shut(h):
            got = h.lock.acquire(timeout=min(h.wait_bound_s, timeout_s))  # let a running call finish
            try:
                h.closed = True
                close_quietly(h.resource)
            finally:
                if got:
                    h.lock.release()

        threads = [threading.Thread(target=shut, args=(h,), daemon=True, name="vlamux-env-close") for h in handles]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    @property
    def closed(self) -> bool:
        return self._handles.closed

    def __enter__(self) -> EnvironmentService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals -------------------------------------------------------------------------------
    def _lookup(self, kind: str, tenant: str, hid):
        return self._handles.lookup(kind, check.tenant_name(tenant), hid)

    def _acquire(self, kind: str, tenant: str, hid):
        return self._handles.acquire(kind, check.tenant_name(tenant), hid)

    def _sim_call(self, s: _Session, fn, on_error):
        """Run a simulator call, timing it; a simulator error is counted, tagged and re-raised."""
        with self._lock:
            if self._inflight == 0:
                self._busy_since = time.monotonic()
            self._inflight += 1
        t0 = time.perf_counter()
        try:
            return fn()
        except EnvError as e:
            e.session_id = s.id
            self._handles.count(s, errors=1)
            on_error(e)
            raise
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self._inflight -= 1
                if self._inflight == 0:
                    self._busy_s += time.monotonic() - self._busy_since
                self._sim_s += dt
            self._handles.count(s, sim_s=dt)

    def _session_info(self, s: _Session) -> dict:
        vec = s.vec
        return {"session_id": s.id, "spec": s.spec, "n_envs": s.n_envs, "n_workers": s.n_workers,
                "pending_workers": getattr(vec, "pending_workers", None),
                "created": s.created, "last_used": s.last_used, "idle_s": time.monotonic() - s.last_used_mono,
                "idle_timeout_s": s.idle_timeout_s, "render_device": s.render_device,
                "env_steps": s.counters.env_steps,
                "step_calls": s.counters.step_calls, "reset_calls": s.counters.reset_calls,
                "errors": s.counters.errors, "needs_reset": np.array(vec.needs_reset, dtype=bool).tolist(),
                "worker_restarts": int(getattr(vec, "restarts", 0)), "action_spec": getattr(vec, "action_spec", None)}

__all__ = ["DatasetNotFound", "EnvironmentService", "NotFound", "QuotaExceeded", "ServiceClosed", "SessionBusy",
           "SessionNotFound", "obs_to_observation"]
