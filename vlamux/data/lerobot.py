"""LeRobot datasets on local disk: a v3.0 writer, and readers for v3.0 and v2.1 (v2.0).

The layout follows LeRobot's own code (`lerobot.datasets`, tags v0.4.x-v0.6.x,
`CODEBASE_VERSION = "v3.0"`) and its v3.0 announcement; docs/DATASETS.md
summarises it. Nothing here imports `lerobot` or touches the network.

v3.0 on disk (`{...}` are LeRobot's path templates, stored in meta/info.json):

    meta/info.json                  codebase_version, fps, features, totals, path templates
    meta/stats.json                 per feature: min/max/mean/std/count (+ q01..q99)
    meta/tasks.parquet              pandas frame: index "task" (the string), column task_index
    meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet
                                    one row per episode: episode_index, tasks, length,
                                    data/{chunk,file}_index, dataset_{from,to}_index,
                                    videos/{key}/{chunk_index,file_index,from_timestamp,to_timestamp},
                                    stats/{feature}/{stat}, meta/episodes/{chunk,file}_index
    data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet
                                    one row per frame, many episodes per file
    videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4
                                    many episodes per file, back to back; an episode's frames
                                    are at from_timestamp + its `timestamp` column

This module also holds what the HDF5 reader shares (errors, statistics, the
episode-dataset base class, the decoded-frame cache).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vlamux.errors import VlamuxError

# ---- constants of the format (LeRobot's names) ---------------------------------------------------

CODEBASE_VERSION = "v3.0"
LEGACY_VERSIONS = ("v2.0", "v2.1")

DEFAULT_CHUNK_SIZE = 1000  # max files per chunk directory
DEFAULT_DATA_FILE_SIZE_IN_MB = 100
DEFAULT_VIDEO_FILE_SIZE_IN_MB = 200

INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"
EPISODES_DIR = "meta/episodes"
CHUNK_FILE_PATTERN = "chunk-{chunk_index:03d}/file-{file_index:03d}"
EPISODES_PATH = EPISODES_DIR + "/" + CHUNK_FILE_PATTERN + ".parquet"
DATA_PATH = "data/" + CHUNK_FILE_PATTERN + ".parquet"
VIDEO_PATH = "videos/{video_key}/" + CHUNK_FILE_PATTERN + ".mp4"

# v2.x (one file per episode, JSON-lines metadata)
LEGACY_EPISODES_PATH = "meta/episodes.jsonl"
LEGACY_EPISODES_STATS_PATH = "meta/episodes_stats.jsonl"
LEGACY_TASKS_PATH = "meta/tasks.jsonl"
LEGACY_DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
LEGACY_VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"

# Columns every frame carries; the writer fills them in.
DEFAULT_FEATURES = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}
DEFAULT_QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
CAMERA_DTYPES = ("video", "image")
_NUMERIC_DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
                   "uint32", "uint64", "bool")


# ---- errors ---------------------------------------------------------------------------------------

class DatasetError(VlamuxError):
    """Base class of offline-dataset errors."""


class DatasetFormatError(DatasetError, ValueError):
    """A dataset on disk does not follow its format; the message names the file and the field."""


class MissingKeyError(DatasetError, KeyError):
    """A feature or statistic a caller needs is not in the dataset; the message names it."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "missing key"


def _have(keys) -> str:
    keys = sorted(keys)
    return ", ".join(repr(k) for k in keys) if keys else "nothing"


# ---- statistics (LeRobot's conventions) -----------------------------------------------------------

def feature_stats(x: np.ndarray) -> dict[str, np.ndarray]:
    """min/max/mean/std/count and quantiles over the first axis of x [N, ...]; scalars get shape (1,)."""
    x = np.asarray(x)
    if x.ndim == 1:
        x = x[:, None]
    out = {"min": x.min(0), "max": x.max(0)}  # in the feature's dtype, as LeRobot stores them
    x = x.astype(np.float64)
    out.update(mean=x.mean(0), std=x.std(0), count=np.array([x.shape[0]], dtype=np.int64))
    qs = np.quantile(x, DEFAULT_QUANTILES, axis=0)
    for q, v in zip(DEFAULT_QUANTILES, qs):
        out[f"q{int(round(q * 100)):02d}"] = v
    return out


def sample_indices(n: int) -> np.ndarray:
    """LeRobot's frame sampling for image statistics (100 frames up to ~500, then n**0.75, max 10k)."""
    num = max(min(100, n), min(int(n ** 0.75), 10_000))
    return np.round(np.linspace(0, n - 1, num)).astype(int)


def image_stats(frames: np.ndarray) -> dict[str, np.ndarray]:
    """Per-channel statistics of uint8 frames [T, H, W, 3], scaled to [0, 1], each of shape (3, 1, 1)."""
    sample = frames[sample_indices(len(frames))]
    h, w = sample.shape[1:3]
    if max(h, w) >= 300:  # LeRobot downsamples large images before computing statistics
        step = int(max(h, w) / 150)
        sample = sample[:, ::step, ::step]
    flat = sample.reshape(-1, sample.shape[-1]) / 255.0
    out = feature_stats(flat)
    out = {k: (v if k == "count" else v.reshape(-1, 1, 1)) for k, v in out.items()}
    out["count"] = np.array([len(sample)], dtype=np.int64)
    return out


