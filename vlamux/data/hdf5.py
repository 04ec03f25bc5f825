"""robomimic / LIBERO demonstration files (HDF5), read episode by episode.

Layout (robomimic's, which LIBERO extends):

    data/                       attrs: env_args (JSON: env_name, env_kwargs.control_freq, ...),
                                       total; LIBERO adds problem_info (JSON with
                                       "language_instruction"), bddl_file_name, ...
    data/demo_0/actions         [T, A]
    data/demo_0/obs/<name>      [T, ...]; cameras are uint8 [T, H, W, 3] (e.g. agentview_rgb,
                                eye_in_hand_rgb; robomimic: agentview_image, robot0_eye_in_hand_image)
    data/demo_0/rewards, dones  [T]
    data/demo_0/states, ...     other arrays
    mask/<filter_key>           optional: names of the demos in a split (e.g. b"demo_0")

Feature keys are paths below a demo: "actions", "obs/agentview_rgb", "rewards". Statistics are
computed from the file (it stores none): exact over every frame for numeric features, per channel
in [0, 1] with shape (3, 1, 1) for cameras, as LeRobot computes them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from vlamux.data.episodes import ByteLRU, EpisodeDataset
from vlamux.data.errors import DatasetFormatError, MissingKeyError
from vlamux.data.lerobot_format import _have
from vlamux.data.stats import feature_stats, image_stats

DEFAULT_FPS = 20  # robomimic's and LIBERO's control frequency


def _attr_json(attrs, name: str, where: str) -> dict | None:
    if name not in attrs:
        return None
    raw = attrs[name]
    if isinstance(raw, bytes):
        raw = raw.decode()
    try:
        return json.loads(raw)
    except (TypeError, json.JSONDecodeError) as e:
        raise DatasetFormatError(f"{where}: attribute {name!r} is not JSON ({e})") from None


def _demo_order(name: str):
    m = re.search(r"(\d+)$", name)
    return (0, int(m.group(1)), name) if m else (1, 0, name)


class RobomimicDataset(EpisodeDataset):
    """A robomimic/LIBERO HDF5 file of demos as an episode dataset.

    instruction: the task of every demo; by default LIBERO's problem_info["language_instruction"]
    (robomimic files have none: pass one). fps: by default env_args.env_kwargs.control_freq, else 20.
    filter_key: read only the demos listed under mask/<filter_key>. rotate_images: turn every camera
    frame by 180 degrees (LIBERO's raw renders are upside down; OpenVLA's regenerated sets are not).
    """

    def __init__(self, path: str | Path, *, instruction: str | None = None, fps: float | None = None,
                 filter_key: str | None = None, rotate_images: bool = False, cache_mb: float = 512):
        import h5py

        self.path = Path(path)
        self.name = self.path.name  # what errors name: the file, never the machine's directories
        self.source = self.name
        self.stats_source = f"{self.name} (computed statistics)"
        try:
            self._file = h5py.File(self.path, "r")
        except FileNotFoundError:
            raise DatasetFormatError(f"{self.name}: file missing") from None
        except OSError as e:
            raise DatasetFormatError(f"{self.name}: not an HDF5 file ({str(e).replace(str(self.path), self.name)})") \
                from None
        self._local("data")  # before any look inside: a link to another file is refused unread
        if "data" not in self._file:
            raise DatasetFormatError(f"{self.name}: no 'data' group (groups: {_have(self._file.keys())})")
        data = self._file["data"]
        self.env_args = _attr_json(data.attrs, "env_args", f"{self.name}:/data") or {}
        self.problem_info = _attr_json(data.attrs, "problem_info", f"{self.name}:/data") or {}
        names = sorted((k for k in data.keys() if k.startswith("demo")), key=_demo_order)
        if filter_key is not None:
            self._local(f"mask/{filter_key}")
            mask = self._file.get(f"mask/{filter_key}")
            if mask is None:
                have = list(self._file["mask"].keys()) if "mask" in self._file else []
                raise MissingKeyError(f"{self.name}: no mask/{filter_key!r} (masks: {_have(have)})")
            wanted = {m.decode() if isinstance(m, bytes) else str(m) for m in mask[()]}
            names = [n for n in names if n in wanted]
        if not names:
            raise DatasetFormatError(f"{self.name}: no demos under /data")
        self.demo_names = names
        self._lengths = []
        for n in names:
            self._local(f"data/{n}/actions")
            g = data[n]
            if "actions" not in g:
                raise DatasetFormatError(f"{self.name}:/data/{n}: no 'actions' dataset")
            self._lengths.append(int(g["actions"].shape[0]))

        if instruction is None:
            li = self.problem_info.get("language_instruction")
            if isinstance(li, (list, tuple)):
                li = " ".join(map(str, li))
            instruction = li
        if not instruction:
            raise DatasetFormatError(f"{self.name}: no language instruction (LIBERO stores one in "
                                     f"data.attrs['problem_info']); pass instruction=")
        self.instruction = str(instruction)
        self.tasks = [self.instruction]
        control = (self.env_args.get("env_kwargs") or {}).get("control_freq")
        self.fps = float(fps if fps is not None else control if control else DEFAULT_FPS)
        self.rotate_images = rotate_images
        self.features = self._features(data[names[0]])
        self._cache = ByteLRU(int(cache_mb * 2 ** 20))
        self._stats: dict[str, dict[str, np.ndarray]] = {}

    def _local(self, key: str) -> None:
        """Refuse `key` (a path in the file) if reading it would read another file: an external link
        on its way, a virtual dataset or external storage (what the upload check refuses too).
        Looks at links only, so the refusal does not depend on what the other file holds; a `key`
        that is not there passes (the caller says so)."""
        import h5py

        parts = [p for p in key.split("/") if p]
        for n in range(1, len(parts) + 1):
            sub = "/".join(parts[:n])
            link = self._file.get(sub, getlink=True)
            if isinstance(link, h5py.ExternalLink):
                raise DatasetFormatError(f"{self.name}:/{sub}: an external link (to another file); "
                                         f"links to other files are not read")
        obj = self._file.get(key)
        if isinstance(obj, h5py.Dataset) and (obj.is_virtual or obj.external):
            raise DatasetFormatError(f"{self.name}:/{key}: stored outside the file (virtual or external "
                                     f"storage), which is not read")

    def _array(self, i: int, key: str) -> np.ndarray:
        """The whole `key` array of demo i, read from this file only."""
        name = self.demo_names[i]
        self._local(f"data/{name}/{key}")
        if key not in self._file["data"][name]:
            raise DatasetFormatError(f"{self.name}:/data/{name}: no {key!r} (the first demo has it)")
        return self._file["data"][name][key][()]

    def _features(self, demo) -> dict[str, dict]:
        import h5py

        out = {}

        def visit(name, obj):
            if not isinstance(obj, h5py.Dataset) or obj.ndim == 0:
                return
            shape = list(obj.shape[1:])
            if obj.dtype == np.uint8 and obj.ndim == 4 and shape[-1] == 3:
                out[name] = {"dtype": "image", "shape": shape, "names": ["height", "width", "channels"]}
            elif obj.dtype.kind in "fiub":
                out[name] = {"dtype": str(obj.dtype), "shape": shape or [1], "names": None}

        demo.visititems(visit)
        return out

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> RobomimicDataset:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def num_episodes(self) -> int:
        return len(self.demo_names)

    def episode_length(self, i: int) -> int:
        return self._lengths[self._check_episode(i)]

    def _read(self, i: int, key: str) -> np.ndarray:
        i = self._check_episode(i)
        self.feature(key)
        cached = self._cache.get((i, key))
        if cached is not None:
            return cached
        arr = self._array(i, key)
        if len(arr) != self._lengths[i]:
            raise DatasetFormatError(f"{self.name}:/data/{self.demo_names[i]}/{key}: {len(arr)} frames, "
                                     f"actions have {self._lengths[i]}")
        if self.features[key]["dtype"] == "image" and self.rotate_images:
            arr = np.ascontiguousarray(arr[:, ::-1, ::-1])
        arr.setflags(write=False)
        self._cache.put((i, key), arr)
        return arr

    def episode_array(self, i: int, key: str) -> np.ndarray:
        if self.is_camera(key):
            raise DatasetFormatError(f"{self.name}: {key!r} is a camera; use episode_images")
        return self._read(i, key)

    def episode_images(self, i: int, key: str) -> np.ndarray:
        if not self.is_camera(key):
            raise DatasetFormatError(f"{self.name}: {key!r} is not a camera (uint8 [T, H, W, 3])")
        return self._read(i, key)

    def frame_tasks(self, i: int) -> list[str]:
        return [self.instruction] * self.episode_length(i)

    @property
    def stats(self) -> dict[str, dict[str, np.ndarray]]:
        """Statistics of every feature (computed on first use, cameras included)."""
        for key in self.features:
            self._compute_stats(key)
        return self._stats

    def stat(self, key: str) -> dict[str, np.ndarray]:
        if key not in self.features:
            raise MissingKeyError(f"{self.stats_source} has no {key!r} entry (features: {_have(self.features)})")
        return self._compute_stats(key)

    def _compute_stats(self, key: str) -> dict[str, np.ndarray]:
        if key not in self._stats:
            demo_names = range(self.num_episodes)
            if self.features[key]["dtype"] == "image":
                from vlamux.data.stats import aggregate_stats

                per = [{key: image_stats(self._array(i, key))} for i in demo_names]
                self._stats[key] = aggregate_stats(per)[key]
            else:
                self._stats[key] = feature_stats(np.concatenate([self._array(i, key) for i in demo_names]))
        return self._stats[key]
