"""Offline datasets: the LeRobot v3.0 writer/reader, v2.1 reader, robomimic/LIBERO HDF5 reader, chunk sampler.

The real `lerobot` package cannot be installed in the test environment (it pulls a CUDA torch
build), so datasets "written by LeRobot" are built here by fixtures that follow LeRobot's
documented layout directly with pyarrow, pandas and PyAV (layout: lerobot.datasets utils/
dataset_metadata/dataset_writer, v0.4-v0.6, and the LeRobotDataset v3.0 announcement).
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from vlamux.data import (
    ChunkSampler,
    DatasetError,
    LeRobotDataset,
    LeRobotWriter,
    MissingKeyError,
    RobomimicDataset,
)
from vlamux.model import NormStats, Observation

CAMS = ("observation.images.top", "observation.images.wrist")
LENGTHS = (7, 5, 9)
TASKS = ("pick up the red block", "open the drawer", "pick up the red block")
FEATURES = {
    CAMS[0]: {"dtype": "video", "shape": [32, 32, 3]},
    CAMS[1]: {"dtype": "video", "shape": [32, 32, 3]},
    "observation.state": {"dtype": "float32", "shape": [4], "names": ["x", "y", "z", "gripper"]},
    "action": {"dtype": "float32", "shape": [3]},
}


def smooth_frames(t: int, seed: int, h: int = 32, w: int = 32) -> np.ndarray:
    """uint8 [T, H, W, 3] gradients that move a little each frame (what a lossy codec keeps well)."""
    y, x = np.mgrid[0:h, 0:w]
    out = np.empty((t, h, w, 3), np.uint8)
    for i in range(t):
        out[i, ..., 0] = 30 + 4 * x + 3 * i + seed
        out[i, ..., 1] = 60 + 3 * y + 2 * seed
        out[i, ..., 2] = 200 - 2 * x - 2 * y + i
    return out


def make_episodes(seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{CAMS[0]: smooth_frames(t, 10 * e), CAMS[1]: smooth_frames(t, 10 * e + 5),
             "observation.state": rng.normal(size=(t, 4)).astype(np.float32),
             "action": rng.normal(size=(t, 3)).astype(np.float32)} for e, t in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("ours") / "ds"
    episodes = make_episodes()
    with LeRobotWriter(root, fps=10, features=FEATURES, robot_type="sim_arm") as w:
        for ep, task in zip(episodes, TASKS):
            w.add_episode(ep, task)
    return root, episodes


# ---- our writer -----------------------------------------------------------------------------------

def test_writer_roundtrip(written):
    root, episodes = written
    ds = LeRobotDataset(root)
    assert (ds.version, ds.num_episodes, ds.num_frames, ds.fps, ds.robot_type) == ("v3.0", 3, 21, 10, "sim_arm")
    assert ds.tasks == ["pick up the red block", "open the drawer"]
    assert ds.camera_keys == list(CAMS)
    for e, ep in enumerate(episodes):
        data = ds.episode_data(e)
        for key in ("observation.state", "action"):  # numeric: exact
            assert data[key].dtype == np.float32 and np.array_equal(data[key], ep[key])
        assert np.array_equal(data["frame_index"], np.arange(LENGTHS[e]))
        assert np.array_equal(data["episode_index"], np.full(LENGTHS[e], e))
        assert np.array_equal(data["index"], sum(LENGTHS[:e]) + np.arange(LENGTHS[e]))
        assert np.allclose(data["timestamp"], np.arange(LENGTHS[e]) / 10)
        assert ds.frame_tasks(e) == [TASKS[e]] * LENGTHS[e]
        for cam in CAMS:  # mp4 (libx264, yuv420p) is lossy: a few intensity levels on average
            img = ds.episode_images(e, cam)
            assert img.shape == ep[cam].shape and img.dtype == np.uint8
            assert np.abs(img.astype(int) - ep[cam]).mean() < 3.0
    frame = ds[LENGTHS[0] + 2]  # frame 2 of episode 1
    assert frame["task"] == TASKS[1] and np.array_equal(frame["action"], episodes[1]["action"][2])
    assert frame[CAMS[0]].shape == (32, 32, 3)
    one = ds.episode(2)
    assert (one.index, one.length, one.task) == (2, 9, TASKS[2]) and one.images(CAMS[1]).shape == (9, 32, 32, 3)


def test_writer_follows_v30_layout(written):
    root, episodes = written
    for rel in ("meta/info.json", "meta/stats.json", "meta/tasks.parquet",
                "meta/episodes/chunk-000/file-000.parquet", "data/chunk-000/file-000.parquet",
                f"videos/{CAMS[0]}/chunk-000/file-000.mp4", f"videos/{CAMS[1]}/chunk-000/file-000.mp4"):
        assert (root / rel).is_file(), rel
    assert not list(root.parent.glob(".ds.*")), "staging directory left behind"
    info = json.loads((root / "meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0"
    assert {"robot_type", "total_episodes", "total_frames", "total_tasks", "chunks_size", "data_files_size_in_mb",
            "video_files_size_in_mb", "fps", "splits", "data_path", "video_path", "features"} <= set(info)
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (3, 21, 2)
    assert info["splits"] == {"train": "0:3"}
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    feats = info["features"]
    assert list(feats) == [*FEATURES, "timestamp", "frame_index", "episode_index", "index", "task_index"]
    assert feats["observation.state"] == {"dtype": "float32", "shape": [4], "names": ["x", "y", "z", "gripper"]}
    assert feats["index"] == {"dtype": "int64", "shape": [1], "names": None}
    cam = feats[CAMS[0]]
    assert cam["dtype"] == "video" and cam["shape"] == [32, 32, 3] and cam["names"] == ["height", "width", "channels"]
    assert cam["info"]["video.codec"] == "h264" and cam["info"]["video.pix_fmt"] == "yuv420p"
    assert (cam["info"]["video.height"], cam["info"]["video.width"], cam["info"]["video.fps"]) == (32, 32, 10)

    tasks = pd.read_parquet(root / "meta/tasks.parquet")  # as LeRobot reads it: index = task string
    assert tasks.index.name == "task" and tasks.loc["open the drawer", "task_index"] == 1

    eps = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [e["episode_index"] for e in eps] == [0, 1, 2] and [e["length"] for e in eps] == list(LENGTHS)
    assert [e["tasks"] for e in eps] == [[t] for t in TASKS]
    assert [(e["dataset_from_index"], e["dataset_to_index"]) for e in eps] == [(0, 7), (7, 12), (12, 21)]
    assert all(e["data/chunk_index"] == 0 and e["data/file_index"] == 0 for e in eps)
    for cam in CAMS:  # episodes back to back in one mp4 per camera
        spans = [(e[f"videos/{cam}/from_timestamp"], e[f"videos/{cam}/to_timestamp"]) for e in eps]
        assert np.allclose(spans, [(0.0, 0.7), (0.7, 1.2), (1.2, 2.1)])
        assert all(e[f"videos/{cam}/chunk_index"] == 0 and e[f"videos/{cam}/file_index"] == 0 for e in eps)
    assert np.allclose(eps[1]["stats/action/mean"], episodes[1]["action"].mean(0), atol=1e-6)
    assert np.asarray(eps[0][f"stats/{CAMS[0]}/mean"]).shape == (3, 1, 1)

    stats = json.loads((root / "meta/stats.json").read_text())
    assert set(stats) == set(feats)
    allact = np.concatenate([e["action"] for e in episodes])
    for name in ("min", "max", "mean", "std", "count", "q01", "q50", "q99"):
        assert name in stats["action"]
    assert np.allclose(stats["action"]["mean"], allact.mean(0), atol=1e-6)
    assert np.allclose(stats["action"]["std"], allact.std(0), atol=1e-6) and stats["action"]["count"] == [21]
    img = {k: np.asarray(v) for k, v in stats[CAMS[0]].items()}
    assert img["mean"].shape == (3, 1, 1) and 0 <= img["min"].min() and img["max"].max() <= 1
    frames = np.concatenate([e[CAMS[0]] for e in episodes]).reshape(-1, 3) / 255
    assert np.allclose(img["mean"].reshape(3), frames.mean(0), atol=1e-6)  # every frame sampled at this size
    assert np.allclose(img["std"].reshape(3), frames.std(0), atol=1e-6)


def test_writer_rolls_over_files_and_chunks(tmp_path):
    """Tiny size limits: every episode opens a new data and video file; chunks_size=2 opens chunk-001."""
    root = tmp_path / "rolled"
    episodes = make_episodes(1)
    feats = {k: v for k, v in FEATURES.items() if k != CAMS[1]}
    with LeRobotWriter(root, 10, feats, chunks_size=2, data_files_size_in_mb=1e-4, video_files_size_in_mb=1e-4,
                       crf=10) as w:
        for ep, task in zip(episodes, TASKS):
            w.add_episode({k: v for k, v in ep.items() if k != CAMS[1]}, task)
    for rel in ("data/chunk-000/file-000.parquet", "data/chunk-000/file-001.parquet",
                "data/chunk-001/file-000.parquet", f"videos/{CAMS[0]}/chunk-001/file-000.mp4"):
        assert (root / rel).is_file(), rel
    eps = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [(e["data/chunk_index"], e["data/file_index"]) for e in eps] == [(0, 0), (0, 1), (1, 0)]
    assert all(e[f"videos/{CAMS[0]}/from_timestamp"] == 0.0 for e in eps)
    ds = LeRobotDataset(root)
    for e, ep in enumerate(episodes):
        assert np.array_equal(ds.episode_data(e)["action"], ep["action"])
        assert np.abs(ds.episode_images(e, CAMS[0]).astype(int) - ep[CAMS[0]]).mean() < 2.0


def test_writer_is_atomic_and_validates(tmp_path):
    root = tmp_path / "atomic"
    with pytest.raises(RuntimeError):
        with LeRobotWriter(root, 10, FEATURES) as w:
            w.add_episode(make_episodes()[0], "task")
            raise RuntimeError("expert crashed")
    assert not root.exists() and not list(tmp_path.iterdir())  # nothing published, staging removed
    w = LeRobotWriter(root, 10, FEATURES)
    ep = make_episodes()[0]
    with pytest.raises(DatasetError, match="missing 'action'"):
        w.add_episode({k: v for k, v in ep.items() if k != "action"}, "task")
    with pytest.raises(DatasetError, match=r"frames\['observation.state'\]: expected shape \[T, 4\]"):
        w.add_episode({**ep, "observation.state": ep["observation.state"][:, :3]}, "task")
    with pytest.raises(DatasetError, match="different lengths"):
        w.add_episode({**ep, "action": ep["action"][:-1]}, "task")
    w.add_episode(ep, "task")
    w.finalize()
    with pytest.raises(DatasetError, match="not empty"):
        LeRobotWriter(root, 10, FEATURES)
    empty = LeRobotWriter(tmp_path / "empty", 10, FEATURES)
    with pytest.raises(DatasetError, match="no episodes"):
        empty.finalize()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atomic"]
    with pytest.raises(DatasetError, match="reserved"):
        LeRobotWriter(tmp_path / "other", 10, {**FEATURES, "timestamp": {"dtype": "float32", "shape": [1]}})


# ---- datasets in LeRobot's layout, not written by our writer ----------------------------------------

def encode_mp4(path: Path, frames: np.ndarray, fps: int) -> None:
    """What LeRobot's encode_video_frames does (PyAV, yuv420p, g=2); libx264 instead of its AV1 default."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps, options={"g": "2", "crf": "18", "threads": "1"})
        stream.pix_fmt, stream.width, stream.height = "yuv420p", frames.shape[2], frames.shape[1]
        for i, img in enumerate(frames):
            f = av.VideoFrame.from_ndarray(img, format="rgb24")
            f.pts, f.time_base = i, Fraction(1, fps)
            out.mux(stream.encode(f))
        out.mux(stream.encode())