def aggregate_stats(per_episode: Sequence[Mapping[str, Mapping[str, np.ndarray]]]) -> dict:
    """LeRobot's aggregation: count-weighted mean, pooled variance, min of mins, count-weighted quantiles."""
    keys = sorted({k for s in per_episode for k in s})
    out = {}
    for key in keys:
        items = [s[key] for s in per_episode if key in s]
        counts = np.stack([np.asarray(s["count"], dtype=np.float64).reshape(-1)[:1] for s in items])  # [E, 1]
        means = np.stack([np.asarray(s["mean"], dtype=np.float64) for s in items])
        total = counts.sum()
        w = counts.reshape((-1,) + (1,) * (means.ndim - 1))
        mean = (means * w).sum(0) / total
        var = ((np.stack([np.asarray(s["std"], dtype=np.float64) ** 2 for s in items]) + (means - mean) ** 2)
               * w).sum(0) / total
        agg = {"min": np.min(np.stack([np.asarray(s["min"]) for s in items]), 0),
               "max": np.max(np.stack([np.asarray(s["max"]) for s in items]), 0),
               "mean": mean, "std": np.sqrt(var), "count": np.array([int(total)], dtype=np.int64)}
        for q in [k for k in items[0] if k.startswith("q") and k[1:].isdigit()]:
            if all(q in s for s in items):
                agg[q] = (np.stack([np.asarray(s[q], dtype=np.float64) for s in items]) * w).sum(0) / total
        out[key] = agg
    return out


def _jsonable(stats: Mapping[str, Mapping[str, np.ndarray]]) -> dict:
    return {k: {s: np.asarray(v).tolist() for s, v in d.items()} for k, d in stats.items()}


def _as_arrays(stats: Mapping[str, Any]) -> dict[str, dict[str, np.ndarray]]:
    return {k: {s: np.asarray(v) for s, v in d.items()} for k, d in stats.items() if isinstance(d, Mapping)}


# ---- small utilities ------------------------------------------------------------------------------

class ByteLRU:
    """A thread-safe LRU cache bounded by the total `nbytes` of its numpy values."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._items: OrderedDict = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key):
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key]
            self.misses += 1
            return None

    def put(self, key, value: np.ndarray) -> None:
        size = int(getattr(value, "nbytes", 0))
        with self._lock:
            if key in self._items:
                self._bytes -= int(getattr(self._items.pop(key), "nbytes", 0))
            if size > self.max_bytes:
                return  # larger than the whole budget: hand it out, keep nothing
            self._items[key] = value
            self._bytes += size
            while self._bytes > self.max_bytes and self._items:
                _, old = self._items.popitem(last=False)
                self._bytes -= int(getattr(old, "nbytes", 0))

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0


def _write_json_atomic(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=4, ensure_ascii=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_json(path: Path) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise DatasetFormatError(f"{path}: file missing") from None
    except json.JSONDecodeError as e:
        raise DatasetFormatError(f"{path}: not valid JSON ({e})") from None


def _read_jsonl(path: Path) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        raise DatasetFormatError(f"{path}: file missing") from None
    except json.JSONDecodeError as e:
        raise DatasetFormatError(f"{path}: not valid JSON lines ({e})") from None


def _column_to_numpy(col: pa.ChunkedArray | pa.Array, shape: Sequence[int] | None) -> np.ndarray:
    """A (possibly nested-list) numeric arrow column as an array [N, *shape] ([N] for scalars)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    n = len(arr)
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        return np.array(arr.to_pylist(), dtype=object)
    depth = 0
    while (pa.types.is_list(arr.type) or pa.types.is_fixed_size_list(arr.type)
           or pa.types.is_large_list(arr.type)):
        arr = arr.flatten()
        depth += 1
    values = arr.to_numpy(zero_copy_only=False)
    if depth == 0:
        return values
    if shape is not None and n * int(np.prod(shape)) == values.size:
        return values.reshape(n, *shape)
    return values.reshape(n, -1)


def _decode_png_column(col: pa.ChunkedArray, root: Path) -> np.ndarray:
    """An inline-image column (HF `Image`: struct<bytes, path>) as uint8 [N, H, W, 3]."""
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - Pillow ships with most installs
        raise DatasetError("reading 'image' features needs Pillow (pip install pillow)") from e
    out = []
    for cell in col.to_pylist():
        if cell is None:
            raise DatasetFormatError("an 'image' cell is empty")
        data = cell.get("bytes") if isinstance(cell, dict) else cell
        if data is None:
            with Image.open(root / cell["path"]) as im:
                out.append(np.asarray(im.convert("RGB")))
        else:
            with Image.open(io.BytesIO(data)) as im:
                out.append(np.asarray(im.convert("RGB")))
    return np.stack(out) if out else np.zeros((0, 0, 0, 3), np.uint8)


