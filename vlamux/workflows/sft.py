"""SFT: batches from an offline dataset (the Environment Service samples them) -> grouped
`forward_backward` + `optim_step` through the Training Queue. Other tenants' requests share the
backbone forward; this file only sees its own tenant."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class SFTConfig:
    dataset: str = "data/demos/tabletop-goal"
    camera_map: dict = field(default_factory=lambda: {"observation.images.agentview": "agentview",
                                                      "observation.images.wrist": "wrist"})
    steps: int = 500
    batch_size: int = 32
    grad_accum: int = 1  # forward_backwards per optimizer step
    seed: int = 0
    timeout_s: float = 120.0


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

    def __init__(self, services, tenant: str, horizon: int, cfg: SFTConfig, on_step=None):
        self.services, self.tenant, self.horizon, self.cfg = services, tenant, horizon, cfg
        self.on_step = on_step or (lambda stats: None)
        self.stats = SFTStats()
        self.dataset_id: str | None = None

    def open(self, stats_mode: str = "mean_std") -> dict:
        env = self.services.environment
        self.dataset_id = env.open_dataset(self.tenant, self.cfg.dataset, self.horizon, self.cfg.batch_size,
                                           self.cfg.camera_map, seed=self.cfg.seed)
        return env.dataset_stats(self.tenant, self.dataset_id, stats_mode)

    def run(self, start_step: int = 0) -> SFTStats:
        cfg, env = self.cfg, self.services.environment
        if self.dataset_id is None:
            self.open()
        self.stats.step = start_step
        try:
            while self.stats.step < cfg.steps:
                futures = []
                for _ in range(cfg.grad_accum):
                    obs, actions, mask = env.sample(self.tenant, self.dataset_id)
                    futures.append(self.services.forward_backward(self.tenant, obs, actions, mask))
                    self.stats.samples += obs.batch_size
                step = self.services.optim_step(self.tenant)  # queued behind them: runs in order
                loss = sum(f.result(cfg.timeout_s)["loss"] for f in futures) / len(futures)
                self.stats.version = step.result(cfg.timeout_s)["policy_version"]
                self.stats.step += 1
                self.stats.losses.append(loss)
                self.on_step(self.stats)
        finally:
            env.close_dataset(self.tenant, self.dataset_id)
            self.dataset_id = None
        return self.stats
