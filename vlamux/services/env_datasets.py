"""The Environment Service's offline datasets: a tenant opens a LeRobot dataset directory (or a
robomimic/LIBERO HDF5 file) and a `ChunkSampler` over it; ``sample`` hands out the next batch, epoch
after epoch, in the sampler's seeded order. Dataset handles live in the service's handle registry
(vlamux.services.handles) beside its simulator sessions, with their own quota and idle timeouts."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vlamux.data.errors import DatasetError, DatasetFormatError
from vlamux.errors import InvalidInputError, public_message
from vlamux.services import env_inputs as check
from vlamux.services.env_inputs import check_dataset_root
from vlamux.services.handles import Handle, QuotaExceeded

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class _Dataset(Handle):
    KIND = "dataset"

    root: str
    dataset: Any  # EpisodeDataset
    sampler: Any  # ChunkSampler
    epoch: int = 0
    next_batch: int = 0
    order: np.ndarray | None = None

    @property
    def wait_bound_s(self) -> float:
        return 300.0  # a batch is local disk reads and decoding

    @property
    def resource(self):
        return self.dataset


class DatasetHandles:
    """The dataset part of `EnvironmentService` (its methods are the service's). It uses the service's
    handle registry (``_handles``, ``_lookup``, ``_acquire``), ``allowed_dataset_roots``,
    ``max_datasets_per_tenant``, ``_id_prefix``, and ``worker_cpus`` with ``_lock`` and ``_data_threads``
    for decoding on the simulators' cores."""

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

        tenant = check.tenant_name(tenant)
        idle_timeout_s = check.idle_seconds("idle_timeout_s", idle_timeout_s)
        if not isinstance(root, (str, Path)) or not str(root):
            raise InvalidInputError(f"root: expected a path, got {root!r}")
        path = check_dataset_root(root, self.allowed_dataset_roots)
        if not isinstance(camera_map, Mapping):
            raise InvalidInputError(f"camera_map: expected a mapping of dataset camera key -> camera name, "
                                    f"got {type(camera_map).__name__}")
        handles = self._handles
        with handles.lock:
            handles.check_open()
            mine = len(handles.owned("dataset", tenant)) + handles.pending[tenant][2]
            if self.max_datasets_per_tenant is not None and mine + 1 > self.max_datasets_per_tenant:
                raise QuotaExceeded(f"tenant {tenant!r}: dataset quota reached ({self.max_datasets_per_tenant} "
                                    f"open datasets at most); close one first")
            handles.pending[tenant][2] += 1
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
                                   action_key=action_key, seed=check.seed_value(seed) or 0, episodes=episodes)
            if len(sampler) == 0:
                raise DatasetError(f"{path.name}: batch_size {batch_size} is larger than the {sampler.num_samples} "
                                   f"frames of the dataset")
            now, wall = time.monotonic(), time.time()
            d = _Dataset(id=self._id_prefix + uuid.uuid4().hex, tenant=tenant, root=str(path), dataset=ds, sampler=sampler,
                         idle_timeout_s=idle_timeout_s, created=wall, last_used_mono=now, last_used=wall)
            with handles.lock:
                handles.add(d)
                ds = None
            return d.id
        finally:
            with handles.lock:
                handles.pending[tenant][2] -= 1
            if ds is not None:
                close_quietly(ds)

    def sample(self, tenant: str, dataset_id: str):
        """The next training batch: (Observation, actions float32 [B, H, A], action_mask bool [B, H]).
        Batches walk the sampler's seeded epochs in order (epoch 0, 1, ...), every frame once per epoch."""
        d = self._acquire("dataset", tenant, dataset_id)
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
            self._handles.count(d, samples=batch[0].batch_size, sample_calls=1, sample_s=time.perf_counter() - t0)
            return batch
        finally:
            self._handles.release(d)

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
        d = self._acquire("dataset", tenant, dataset_id)
        try:
            stats = d.sampler.norm_stats(mode)
        finally:
            self._handles.release(d)
        return {k: None if v is None else v.to("cpu") for k, v in stats.items()}

    def dataset_info(self, tenant: str, dataset_id: str) -> dict:
        return self._dataset_info(self._lookup("dataset", tenant, dataset_id))

    def list_datasets(self, tenant: str) -> list[dict]:
        return [self._dataset_info(d) for d in self._handles.mine("dataset", check.tenant_name(tenant))]

    def close_dataset(self, tenant: str, dataset_id: str) -> None:
        d = self._acquire("dataset", tenant, dataset_id)
        self._handles.close(d)
        close_quietly(d.dataset)

    def _dataset_info(self, d: _Dataset) -> dict:
        sm = d.sampler
        return {"dataset_id": d.id, "root": d.root, "num_episodes": len(sm.episodes), "num_samples": sm.num_samples,
                "horizon": sm.horizon, "batch_size": sm.batch_size, "batches_per_epoch": len(sm),
                "camera_map": dict(sm.camera_map), "state_key": sm.state_key, "action_key": sm.action_key,
                "epoch": d.epoch, "next_batch": d.next_batch, "samples": d.counters.samples,
                "created": d.created, "last_used": d.last_used, "idle_timeout_s": d.idle_timeout_s}


def close_quietly(obj) -> None:
    close = getattr(obj, "close", None)  # readers that hold no open files have nothing to close
    if close is None:
        return
    try:
        close()
    except Exception:  # noqa: BLE001 - closing must not fail the caller
        log.exception("environment service: closing %s failed", type(obj).__name__)