def decode_video_segment(path: Path, timestamps: Sequence[float], tolerance_s: float) -> np.ndarray:
    """Frames of an mp4 nearest to each timestamp (seconds in the file), as uint8 [N, H, W, 3].

    Seeks to the keyframe before the first timestamp and decodes forward past the last one (as
    LeRobot's pyav backend does); every timestamp must have a frame within `tolerance_s`.
    """
    import av

    ts = np.asarray(timestamps, dtype=np.float64)
    first, last = float(ts.min()), float(ts.max())
    frames, got = [], []
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            if first > 0:
                container.seek(max(0, int(first / stream.time_base) - 1), backward=True, any_frame=False,
                               stream=stream)
            for frame in container.decode(stream):
                if frame.pts is None:
                    continue
                t = float(frame.pts * frame.time_base)
                if t < first - tolerance_s:
                    continue
                frames.append(frame.to_ndarray(format="rgb24"))
                got.append(t)
                if t >= last - tolerance_s:
                    break
    except FileNotFoundError:
        raise DatasetFormatError(f"{path}: video file missing") from None
    except av.error.FFmpegError as e:
        raise DatasetFormatError(f"{path}: cannot decode ({e})") from None
    if not frames:
        raise DatasetFormatError(f"{path}: no frames decoded in [{first:.4f}, {last:.4f}] s")
    got = np.asarray(got)
    nearest = np.abs(ts[:, None] - got[None, :]).argmin(1)
    err = np.abs(got[nearest] - ts)
    if (err > tolerance_s).any():
        bad = int(err.argmax())
        raise DatasetFormatError(
            f"{path}: no frame within {tolerance_s} s of t={ts[bad]:.6f} s (nearest {got[nearest[bad]]:.6f} s)")
    return np.stack([frames[i] for i in nearest])


# ---- base class shared by the readers -------------------------------------------------------------

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


# ---- reader ---------------------------------------------------------------------------------------

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