def png_cells(frames: np.ndarray) -> list[dict]:
    import io

    from PIL import Image

    cells = []
    for img in frames:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG")
        cells.append({"bytes": buf.getvalue(), "path": None})
    return cells


def frame_table(ep: int, first_index: int, n: int, fps: int, rng, task_index: int, side=None) -> pa.Table:
    cols = {
        "observation.state": pa.array(rng.normal(size=(n, 2)).astype(np.float32).tolist(), pa.list_(pa.float32())),
        "action": pa.FixedSizeListArray.from_arrays(pa.array(rng.normal(size=n * 2).astype(np.float32)), 2),
        "timestamp": pa.array((np.arange(n) / fps).astype(np.float32)),
        "frame_index": pa.array(np.arange(n)),
        "episode_index": pa.array(np.full(n, ep)),
        "index": pa.array(first_index + np.arange(n)),
        "task_index": pa.array(np.full(n, task_index)),
    }
    if side is not None:
        cols["observation.images.side"] = pa.array(png_cells(side), pa.struct([("bytes", pa.binary()),
                                                                               ("path", pa.string())]))
    return pa.table(cols)


@pytest.fixture(scope="module")
def lerobot_v30(tmp_path_factory):
    """A v3.0 dataset as LeRobot lays it out: fps 15, a [C, H, W] video camera, an inline PNG camera,
    episodes 0-1 in data/chunk-000/file-000 and episode 2 in file-001; videos: episodes 0-1 back to
    back in file-000, episode 2 at the start of file-001."""
    root = tmp_path_factory.mktemp("lerobot") / "v30"
    fps, lengths, rng = 15, (6, 4, 5), np.random.default_rng(3)
    task_of = [1, 0, 1]
    tasks = pd.DataFrame({"task_index": [0, 1]}, index=pd.Index(["stack cups", "wipe table"], name="task"))
    (root / "meta").mkdir(parents=True)
    tasks.to_parquet(root / "meta/tasks.parquet")  # LeRobot's write_tasks
    frames = [smooth_frames(n, 7 * e, 24, 40) for e, n in enumerate(lengths)]
    side = [smooth_frames(n, 3 * e, 16, 16) for e, n in enumerate(lengths)]
    tables = [frame_table(e, sum(lengths[:e]), n, fps, rng, task_of[e], side[e]) for e, n in enumerate(lengths)]
    for file, eps in ((0, [0, 1]), (1, [2])):
        path = root / f"data/chunk-000/file-{file:03d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.concat_tables([tables[e] for e in eps]), path)
        encode_mp4(root / f"videos/observation.images.front/chunk-000/file-{file:03d}.mp4",
                   np.concatenate([frames[e] for e in eps]), fps)
    rows, start = [], {0: 0.0, 1: 0.0}
    for e, n in enumerate(lengths):
        file = 0 if e < 2 else 1
        rows.append({
            "episode_index": e, "tasks": [tasks.index[task_of[e]]], "length": n,
            "data/chunk_index": 0, "data/file_index": file,
            "dataset_from_index": sum(lengths[:e]), "dataset_to_index": sum(lengths[:e + 1]),
            "videos/observation.images.front/chunk_index": 0, "videos/observation.images.front/file_index": file,
            "videos/observation.images.front/from_timestamp": start[file],
            "videos/observation.images.front/to_timestamp": start[file] + n / fps,
            "stats/action/mean": np.zeros(2).tolist(),
            "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0,
        })
        start[file] += n / fps
    path = root / "meta/episodes/chunk-000/file-000.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    feats = {
        "observation.images.front": {"dtype": "video", "shape": [3, 24, 40], "names": ["channels", "height", "width"],
                                     "info": {"video.height": 24, "video.width": 40, "video.codec": "h264",
                                              "video.pix_fmt": "yuv420p", "video.is_depth_map": False,
                                              "video.fps": fps, "video.channels": 3, "has_audio": False}},
        "observation.images.side": {"dtype": "image", "shape": [16, 16, 3], "names": ["height", "width", "channel"]},
        "observation.state": {"dtype": "float32", "shape": [2], "names": ["x", "y"]},
        "action": {"dtype": "float32", "shape": [2], "names": ["vx", "vy"]},
        "timestamp": {"dtype": "float32", "shape": [1], "names": None},
        "frame_index": {"dtype": "int64", "shape": [1], "names": None},
        "episode_index": {"dtype": "int64", "shape": [1], "names": None},
        "index": {"dtype": "int64", "shape": [1], "names": None},
        "task_index": {"dtype": "int64", "shape": [1], "names": None},
    }
    info = {"codebase_version": "v3.0", "robot_type": "so100", "total_episodes": 3, "total_frames": sum(lengths),
            "total_tasks": 2, "chunks_size": 1000, "data_files_size_in_mb": 100, "video_files_size_in_mb": 200,
            "fps": fps, "splits": {"train": "0:3"},
            "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
            "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4", "features": feats}
    (root / "meta/info.json").write_text(json.dumps(info, indent=4))
    allt = pa.concat_tables(tables)
    stats = {k: {"mean": np.asarray(allt[k].to_pylist()).mean(0).tolist(), "std": [1.0, 1.0], "min": [-3.0, -3.0],
                 "max": [3.0, 3.0], "count": [sum(lengths)]} for k in ("observation.state", "action")}
    (root / "meta/stats.json").write_text(json.dumps(stats, indent=4))
    return root, tables, frames, side, tasks


