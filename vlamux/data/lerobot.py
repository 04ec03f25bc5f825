"""LeRobot datasets on local disk: the reader of v3.0 and v2.1 (v2.0); the format's constants are
`vlamux.data.lerobot_format`, the v3.0 writer `vlamux.data.lerobot_writer`.

The layout follows LeRobot's own code (`lerobot.datasets`, tags v0.4.x-v0.6.x,
`CODEBASE_VERSION = "v3.0"`) and its v3.0 announcement; docs/DATASETS.md
summarises it. Nothing here imports `lerobot` or touches the network.
The reader opens only files inside the dataset's directory (symbolic links resolved): the path
templates take only LeRobot's fields ({chunk_index}, {file_index}, {video_key}; v2.x: {episode_chunk},
{episode_index}, {video_key}) and are filled in without `str.format`; a dataset naming a file
outside itself is refused when it is opened, with the same message whether or not that file exists.
"""

from __future__ import annotations

import fnmatch
import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vlamux.data.episodes import ByteLRU, Episode, EpisodeDataset, EpisodeInfo, VideoSegment
from vlamux.data.errors import DatasetError, DatasetFormatError, MissingKeyError
from vlamux.data.lerobot_format import (CAMERA_DTYPES, CODEBASE_VERSION, DATA_PATH, DEFAULT_CHUNK_SIZE, EPISODES_DIR,
                                        EPISODES_PATH, INFO_PATH, LEGACY_DATA_PATH, LEGACY_EPISODES_PATH,
                                        LEGACY_EPISODES_STATS_PATH, LEGACY_TASKS_PATH, LEGACY_VERSIONS,
                                        LEGACY_VIDEO_PATH, STATS_PATH, TASKS_PATH, VIDEO_PATH, _read_json,
                                        _read_jsonl)
from vlamux.data.paths import (LEGACY_TEMPLATE_FIELDS, MAX_INDEX, V3_TEMPLATE_FIELDS, PathTemplate, is_dir, is_file,
                               listdir, resolve_inside, scrub, short)
from vlamux.data.stats import _as_arrays, aggregate_stats
from vlamux.data.video import decode_video_segment


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