class LeRobotDataset(EpisodeDataset):
    """A local LeRobot dataset, v3.0 or v2.1 (v2.0), read with pyarrow and PyAV.

    Video frames are decoded per (episode, camera), the whole episode at once, and kept in an LRU
    cache of `video_cache_mb`; size it to the decoded dataset for random-access training or
    sampling will decode episodes repeatedly. `tolerance_s` is LeRobot's: a frame's timestamp must
    match a decoded video frame to within it.
    """

    def __init__(self, root: str | Path, *, tolerance_s: float = 1e-4, video_cache_mb: float = 512,
                 data_cache_mb: float = 256):
        self.root = Path(root)
        self.source = str(self.root)
        if not (self.root / INFO_PATH).is_file():
            raise DatasetFormatError(f"{self.root}: no {INFO_PATH}; not a LeRobot dataset")
        self.info = _read_json(self.root / INFO_PATH)
        for req in ("codebase_version", "fps", "features"):
            if req not in self.info:
                raise DatasetFormatError(f"{self.root / INFO_PATH}: no {req!r} field")
        self.version = str(self.info["codebase_version"])
        if self.version != CODEBASE_VERSION and self.version not in LEGACY_VERSIONS:
            raise DatasetFormatError(f"{self.root / INFO_PATH}: codebase_version {self.version!r} is not supported "
                                     f"(reads {CODEBASE_VERSION} and {', '.join(LEGACY_VERSIONS)})")
        self.fps = self.info["fps"]
        self.features = self.info["features"]
        self.robot_type = self.info.get("robot_type")
        self.tolerance_s = float(tolerance_s)
        self._frames = ByteLRU(int(video_cache_mb * 2 ** 20))
        self._columns = ByteLRU(int(data_cache_mb * 2 ** 20))
        self._stats: dict | None = None
        if self.version == CODEBASE_VERSION:
            self.stats_source = f"{self.root / STATS_PATH}"
            self.tasks = self._load_tasks_v3()
            self.episodes = self._load_episodes_v3()
        else:
            self.stats_source = (f"{self.root / STATS_PATH}" if (self.root / STATS_PATH).is_file()
                                 else f"{self.root / LEGACY_EPISODES_STATS_PATH}")
            self.tasks = self._load_tasks_v2()
            self.episodes = self._load_episodes_v2()
        total = self.info.get("total_episodes")
        if total is not None and total != len(self.episodes):
            raise DatasetFormatError(f"{self.root / INFO_PATH}: total_episodes is {total} but the episode "
                                     f"metadata lists {len(self.episodes)}")
        self._starts = np.cumsum([0] + [e.length for e in self.episodes])

    # ---- metadata ----
    def _load_tasks_v3(self) -> list[str]:
        path = self.root / TASKS_PATH
        if not path.is_file():
            raise DatasetFormatError(f"{path}: file missing")
        t = pq.read_table(path)
        names = t.column_names
        text_col = "task" if "task" in names else "__index_level_0__" if "__index_level_0__" in names else None
        if "task_index" not in names or text_col is None:
            raise DatasetFormatError(f"{path}: expected a 'task' index and a 'task_index' column, got {names}")
        return self._task_list(t.column("task_index").to_pylist(), t.column(text_col).to_pylist(), path)

    def _load_tasks_v2(self) -> list[str]:
        path = self.root / LEGACY_TASKS_PATH
        rows = _read_jsonl(path)
        return self._task_list([r["task_index"] for r in rows], [r["task"] for r in rows], path)

    @staticmethod
    def _task_list(indices, texts, path) -> list[str]:
        out: list[str | None] = [None] * (max(indices) + 1 if indices else 0)
        for i, s in zip(indices, texts):
            out[int(i)] = s
        if any(s is None for s in out):
            raise DatasetFormatError(f"{path}: task indices are not contiguous from 0: {sorted(indices)}")
        return out  # type: ignore[return-value]

    def _load_episodes_v3(self) -> list[EpisodeInfo]:
        files = sorted((self.root / EPISODES_DIR).glob("chunk-*/file-*.parquet"))
        if not files:
            raise DatasetFormatError(f"{self.root / EPISODES_DIR}: no episode metadata files "
                                     f"({EPISODES_PATH.format(chunk_index=0, file_index=0)} expected)")
        rows = []
        for f in files:
            cols = [c for c in pq.read_schema(f).names if not c.startswith("stats/")]
            rows.extend(pq.read_table(f, columns=cols).to_pylist())
        rows.sort(key=lambda r: r["episode_index"])
        data_tpl = self.info.get("data_path", DATA_PATH)
        video_tpl = self.info.get("video_path") or VIDEO_PATH
        video_keys = [k for k, ft in self.features.items() if ft.get("dtype") == "video"]
        out = []
        for pos, r in enumerate(rows):
            where = f"{self.root / EPISODES_DIR} (episode {r.get('episode_index')})"
            if r["episode_index"] != pos:
                raise DatasetFormatError(f"{where}: episode indices are not 0..N-1")
            try:
                videos = {k: VideoSegment(video_tpl.format(video_key=k, chunk_index=r[f"videos/{k}/chunk_index"],
                                                           file_index=r[f"videos/{k}/file_index"]),
                                          float(r[f"videos/{k}/from_timestamp"]), float(r[f"videos/{k}/to_timestamp"]))
                          for k in video_keys}
                out.append(EpisodeInfo(
                    index=pos, length=int(r["length"]), tasks=tuple(r.get("tasks") or ()),
                    dataset_from_index=int(r["dataset_from_index"]), dataset_to_index=int(r["dataset_to_index"]),
                    data_path=data_tpl.format(chunk_index=r["data/chunk_index"], file_index=r["data/file_index"]),
                    videos=videos))
            except KeyError as e:
                raise DatasetFormatError(f"{where}: no column {e.args[0]!r}") from None
        return out

    def _load_episodes_v2(self) -> list[EpisodeInfo]:
        rows = sorted(_read_jsonl(self.root / LEGACY_EPISODES_PATH), key=lambda r: r["episode_index"])
        chunks = int(self.info.get("chunks_size", DEFAULT_CHUNK_SIZE))
        data_tpl = self.info.get("data_path", LEGACY_DATA_PATH)
        video_tpl = self.info.get("video_path") or LEGACY_VIDEO_PATH
        video_keys = [k for k, ft in self.features.items() if ft.get("dtype") == "video"]
        out, start = [], 0
        for r in rows:
            ep, n = int(r["episode_index"]), int(r["length"])
            chunk = ep // chunks
            videos = {k: VideoSegment(video_tpl.format(episode_chunk=chunk, video_key=k, episode_index=ep), 0.0,
                                      n / self.fps) for k in video_keys}
            out.append(EpisodeInfo(ep, n, tuple(r.get("tasks") or ()), start, start + n,
                                   data_tpl.format(episode_chunk=chunk, episode_index=ep), videos))
            start += n
        if [e.index for e in out] != list(range(len(out))):
            raise DatasetFormatError(f"{self.root / LEGACY_EPISODES_PATH}: episode indices are not 0..N-1")
        return out

    @property
    def stats(self) -> dict[str, dict[str, np.ndarray]]:
        if self._stats is None:
            path = self.root / STATS_PATH
            if path.is_file():
                self._stats = _as_arrays(_read_json(path))
            elif self.version != CODEBASE_VERSION and (self.root / LEGACY_EPISODES_STATS_PATH).is_file():
                rows = _read_jsonl(self.root / LEGACY_EPISODES_STATS_PATH)
                self._stats = aggregate_stats([_as_arrays(r["stats"]) for r in rows])
            else:
                raise MissingKeyError(f"{self.root}: no {STATS_PATH}" + (
                    "" if self.version == CODEBASE_VERSION else f" and no {LEGACY_EPISODES_STATS_PATH}"))
        return self._stats

    @property
    def num_episodes(self) -> int:
        return len(self.episodes)

    @property
    def num_frames(self) -> int:
        return int(self._starts[-1])

    @property
    def video_keys(self) -> list[str]:
        return [k for k, ft in self.features.items() if ft.get("dtype") == "video"]

    @property
    def image_keys(self) -> list[str]:
        return [k for k, ft in self.features.items() if ft.get("dtype") == "image"]

    def episode_length(self, i: int) -> int:
        return self.episodes[self._check_episode(i)].length

    # ---- frame data ----
    def _episode_columns(self, i: int) -> dict[str, np.ndarray]:
        """Every parquet column of episode i (inline images decoded)."""
        i = self._check_episode(i)
        key = ("episode", i)
        cached = self._columns.get(key)
        if cached is not None:
            return cached.cols
        ep = self.episodes[i]
        path = self.root / ep.data_path
        if not path.is_file():
            raise DatasetFormatError(f"{path}: data file of episode {i} missing")
        try:
            if "episode_index" in pq.read_schema(path).names:
                table = pq.read_table(path, filters=[("episode_index", "=", i)])
            else:  # one episode per file (v2.x) without the column
                table = pq.read_table(path)
        except (pa.ArrowInvalid, OSError) as e:
            raise DatasetFormatError(f"{path}: cannot read ({e})") from None
        if table.num_rows != ep.length:
            raise DatasetFormatError(f"{path}: episode {i} has {table.num_rows} rows, its metadata says {ep.length}")
        if "frame_index" in table.column_names:
            order = np.argsort(table.column("frame_index").to_numpy(), kind="stable")
            if (order != np.arange(len(order))).any():
                table = table.take(pa.array(order))
        cols = {}
        for name in table.column_names:
            ft = self.features.get(name, {})
            if ft.get("dtype") == "image":
                cols[name] = _decode_png_column(table.column(name), self.root)
            else:
                cols[name] = _column_to_numpy(table.column(name), ft.get("shape"))
        self._columns.put(key, _Cols(cols))
        return cols

    def episode_data(self, i: int) -> dict[str, np.ndarray]:
        """Non-camera columns of episode i, each [T, ...] ([T] for scalars)."""
        return {k: v for k, v in self._episode_columns(i).items() if self.features.get(k, {}).get("dtype") != "image"}

    def episode_array(self, i: int, key: str) -> np.ndarray:
        ft = self.feature(key)
        if ft.get("dtype") in CAMERA_DTYPES:
            raise DatasetError(f"{self.source}: {key!r} is a camera; use episode_images")
        cols = self._episode_columns(i)
        if key not in cols:
            raise DatasetFormatError(f"{self.root / self.episodes[i].data_path}: no column {key!r}")
        return cols[key]

    def episode_images(self, i: int, key: str) -> np.ndarray:
        i = self._check_episode(i)
        dtype = self.feature(key).get("dtype")
        if dtype == "image":
            cols = self._episode_columns(i)
            if key not in cols:
                raise DatasetFormatError(f"{self.root / self.episodes[i].data_path}: no column {key!r}")
            return cols[key]
        if dtype != "video":
            raise DatasetError(f"{self.source}: {key!r} is not a camera (dtype {dtype!r})")
        cached = self._frames.get((i, key))
        if cached is not None:
            return cached
        ep = self.episodes[i]
        seg = ep.videos[key]
        cols = self._episode_columns(i)
        rel = cols["timestamp"] if "timestamp" in cols else np.arange(ep.length) / self.fps
        frames = decode_video_segment(self.root / seg.path, seg.from_timestamp + np.asarray(rel, np.float64),
                                      self.tolerance_s)
        frames.setflags(write=False)
        self._frames.put((i, key), frames)
        return frames

    def frame_tasks(self, i: int) -> list[str]:
        cols = self._episode_columns(i)
        if "task_index" in cols:
            try:
                return [self.tasks[int(t)] for t in cols["task_index"]]
            except IndexError:
                raise DatasetFormatError(f"{self.root / self.episodes[i].data_path}: a task_index of episode {i} "
                                         f"is not in the task table ({len(self.tasks)} tasks)") from None
        tasks = self.episodes[i].tasks
        if not tasks:
            raise DatasetFormatError(f"{self.source}: episode {i} has neither task_index nor tasks")
        return [tasks[0]] * self.episodes[i].length

    def episode(self, i: int) -> Episode:
        """Episode i: every parquet column but the cameras ([T, ...]); cameras through `Episode.images`."""
        i = self._check_episode(i)
        return Episode(i, self.episodes[i].length, self.frame_tasks(i)[0], self.episode_data(i), self)

    def __len__(self) -> int:
        return self.num_frames

    def __getitem__(self, idx: int) -> dict[str, Any]:
        """Frame `idx` of the whole dataset: its columns, its cameras (uint8 [H, W, 3]) and "task"."""
        if not -self.num_frames <= idx < self.num_frames:
            raise IndexError(f"{self.source}: frame {idx} out of range [0, {self.num_frames})")
        idx %= self.num_frames
        ep = int(np.searchsorted(self._starts, idx, side="right") - 1)
        t = idx - int(self._starts[ep])
        out: dict[str, Any] = {k: v[t] for k, v in self.episode_data(ep).items()}
        for key in self.camera_keys:
            out[key] = self.episode_images(ep, key)[t]
        out["task"] = self.frame_tasks(ep)[t]
        return out


