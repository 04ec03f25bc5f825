"""LeRobot's dataset format: its version, path templates and default features (LeRobot's own names),
and the JSON metadata files' reading and writing, shared by the reader (`vlamux.data.lerobot`), the
writer (`vlamux.data.lerobot_writer`) and the HDF5 reader.

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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlamux.data.errors import DatasetFormatError
from vlamux.utils.io import atomic_write_text

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


def _write_json_atomic(obj, path: Path) -> None:
    atomic_write_text(path, json.dumps(obj, indent=4, ensure_ascii=False))


def _read_json(path: Path, name: str | None = None) -> Any:
    """JSON from `path`; errors name the file as `name` (relative to the dataset root)."""
    return _parsed(path, name, json.load, "JSON")


def _read_jsonl(path: Path, name: str | None = None) -> list[dict]:
    rows = _parsed(path, name, lambda f: [json.loads(line) for line in f if line.strip()], "JSON lines")
    if not all(isinstance(r, dict) for r in rows):
        raise DatasetFormatError(f"{name if name is not None else path}: every line must be a JSON object")
    return rows


def _parsed(path: Path, name: str | None, parse, what: str):
    name = name if name is not None else str(path)
    try:
        with open(path) as f:
            return parse(f)
    except FileNotFoundError:
        raise DatasetFormatError(f"{name}: file missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetFormatError(f"{name}: not valid {what} ({e})") from None
    except OSError as e:
        raise DatasetFormatError(f"{name}: cannot read ({e.strerror or type(e).__name__})") from None
