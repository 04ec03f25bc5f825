"""Rollout memory: preallocated segment buffers in a pool of their own, reused for the whole run.

A segment is T vectorised steps of one sub-batch of n environments. The sampling lane fills a
buffer, the training lane consumes it and gives it back. Nothing on the rollout path allocates in
the model's memory: buffers are host tensors, pinned when CUDA is present, and the rows a training
call takes from them are gathered into pinned memory too (`gather`), so their copies to the device
are asynchronous; on the device they land in the rollout pool (vlamux.model.memory), never in the
pool that holds the model. The pool's size also bounds how many segments can be in flight, which
throttles the producers.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

import numpy as np
import torch

from vlamux.errors import VlamuxError
from vlamux.model.batch import Observation
from vlamux.model.heads.flow_sde import RL_SAMPLED


@dataclass(frozen=True)
class SegmentShape:
    steps: int  # T
    n_envs: int
    cameras: dict  # camera -> (H, W)
    state_dim: int
    horizon: int
    action_dim: int


def gather(src: torch.Tensor, idx: torch.Tensor, pin: bool | None = None) -> torch.Tensor:
    """Rows `idx` of `src`, gathered straight into a new (pinned, where CUDA is present) host tensor."""
    pin = torch.cuda.is_available() if pin is None else pin
    out = torch.empty((len(idx), *src.shape[1:]), dtype=src.dtype, pin_memory=pin)
    return torch.index_select(src, 0, idx, out=out)


class Segment:
    def __init__(self, shape: SegmentShape, pin: bool):
        t, n = shape.steps, shape.n_envs

        def empty(*dims, dtype=torch.float32):
            return torch.empty(*dims, dtype=dtype, pin_memory=pin)

        self.shape = shape
        self.pinned = pin
        self.images = {c: empty(t, n, 3, h, w, dtype=torch.uint8) for c, (h, w) in shape.cameras.items()}
        self.state = empty(t, n, shape.state_dim)
        self.actions = empty(t, n, shape.horizon, shape.action_dim)
        self.log_prob = empty(t, n)  # behaviour log-prob of the executed steps
        self.value = empty(t, n)
        self.reward = empty(t, n)
        self.done = empty(t, n, dtype=torch.bool)
        self.valid = empty(t, n, dtype=torch.bool)
        self.version = empty(t, n, dtype=torch.int64)
        self.last_value = empty(n)
        # a flow policy's chains (RL_SAMPLED), [T, n, ...]: made at the first sample that carries them
        self.sampled: dict[str, torch.Tensor] = {}
        self.instruction: list[str] = [""] * n
        self.group: np.ndarray | None = None  # GRPO: group id per env
        self.source = ""  # which sub-batch filled it

    def store(self, t: int, obs: dict, out: dict, executed: int) -> None:
        for c, img in obs["images"].items():
            self.images[c][t].copy_(torch.from_numpy(np.asarray(img)))
        self.state[t].copy_(torch.from_numpy(np.asarray(obs["state"], dtype=np.float32)))
        self.actions[t].copy_(out["actions"])
        if "step_log_prob" not in out:
            raise VlamuxError("the policy's sample has no log-probability, so RL cannot train it: a flow head "
                              "samples with one only when exploring (an RL job's rl.flow)")
        self.log_prob[t].copy_(out["step_log_prob"][:, :executed].sum(-1))
        if "value" in out:
            self.value[t].copy_(out["value"])
        else:  # a policy without a critic (GRPO)
            self.value[t].zero_()
        for k in RL_SAMPLED:
            if k in out:
                if k not in self.sampled:
                    self.sampled[k] = torch.empty(self.shape.steps, *out[k].shape, dtype=out[k].dtype,
                                                  pin_memory=self.pinned)
                self.sampled[k][t].copy_(out[k])
        self.version[t].fill_(int(out["policy_version"]))
        self.instruction = list(obs["instruction"])

    def rows(self, idx: torch.Tensor) -> Observation:
        """The observations of flat rows `idx` (row = t * n + env)."""
        n = self.shape.n_envs
        flat = {c: gather(v.flatten(0, 1), idx, self.pinned) for c, v in self.images.items()}
        return Observation(flat, [self.instruction[int(i) % n] for i in idx.tolist()],
                           gather(self.state.flatten(0, 1), idx, self.pinned))


class SegmentPool:
    """A fixed set of segments: `acquire` blocks (bounded) while all are in use."""

    def __init__(self, shape: SegmentShape, size: int):
        pin = torch.cuda.is_available()
        self.size = size
        self._free: queue.Queue[Segment] = queue.Queue()
        for _ in range(size):
            self._free.put(Segment(shape, pin))

    def acquire(self, timeout_s: float) -> Segment | None:
        try:
            return self._free.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def release(self, seg: Segment) -> None:
        self._free.put(seg)

    @property
    def free(self) -> int:
        return self._free.qsize()


def replace_rows(obs: dict, idx, new: dict) -> dict:
    """Rows `idx` of a batch of numpy observations replaced by `new`'s rows."""
    out = {"images": {c: v.copy() for c, v in obs["images"].items()}, "state": np.array(obs["state"], copy=True),
           "instruction": list(obs["instruction"])}
    for c in out["images"]:
        out["images"][c][idx] = new["images"][c]
    out["state"][idx] = new["state"]
    for j, i in enumerate(idx):
        out["instruction"][i] = new["instruction"][j]
    return out