@dataclass
class _Cols:
    """A cache entry holding one episode's columns; nbytes lets the LRU account for it."""

    cols: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(int(getattr(v, "nbytes", 0)) for v in self.cols.values())


# ---- writer ---------------------------------------------------------------------------------------

class _VideoFile:
    """One open mp4 of one camera, episodes appended back to back."""

    def __init__(self, path: Path, fps: int, width: int, height: int, codec: str, pix_fmt: str,
                 options: dict[str, str]):
        import av

        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.container = av.open(str(path), "w")
        self.stream = self.container.add_stream(codec, rate=fps, options=options)
        self.stream.pix_fmt = pix_fmt
        self.stream.width, self.stream.height = width, height
        self.time_base = Fraction(1, fps)
        self.frames = 0
        self.bytes = 0  # of the packets muxed so far (the file on disk lags behind the muxer)

    def add(self, images: np.ndarray) -> None:
        import av

        for img in images:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
            frame.pts, frame.time_base = self.frames, self.time_base
            for packet in self.stream.encode(frame):
                self.bytes += packet.size
                self.container.mux(packet)
            self.frames += 1

    def size_mb(self) -> float:
        return self.bytes / 2 ** 20

    def close(self) -> None:
        for packet in self.stream.encode():
            self.container.mux(packet)
        self.container.close()


