"""LeRobot datasets on local disk: readers for v3.0 and v2.1 (v2.0); the v3.0 writer is
`vlamux.data.lerobot_writer`.

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

The reader opens only files inside the dataset's directory (symbolic links resolved): the path
templates take only LeRobot's fields ({chunk_index}, {file_index}, {video_key}; v2.x: {episode_chunk},
{episode_index}, {video_key}) and are filled in without `str.format`; a dataset naming a file
outside itself is refused when it is opened, with the same message whether or not that file exists.
Errors name files relative to the dataset's root.

This module also holds what the HDF5 reader and the writer share (statistics, the episode-dataset
base class, the decoded-frame cache); the paths' checks are `vlamux.data.paths`, the errors
`vlamux.data.errors`.
"""

from __future__ import annotations

import fnmatch
import io
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vlamux.utils.io import atomic_write_text
from vlamux.data.errors import DatasetError, DatasetFormatError, MissingKeyError
from vlamux.data.paths import (LEGACY_TEMPLATE_FIELDS, MAX_INDEX, V3_TEMPLATE_FIELDS, PathTemplate, is_dir, is_file,
                               listdir, resolve_inside, scrub, short)

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
    atomic_write_text(path, json.dumps(obj, indent=4, ensure_ascii=False))


def _read_json(path: Path, name: str | None = None) -> Any:
    """JSON from `path`; errors name the file as `name` (relative to the dataset root)."""
    name = name if name is not None else str(path)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise DatasetFormatError(f"{name}: file missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetFormatError(f"{name}: not valid JSON ({e})") from None
    except OSError as e:
        raise DatasetFormatError(f"{name}: cannot read ({e.strerror or type(e).__name__})") from None


def _read_jsonl(path: Path, name: str | None = None) -> list[dict]:
    name = name if name is not None else str(path)
    try:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        raise DatasetFormatError(f"{name}: file missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetFormatError(f"{name}: not valid JSON lines ({e})") from None
    except OSError as e:
        raise DatasetFormatError(f"{name}: cannot read ({e.strerror or type(e).__name__})") from None
    if not all(isinstance(r, dict) for r in rows):
        raise DatasetFormatError(f"{name}: every line must be a JSON object")
    return rows


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


def _decode_png_column(col: pa.ChunkedArray, root: Path, where: str = "an 'image' column") -> np.ndarray:
    """An inline-image column (HF `Image`: struct<bytes, path>) as uint8 [N, H, W, 3]. A cell without
    bytes names a file relative to `root` (the dataset's resolved directory); it must lie inside it."""
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - Pillow ships with most installs
        raise DatasetError("reading 'image' features needs Pillow (pip install pillow)") from e
    out = []
    for cell in col.to_pylist():
        if cell is None:
            raise DatasetFormatError(f"{where}: an 'image' cell is empty")
        data = cell.get("bytes") if isinstance(cell, dict) else cell
        rel = None
        try:
            if data is None:
                rel = cell.get("path") if isinstance(cell, dict) else None
                path = resolve_inside(root, rel, f"{where}: image path {short(rel)}")
                with Image.open(path) as im:
                    out.append(np.asarray(im.convert("RGB")))
            else:
                with Image.open(io.BytesIO(data)) as im:
                    out.append(np.asarray(im.convert("RGB")))
        except DatasetError:
            raise
        except FileNotFoundError:
            raise DatasetFormatError(f"{where}: image file {short(rel)} missing") from None
        except (OSError, ValueError, TypeError) as e:
            raise DatasetFormatError(f"{where}: an image does not decode ({scrub(str(e), root)})") from None
    return np.stack(out) if out else np.zeros((0, 0, 0, 3), np.uint8)


def decode_video_segment(path: Path, timestamps: Sequence[float], tolerance_s: float,
                         name: str | None = None) -> np.ndarray:
    """Frames of an mp4 nearest to each timestamp (seconds in the file), as uint8 [N, H, W, 3].

    Seeks to the keyframe before the first timestamp and decodes forward past the last one (as
    LeRobot's pyav backend does); every timestamp must have a frame within `tolerance_s`. Errors
    name the file as `name` (by default its path).
    """
    import av

    name = name if name is not None else str(path)
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
        raise DatasetFormatError(f"{name}: video file missing") from None
    except (av.error.FFmpegError, OSError, IndexError) as e:
        msg = str(e).replace(str(path), name)
        raise DatasetFormatError(f"{name}: cannot decode ({msg})") from None
    if not frames:
        raise DatasetFormatError(f"{name}: no frames decoded in [{first:.4f}, {last:.4f}] s")
    got = np.asarray(got)
    nearest = np.abs(ts[:, None] - got[None, :]).argmin(1)
    err = np.abs(got[nearest] - ts)
    if (err > tolerance_s).any():
        bad = int(err.argmax())
        raise DatasetFormatError(
            f"{name}: no frame within {tolerance_s} s of t={ts[bad]:.6f} s (nearest {got[nearest[bad]]:.6f} s)")
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

    The reader opens only files inside the dataset's own directory: every path its files name
    (meta/info.json's `data_path` / `video_path` templates filled in for each episode, the fixed
    metadata files, image cells' paths) must stay inside it once symbolic links are resolved, and
    the templates take only LeRobot's fields, checked when the dataset is opened. Errors name files
    relative to the dataset's root (`data/chunk-000/file-000.parquet: no column 'action'`), never
    the machine's absolute paths.
    """

    def __init__(self, root: str | Path, *, tolerance_s: float = 1e-4, video_cache_mb: float = 512,
                 data_cache_mb: float = 256):
        self.root = Path(root)
        self.real_root = Path(os.path.realpath(self.root))  # what "inside the dataset" means
        self.source = INFO_PATH  # features, totals and episodes: what errors about the whole dataset name
        self._real: dict[str, Path] = {}  # relative path -> checked real path
        info = self._path(INFO_PATH)
        if not is_file(info):
            raise DatasetFormatError(f"{self.root.name}: no {INFO_PATH}; not a LeRobot dataset")
        self.info = _read_json(info, INFO_PATH)
        if not isinstance(self.info, dict):
            raise DatasetFormatError(f"{INFO_PATH}: expected a JSON object")
        for req in ("codebase_version", "fps", "features"):
            if req not in self.info:
                raise DatasetFormatError(f"{INFO_PATH}: no {req!r} field")
        self.version = str(self.info["codebase_version"])
        if self.version != CODEBASE_VERSION and self.version not in LEGACY_VERSIONS:
            raise DatasetFormatError(f"{INFO_PATH}: codebase_version {short(self.version, 40)} is not supported "
                                     f"(reads {CODEBASE_VERSION} and {', '.join(LEGACY_VERSIONS)})")
        self.fps = self.info["fps"]
        if isinstance(self.fps, bool) or not isinstance(self.fps, (int, float)) or not self.fps > 0:
            raise DatasetFormatError(f"{INFO_PATH}: fps must be a positive number, got {short(self.fps, 40)}")
        self.features = self.info["features"]
        if not isinstance(self.features, dict) or not all(isinstance(v, dict) for v in self.features.values()):
            raise DatasetFormatError(f"{INFO_PATH}: features must map each feature name to its spec (an object)")
        self.robot_type = self.info.get("robot_type")
        self.tolerance_s = float(tolerance_s)
        self._frames = ByteLRU(int(video_cache_mb * 2 ** 20))
        self._columns = ByteLRU(int(data_cache_mb * 2 ** 20))
        self._stats: dict | None = None
        legacy = self.version != CODEBASE_VERSION
        fields = LEGACY_TEMPLATE_FIELDS if legacy else V3_TEMPLATE_FIELDS
        # the path templates: checked here, so a dataset naming files outside itself never opens
        self.data_template = PathTemplate(self.info.get("data_path") or (LEGACY_DATA_PATH if legacy else DATA_PATH),
                                          fields, f"{INFO_PATH}: data_path")
        self.video_template = PathTemplate(
            self.info.get("video_path") or (LEGACY_VIDEO_PATH if legacy else VIDEO_PATH), fields,
            f"{INFO_PATH}: video_path")
        stats = self._path(STATS_PATH)  # a link out of the dataset is refused now, not when statistics are read
        if not legacy:
            self.stats_source = STATS_PATH
            self.tasks = self._load_tasks_v3()
            self.episodes = self._load_episodes_v3()
        else:
            legacy_stats = self._path(LEGACY_EPISODES_STATS_PATH)
            self.stats_source = STATS_PATH if is_file(stats) or not is_file(legacy_stats) \
                else LEGACY_EPISODES_STATS_PATH
            self.tasks = self._load_tasks_v2()
            self.episodes = self._load_episodes_v2()
        total = self.info.get("total_episodes")
        if total is not None and total != len(self.episodes):
            raise DatasetFormatError(f"{INFO_PATH}: total_episodes is {short(total, 40)} but the episode "
                                     f"metadata lists {len(self.episodes)}")
        self._starts = np.cumsum([0] + [e.length for e in self.episodes])

    # ---- the dataset's own files ----
    def _path(self, rel: str, what: str | None = None) -> Path:
        """The real path of `rel` (relative to the root), which must lie inside the dataset."""
        real = self._real.get(rel)
        if real is None:
            real = self._real[rel] = resolve_inside(self.real_root, rel, what or short(rel))
        return real

    def _scrub(self, e: BaseException) -> str:
        return scrub(str(e), self.real_root)

    def _filled(self, template: PathTemplate, where: str, episode: int, **values) -> str:
        """A path template filled in for one episode, checked to lie inside the dataset."""
        try:
            rel = template.fill(**values)
        except ValueError as e:
            raise DatasetFormatError(f"{where}: {e}") from None
        self._path(rel, f"{template.where} {short(template.template)} (episode {episode}: {short(rel)})")
        return rel

    @staticmethod
    def _index(row: Mapping, key: str, where: str) -> int:
        v = row[key]
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not 0 <= v < MAX_INDEX:
            raise DatasetFormatError(f"{where}: {key!r} must be an integer in [0, {MAX_INDEX}), got {short(v, 40)}")
        return int(v)

    # ---- metadata ----
    def _load_tasks_v3(self) -> list[str]:
        path = self._path(TASKS_PATH)
        if not is_file(path):
            raise DatasetFormatError(f"{TASKS_PATH}: file missing")
        try:
            t = pq.read_table(path)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise DatasetFormatError(f"{TASKS_PATH}: cannot read ({self._scrub(e)})") from None
        names = t.column_names
        text_col = "task" if "task" in names else "__index_level_0__" if "__index_level_0__" in names else None
        if "task_index" not in names or text_col is None:
            raise DatasetFormatError(f"{TASKS_PATH}: expected a 'task' index and a 'task_index' column, got {names}")
        return self._task_list(t.column("task_index").to_pylist(), t.column(text_col).to_pylist(), TASKS_PATH)

    def _load_tasks_v2(self) -> list[str]:
        rows = _read_jsonl(self._path(LEGACY_TASKS_PATH), LEGACY_TASKS_PATH)
        try:
            return self._task_list([r["task_index"] for r in rows], [r["task"] for r in rows], LEGACY_TASKS_PATH)
        except KeyError as e:
            raise DatasetFormatError(f"{LEGACY_TASKS_PATH}: a line has no {e.args[0]!r}") from None

    @staticmethod
    def _task_list(indices, texts, name: str) -> list[str]:
        n = len(indices)
        out: list[str | None] = [None] * n
        for i, s in zip(indices, texts):
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n or not isinstance(s, str):
                raise DatasetFormatError(f"{name}: task indices are not contiguous from 0, or a task is not a "
                                         f"string (task_index {short(i, 40)})")
            out[i] = s
        if any(s is None for s in out):
            raise DatasetFormatError(f"{name}: task indices are not contiguous from 0: {sorted(indices)[:20]}")
        return out  # type: ignore[return-value]

    def _episode_files_v3(self) -> list[str]:
        """meta/episodes/chunk-*/file-*.parquet, relative to the root; each directory is checked to be
        inside the dataset before it is listed."""
        top = self._path(EPISODES_DIR)
        out = []
        if is_dir(top):
            for chunk in listdir(top, EPISODES_DIR):
                if not fnmatch.fnmatchcase(chunk, "chunk-*"):
                    continue
                rel = f"{EPISODES_DIR}/{chunk}"
                d = self._path(rel)
                if is_dir(d):
                    out += [f"{rel}/{f}" for f in listdir(d, rel) if fnmatch.fnmatchcase(f, "file-*.parquet")]
        return out

    def _load_episodes_v3(self) -> list[EpisodeInfo]:
        files = self._episode_files_v3()
        if not files:
            raise DatasetFormatError(f"{EPISODES_DIR}: no episode metadata files "
                                     f"({EPISODES_PATH.format(chunk_index=0, file_index=0)} expected)")
        rows = []
        for rel in files:
            path = self._path(rel)
            try:
                cols = [c for c in pq.read_schema(path).names if not c.startswith("stats/")]
                table = pq.read_table(path, columns=cols)
            except (pa.ArrowException, OSError, ValueError) as e:
                raise DatasetFormatError(f"{rel}: cannot read ({self._scrub(e)})") from None
            if "episode_index" not in cols:
                raise DatasetFormatError(f"{rel}: no column 'episode_index'")
            rows += [(self._index(r, "episode_index", rel), rel, r) for r in table.to_pylist()]
        rows.sort(key=lambda x: x[0])
        video_keys = [k for k, ft in self.features.items() if ft.get("dtype") == "video"]
        out = []
        for pos, (index, rel, r) in enumerate(rows):
            where = f"{rel} (episode {index})"
            if index != pos:
                raise DatasetFormatError(f"{EPISODES_DIR}: episode indices are not 0..N-1 (episode {index} "
                                         f"where {pos} belongs)")
            try:
                videos = {}
                for k in video_keys:
                    c = f"videos/{k}/"
                    seg = self._filled(self.video_template, where, pos, video_key=k,
                                       chunk_index=self._index(r, c + "chunk_index", where),
                                       file_index=self._index(r, c + "file_index", where))
                    videos[k] = VideoSegment(seg, float(r[c + "from_timestamp"]), float(r[c + "to_timestamp"]))
                data = self._filled(self.data_template, where, pos,
                                    chunk_index=self._index(r, "data/chunk_index", where),
                                    file_index=self._index(r, "data/file_index", where))
                out.append(EpisodeInfo(
                    index=pos, length=self._index(r, "length", where), tasks=tuple(r.get("tasks") or ()),
                    dataset_from_index=int(r["dataset_from_index"]), dataset_to_index=int(r["dataset_to_index"]),
                    data_path=data, videos=videos))
            except DatasetError:
                raise
            except KeyError as e:
                raise DatasetFormatError(f"{where}: no column {e.args[0]!r}") from None
            except (TypeError, ValueError) as e:
                raise DatasetFormatError(f"{where}: a value of the wrong type ({e})") from None
        return out

    def _load_episodes_v2(self) -> list[EpisodeInfo]:
        name = LEGACY_EPISODES_PATH
        rows = _read_jsonl(self._path(name), name)
        chunks = self.info.get("chunks_size", DEFAULT_CHUNK_SIZE)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0:
            raise DatasetFormatError(f"{INFO_PATH}: chunks_size must be a positive integer, got {short(chunks, 40)}")
        try:
            rows = sorted(((self._index(r, "episode_index", name), r) for r in rows), key=lambda x: x[0])
        except KeyError as e:
            raise DatasetFormatError(f"{name}: a line has no {e.args[0]!r}") from None
        video_keys = [k for k, ft in self.features.items() if ft.get("dtype") == "video"]
        out, start = [], 0
        for pos, (ep, r) in enumerate(rows):
            where = f"{name} (episode {ep})"
            if ep != pos:
                raise DatasetFormatError(f"{name}: episode indices are not 0..N-1")
            try:
                n = self._index(r, "length", where)
            except KeyError:
                raise DatasetFormatError(f"{where}: no 'length'") from None
            chunk = ep // chunks
            videos = {k: VideoSegment(self._filled(self.video_template, where, ep, episode_chunk=chunk, video_key=k,
                                                   episode_index=ep), 0.0, n / self.fps) for k in video_keys}
            tasks = r.get("tasks") or ()
            out.append(EpisodeInfo(ep, n, tuple(tasks) if isinstance(tasks, list) else (str(tasks),), start,
                                   start + n, self._filled(self.data_template, where, ep, episode_chunk=chunk,
                                                           episode_index=ep), videos))
            start += n
        return out

    @property
    def stats(self) -> dict[str, dict[str, np.ndarray]]:
        if self._stats is None:
            path = self._path(STATS_PATH)
            if is_file(path):
                raw = _read_json(path, STATS_PATH)
                if not isinstance(raw, dict):
                    raise DatasetFormatError(f"{STATS_PATH}: expected a JSON object")
                self._stats = _as_arrays(raw)
            elif self.version != CODEBASE_VERSION and is_file(self._path(LEGACY_EPISODES_STATS_PATH)):
                rows = _read_jsonl(self._path(LEGACY_EPISODES_STATS_PATH), LEGACY_EPISODES_STATS_PATH)
                try:
                    self._stats = aggregate_stats([_as_arrays(r["stats"]) for r in rows])
                except (KeyError, TypeError, ValueError, AttributeError) as e:
                    raise DatasetFormatError(f"{LEGACY_EPISODES_STATS_PATH}: not per-episode statistics "
                                             f"({type(e).__name__}: {e})") from None
            else:
                raise MissingKeyError(f"{STATS_PATH} missing" + (
                    "" if self.version == CODEBASE_VERSION else f" and {LEGACY_EPISODES_STATS_PATH} missing"))
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
        path = self._path(ep.data_path)
        if not is_file(path):
            raise DatasetFormatError(f"{ep.data_path}: data file of episode {i} missing")
        try:
            if "episode_index" in pq.read_schema(path).names:
                table = pq.read_table(path, filters=[("episode_index", "=", i)])
            else:  # one episode per file (v2.x) without the column
                table = pq.read_table(path)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise DatasetFormatError(f"{ep.data_path}: cannot read ({self._scrub(e)})") from None
        if table.num_rows != ep.length:
            raise DatasetFormatError(f"{ep.data_path}: episode {i} has {table.num_rows} rows, its metadata says "
                                     f"{ep.length}")
        if "frame_index" in table.column_names:
            order = np.argsort(table.column("frame_index").to_numpy(), kind="stable")
            if (order != np.arange(len(order))).any():
                table = table.take(pa.array(order))
        cols = {}
        for name in table.column_names:
            ft = self.features.get(name, {})
            if ft.get("dtype") == "image":
                cols[name] = _decode_png_column(table.column(name), self.real_root,
                                                f"{ep.data_path}: column {name!r}")
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
            raise DatasetFormatError(f"{self.episodes[i].data_path}: no column {key!r}")
        return cols[key]

    def episode_images(self, i: int, key: str) -> np.ndarray:
        i = self._check_episode(i)
        dtype = self.feature(key).get("dtype")
        if dtype == "image":
            cols = self._episode_columns(i)
            if key not in cols:
                raise DatasetFormatError(f"{self.episodes[i].data_path}: no column {key!r}")
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
        frames = decode_video_segment(self._path(seg.path), seg.from_timestamp + np.asarray(rel, np.float64),
                                      self.tolerance_s, name=seg.path)
        frames.setflags(write=False)
        self._frames.put((i, key), frames)
        return frames

    def frame_tasks(self, i: int) -> list[str]:
        cols = self._episode_columns(i)
        if "task_index" in cols:
            try:
                return [self.tasks[int(t)] for t in cols["task_index"]]
            except (IndexError, TypeError, ValueError):
                raise DatasetFormatError(f"{self.episodes[i].data_path}: a task_index of episode {i} "
                                         f"is not in the task table ({len(self.tasks)} tasks)") from None
        tasks = self.episodes[i].tasks
        if not tasks:
            raise DatasetFormatError(f"{self.episodes[i].data_path}: episode {i} has neither a task_index column "
                                     f"nor tasks in its metadata")
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