def test_reads_lerobot_v30_layout(lerobot_v30):
    root, tables, frames, side, tasks = lerobot_v30
    ds = LeRobotDataset(root)
    assert (ds.version, ds.num_episodes, ds.num_frames, ds.fps) == ("v3.0", 3, 15, 15)
    assert ds.tasks == ["stack cups", "wipe table"]
    assert ds.video_keys == ["observation.images.front"] and ds.image_keys == ["observation.images.side"]
    for e, table in enumerate(tables):
        data = ds.episode_data(e)
        assert np.array_equal(data["action"], np.asarray(table["action"].to_pylist(), np.float32))
        assert np.array_equal(data["observation.state"], np.asarray(table["observation.state"].to_pylist(), np.float32))
        assert np.array_equal(data["index"], np.asarray(table["index"].to_pylist()))
        assert np.array_equal(ds.episode_images(e, "observation.images.side"), side[e])  # PNG: lossless
        front = ds.episode_images(e, "observation.images.front")  # from the right span of the right file
        assert front.shape == frames[e].shape and np.abs(front.astype(int) - frames[e]).mean() < 3.0
    assert ds.frame_tasks(0)[0] == "wipe table" and ds.frame_tasks(1)[0] == "stack cups"
    assert np.allclose(ds.stat("action")["mean"], np.asarray(pa.concat_tables(tables)["action"].to_pylist()).mean(0))
    ns = ds.norm_stats("observation.state", "min_max")
    assert isinstance(ns, NormStats) and ns.mode == "min_max" and ns.dim == 2


