"""What every dataset reader gives the chunk sampler: episodes of frames with numeric features, cameras
and a task (`EpisodeDataset`, implemented by the LeRobot and HDF5 readers), and the byte-bounded cache of
decoded frames they share."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import cachetools
import numpy as np

from vlamux.data.errors import MissingKeyError
from vlamux.data.lerobot_format import CAMERA_DTYPES, _have

class ByteLRU:
    """A thread-safe LRU cache bounded by the total `nbytes` of its numpy values (cachetools' LRU
    cache, sized by bytes, behind a lock); `hits` and `misses` count lookups."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._items = cachetools.LRUCache(maxsize=self.max_bytes, getsizeof=_nbytes)
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key):
        with self._lock:
            value = self._items.get(key)
            if value is None:
                self.misses += 1
            else:
                self.hits += 1
            return value

    def put(self, key, value: np.ndarray) -> None:
        with self._lock:
            self._items.pop(key, None)
            if _nbytes(value) <= self.max_bytes:  # larger than the whole budget: hand it out, keep nothing
                self._items[key] = value

    @property
    def nbytes(self) -> int:
        return int(self._items.currsize)

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


def _nbytes(value) -> int:
    return int(getattr(value, "nbytes", 0))


class EpisodeDataset:
    """What the chunk sampler reads: episodes of frames with numeric features, cameras and a task.

    Subclasses fill `features`, `stats`, `fps` and the episode accessors.
    """

    features: dict[str, dict]
    fps: float
    source: str  # what to name in error messages (a path)
    stats_source: str  # where statistics come from, for error messages

    # accessors a subclass implements
    @property
    def num_episodes(self) -> int:
        raise NotImplementedError

    def episode_length(self, i: int) -> int:
        raise NotImplementedError

    def episode_array(self, i: int, key: str) -> np.ndarray:
        """A non-camera feature of episode i, [T, ...]."""
        raise NotImplementedError

    def episode_images(self, i: int, key: str) -> np.ndarray:
        """A camera of episode i, uint8 [T, H, W, 3]."""
        raise NotImplementedError

    def frame_tasks(self, i: int) -> list[str]:
        """The task (instruction) of each frame of episode i."""
        raise NotImplementedError

    @property
    def stats(self) -> dict[str, dict[str, np.ndarray]]:
        raise NotImplementedError

    # shared
    @property
    def num_frames(self) -> int:
        return sum(self.episode_length(i) for i in range(self.num_episodes))

    @property
    def camera_keys(self) -> list[str]:
        return [k for k, ft in self.features.items() if ft.get("dtype") in CAMERA_DTYPES]

    def feature(self, key: str) -> dict:
        if key not in self.features:
            raise MissingKeyError(f"{self.source}: no feature {key!r} (features: {_have(self.features)})")
        return self.features[key]

    def is_camera(self, key: str) -> bool:
        return self.feature(key).get("dtype") in CAMERA_DTYPES

    def stat(self, key: str) -> dict[str, np.ndarray]:
        stats = self.stats
        if key not in stats:
            raise MissingKeyError(f"{self.stats_source} has no {key!r} entry (it has: {_have(stats)})")
        return stats[key]

    def norm_stats(self, key: str, mode: str = "mean_std"):
        """The statistics of a numeric feature as the model core's `NormStats` (flattened to [D])."""
        import torch

        from vlamux.model.normalize import NormStats

        entry = self.stat(key)
        missing = [f for f in ("mean", "std", "min", "max") if f not in entry]
        if missing:
            raise MissingKeyError(f"{self.stats_source}[{key!r}] has no {_have(missing)} (it has: {_have(entry)})")
        t = [torch.as_tensor(np.asarray(entry[f], dtype=np.float32).reshape(-1)) for f in ("mean", "std", "min", "max")]
        return NormStats(*t, mode=mode)

    def episode(self, i: int) -> Episode:
        """Episode i: its non-camera features as arrays [T, ...]; cameras through `Episode.images`."""
        i = self._check_episode(i)
        data = {k: self.episode_array(i, k) for k, ft in self.features.items() if ft.get("dtype") not in CAMERA_DTYPES}
        return Episode(i, self.episode_length(i), self.frame_tasks(i)[0], data, self)

    def _check_episode(self, i: int) -> int:
        if not isinstance(i, (int, np.integer)) or not 0 <= i < self.num_episodes:
            raise IndexError(f"{self.source}: episode {i!r} out of range [0, {self.num_episodes})")
        return int(i)


@dataclass(frozen=True)
class VideoSegment:
    path: str  # relative to the dataset root
    from_timestamp: float
    to_timestamp: float


@dataclass(frozen=True)
class EpisodeInfo:
    index: int
    length: int
    tasks: tuple[str, ...]
    dataset_from_index: int
    dataset_to_index: int
    data_path: str  # relative to the dataset root
    videos: dict[str, VideoSegment] = field(default_factory=dict)


@dataclass
class Episode:
    """One episode: non-camera columns as arrays [T, ...]; cameras decoded on demand."""

    index: int
    length: int
    task: str
    data: dict[str, np.ndarray]
    _dataset: EpisodeDataset = field(repr=False)

    def images(self, key: str) -> np.ndarray:
        """uint8 [T, H, W, 3]."""
        return self._dataset.episode_images(self.index, key)
