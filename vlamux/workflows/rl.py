"""RL on the four-lane asynchronous pipeline (D-VLA), and the synchronous baseline, from the same parts.

Lanes, each on its own thread(s), meeting only through queues:

1. sampling   — a `Sampler` per sub-batch of environments steps its envs (Environment Service);
2. inference  — its action chunks come from the Inference Queue (`services.predict`), each stamped
                with the policy version that produced it;
3. training   — `Learner` consumes filled segments, computes advantages (GAE for PPO, group-normalised
                returns for GRPO) and updates the tenant's slot through the Training Queue;
4. distribution — every optimizer step's new version reaches the inference replicas through the
                control plane's own thread (`PolicyPublisher`), never the data plane.

Staleness is bounded twice: producers wait while `max_staleness` segments are being filled, waiting or
being trained (and the segment pool is finite), and the learner leaves out every step whose action
came from a version more than `max_staleness` behind its own. What staleness remains is corrected by decoupled PPO
(`vlamux.model.policy_loss`) from the behaviour log-probs stored per step.

The synchronous mode runs the same samplers and learner in phases — roll out every sub-batch, train,
wait until the new weights reached inference — as RLinf and most VLA RL stacks do.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from vlamux.envs import EnvSpec
from vlamux.errors import VlamuxError
from vlamux.model.device import to_numpy
from vlamux.model.heads.flow_sde import RL_SAMPLED, FlowExploration
from vlamux.model.batch import Observation
from vlamux.model.policy_loss import PolicyLoss
from vlamux.model.batch import obs_to_observation
from vlamux.specs import SEED_MAX, bounded, check
from vlamux.workflows.advantages import gae, group_advantages
from vlamux.workflows.rollout import Segment, SegmentPool, SegmentShape, gather, replace_rows

if TYPE_CHECKING:  # the contract, for annotations only
    from vlamux.services.contract import Runtime

log = logging.getLogger(__name__)


@dataclass
class RLConfig:
    env: EnvSpec = field(default_factory=EnvSpec)
    tasks: tuple = ()  # multi-task RL: sub-batch i runs tasks[i % len(tasks)] (default: env.task only)
    algorithm: str = bounded("ppo", choices=("ppo", "grpo"))  # ppo | grpo
    mode: str = bounded("async", choices=("async", "sync"))  # async (four lanes) | sync (phases)
    env_steps: int = bounded(2000, 1, 10**9)  # budget: simulator steps over all envs
    n_envs: int = bounded(4, 1, 1024)  # per sub-batch
    sub_batches: int = bounded(2, 1, 64)
    env_workers: int = bounded(1, 1, 64)  # worker processes per sub-batch
    segment_steps: int = bounded(16, 1, 10**4)  # vectorised steps per segment (GRPO: long enough for an episode)
    group_size: int = bounded(4, 1, 1024)  # GRPO: envs reset to the same state
    episode_mean: bool = True  # GRPO: every episode weighs the same, however long (as in the GRPO paper);
    # False: every step does, so long (failed) episodes outweigh short (successful) ones
    # every reward is multiplied by it before advantages: a task whose shaped reward reaches 10 a step
    # (Meta-World) gives returns in the hundreds, which the critic's squared loss then dominates
    reward_scale: float = bounded(1.0, 0.0, 1e6, lo_open=True)
    gamma: float = bounded(0.99, 0.0, 1.0)
    lam: float = bounded(0.95, 0.0, 1.0)
    clip_eps: float = bounded(0.2, 1e-6, 10.0)
    max_is_weight: float = bounded(2.0, 1.0, 1e6)
    value_coef: float = bounded(0.5, 0.0, 1e3)
    entropy_coef: float = bounded(0.0, 0.0, 10.0)
    epochs: int = bounded(1, 1, 100)  # passes over a segment; one optimizer step each
    # PPO's early stop (as CleanRL's target_kl): no further pass once a pass finds the policy this far from
    # where the update began (the loss's approx_kl, mean log pi_old - log pi; the first pass's is 0, so
    # an update makes at least two); None: every pass
    target_kl: float | None = bounded(None, 0.0, 10.0, lo_open=True)
    # PPO: the first updates fit the value head only (an SFT-initialised policy comes with an untrained
    # critic, whose advantages would otherwise undo what SFT learned)
    critic_warmup: int = bounded(0, 0, 10**6)
    minibatch_rows: int = bounded(64, 1, 10**5)
    # versions a step's action may lag the learner (a trained segment adds up to `epochs`)
    max_staleness: int = bounded(2, 0, 10**3)
    deterministic: bool = False
    seed: int = bounded(0, 0, SEED_MAX)
    timeout_s: float = bounded(120.0, 1e-3, 3600.0)  # bound on any single service call
    # the learning rate for RL (None: keep the slot's), e.g. below the SFT phase's
    lr: float | None = bounded(None, 0.0, 10.0, lo_open=True)
    fresh_optimizer: bool = True  # with lr set: RL starts with fresh Adam moments. A converged SFT phase
    # leaves tiny second moments, which would scale the first policy-gradient steps up many times
    # a flow head's RL (Flow-SDE): its chain's noise level and stochastic steps; a job on a flow head
    # gets the defaults when it gives none
    flow: FlowExploration | None = None

    def __post_init__(self):
        check(self)
        if self.algorithm == "grpo" and self.n_envs % self.group_size:
            raise VlamuxError(f"group_size: {self.group_size} must divide n_envs ({self.n_envs})")
        if self.tasks and self.sub_batches % len(self.tasks):
            raise VlamuxError(f"sub_batches: {self.sub_batches} must be a multiple of the number of tasks "
                              f"({len(self.tasks)}), so that every task gets the same share of the envs")

    def task_of(self, sub_batch: int) -> str:
        return self.tasks[sub_batch % len(self.tasks)] if self.tasks else self.env.task


@dataclass
class Stats:
    """What a run did, updated live by the lanes (read it for progress)."""

    env_steps: int = 0
    episodes: list = field(default_factory=list)  # (env_steps at the end, success)
    by_task: dict = field(default_factory=dict)  # task -> [successes, episodes]
    segments_trained: int = 0
    segments_dropped: int = 0  # nothing fresh enough (or, GRPO, no group with signal) left to train on
    rows_dropped: int = 0  # steps older than max_staleness versions, left out
    lags: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    approx_kl: list = field(default_factory=list)  # per update, its last pass: how far the policy moved
    clip_frac: list = field(default_factory=list)
    passes: list = field(default_factory=list)  # per update: the passes it made (fewer than epochs: target_kl)
    version: int = 0
    started: float = field(default_factory=time.monotonic)
    lane_busy_s: dict = field(default_factory=lambda: {"sampling": 0.0, "inference": 0.0, "training": 0.0})

    def success_rate(self, last: int = 50) -> float | None:
        return success_rate(self.episodes, last)


def success_rate(episodes: list, last: int = 50) -> float | None:
    """Over the last `last` of (env steps, success) episodes."""
    recent = episodes[-last:]
    return sum(s for _, s in recent) / len(recent) if recent else None


class Sampler:
    """Lanes 1 and 2 for one sub-batch: step the envs, ask the Inference Queue for each chunk."""

    def __init__(self, services: Runtime, tenant: str, cfg: RLConfig, index: int, stats: Stats, lock: threading.Lock):
        self.services, self.tenant, self.cfg, self.index = services, tenant, cfg, index
        self.stats, self.lock = stats, lock
        self.env = services.environment
        self.task = cfg.task_of(index)
        self.sid = self.env.open_session(tenant, dataclasses.replace(cfg.env, task=self.task), cfg.n_envs,
                                         seed=cfg.seed + 1000 * index, n_workers=cfg.env_workers,
                                         timeout_s=cfg.timeout_s)
        self.obs = None
        self.pending = None  # the chunk for the current observations, asked for ahead of time
        self.episode = 0

    def close(self) -> None:
        self.env.close_session(self.tenant, self.sid)

    def _timed(self, lane: str, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            with self.lock:
                self.stats.lane_busy_s[lane] += time.perf_counter() - t0

    def _predict(self, obs: dict) -> dict:
        fut = self.services.predict(self.tenant, obs_to_observation(obs), deterministic=self.cfg.deterministic,
                                    explore=self.cfg.flow)
        return self._timed("inference", fut.result, self.cfg.timeout_s)

    def _reset(self, indices=None, seed=None) -> dict:
        obs, _ = self._timed("sampling", self.env.reset, self.tenant, self.sid, seed=seed, indices=indices)
        return obs

    def _reset_groups(self) -> None:
        """GRPO: every group's envs start from one state (sub-env i is seeded seed + i, so shift)."""
        cfg = self.cfg
        base = cfg.seed + 1_000_003 * (self.index + 1) + 7919 * self.episode
        self.episode += 1
        rows = [self._reset([i], base + (i // cfg.group_size) * 104_729 - i) for i in range(cfg.n_envs)]
        self.obs = {"images": {c: np.concatenate([r["images"][c] for r in rows]) for c in rows[0]["images"]},
                    "state": np.concatenate([r["state"] for r in rows]),
                    "instruction": [s for r in rows for s in r["instruction"]]}
        self.pending = None

    def fill(self, seg: Segment, fresh_policy: bool) -> None:
        """Run one segment into `seg`. fresh_policy: ask for the first chunk now (sync mode acts with
        the weights it just trained) rather than use the one asked for at the end of the last segment."""
        cfg = self.cfg
        n = cfg.n_envs
        grpo = cfg.algorithm == "grpo"
        if grpo:
            self._reset_groups()
            seg.group = np.arange(n) // cfg.group_size
        elif self.obs is None:
            self.obs = self._reset()
        if fresh_policy or self.pending is None:
            self.pending = self._predict(self.obs)
        executed = cfg.env.n_action_steps
        alive = torch.ones(n, dtype=torch.bool)
        for t in range(cfg.segment_steps):
            out = self.pending
            seg.store(t, self.obs, out, executed)
            obs, reward, term, trunc, infos = self._timed("sampling", self.env.step, self.tenant, self.sid,
                                                          to_numpy(out["actions"]))
            done = np.asarray(term) | np.asarray(trunc)
            seg.reward[t].copy_(torch.as_tensor(reward, dtype=torch.float32)).mul_(cfg.reward_scale)
            seg.done[t].copy_(torch.as_tensor(done))
            seg.valid[t].copy_(alive)
            finished = np.flatnonzero(done)
            with self.lock:
                self.stats.env_steps += n * executed
                for i in finished:
                    if not grpo or alive[i]:
                        ok = bool(infos[i].get("is_success", False))
                        self.stats.episodes.append((self.stats.env_steps, ok))
                        tally = self.stats.by_task.setdefault(self.task, [0, 0])
                        tally[0] += ok
                        tally[1] += 1
            if grpo:
                alive &= ~torch.as_tensor(done)
            if len(finished):
                obs = replace_rows(obs, finished, self._reset(finished.tolist()))
            self.obs = obs
            self.pending = self._predict(obs)
        if "value" in self.pending:
            seg.last_value.copy_(self.pending["value"])
        else:  # no critic (GRPO)
            seg.last_value.zero_()
        seg.source = f"sub-batch {self.index}"


class Learner:
    """Lane 3: advantages and updates through the Training Queue, one optimizer step per epoch."""

    def __init__(self, services: Runtime, tenant: str, cfg: RLConfig, stats: Stats, lock: threading.Lock):
        self.services, self.tenant, self.cfg, self.stats, self.lock = services, tenant, cfg, stats, lock
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.updates = 0

    def train(self, segs: list[Segment]) -> None:
        """One update (an optimizer step per epoch) on the rows of `segs` that are fresh enough."""
        cfg, t0 = self.cfg, time.perf_counter()
        version = self.services.version(self.tenant)
        parts = [self._rows(seg, version) for seg in segs]
        parts = [p for p in parts if p is not None]
        if not parts:
            return
        obs_of = [(seg, rows) for seg, rows, *_ in parts]
        sampled = None
        if parts[0][0].sampled:  # a flow policy's chains, kept by its rollout: what its update scores
            sampled = {k: torch.cat([gather(seg.sampled[k].flatten(0, 1), rows, seg.pinned)
                                     for seg, rows, *_ in parts]) for k in RL_SAMPLED}
        actions = torch.cat([a for _, _, a, _, _, _, _ in parts])
        behaviour = torch.cat([b for *_, b, _, _, _ in parts])
        adv = torch.cat([a for *_, a, _, _ in parts])
        returns = None if cfg.algorithm == "grpo" else torch.cat([r for *_, r, _ in parts])
        versions = torch.cat([v for *_, v in parts])
        if cfg.algorithm == "ppo":
            adv = (adv - adv.mean()) / (adv.std(unbiased=False) + 1e-6)
            if self.updates < cfg.critic_warmup:
                adv = torch.zeros_like(adv)  # no policy gradient yet: only the value loss trains
        self.updates += 1
        mask = torch.zeros(actions.shape[1], dtype=torch.bool)
        mask[: cfg.env.n_action_steps] = True
        proximal = torch.zeros_like(behaviour)
        losses = []
        for epoch in range(cfg.epochs):
            order = torch.randperm(len(behaviour), generator=self.gen)
            futures = []
            for mb in torch.split(order, cfg.minibatch_rows):
                loss = PolicyLoss(behaviour[mb], adv[mb], None if returns is None else returns[mb],
                                  proximal_log_prob=proximal[mb] if epoch else None, clip_eps=cfg.clip_eps,
                                  max_is_weight=cfg.max_is_weight, value_coef=cfg.value_coef,
                                  entropy_coef=cfg.entropy_coef,
                                  sampled=None if sampled is None else {k: gather(v, mb) for k, v in sampled.items()})
                futures.append((mb, self.services.forward_backward(
                    self.tenant, _observations(obs_of, mb), gather(actions, mb), mask.expand(len(mb), -1).clone(),
                    # the queue's staleness guard is for the data's age, not for this update's own passes
                    policy_version=int(versions[mb].min()) if epoch == 0 else None, loss=loss)))
            step = self.services.optim_step(self.tenant)
            kl, clipped = [], []
            for mb, fut in futures:
                out = fut.result(cfg.timeout_s)
                losses.append(out["loss"])
                kl.append(out["approx_kl"])
                clipped.append(out["clip_frac"])
                if epoch == 0:
                    proximal[mb] = out["log_prob"]
            new_version = step.result(cfg.timeout_s)["policy_version"]
            if cfg.target_kl is not None and np.mean(kl) > cfg.target_kl:
                break
        with self.lock:
            self.stats.segments_trained += len(parts)
            self.stats.version = new_version
            self.stats.losses.append(float(np.mean(losses)))
            self.stats.approx_kl.append(float(np.mean(kl)))
            self.stats.clip_frac.append(float(np.mean(clipped)))
            self.stats.passes.append(epoch + 1)
            self.stats.lane_busy_s["training"] += time.perf_counter() - t0

    def _rows(self, seg: Segment, version: int):
        """(seg, flat rows, actions, behaviour log-probs, advantages, returns, versions) of the
        segment's trainable rows, or None (counted as dropped) when none is left."""
        cfg = self.cfg
        valid = seg.valid.clone()
        if cfg.algorithm == "grpo":
            ep_return = (seg.reward * seg.valid).sum(0)
            adv_env, keep = group_advantages(ep_return, torch.as_tensor(seg.group))
            if cfg.episode_mean:
                steps = seg.valid.sum(0).clamp(min=1).float()
                adv_env = adv_env * steps[keep].mean() / steps if keep.any() else adv_env
            adv, ret = adv_env.expand_as(seg.reward).clone(), torch.zeros_like(seg.reward)
            valid &= keep
        else:
            adv, ret = gae(seg.reward, seg.value, seg.done, seg.last_value, cfg.gamma, cfg.lam)
        fresh = seg.version >= version - cfg.max_staleness  # the consumer's filter, per step
        rows = torch.nonzero((valid & fresh).flatten()).squeeze(1)
        with self.lock:
            self.stats.lags.append(version - int(seg.version[valid].min()) if valid.any() else 0)
            self.stats.rows_dropped += int((valid & ~fresh).sum())
            if len(rows) == 0:
                self.stats.segments_dropped += 1
        if len(rows) == 0:
            return None
        return (seg, rows, seg.actions.flatten(0, 1)[rows], seg.log_prob.flatten()[rows], adv.flatten()[rows],
                ret.flatten()[rows], seg.version.flatten()[rows])


def _observations(parts: list, idx: torch.Tensor):
    """The Observation of rows `idx` of the concatenation of each (segment, rows) part, in idx's order
    (the order of the actions and log-probs they are trained with)."""
    pieces, placed, start = [], [], 0
    for seg, rows in parts:
        inside = (idx >= start) & (idx < start + len(rows))
        if inside.any():
            pieces.append(seg.rows(rows[idx[inside] - start]))
            placed.append(torch.nonzero(inside).squeeze(1))
        start += len(rows)
    if len(pieces) == 1:
        return pieces[0]
    back = torch.empty(len(idx), dtype=torch.long)
    back[torch.cat(placed)] = torch.arange(len(idx))  # minibatch position -> row of the concatenation
    instructions = [s for p in pieces for s in p.instruction]
    return Observation({c: gather(torch.cat([p.images[c] for p in pieces]), back) for c in pieces[0].images},
                       [instructions[i] for i in back.tolist()], gather(torch.cat([p.state for p in pieces]), back))


class RLRun:
    """One tenant's RL job on the services. `run()` returns its Stats; `on_progress(stats)` is called
    after every trained segment."""

    def __init__(self, services: Runtime, tenant: str, cfg: RLConfig, on_progress=None):
        self.services, self.tenant, self.cfg = services, tenant, cfg
        self.on_progress = on_progress or (lambda stats: None)
        self.stats = Stats()
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._errors: list[BaseException] = []

    def run(self) -> Stats:
        cfg = self.cfg
        if cfg.lr is not None:
            self.services.set_lr(self.tenant, cfg.lr, cfg.fresh_optimizer).result(cfg.timeout_s)
        samplers = [Sampler(self.services, self.tenant, cfg, i, self.stats, self.lock) for i in range(cfg.sub_batches)]
        try:
            shape = self._shape(samplers[0])
            learner = Learner(self.services, self.tenant, cfg, self.stats, self.lock)
            self.stats.started = time.monotonic()
            if cfg.mode == "sync":
                self._run_sync(samplers, learner, SegmentPool(shape, cfg.sub_batches))
            else:
                self._run_async(samplers, learner, SegmentPool(shape, cfg.sub_batches + 1))
        finally:
            for s in samplers:
                try:
                    s.close()
                except Exception:  # noqa: BLE001 - closing is best effort; the reaper gets the rest
                    log.exception("closing a sampler's env session")
        if self._errors:
            raise self._errors[0]
        return self.stats

    def stop(self) -> None:
        """Sample no new segment; `run()` trains what is in flight and returns its stats."""
        self._stop.set()

    def _shape(self, sampler: Sampler) -> SegmentShape:
        obs = sampler.obs = sampler._reset()
        probe = sampler._predict(obs)
        sampler.pending = probe
        _, h, a = probe["actions"].shape
        return SegmentShape(self.cfg.segment_steps, self.cfg.n_envs,
                            {c: tuple(v.shape[-2:]) for c, v in obs["images"].items()}, obs["state"].shape[-1], h, a)

    def _budget_left(self) -> bool:
        with self.lock:
            return self.stats.env_steps < self.cfg.env_steps and not self._errors and not self._stop.is_set()

    def _run_sync(self, samplers, learner, pool: SegmentPool) -> None:
        while self._budget_left():
            segs = [pool.acquire(self.cfg.timeout_s) for _ in samplers]
            threads = [threading.Thread(target=self._guard, args=(s.fill, seg, True)) for s, seg in zip(samplers, segs)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            if self._errors:
                break
            learner.train(segs)  # then train, on all of them at once ...
            for seg in segs:
                pool.release(seg)
            t0 = time.perf_counter()
            self.services.flush(self.cfg.timeout_s)  # ... then wait for the weights to reach inference
            self.stats.lane_busy_s.setdefault("distribution_wait", 0.0)
            self.stats.lane_busy_s["distribution_wait"] += time.perf_counter() - t0
            self.on_progress(self.stats)

    def _run_async(self, samplers, learner, pool: SegmentPool) -> None:
        ready: queue.Queue[Segment] = queue.Queue()
        # producer throttle: at most max_staleness segments between their first action and their update
        waiting = threading.Semaphore(max(1, self.cfg.max_staleness))

        def sample_lane(sampler: Sampler) -> None:
            while self._budget_left():
                if not waiting.acquire(timeout=0.5):
                    continue
                seg = pool.acquire(0.5)
                if seg is None:
                    waiting.release()
                    continue
                # the chunk asked for at the end of its last segment may be old by now (it waited)
                behind = sampler.pending is not None and sampler.pending["policy_version"] < \
                    self.services.version(self.tenant)
                sampler.fill(seg, fresh_policy=behind)
                ready.put(seg)

        threads = [threading.Thread(target=self._guard, args=(sample_lane, s), name=f"vlamux-sampler-{i}",
                                    daemon=True) for i, s in enumerate(samplers)]
        for th in threads:
            th.start()
        try:
            while any(th.is_alive() for th in threads) or not ready.empty():
                try:
                    seg = ready.get(timeout=0.5)
                except queue.Empty:
                    continue
                try:
                    learner.train([seg])
                finally:
                    pool.release(seg)
                    waiting.release()
                self.on_progress(self.stats)
        finally:
            self._stop.set()
            for th in threads:
                th.join(self.cfg.timeout_s)

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - raised from run() on the caller's thread
            log.exception("RL lane of tenant %r failed", self.tenant)
            self._errors.append(e)
            self._stop.set()