def test_reads_lerobot_v21_layout(tmp_path):
    """v2.1: one parquet and one mp4 per episode, JSON-lines metadata, stats per episode only."""
    root, fps, lengths, rng = tmp_path / "v21", 10, (4, 6), np.random.default_rng(5)
    frames = [smooth_frames(n, 9 * e) for e, n in enumerate(lengths)]
    ep_stats, tables = [], []
    for e, n in enumerate(lengths):
        t = frame_table(e, sum(lengths[:e]), n, fps, rng, e)
        tables.append(t)
        path = root / f"data/chunk-000/episode_{e:06d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(t, path)
        encode_mp4(root / f"videos/chunk-000/observation.images.top/episode_{e:06d}.mp4", frames[e], fps)
        act = np.asarray(t["action"].to_pylist())
        ep_stats.append({"episode_index": e, "stats": {"action": {
            "min": act.min(0).tolist(), "max": act.max(0).tolist(), "mean": act.mean(0).tolist(),
            "std": act.std(0).tolist(), "count": [n]}}})
    feats = {"observation.images.top": {"dtype": "video", "shape": [32, 32, 3],
                                        "names": ["height", "width", "channel"]},
             "observation.state": {"dtype": "float32", "shape": [2], "names": None},
             "action": {"dtype": "float32", "shape": [2], "names": None},
             **{k: {"dtype": d, "shape": [1], "names": None} for k, d in
                (("timestamp", "float32"), ("frame_index", "int64"), ("episode_index", "int64"), ("index", "int64"),
                 ("task_index", "int64"))}}
    info = {"codebase_version": "v2.1", "robot_type": None, "total_episodes": 2, "total_frames": 10, "total_tasks": 2,
            "total_videos": 2, "total_chunks": 1, "chunks_size": 1000, "fps": fps, "splits": {"train": "0:2"},
            "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
            "video_path": "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4",
            "features": feats}
    (root / "meta").mkdir()
    (root / "meta/info.json").write_text(json.dumps(info))
    (root / "meta/tasks.jsonl").write_text("".join(json.dumps({"task_index": i, "task": s}) + "\n"
                                                   for i, s in enumerate(["push the cube", "lift the cube"])))
    (root / "meta/episodes.jsonl").write_text("".join(
        json.dumps({"episode_index": e, "tasks": [["push the cube", "lift the cube"][e]], "length": n}) + "\n"
        for e, n in enumerate(lengths)))
    (root / "meta/episodes_stats.jsonl").write_text("".join(json.dumps(s) + "\n" for s in ep_stats))

    ds = LeRobotDataset(root)
    assert (ds.version, ds.num_episodes, ds.num_frames) == ("v2.1", 2, 10)
    for e, t in enumerate(tables):
        assert np.array_equal(ds.episode_data(e)["action"], np.asarray(t["action"].to_pylist(), np.float32))
        assert np.abs(ds.episode_images(e, "observation.images.top").astype(int) - frames[e]).mean() < 3.0
        assert ds.frame_tasks(e)[0] == ["push the cube", "lift the cube"][e]
    allact = np.concatenate([np.asarray(t["action"].to_pylist()) for t in tables])
    st = ds.stat("action")  # aggregated from episodes_stats.jsonl as LeRobot aggregates
    assert np.allclose(st["mean"], allact.mean(0)) and np.allclose(st["std"], allact.std(0))
    assert st["count"].tolist() == [10] and np.allclose(st["min"], allact.min(0))
    with pytest.raises(MissingKeyError, match="episodes_stats.jsonl has no 'observation.state' entry"):
        ds.norm_stats("observation.state")


