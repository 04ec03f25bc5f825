"""Training batches of action chunks from an episode dataset, in the model core's schema.

A sample is one frame t of one episode: the cameras and state at t, the frame's task as the
instruction, and the action chunk actions[t : t + H] of the same episode. Past the episode's end
the chunk repeats the last action and the mask is False there (LeRobot's `action_is_pad`,
inverted). Actions and state are returned in dataset units: the tenant's slot normalises them
with the statistics `norm_stats()` returns.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from vlamux.data.episodes import EpisodeDataset
from vlamux.data.errors import DatasetError
from vlamux.model.batch import Observation
from vlamux.model.normalize import NormStats

Batch = tuple[Observation, Tensor, Tensor]  # (observation, actions float32 [B, H, A], action_mask bool [B, H])


class ChunkSampler:
    """Seeded batches of (Observation, action chunk, mask) drawn from every frame of the episodes.

    camera_map: dataset camera key -> camera name in the Observation. state_key: None for no state.
    Each epoch visits every frame of `episodes` (all by default) once, in an order fixed by
    (seed, epoch); iterating the sampler runs epochs 0, 1, 2, ... without end, `epoch(n)` runs one.
    """

    def __init__(self, dataset: EpisodeDataset, horizon: int, batch_size: int, camera_map: Mapping[str, str],
                 state_key: str | None = "observation.state", action_key: str = "action", seed: int = 0,
                 *, episodes: Sequence[int] | None = None, drop_last: bool = True):
        if not isinstance(horizon, int) or horizon < 1:
            raise DatasetError(f"horizon: expected a positive int, got {horizon!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise DatasetError(f"batch_size: expected a positive int, got {batch_size!r}")
        if not camera_map:
            raise DatasetError("camera_map: at least one camera is required")
        if len(set(camera_map.values())) != len(camera_map):
            raise DatasetError(f"camera_map: two dataset keys map to one camera name: {dict(camera_map)}")
        for key in camera_map:
            if not dataset.is_camera(key):  # raises MissingKeyError naming the key if absent
                raise DatasetError(f"camera_map: {key!r} is not a camera of the dataset "
                                   f"(cameras: {', '.join(dataset.camera_keys) or 'none'})")
        for key in ([state_key] if state_key is not None else []) + [action_key]:
            if dataset.is_camera(key):
                raise DatasetError(f"{key!r} is a camera, not a numeric feature")
        self.dataset = dataset
        self.horizon, self.batch_size = horizon, batch_size
        self.camera_map = dict(camera_map)
        self.state_key, self.action_key = state_key, action_key
        self.seed, self.drop_last = int(seed), drop_last
        self.episodes = np.asarray(range(dataset.num_episodes) if episodes is None else list(episodes), np.int64)
        for e in self.episodes:
            dataset.episode_length(int(e))  # range check
        lengths = np.array([dataset.episode_length(int(e)) for e in self.episodes], np.int64)
        self._starts = np.concatenate([[0], np.cumsum(lengths)])
        self.num_samples = int(self._starts[-1])
        if self.num_samples == 0:
            raise DatasetError("the sampler's episodes hold no frames")

    # ---- statistics ----
    def norm_stats(self, mode: str = "mean_std") -> dict[str, NormStats | None]:
        """The dataset's statistics of the action and state features, for `Slot.set_stats`."""
        return {"action": self.dataset.norm_stats(self.action_key, mode),
                "state": None if self.state_key is None else self.dataset.norm_stats(self.state_key, mode)}

    # ---- batches ----
    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full if self.drop_last or not rest else full + 1

    def order(self, epoch: int) -> np.ndarray:
        """The sample order of an epoch: a permutation of range(num_samples) fixed by (seed, epoch)."""
        return np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_samples)

    def epoch(self, epoch: int) -> Iterator[Batch]:
        order = self.order(epoch)
        for b in range(len(self)):
            yield self.batch(order[b * self.batch_size:(b + 1) * self.batch_size])

    def __iter__(self) -> Iterator[Batch]:
        e = 0
        while True:
            yield from self.epoch(e)
            e += 1

    def locate(self, sample: int) -> tuple[int, int]:
        """(episode index, frame index) of a sample id in [0, num_samples)."""
        if not 0 <= sample < self.num_samples:
            raise IndexError(f"sample {sample} out of range [0, {self.num_samples})")
        k = int(np.searchsorted(self._starts, sample, side="right") - 1)
        return int(self.episodes[k]), int(sample - self._starts[k])

    def batch(self, samples: Sequence[int]) -> Batch:
        """The batch of the given sample ids (see `locate`)."""
        where = [self.locate(int(s)) for s in samples]
        if not where:
            raise DatasetError("batch: no samples")
        ds, h = self.dataset, self.horizon
        b = len(where)
        actions, mask, states, instructions = [], np.zeros((b, h), bool), [], []
        per_episode: dict[int, tuple] = {}  # each episode's arrays, fetched once per batch
        for row, (ep, t) in enumerate(where):
            if ep not in per_episode:
                n = ds.episode_length(ep)
                act = np.asarray(ds.episode_array(ep, self.action_key), np.float32).reshape(n, -1)
                st = None if self.state_key is None else \
                    np.asarray(ds.episode_array(ep, self.state_key), np.float32).reshape(n, -1)
                per_episode[ep] = (act, st, ds.frame_tasks(ep))
            act, st, tasks = per_episode[ep]
            idx = np.arange(t, t + h)
            mask[row] = idx < len(act)
            actions.append(act[np.minimum(idx, len(act) - 1)])
            if st is not None:
                states.append(st[t])
            instructions.append(tasks[t])
        images = {}
        for key, name in self.camera_map.items():
            frames = [ds.episode_images(ep, key)[t] for ep, t in where]
            shapes = {f.shape for f in frames}
            if len(shapes) != 1:
                raise DatasetError(f"camera {key!r}: frames of different sizes in one batch: {sorted(shapes)}")
            images[name] = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous()
        obs = Observation(images=images, instruction=instructions,
                          state=torch.from_numpy(np.stack(states)) if states else None)
        return obs, torch.from_numpy(np.stack(actions)), torch.from_numpy(mask)