def _next_file(chunk: int, file: int, chunks_size: int) -> tuple[int, int]:
    return (chunk + 1, 0) if file == chunks_size - 1 else (chunk, file + 1)


class LeRobotWriter:
    """Write a LeRobot v3.0 dataset, one episode at a time.

    features: LeRobot feature specs, e.g. {"observation.state": {"dtype": "float32", "shape": [4]},
    "observation.images.top": {"dtype": "video", "shape": [H, W, 3]}, "action": {...}}. Numeric features
    have shape [] / [1] (a scalar) or [D]; "video" features are encoded to mp4 (lossy: libx264,
    yuv420p, `crf`; H and W must be even), "image" features are stored inline as PNG (lossless).
    The per-frame columns timestamp, frame_index, episode_index, index and task_index are added.

    Everything is written under a staging directory next to `root`, which `finalize()` renames to
    `root`: a reader sees the whole dataset or none of it. Use as a context manager to finalize on
    success and discard the staging directory on an exception.
    """

    def __init__(self, root: str | Path, fps: int, features: Mapping[str, Mapping], robot_type: str | None = None,
                 *, codec: str = "libx264", pix_fmt: str = "yuv420p", crf: int = 18, gop: int = 2,
                 encoder_threads: int = 1, chunks_size: int = DEFAULT_CHUNK_SIZE,
                 data_files_size_in_mb: float = DEFAULT_DATA_FILE_SIZE_IN_MB,
                 video_files_size_in_mb: float = DEFAULT_VIDEO_FILE_SIZE_IN_MB, overwrite: bool = False):
        self.root = Path(root)
        if not isinstance(fps, int) or fps <= 0:
            raise DatasetError(f"fps: expected a positive int, got {fps!r}")
        if self.root.exists() and any(self.root.iterdir()) and not overwrite:
            raise DatasetError(f"{self.root}: exists and is not empty (pass overwrite=True to replace it)")
        self.fps, self.robot_type = fps, robot_type
        self.features = self._check_features(features)
        self.codec, self.pix_fmt = codec, pix_fmt
        self.video_options = {"crf": str(crf), "g": str(gop), "threads": str(encoder_threads)}
        if codec not in ("libx264", "h264", "libx265", "hevc"):
            self.video_options = {"g": str(gop), "threads": str(encoder_threads)}
        self.chunks_size = int(chunks_size)
        self.data_mb, self.video_mb = float(data_files_size_in_mb), float(video_files_size_in_mb)
        self.overwrite = overwrite
        self.root.parent.mkdir(parents=True, exist_ok=True)
        self.stage = self.root.parent / f".{self.root.name}.writing-{uuid.uuid4().hex[:8]}"
        self.stage.mkdir()
        self._tasks: dict[str, int] = {}
        self._episodes: list[dict] = []
        self._numeric: dict[str, list[np.ndarray]] = {k: [] for k, ft in self._all_features().items()
                                                      if ft["dtype"] in _NUMERIC_DTYPES}
        self._image_stats: dict[str, list[dict]] = {k: [] for k in self.camera_keys}
        self._data_writer: pq.ParquetWriter | None = None
        self._data_loc = (0, 0)
        self._data_frames_in_file = 0
        self._videos: dict[str, _VideoFile] = {}
        self._video_loc: dict[str, tuple[int, int]] = {}
        self._video_info: dict[str, dict] = {}
        self._frames = 0
        self._closed = False

    # ---- features ----
    @staticmethod
    def _check_features(features: Mapping[str, Mapping]) -> dict[str, dict]:
        out = {}
        for key, ft in features.items():
            if key in DEFAULT_FEATURES or key == "task":
                raise DatasetError(f"features[{key!r}]: reserved, the writer fills it in")
            if "/" in key:
                raise DatasetError(f"features[{key!r}]: '/' is not allowed in a feature name")
            dtype = ft.get("dtype")
            shape = list(ft.get("shape", []))
            if dtype in CAMERA_DTYPES:
                if len(shape) != 3 or shape[2] != 3:
                    raise DatasetError(f"features[{key!r}]: a camera needs shape [H, W, 3], got {shape}")
                out[key] = {"dtype": dtype, "shape": shape,
                            "names": list(ft.get("names") or ["height", "width", "channels"])}
            elif dtype in _NUMERIC_DTYPES or dtype == "string":
                if len(shape) > 1:
                    raise DatasetError(f"features[{key!r}]: shape {shape}: only scalars and vectors are supported")
                out[key] = {"dtype": dtype, "shape": shape or [1], "names": ft.get("names")}
            else:
                raise DatasetError(f"features[{key!r}]: dtype {dtype!r} not supported "
                                   f"(one of {', '.join(_NUMERIC_DTYPES + CAMERA_DTYPES + ('string',))})")
        return out

    def _all_features(self) -> dict[str, dict]:
        return {**self.features, **{k: dict(v) for k, v in DEFAULT_FEATURES.items()}}

    @property
    def camera_keys(self) -> list[str]:
        return [k for k, ft in self.features.items() if ft["dtype"] in CAMERA_DTYPES]

    @property
    def video_keys(self) -> list[str]:
        return [k for k, ft in self.features.items() if ft["dtype"] == "video"]

    @property
    def num_episodes(self) -> int:
        return len(self._episodes)

    # ---- episodes ----
    def add_episode(self, frames: Mapping[str, Any], task: str) -> int:
        """Append one episode: every feature as an array of T frames; returns its episode index."""
        if self._closed:
            raise DatasetError(f"{self.root}: writer already finalized or aborted")
        if not isinstance(task, str) or not task:
            raise DatasetError("task: expected a non-empty string")
        arrays = self._check_frames(frames)
        ep = len(self._episodes)
        t = len(next(iter(arrays.values())))
        task_index = self._tasks.setdefault(task, len(self._tasks))
        cols = dict(arrays)
        cols["timestamp"] = (np.arange(t) / self.fps).astype(np.float32)
        cols["frame_index"] = np.arange(t, dtype=np.int64)
        cols["episode_index"] = np.full(t, ep, dtype=np.int64)
        cols["index"] = np.arange(self._frames, self._frames + t, dtype=np.int64)
        cols["task_index"] = np.full(t, task_index, dtype=np.int64)

        meta: dict[str, Any] = {"episode_index": ep, "tasks": [task], "length": t}
        meta.update(self._write_data(cols, t))
        for key in self.video_keys:
            meta.update(self._write_video(key, arrays[key]))
        ep_stats = {}
        for key, ft in self._all_features().items():
            if ft["dtype"] in _NUMERIC_DTYPES:
                ep_stats[key] = feature_stats(cols[key])
                self._numeric[key].append(cols[key])
            elif ft["dtype"] in CAMERA_DTYPES:
                ep_stats[key] = image_stats(arrays[key])
                self._image_stats[key].append(ep_stats[key])
        for key, st in ep_stats.items():
            for name, v in st.items():
                meta[f"stats/{key}/{name}"] = np.asarray(v).tolist()
        meta["meta/episodes/chunk_index"], meta["meta/episodes/file_index"] = 0, 0
        self._episodes.append(meta)
        self._frames += t
        return ep

    def _check_frames(self, frames: Mapping[str, Any]) -> dict[str, np.ndarray]:
        extra = set(frames) - set(self.features)
        missing = set(self.features) - set(frames)
        if extra or missing:
            raise DatasetError(f"frames: keys differ from the features: missing {_have(missing)}, "
                               f"unexpected {_have(extra)}")
        out, lengths = {}, {}
        for key, ft in self.features.items():
            v = frames[key]
            if hasattr(v, "detach"):  # a torch tensor
                v = v.detach().cpu().numpy()
            if ft["dtype"] == "string":
                a = np.asarray(list(v), dtype=object)
            else:
                a = np.asarray(v)
            if a.ndim == 0:
                raise DatasetError(f"frames[{key!r}]: expected an array of T frames, got a scalar")
            lengths[key] = a.shape[0]
            if ft["dtype"] in CAMERA_DTYPES:
                if a.dtype != np.uint8 or a.ndim != 4 or list(a.shape[1:]) != ft["shape"]:
                    raise DatasetError(f"frames[{key!r}]: expected uint8 [T, {', '.join(map(str, ft['shape']))}], "
                                       f"got {a.dtype} {list(a.shape)}")
                if ft["dtype"] == "video" and self.pix_fmt == "yuv420p" and (a.shape[1] % 2 or a.shape[2] % 2):
                    raise DatasetError(f"frames[{key!r}]: {self.pix_fmt} video needs an even height and width, "
                                       f"got {a.shape[1]}x{a.shape[2]}")
            elif ft["dtype"] != "string":
                want = ft["shape"]
                if want == [1] and a.ndim == 2 and a.shape[1] == 1:
                    a = a[:, 0]
                if (want == [1] and a.ndim != 1) or (want != [1] and list(a.shape[1:]) != want):
                    raise DatasetError(f"frames[{key!r}]: expected shape [T, {', '.join(map(str, want))}], "
                                       f"got {list(a.shape)}")
                if a.dtype.kind == "f" and not np.isfinite(a).all():
                    raise DatasetError(f"frames[{key!r}]: contains NaN or infinite values")
                a = a.astype(ft["dtype"])
            out[key] = a
        if len(set(lengths.values())) != 1:
            raise DatasetError(f"frames: features have different lengths: {lengths}")
        if next(iter(lengths.values())) == 0:
            raise DatasetError("frames: an episode needs at least one frame")
        return out

    def _arrow_column(self, key: str, values: np.ndarray) -> pa.Array:
        ft = self._all_features()[key]
        if ft["dtype"] == "string":
            return pa.array(list(values), pa.string())
        if ft["dtype"] == "image":
            return _png_column(values)
        if ft["shape"] == [1]:
            return pa.array(values.reshape(-1))
        return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), ft["shape"][0])

    def _write_data(self, cols: dict[str, np.ndarray], t: int) -> dict:
        keys = [k for k, ft in self._all_features().items() if ft["dtype"] != "video"]
        table = pa.table({k: self._arrow_column(k, cols[k]) for k in keys})
        chunk, file = self._data_loc
        if self._data_writer is not None and self._data_frames_in_file:
            size = (self.stage / DATA_PATH.format(chunk_index=chunk, file_index=file)).stat().st_size / 2 ** 20
            if size + size / self._data_frames_in_file * t >= self.data_mb:
                self._data_writer.close()
                self._data_writer = None
                chunk, file = self._data_loc = _next_file(chunk, file, self.chunks_size)
                self._data_frames_in_file = 0
        if self._data_writer is None:
            path = self.stage / DATA_PATH.format(chunk_index=chunk, file_index=file)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._data_writer = pq.ParquetWriter(path, table.schema, compression="snappy")
        self._data_writer.write_table(table)
        self._data_frames_in_file += t
        return {"data/chunk_index": chunk, "data/file_index": file,
                "dataset_from_index": self._frames, "dataset_to_index": self._frames + t}

    def _write_video(self, key: str, images: np.ndarray) -> dict:
        t = len(images)
        vf = self._videos.get(key)
        if vf is not None and vf.frames:
            size = vf.size_mb()
            if size + size / vf.frames * t >= self.video_mb:
                vf.close()
                self._video_loc[key] = _next_file(*self._video_loc[key], self.chunks_size)
                vf = None
        if vf is None:
            chunk, file = self._video_loc.setdefault(key, (0, 0))
            path = self.stage / VIDEO_PATH.format(video_key=key, chunk_index=chunk, file_index=file)
            vf = self._videos[key] = _VideoFile(path, self.fps, images.shape[2], images.shape[1], self.codec,
                                                self.pix_fmt, self.video_options)
        start = vf.frames
        vf.add(images)
        chunk, file = self._video_loc[key]
        return {f"videos/{key}/chunk_index": chunk, f"videos/{key}/file_index": file,
                f"videos/{key}/from_timestamp": start / self.fps, f"videos/{key}/to_timestamp": (start + t) / self.fps}

    # ---- finalize ----
    def finalize(self) -> Path:
        """Close the files, write meta/ (info, stats, tasks, episodes) and move the dataset to `root`."""
        if self._closed:
            raise DatasetError(f"{self.root}: writer already finalized or aborted")
        if not self._episodes:
            self.abort()
            raise DatasetError(f"{self.root}: no episodes were added; nothing written")
        try:
            if self._data_writer is not None:
                self._data_writer.close()
            for key, vf in self._videos.items():
                vf.close()
                self._video_info[key] = self._probe_video(vf.path)
            self._write_meta()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        old = None
        if self.root.exists():
            old = self.root.parent / f".{self.root.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(self.root, old)
        os.replace(self.stage, self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.root

    def _probe_video(self, path: Path) -> dict:
        import av

        with av.open(str(path)) as c:
            s = c.streams.video[0]
            return {"video.height": s.height, "video.width": s.width, "video.codec": s.codec_context.name,
                    "video.pix_fmt": s.pix_fmt, "video.is_depth_map": False, "video.fps": self.fps,
                    "video.channels": 3, "has_audio": False}

    def _write_meta(self) -> None:
        import pandas as pd  # tasks.parquet is a pandas frame with a named index, as LeRobot writes it

        features = self._all_features()
        for key, ft in features.items():
            if ft["dtype"] == "video":
                ft["info"] = self._video_info[key]
        tasks = pd.DataFrame({"task_index": list(self._tasks.values())},
                             index=pd.Index(list(self._tasks), name="task"))
        path = self.stage / TASKS_PATH
        path.parent.mkdir(parents=True, exist_ok=True)
        tasks.to_parquet(path)

        stats = {}
        for key, ft in features.items():
            if ft["dtype"] in _NUMERIC_DTYPES:
                stats[key] = feature_stats(np.concatenate(self._numeric[key]))
            elif ft["dtype"] in CAMERA_DTYPES:
                stats[key] = aggregate_stats([{key: s} for s in self._image_stats[key]])[key]
        _write_json_atomic(_jsonable(stats), self.stage / STATS_PATH)

        path = self.stage / EPISODES_PATH.format(chunk_index=0, file_index=0)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(self._episodes), path)

        info = {
            "codebase_version": CODEBASE_VERSION,
            "robot_type": self.robot_type,
            "total_episodes": len(self._episodes),
            "total_frames": self._frames,
            "total_tasks": len(self._tasks),
            "chunks_size": self.chunks_size,
            "data_files_size_in_mb": _num(self.data_mb),
            "video_files_size_in_mb": _num(self.video_mb),
            "fps": self.fps,
            "splits": {"train": f"0:{len(self._episodes)}"},
            "data_path": DATA_PATH,
            "video_path": VIDEO_PATH if self.video_keys else None,
            "features": features,
        }
        _write_json_atomic(info, self.stage / INFO_PATH)

    def abort(self) -> None:
        """Discard everything written so far; `root` is left as it was."""
        self._closed = True
        if self._data_writer is not None:
            try:
                self._data_writer.close()
            except Exception:
                pass
        for vf in self._videos.values():
            try:
                vf.container.close()
            except Exception:
                pass
        shutil.rmtree(self.stage, ignore_errors=True)

    def __enter__(self) -> LeRobotWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.finalize()


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _png_column(images: np.ndarray) -> pa.Array:
    """uint8 [T, H, W, 3] as the HF `Image` struct<bytes: binary, path: string> of PNG bytes."""
    from PIL import Image

    blobs = []
    for img in images:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG")
        blobs.append({"bytes": buf.getvalue(), "path": None})
    return pa.array(blobs, pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