def test_missing_stat_and_feature_name_the_key(tmp_path, written):
    root, _ = written
    ds = LeRobotDataset(root)
    with pytest.raises(MissingKeyError, match="no feature 'observation.images.side'"):
        ChunkSampler(ds, 4, 2, {"observation.images.side": "side"})
    with pytest.raises(MissingKeyError, match="no feature 'joint_pos'"):
        ChunkSampler(ds, 4, 2, {CAMS[0]: "top"}, state_key="joint_pos")
    import shutil

    copy = tmp_path / "nostats"
    shutil.copytree(root, copy)
    stats = json.loads((copy / "meta/stats.json").read_text())
    del stats["action"]
    del stats["observation.state"]["std"]
    (copy / "meta/stats.json").write_text(json.dumps(stats))
    sampler = ChunkSampler(LeRobotDataset(copy), 4, 2, {CAMS[0]: "top"})
    with pytest.raises(MissingKeyError, match=r"meta/stats.json has no 'action' entry") as err:
        sampler.norm_stats()
    assert isinstance(err.value, KeyError) and "'action'" in str(err.value)
    with pytest.raises(MissingKeyError, match=r"stats.json\['observation.state'\] has no 'std'"):
        LeRobotDataset(copy).norm_stats("observation.state")  # what the sampler's state statistics read
    (copy / "meta/stats.json").unlink()
    with pytest.raises(MissingKeyError, match="^meta/stats.json missing$"):  # named relative to the root
        LeRobotDataset(copy).stat("action")
    with pytest.raises(DatasetError, match="codebase_version 'v9.9'"):
        info = json.loads((copy / "meta/info.json").read_text())
        (copy / "meta/info.json").write_text(json.dumps({**info, "codebase_version": "v9.9"}))
        LeRobotDataset(copy)


