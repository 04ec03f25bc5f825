"""LeRobot v3.0 datasets written one episode at a time (`LeRobotWriter`), in the layout
`vlamux.data.lerobot` reads and LeRobot's own code loads (docs/DATASETS.md)."""

from __future__ import annotations

import io
import os
import shutil
import uuid
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vlamux.data.errors import DatasetError
from vlamux.data.lerobot_format import (
    _NUMERIC_DTYPES,
    CAMERA_DTYPES,
    CODEBASE_VERSION,
    DATA_PATH,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_DATA_FILE_SIZE_IN_MB,
    DEFAULT_FEATURES,
    DEFAULT_VIDEO_FILE_SIZE_IN_MB,
    EPISODES_PATH,
    INFO_PATH,
    STATS_PATH,
    TASKS_PATH,
    VIDEO_PATH,
    _have,
    _write_json_atomic,
)
from vlamux.data.stats import _jsonable, aggregate_stats, feature_stats, image_stats


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
