"""SFT: batches from an offline dataset (the Environment Service samples them) -> grouped
`forward_backward` + `optim_step` through the Training Queue. Other tenants' requests share the
backbone forward; this file only sees its own tenant."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vlamux.errors import InvalidInputError
from vlamux.specs import SEED_MAX, bounded, check

if TYPE_CHECKING:  # the contract, for annotations only
    from vlamux.services.contract import Runtime

READER_OPTIONS = frozenset({"instruction", "filter_key", "rotate_images", "fps"})  # robomimic / LIBERO files


@dataclass
class SFTConfig:
    dataset: str = "data/demos/tabletop-goal"
    camera_map: dict = field(default_factory=lambda: {"observation.images.agentview": "agentview",
                                                      "observation.images.wrist": "wrist"})
    # the dataset's keys: LeRobot's by default; a robomimic / LIBERO file names its own ("actions",
    # "obs/ee_pos"); None: no state
    state_key: str | None = "observation.state"
    action_key: str = "action"
    reader: dict = field(default_factory=dict)  # the reader's options (robomimic: instruction, filter_key, ...)
    steps: int = bounded(500, 1, 10**8)
    batch_size: int = bounded(32, 1, 65536)
    grad_accum: int = bounded(1, 1, 1024)  # forward_backwards per optimizer step
    lr: float | None = bounded(None, 0.0, 10.0, lo_open=True)  # None: the slot's optimizer lr throughout
    schedule: str = bounded("constant", choices=("constant", "cosine"))  # cosine: from lr down to 0 over `steps`
    # a linear ramp from 0 to lr first (Adam's early steps on a fresh head are large)
    warmup_steps: int = bounded(0, 0, 10**8)
    seed: int = bounded(0, 0, SEED_MAX)
    timeout_s: float = bounded(120.0, 1e-3, 3600.0)

    def __post_init__(self):
        check(self)
        bad = [k for k, v in self.camera_map.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise InvalidInputError(f"camera_map: expected dataset camera key -> camera name (strings), got "
                                    f"{str(self.camera_map)[:80]}")
        unknown = sorted(set(self.reader) - READER_OPTIONS)
        if unknown:
            raise InvalidInputError(f"reader.{unknown[0]}: unknown option; allowed: {', '.join(sorted(READER_OPTIONS))}")
        if self.schedule == "cosine" and self.lr is None:
            raise InvalidInputError("lr: a cosine schedule needs its peak lr")


@dataclass
class SFTStats:
    step: int = 0
    losses: list = field(default_factory=list)
    version: int = 0
    samples: int = 0
    started: float = field(default_factory=time.monotonic)


class SFTRun:
    """`open()` opens the dataset and returns its statistics (install them in the slot before
    training); `run(start_step)` trains to `cfg.steps`, calling `on_step(stats)` after each step."""

    def __init__(self, services: Runtime, tenant: str, horizon: int, cfg: SFTConfig, on_step=None):
        self.services, self.tenant, self.horizon, self.cfg = services, tenant, horizon, cfg
        self.on_step = on_step or (lambda stats: None)
        self.stats = SFTStats()
        self.dataset_id: str | None = None

    def open(self, stats_mode: str = "mean_std") -> dict:
        env = self.services.environment
        self.dataset_id = env.open_dataset(self.tenant, self.cfg.dataset, self.horizon, self.cfg.batch_size,
                                           self.cfg.camera_map, state_key=self.cfg.state_key,
                                           action_key=self.cfg.action_key, seed=self.cfg.seed,
                                           options=self.cfg.reader or None)
        return env.dataset_stats(self.tenant, self.dataset_id, stats_mode)

    def lr_at(self, step: int) -> float | None:
        cfg = self.cfg
        if cfg.lr is None:
            return None
        ramp = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
        if cfg.schedule == "constant":
            return cfg.lr * ramp
        return cfg.lr * ramp * 0.5 * (1 + math.cos(math.pi * step / cfg.steps)) + 1e-8

    def run(self, start_step: int = 0) -> SFTStats:
        cfg, env = self.cfg, self.services.environment
        if self.dataset_id is None:
            self.open()
        self.stats.step = start_step

        def batches() -> list:
            return [env.sample(self.tenant, self.dataset_id) for _ in range(cfg.grad_accum)]

        try:
            ready = batches() if self.stats.step < cfg.steps else []
            while self.stats.step < cfg.steps:
                lr = self.lr_at(self.stats.step)
                if lr is not None:
                    self.services.set_lr(self.tenant, lr)  # queued: applies before this step's update
                futures = []
                for obs, actions, mask in ready:
                    futures.append(self.services.forward_backward(self.tenant, obs, actions, mask))
                    self.stats.samples += obs.batch_size
                step = self.services.optim_step(self.tenant)  # queued behind them: runs in order
                # the next step's batches load while the services run this one; nothing of them is
                # submitted before on_step (checkpoints there hold exactly this step's state)
                ready = batches() if self.stats.step + 1 < cfg.steps else []
                loss = sum(f.result(cfg.timeout_s)["loss"] for f in futures) / len(futures)
                self.stats.version = step.result(cfg.timeout_s)["policy_version"]
                self.stats.step += 1
                self.stats.losses.append(loss)
                self.on_step(self.stats)
        finally:
            env.close_dataset(self.tenant, self.dataset_id)
            self.dataset_id = None
        return self.stats