# ---- robomimic / LIBERO HDF5 ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def libero_file(tmp_path_factory):
    import h5py

    path = tmp_path_factory.mktemp("hdf5") / "pick_up_the_bowl_demo.hdf5"
    rng = np.random.default_rng(7)
    demos = {}
    with h5py.File(path, "w") as f:
        data = f.create_group("data")
        data.attrs["problem_info"] = json.dumps({"problem_name": "libero_tabletop_manipulation",
                                                 "domain_name": "robosuite",
                                                 "language_instruction": "pick up the black bowl"})
        data.attrs["env_args"] = json.dumps({"type": 1, "env_name": "Libero_Tabletop_Manipulation",
                                             "env_kwargs": {"control_freq": 20, "camera_heights": 16}})
        for i, n in enumerate((6, 3, 5)):  # written out of order: demo_10 must come after demo_2
            name = ["demo_0", "demo_2", "demo_10"][i]
            g = data.create_group(name)
            d = {"actions": rng.normal(size=(n, 7)), "obs/agentview_rgb": smooth_frames(n, i, 16, 16),
                 "obs/eye_in_hand_rgb": smooth_frames(n, i + 50, 16, 16),
                 "obs/ee_pos": rng.normal(size=(n, 3)), "obs/gripper_states": rng.normal(size=(n, 2)),
                 "rewards": np.eye(n)[-1], "dones": np.eye(n, dtype=np.uint8)[-1]}
            for k, v in d.items():
                g.create_dataset(k, data=v)
            g.attrs["num_samples"] = n
            demos[name] = d
        f.create_dataset("mask/train", data=np.array([b"demo_0", b"demo_10"]))
    return path, demos


