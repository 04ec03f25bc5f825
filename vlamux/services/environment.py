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

import collections
import dataclasses
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlamux.data.lerobot import DatasetError, DatasetFormatError
from vlamux.envs import BACKENDS
from vlamux.envs.base import EnvError, EnvSpec
from vlamux.envs.workers import VectorEnv
from vlamux.errors import InvalidInputError, VlamuxError, public_message
from vlamux.model.batch import Observation

log = logging.getLogger(__name__)

_TOMBSTONES = 4096  # how many closed/expired handles are remembered (for "expired" messages)


# ---- errors ---------------------------------------------------------------------------------------

class NotFound(VlamuxError, KeyError):
    """No such handle for this tenant. Never says whether the id belongs to someone else."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "not found"


class SessionNotFound(NotFound):
    """The tenant has no session with this id (never opened, closed, expired, or someone else's)."""


class DatasetNotFound(NotFound):
    """The tenant has no dataset handle with this id."""


class QuotaExceeded(VlamuxError):
    """Opening this would take the tenant (or the service) past a configured limit."""


class SessionBusy(VlamuxError, TimeoutError):
    """Another call on the same session did not finish within the session's bound."""


class ServiceClosed(VlamuxError, RuntimeError):
    """The service has been shut down."""


# ---- observations ---------------------------------------------------------------------------------

def _tensor(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if not a.flags.writeable:  # e.g. unpickled from a read-only buffer; torch wants to own writable memory
        a = a.copy()
    return torch.from_numpy(a)


def check_dataset_root(root: str | Path, allowed: Sequence[Path] | None) -> Path:
    """`root` as a path this service may read a dataset from (under one of `allowed`, if given)."""
    path = Path(root).expanduser()
    if allowed is not None:
        resolved = path.resolve()
        if not any(resolved == a or a in resolved.parents for a in allowed):
            raise DatasetError(f"dataset root {str(root)!r}: outside the directories this service may read")
    if not path.exists():
        raise DatasetError(f"dataset root {str(root)!r}: no such file or directory")
    return path


def obs_to_observation(obs: Mapping[str, Any]) -> Observation:
    """A batched env observation (``{"images": {cam: uint8 [B,3,H,W]}, "state": [B,S], "instruction": [B]}``)
    as the model core's `Observation`. The tensors share memory with the arrays (no copy) unless an array
    is read-only or not contiguous."""
    if isinstance(obs, Observation):
        return obs
    try:
        images = {str(c): _tensor(np.asarray(v)) for c, v in obs["images"].items()}
        state = obs.get("state")
        if state is not None:
            state = np.asarray(state)
            if state.dtype != np.float32:
                state = state.astype(np.float32)
            state = _tensor(state)
        instruction = [str(s) for s in obs["instruction"]]
    except (KeyError, TypeError, AttributeError) as e:
        raise InvalidInputError(f"obs: expected a dict with 'images', 'state' and 'instruction' ({e})") from None
    return Observation(images=images, instruction=instruction, state=state)


# ---- handles --------------------------------------------------------------------------------------

@dataclass
class _Counters:
    env_steps: int = 0
    step_calls: int = 0
    reset_calls: int = 0
    episodes_started: int = 0  # sub-env resets that succeeded
    sim_s: float = 0.0  # time inside simulator calls
    errors: int = 0  # simulator calls that raised
    samples: int = 0  # dataset rows handed out
    sample_calls: int = 0
    sample_s: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class _Session:
    id: str
    tenant: str
    spec: EnvSpec
    n_envs: int
    n_workers: int
    seed: int | None
    idle_timeout_s: float | None
    as_observation: bool
    timeout_s: float
    start_timeout_s: float
    render_device: int | None
    vec: Any  # VectorEnv (or a stand-in with its interface)
    created: float  # wall clock (time.time())
    last_used_mono: float
    last_used: float  # wall clock
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    was_reset: bool = False
    counters: _Counters = field(default_factory=_Counters)

    @property
    def wait_bound_s(self) -> float:
        """How long a call may wait for an earlier call on this session (its worst case, plus slack)."""
        return self.timeout_s + self.n_workers * self.start_timeout_s + 10.0


@dataclass
class _Dataset:
    id: str
    tenant: str
    root: str
    dataset: Any  # EpisodeDataset
    sampler: Any  # ChunkSampler
    idle_timeout_s: float | None
    created: float
    last_used_mono: float
    last_used: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    epoch: int = 0
    next_batch: int = 0
    order: np.ndarray | None = None
    counters: _Counters = field(default_factory=_Counters)

    @property
    def wait_bound_s(self) -> float:
        return 300.0  # a batch is local disk reads and decoding


# ---- the service ----------------------------------------------------------------------------------

class EnvironmentService:
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
        for quota, v in (("max_sessions_per_tenant", max_sessions_per_tenant),
                        ("max_envs_per_tenant", max_envs_per_tenant),
                        ("max_datasets_per_tenant", max_datasets_per_tenant), ("max_envs_total", max_envs_total)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise InvalidInputError(f"{quota}: expected a non-negative int or None, got {v!r}")
        self.max_sessions_per_tenant = max_sessions_per_tenant
        self.max_envs_per_tenant = max_envs_per_tenant
        self.max_datasets_per_tenant = max_datasets_per_tenant
        self.max_envs_total = max_envs_total
        self.env_timeout_s = _positive("env_timeout_s", env_timeout_s)
        self.start_timeout_s = _positive("start_timeout_s", start_timeout_s)
        self.allowed_dataset_roots = None if allowed_dataset_roots is None else \
            [Path(r).expanduser().resolve() for r in allowed_dataset_roots]
        self._factory = vector_env_factory
        self.render_devices = _devices(render_devices)
        self.worker_cpus = tuple(worker_cpus) if worker_cpus else None  # the simulators' cores (placement)
        self._data_threads = None  # with worker_cpus: datasets decode there too, not on the callers' cores
        self._next_device = 0  # round-robin position in render_devices
        self.name = name
        self._id_prefix = f"{name}." if name else ""  # a runtime with several replicas routes an id by it

        self._lock = threading.Lock()  # guards every dict and counter below; never held across a simulator call
        self._sessions: dict[str, _Session] = {}
        self._datasets: dict[str, _Dataset] = {}
        self._pending: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])  # sessions, envs, datasets
        self._gone: collections.OrderedDict[tuple[str, str, str], str] = collections.OrderedDict()
        self._usage: dict[str, _Counters] = collections.defaultdict(_Counters)
        self._events = collections.Counter({f"{k}_{e}": 0 for k in ("sessions", "datasets")
                                            for e in ("opened", "closed", "reaped")})
        self._closed = False

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
        tenant = _tenant(tenant)
        spec = _spec(spec)
        n_envs = _count("n_envs", n_envs)
        if n_workers is not None:
            n_workers = _count("n_workers", n_workers)
        seed = _seed(seed)
        idle_timeout_s = _idle("idle_timeout_s", idle_timeout_s)
        timeout_s = self.env_timeout_s if timeout_s is None else _positive("timeout_s", timeout_s)
        start_timeout_s = self.start_timeout_s if start_timeout_s is None else \
            _positive("start_timeout_s", start_timeout_s)
        render_device = None if render_device is None else _device("render_device", render_device)

        with self._lock:
            self._check_open()
            mine = [s for s in self._sessions.values() if s.tenant == tenant]
            pending = self._pending[tenant]
            if self.max_sessions_per_tenant is not None and len(mine) + pending[0] + 1 > self.max_sessions_per_tenant:
                raise QuotaExceeded(f"tenant {tenant!r}: session quota reached ({self.max_sessions_per_tenant} open "
                                    f"sessions at most); close one first")
            envs = sum(s.n_envs for s in mine) + pending[1]
            if self.max_envs_per_tenant is not None and envs + n_envs > self.max_envs_per_tenant:
                raise QuotaExceeded(f"tenant {tenant!r}: env quota is {self.max_envs_per_tenant} envs; "
                                    f"{envs} in use, {n_envs} requested")
            total = sum(s.n_envs for s in self._sessions.values()) + sum(p[1] for p in self._pending.values())
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
            with self._lock:
                self._check_open()
                self._sessions[s.id] = s
                self._events["sessions_opened"] += 1
                vec = None  # the service owns it now
            log.info("tenant %s opened env session %s (%s/%s x%d)", tenant, s.id, spec.backend, spec.task, n_envs)
            return s.id
        finally:
            with self._lock:
                pending[0] -= 1
                pending[1] -= n_envs
            if vec is not None:  # opened, but the service closed meanwhile (or bookkeeping failed)
                _close_quietly(vec)

    def reset(self, tenant: str, session_id: str, seed: int | None = None, indices: Sequence[int] | None = None):
        """Reset sub-envs (all by default; sub-env i gets seed + i). Returns (obs, infos) for `indices`."""
        s = self._acquire_session(tenant, session_id)
        try:
            seed = _seed(seed)
            if indices is not None:
                try:
                    indices = [int(i) for i in np.asarray(indices).reshape(-1)]
                except (TypeError, ValueError):
                    raise InvalidInputError(f"indices: expected env indices, got {indices!r}") from None
                bad = [i for i in indices if not 0 <= i < s.n_envs]
                if bad or not indices:
                    raise InvalidInputError(f"indices: {bad or 'empty'} out of range for {s.n_envs} envs")
            if seed is None and not s.was_reset:
                seed = s.seed
            n = s.n_envs if indices is None else len(indices)

            def partial_resets(e):
                self._count(s, reset_calls=1, episodes_started=len(getattr(e, "partial", None) or {}))

            obs, infos = self._sim_call(s, lambda: s.vec.reset(seed=seed, indices=indices), partial_resets)
            s.n_workers = int(getattr(s.vec, "n_workers", s.n_workers))  # a pending resize applies at a full reset
            s.was_reset = True
            self._count(s, reset_calls=1, episodes_started=n)
            return (obs_to_observation(obs) if s.as_observation else obs), infos
        finally:
            self._release(s)

    def step(self, tenant: str, session_id: str, actions):
        """One vectorised step. actions: [n_envs, A] or a chunk [n_envs, H, A] (its first
        `spec.n_action_steps` actions run). Returns (obs, reward [n], terminated [n], truncated [n], infos)."""
        s = self._acquire_session(tenant, session_id)
        try:
            a = self._check_actions(s, actions)
            per_env = min(a.shape[1], s.spec.n_action_steps)

            def partial_steps(e):
                done = len(getattr(e, "partial", None) or {})
                self._count(s, env_steps=done * per_env, step_calls=1)

            out = self._sim_call(s, lambda: s.vec.step(a), partial_steps)
            self._count(s, env_steps=s.n_envs * per_env, step_calls=1)
            if s.as_observation:
                out = (obs_to_observation(out[0]),) + tuple(out[1:])
            return out
        finally:
            self._release(s)

    def resize_session(self, tenant: str, session_id: str, n_workers: int) -> int:
        """Elastic simulators: give a running session `n_workers` worker processes. It takes effect at
        the session's next reset of all envs (a sub-env's state lives in its worker), so no call and no
        running episode is dropped. Returns the worker count that will apply."""
        n_workers = _count("n_workers", n_workers)
        s = self._acquire_session(tenant, session_id)
        try:
            if not hasattr(s.vec, "resize"):
                raise InvalidInputError(f"session {session_id!r}: its env cannot change its worker count")
            return s.vec.resize(n_workers)
        finally:
            self._release(s)

    def close_session(self, tenant: str, session_id: str) -> None:
        """Close a session and stop its simulators. Its id is then unknown (SessionNotFound)."""
        s = self._acquire_session(tenant, session_id)
        try:
            with self._lock:
                s.closed = True
                self._sessions.pop(s.id, None)
                self._tombstone("session", s.tenant, s.id, f"session {s.id!r} was closed")
                self._events["sessions_closed"] += 1
            vec = s.vec
        finally:
            s.lock.release()
        _close_quietly(vec)

    def list_sessions(self, tenant: str) -> list[dict]:
        """`session_info` of each of the tenant's open sessions, oldest first."""
        tenant = _tenant(tenant)
        with self._lock:
            mine = sorted((s for s in self._sessions.values() if s.tenant == tenant), key=lambda s: s.created)
        return [self._session_info(s) for s in mine]

    def session_info(self, tenant: str, session_id: str) -> dict:
        """spec, n_envs, created/last_used (wall-clock seconds), idle time, env steps so far, needs_reset, ..."""
        return self._session_info(self._lookup_session(tenant, session_id))

    def action_spec(self, tenant: str, session_id: str):
        """The session's `ActionSpace` (dimensions, bounds, control mode)."""
        return self._lookup_session(tenant, session_id).vec.action_spec

    obs_to_observation = staticmethod(obs_to_observation)

    # ---- datasets --------------------------------------------------------------------------------
    def open_dataset(self, tenant: str, root: str | Path, horizon: int, batch_size: int,
                     camera_map: Mapping[str, str], state_key: str | None = "observation.state",
                     action_key: str = "action", seed: int = 0, *, idle_timeout_s: float | None = 3600.0,
                     episodes: Sequence[int] | None = None, cache_mb: float = 512.0,
                     options: Mapping[str, Any] | None = None) -> str:
        """Open a dataset for sampling; returns the dataset id.

        root: a LeRobot dataset directory (v3.0 or v2.1), or a robomimic/LIBERO HDF5 file. camera_map:
        dataset camera key -> camera name in the Observation. The rest is `ChunkSampler`'s. options:
        extra keyword arguments of the reader (e.g. ``instruction`` for a robomimic file).
        """
        from vlamux.data import ChunkSampler, LeRobotDataset, RobomimicDataset

        tenant = _tenant(tenant)
        idle_timeout_s = _idle("idle_timeout_s", idle_timeout_s)
        if not isinstance(root, (str, Path)) or not str(root):
            raise InvalidInputError(f"root: expected a path, got {root!r}")
        path = check_dataset_root(root, self.allowed_dataset_roots)
        if not isinstance(camera_map, Mapping):
            raise InvalidInputError(f"camera_map: expected a mapping of dataset camera key -> camera name, "
                                    f"got {type(camera_map).__name__}")
        with self._lock:
            self._check_open()
            mine = sum(1 for d in self._datasets.values() if d.tenant == tenant) + self._pending[tenant][2]
            if self.max_datasets_per_tenant is not None and mine + 1 > self.max_datasets_per_tenant:
                raise QuotaExceeded(f"tenant {tenant!r}: dataset quota reached ({self.max_datasets_per_tenant} "
                                    f"open datasets at most); close one first")
            self._pending[tenant][2] += 1
        ds = None
        try:
            opts = dict(options or {})
            try:
                if path.is_dir():
                    ds = LeRobotDataset(path, video_cache_mb=cache_mb, **opts)
                else:
                    ds = RobomimicDataset(path, cache_mb=cache_mb, **opts)
            except (DatasetError, InvalidInputError):
                raise
            except TypeError as e:
                raise InvalidInputError(f"options: {e}") from None
            except Exception as e:  # noqa: BLE001 - a reader's own failure, named with the path
                raise DatasetFormatError(public_message(f"{path.name}: could not open the dataset "
                                                        f"({type(e).__name__}: {e})")) from None
            sampler = ChunkSampler(ds, horizon, batch_size, dict(camera_map), state_key=state_key,
                                   action_key=action_key, seed=_seed(seed) or 0, episodes=episodes)
            if len(sampler) == 0:
                raise DatasetError(f"{path.name}: batch_size {batch_size} is larger than the {sampler.num_samples} "
                                   f"frames of the dataset")
            now, wall = time.monotonic(), time.time()
            d = _Dataset(id=self._id_prefix + uuid.uuid4().hex, tenant=tenant, root=str(path), dataset=ds, sampler=sampler,
                         idle_timeout_s=idle_timeout_s, created=wall, last_used_mono=now, last_used=wall)
            with self._lock:
                self._check_open()
                self._datasets[d.id] = d
                self._events["datasets_opened"] += 1
                ds = None
            return d.id
        finally:
            with self._lock:
                self._pending[tenant][2] -= 1
            if ds is not None:
                _close_quietly(ds)

    def sample(self, tenant: str, dataset_id: str):
        """The next training batch: (Observation, actions float32 [B, H, A], action_mask bool [B, H]).
        Batches walk the sampler's seeded epochs in order (epoch 0, 1, ...), every frame once per epoch."""
        d = self._acquire_dataset(tenant, dataset_id)
        try:
            t0 = time.perf_counter()
            sampler = d.sampler
            if d.order is None or d.next_batch >= len(sampler):
                if d.order is not None:
                    d.epoch += 1
                d.order, d.next_batch = sampler.order(d.epoch), 0
            b, bs = d.next_batch, sampler.batch_size
            batch = self._decode(sampler.batch, d.order[b * bs:(b + 1) * bs])
            d.next_batch += 1
            self._count(d, samples=batch[0].batch_size, sample_calls=1, sample_s=time.perf_counter() - t0)
            return batch
        finally:
            self._release(d)

    def _decode(self, fn, *args):
        """Run a dataset's reading and decoding: on the simulators' cores where the service has them
        (the papers' split keeps data work off the model services' cores; the caller waits as before)."""
        if self.worker_cpus is None:
            return fn(*args)
        with self._lock:
            if self._data_threads is None:
                from concurrent.futures import ThreadPoolExecutor

                from vlamux.utils.placement import pin_self

                self._data_threads = ThreadPoolExecutor(2, "vlamux-env-data", initializer=pin_self,
                                                        initargs=(self.worker_cpus,))
            pool = self._data_threads
        return pool.submit(fn, *args).result()

    def dataset_stats(self, tenant: str, dataset_id: str, mode: str = "mean_std") -> dict:
        """{"action": NormStats, "state": NormStats | None}: the dataset's statistics, private copies."""
        d = self._acquire_dataset(tenant, dataset_id)
        try:
            stats = d.sampler.norm_stats(mode)
        finally:
            self._release(d)
        return {k: None if v is None else v.to("cpu") for k, v in stats.items()}

    def dataset_info(self, tenant: str, dataset_id: str) -> dict:
        d = self._lookup_dataset(tenant, dataset_id)
        return self._dataset_info(d)

    def list_datasets(self, tenant: str) -> list[dict]:
        tenant = _tenant(tenant)
        with self._lock:
            mine = sorted((d for d in self._datasets.values() if d.tenant == tenant), key=lambda d: d.created)
        return [self._dataset_info(d) for d in mine]

    def close_dataset(self, tenant: str, dataset_id: str) -> None:
        d = self._acquire_dataset(tenant, dataset_id)
        try:
            with self._lock:
                d.closed = True
                self._datasets.pop(d.id, None)
                self._tombstone("dataset", d.tenant, d.id, f"dataset {d.id!r} was closed")
                self._events["datasets_closed"] += 1
        finally:
            d.lock.release()
        _close_quietly(d.dataset)

    # ---- idle timeouts ---------------------------------------------------------------------------
    def reap(self, now: float | None = None) -> list[str]:
        """Close every session and dataset unused for longer than its idle timeout; returns their ids.
        A handle with a call in progress is in use, never idle. `now`: a time.monotonic() value."""
        now = time.monotonic() if now is None else now
        victims: list[_Session | _Dataset] = []
        with self._lock:
            for kind, table in (("session", self._sessions), ("dataset", self._datasets)):
                for h in list(table.values()):
                    if h.idle_timeout_s is None or now - h.last_used_mono <= h.idle_timeout_s:
                        continue
                    if not h.lock.acquire(blocking=False):  # a call is running on it
                        continue
                    try:
                        h.closed = True
                        del table[h.id]
                        self._tombstone(kind, h.tenant, h.id,
                                        f"{kind} {h.id!r} expired: unused for more than {h.idle_timeout_s:g}s "
                                        f"(its idle timeout) and was closed; open a new one")
                        self._events[f"{kind}s_reaped"] += 1
                    finally:
                        h.lock.release()
                    victims.append(h)
        for h in victims:
            log.info("reaped idle %s %s of tenant %s", type(h).__name__.strip("_").lower(), h.id, h.tenant)
            _close_quietly(h.vec if isinstance(h, _Session) else h.dataset)
        return [h.id for h in victims]

    def check_workers(self, timeout_s: float = 5.0) -> dict[str, list[int]]:
        """Health check of every idle session's simulator workers (busy sessions are being checked by
        their own calls): dead or hung workers are replaced. Returns session id -> replaced workers."""
        with self._lock:
            sessions = [s for s in self._sessions.values() if not s.closed]
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
        interval_s = _positive("interval_s", interval_s)
        with self._lock:
            self._check_open()
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
        with self._lock:
            return sorted(set(self._usage) | {s.tenant for s in self._sessions.values()})

    def env_steps(self) -> dict[str, int]:
        """Every tenant's env steps since the service started, in one call (what metering reads)."""
        with self._lock:
            return {t: c.as_dict().get("env_steps", 0) for t, c in self._usage.items()}

    def usage(self, tenant: str) -> dict:
        """The tenant's totals since the service started (closed sessions included) and per open handle."""
        tenant = _tenant(tenant)
        with self._lock:
            total = self._usage[tenant].as_dict() if tenant in self._usage else _Counters().as_dict()
            sessions = {s.id: s.counters.as_dict() for s in self._sessions.values() if s.tenant == tenant}
            datasets = {d.id: d.counters.as_dict() for d in self._datasets.values() if d.tenant == tenant}
            envs = sum(s.n_envs for s in self._sessions.values() if s.tenant == tenant)
        return {**total, "open_sessions": len(sessions), "open_envs": envs, "open_datasets": len(datasets),
                "sessions": sessions, "datasets": datasets,
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
        with self._lock:
            totals = _Counters()
            for c in self._usage.values():
                for f in dataclasses.fields(c):
                    setattr(totals, f.name, getattr(totals, f.name) + getattr(c, f.name))
            out = {"open_sessions": len(self._sessions), "open_envs": sum(s.n_envs for s in self._sessions.values()),
                   "open_datasets": len(self._datasets), "tenants": len(self._usage),
                   **{f"total_{k}": v for k, v in totals.as_dict().items()}, **dict(self._events)}
        return {**out, **self.utilization()}

    # ---- lifecycle -------------------------------------------------------------------------------
    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the reaper and close every session (all simulators) and dataset. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            handles: list[_Session | _Dataset] = [*self._sessions.values(), *self._datasets.values()]
            self._sessions.clear()
            self._datasets.clear()
            pool, self._data_threads = self._data_threads, None
        self.stop()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

        def shut(h):
            got = h.lock.acquire(timeout=min(h.wait_bound_s, timeout_s))  # let a running call finish
            try:
                h.closed = True
                _close_quietly(h.vec if isinstance(h, _Session) else h.dataset)
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
        return self._closed

    def __enter__(self) -> EnvironmentService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals -------------------------------------------------------------------------------
    def _check_open(self) -> None:  # with self._lock held
        if self._closed:
            raise ServiceClosed("the environment service is closed")

    def _tombstone(self, kind: str, tenant: str, hid: str, why: str) -> None:  # with self._lock held
        self._gone[(kind, tenant, hid)] = why
        while len(self._gone) > _TOMBSTONES:
            self._gone.popitem(last=False)

    def _not_found(self, kind: str, tenant: str, hid) -> NotFound:  # with self._lock held
        err = SessionNotFound if kind == "session" else DatasetNotFound
        why = self._gone.get((kind, tenant, hid)) if isinstance(hid, str) else None
        return err(why or f"tenant {tenant!r} has no {kind} {hid!r}")

    def _lookup(self, kind: str, tenant: str, hid):
        tenant = _tenant(tenant)
        with self._lock:
            self._check_open()
            h = (self._sessions if kind == "session" else self._datasets).get(hid) if isinstance(hid, str) else None
            if h is None or h.tenant != tenant:  # someone else's id reads exactly like an unknown one
                raise self._not_found(kind, tenant, hid)
            return h

    def _lookup_session(self, tenant: str, session_id: str) -> _Session:
        return self._lookup("session", tenant, session_id)

    def _lookup_dataset(self, tenant: str, dataset_id: str) -> _Dataset:
        return self._lookup("dataset", tenant, dataset_id)

    def _acquire(self, kind: str, tenant: str, hid):
        """The handle with its lock held (released by `_release`), after a bounded wait for a running call."""
        h = self._lookup(kind, tenant, hid)
        if not h.lock.acquire(timeout=h.wait_bound_s):
            raise SessionBusy(f"{kind} {h.id!r} is busy: another call on it did not finish within "
                              f"{h.wait_bound_s:.0f}s")
        if h.closed:  # closed or reaped while we waited
            h.lock.release()
            with self._lock:
                raise self._not_found(kind, h.tenant, h.id)
        h.last_used_mono, h.last_used = time.monotonic(), time.time()
        return h

    def _acquire_session(self, tenant: str, session_id: str) -> _Session:
        return self._acquire("session", tenant, session_id)

    def _acquire_dataset(self, tenant: str, dataset_id: str) -> _Dataset:
        return self._acquire("dataset", tenant, dataset_id)

    @staticmethod
    def _release(h) -> None:
        h.last_used_mono, h.last_used = time.monotonic(), time.time()
        h.lock.release()

    def _count(self, h, **inc) -> None:
        with self._lock:
            for c in (h.counters, self._usage[h.tenant]):
                for k, v in inc.items():
                    setattr(c, k, getattr(c, k) + v)

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
            self._count(s, errors=1)
            on_error(e)
            raise
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self._inflight -= 1
                if self._inflight == 0:
                    self._busy_s += time.monotonic() - self._busy_since
                self._sim_s += dt
            self._count(s, sim_s=dt)

    @staticmethod
    def _check_actions(s: _Session, actions) -> np.ndarray:
        if isinstance(actions, torch.Tensor):
            actions = actions.detach().to("cpu", torch.float32).numpy()
        try:
            a = np.asarray(actions, dtype=np.float32)
        except (TypeError, ValueError):
            raise InvalidInputError(f"actions: expected a float array, got {type(actions).__name__}") from None
        dim = s.vec.action_spec.dim
        if a.ndim == 2:
            a = a[:, None]
        if a.ndim != 3 or a.shape[0] != s.n_envs or a.shape[1] < 1 or a.shape[2] != dim:
            raise InvalidInputError(f"actions: expected [{s.n_envs}, {dim}] or [{s.n_envs}, H, {dim}], "
                                    f"got {list(np.shape(actions))}")
        if not np.isfinite(a[:, : s.spec.n_action_steps]).all():
            raise InvalidInputError("actions: contain NaN or infinite values")
        return a

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

    def _dataset_info(self, d: _Dataset) -> dict:
        sm = d.sampler
        return {"dataset_id": d.id, "root": d.root, "num_episodes": len(sm.episodes), "num_samples": sm.num_samples,
                "horizon": sm.horizon, "batch_size": sm.batch_size, "batches_per_epoch": len(sm),
                "camera_map": dict(sm.camera_map), "state_key": sm.state_key, "action_key": sm.action_key,
                "epoch": d.epoch, "next_batch": d.next_batch, "samples": d.counters.samples,
                "created": d.created, "last_used": d.last_used, "idle_timeout_s": d.idle_timeout_s}


# ---- validation helpers ---------------------------------------------------------------------------

def _tenant(tenant) -> str:
    if not isinstance(tenant, str) or not tenant:
        raise InvalidInputError(f"tenant: expected a non-empty string, got {tenant!r}")
    return tenant


def _spec(spec) -> EnvSpec:
    if isinstance(spec, Mapping):
        known = {f.name for f in dataclasses.fields(EnvSpec)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise InvalidInputError(f"spec: unknown fields {unknown} (fields: {sorted(known)})")
        spec = dict(spec)
        if "cameras" in spec:
            spec["cameras"] = tuple(spec["cameras"])
        spec = EnvSpec(**spec)
    if not isinstance(spec, EnvSpec):
        raise InvalidInputError(f"spec: expected an EnvSpec, got {type(spec).__name__}")
    if spec.backend not in BACKENDS:
        raise InvalidInputError(f"spec.backend: unknown backend {spec.backend!r}; available: {sorted(BACKENDS)}")
    for name in ("image_size", "max_steps", "n_action_steps"):
        v = getattr(spec, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InvalidInputError(f"spec.{name}: expected a positive int, got {v!r}")
    if not spec.cameras or not all(isinstance(c, str) and c for c in spec.cameras):
        raise InvalidInputError(f"spec.cameras: expected camera names, got {spec.cameras!r}")
    return spec


def _count(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise InvalidInputError(f"{name}: expected a positive int, got {v!r}")
    return int(v)


def _device(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise InvalidInputError(f"{name}: expected a non-negative GPU index, got {v!r}")
    return int(v)


def _devices(v) -> list[int]:
    if v is None:
        return []
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        raise InvalidInputError(f"render_devices: expected a list of GPU indices or None, got {v!r}")
    return [_device("render_devices[]", d) for d in v]


def _seed(seed) -> int | None:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InvalidInputError(f"seed: expected a non-negative int or None, got {seed!r}")
    return int(seed)


def _positive(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise InvalidInputError(f"{name}: expected a positive number of seconds, got {v!r}")
    return float(v)


def _idle(name: str, v) -> float | None:
    return None if v is None else _positive(name, v)


def _close_quietly(obj) -> None:
    close = getattr(obj, "close", None)  # readers that hold no open files have nothing to close
    if close is None:
        return
    try:
        close()
    except Exception:  # noqa: BLE001 - closing must not fail the caller
        log.exception("environment service: closing %s failed", type(obj).__name__)


__all__ = ["DatasetNotFound", "EnvironmentService", "NotFound", "QuotaExceeded", "ServiceClosed", "SessionBusy",
           "SessionNotFound", "obs_to_observation"]