def test_hdf5_reader(libero_file):
    path, demos = libero_file
    with RobomimicDataset(path) as ds:
        assert ds.demo_names == ["demo_0", "demo_2", "demo_10"]
        assert (ds.num_episodes, ds.num_frames, ds.fps, ds.instruction) == (3, 14, 20.0, "pick up the black bowl")
        assert ds.camera_keys == ["obs/agentview_rgb", "obs/eye_in_hand_rgb"]
        assert ds.features["actions"]["shape"] == [7] and ds.features["rewards"]["shape"] == [1]
        for i, name in enumerate(ds.demo_names):
            assert np.array_equal(ds.episode_array(i, "actions"), demos[name]["actions"])
            assert np.array_equal(ds.episode_images(i, "obs/agentview_rgb"), demos[name]["obs/agentview_rgb"])
            assert ds.frame_tasks(i) == ["pick up the black bowl"] * len(demos[name]["actions"])
        allact = np.concatenate([demos[n]["actions"] for n in ds.demo_names])
        assert np.allclose(ds.stat("actions")["mean"], allact.mean(0)) and ds.stat("actions")["count"][0] == 14
        assert ds.stat("obs/agentview_rgb")["mean"].shape == (3, 1, 1)
        ep = ds.episode(2)
        assert (ep.length, ep.task) == (5, "pick up the black bowl") and "obs/agentview_rgb" not in ep.data
        assert np.array_equal(ep.data["obs/ee_pos"], demos["demo_10"]["obs/ee_pos"])
        assert ep.images("obs/agentview_rgb").shape == (5, 16, 16, 3)
        with pytest.raises(MissingKeyError, match="no 'obs/joint_states' entry"):
            ds.norm_stats("obs/joint_states")
    with RobomimicDataset(path, filter_key="train", rotate_images=True, instruction="other") as ds:
        assert ds.demo_names == ["demo_0", "demo_10"] and ds.instruction == "other"
        assert np.array_equal(ds.episode_images(1, "obs/eye_in_hand_rgb"),
                              demos["demo_10"]["obs/eye_in_hand_rgb"][:, ::-1, ::-1])


# ---- sampler --------------------------------------------------------------------------------------------

def test_sampler_batches(written):
    root, episodes = written
    ds = LeRobotDataset(root)
    cams = {CAMS[0]: "top", CAMS[1]: "wrist"}
    s = ChunkSampler(ds, horizon=4, batch_size=5, camera_map=cams, seed=3)
    assert s.num_samples == 21 and len(s) == 4
    obs, actions, mask = next(iter(s))
    assert isinstance(obs, Observation) and obs.batch_size == 5
    assert set(obs.images) == {"top", "wrist"}
    assert all(v.dtype == torch.uint8 and v.shape == (5, 3, 32, 32) for v in obs.images.values())
    assert obs.state.dtype == torch.float32 and obs.state.shape == (5, 4)
    assert actions.dtype == torch.float32 and actions.shape == (5, 4, 3)
    assert mask.dtype == torch.bool and mask.shape == (5, 4)

    # sample ids 5 and 6 are the last two frames of episode 0 (length 7); 7 is frame 0 of episode 1
    assert s.locate(5) == (0, 5) and s.locate(7) == (1, 0)
    obs, actions, mask = s.batch([5, 6, 7, 0])
    act0 = torch.from_numpy(episodes[0]["action"])
    assert mask[0].tolist() == [True, True, False, False] and mask[1].tolist() == [True, False, False, False]
    assert mask[2].all() and mask[3].all()
    assert torch.equal(actions[0, :2], act0[5:7]) and torch.equal(actions[0, 2], act0[6])  # padded with the last
    assert torch.equal(actions[1], act0[6].expand(4, 3))
    assert torch.equal(actions[2], torch.from_numpy(episodes[1]["action"][:4]))  # never crosses episodes
    assert torch.equal(obs.state[2], torch.from_numpy(episodes[1]["observation.state"][0]))
    assert obs.instruction == [TASKS[0], TASKS[0], TASKS[1], TASKS[0]]
    top = obs.images["top"][2].permute(1, 2, 0).numpy().astype(int)
    assert np.abs(top - episodes[1][CAMS[0]][0]).mean() < 3.0

    # reproducible: same seed, same batches; another seed, another order; epochs differ
    again = ChunkSampler(ds, horizon=4, batch_size=5, camera_map=cams, seed=3)
    for (o1, a1, m1), (o2, a2, m2) in zip(s.epoch(1), again.epoch(1)):
        assert torch.equal(a1, a2) and torch.equal(m1, m2) and o1.instruction == o2.instruction
        assert torch.equal(o1.images["top"], o2.images["top"]) and torch.equal(o1.state, o2.state)
    assert not np.array_equal(s.order(0), s.order(1))
    assert not np.array_equal(s.order(0), ChunkSampler(ds, 4, 5, cams, seed=4).order(0))
    assert sorted(s.order(2)) == list(range(21))  # an epoch visits every frame once
    assert len(ChunkSampler(ds, 4, 5, cams, drop_last=False)) == 5
    assert ChunkSampler(ds, 4, 5, cams, episodes=[2]).num_samples == 9

    stats = s.norm_stats()
    assert isinstance(stats["action"], NormStats) and isinstance(stats["state"], NormStats)
    allact = np.concatenate([e["action"] for e in episodes])
    assert torch.allclose(stats["action"].mean, torch.from_numpy(allact.mean(0)), atol=1e-6)
    assert torch.allclose(stats["action"].max, torch.from_numpy(allact.max(0)))
    assert stats["state"].dim == 4 and stats["action"].mode == "mean_std"
    assert s.norm_stats("min_max")["state"].mode == "min_max"
    assert ChunkSampler(ds, 4, 5, cams, state_key=None).norm_stats()["state"] is None


def test_sampler_on_hdf5(libero_file):
    path, demos = libero_file
    with RobomimicDataset(path) as ds:
        s = ChunkSampler(ds, horizon=8, batch_size=4, camera_map={"obs/agentview_rgb": "agentview"},
                         state_key="obs/ee_pos", action_key="actions", seed=0)
        obs, actions, mask = s.batch([6, 8])  # demo_2 (length 3): frames 0 and 2
        assert obs.images["agentview"].shape == (2, 3, 16, 16) and obs.state.shape == (2, 3)
        assert actions.shape == (2, 8, 7) and mask.sum(1).tolist() == [3, 1]
        assert obs.instruction == ["pick up the black bowl"] * 2
        assert torch.allclose(actions[0, :3], torch.from_numpy(demos["demo_2"]["actions"]).float())
        assert s.norm_stats()["action"].dim == 7
