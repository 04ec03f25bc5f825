"""Vectorised environments whose simulators live in worker processes.

The caller's process never runs a simulator. Every call has a deadline: a
worker that does not answer in time is killed and replaced, a worker that
died is replaced, and the caller gets `EnvTimeoutError` / `EnvWorkerCrashed`
naming the worker, its envs and the call — a stuck renderer can never stall
the caller. Sub-envs of a replaced worker must be reset before they step
again; the healthy sub-envs' results travel on the exception (`.partial`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass

import numpy as np

from vlamux.envs.base import EnvError, EnvSpec, EnvTimeoutError, EnvWorkerCrashed

log = logging.getLogger(__name__)


def _worker_main(conn, spec: EnvSpec, n_envs: int) -> None:
    # Simulators render on the CPU; one thread each keeps workers from fighting over cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from vlamux.envs import make_env

    try:
        envs = [make_env(spec) for _ in range(n_envs)]
    except Exception:  # noqa: BLE001 - the caller gets the reason, not just a dead worker
        conn.send(("error", traceback.format_exc()))
        return
    space = envs[0].action_space
    conn.send(("ready", {"low": space.low.reshape(-1), "high": space.high.reshape(-1)}))
    while True:
        try:
            cmd, payload = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "reset_some":  # payload: per env a seed (or None), or "keep" to leave it running
                conn.send(("ok", [None if s == "keep" else env.reset(seed=s) for env, s in zip(envs, payload)]))
            elif cmd == "step":
                conn.send(("ok", [_run_chunk(env, chunk) for env, chunk in zip(envs, payload)]))
            elif cmd == "ping":
                conn.send(("ok", os.getpid()))
            elif cmd == "debug_sleep":  # lets tests make a worker hang the way a stuck renderer does
                time.sleep(payload)
                conn.send(("ok", None))
            elif cmd == "close":
                for env in envs:
                    env.close()
                conn.send(("ok", None))
                return
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except Exception:  # noqa: BLE001 - reported to the caller, the worker lives on
            conn.send(("error", traceback.format_exc()))


def _run_chunk(env, chunk):
    """Execute up to len(chunk) actions, stopping at the end of the episode."""
    reward, term, trunc, info, obs = 0.0, False, False, {}, None
    for action in chunk:
        obs, r, term, trunc, info = env.step(action)
        reward += r
        if term or trunc:
            break
    return obs, reward, term, trunc, info


@dataclass
class _Worker:
    proc: mp.Process
    conn: object
    envs: list[int]  # global sub-env indices


class VectorEnv:
    """n sub-environments of one `EnvSpec`, spread over worker processes."""

    def __init__(self, spec: EnvSpec, n_envs: int, n_workers: int | None = None, timeout_s: float = 30.0,
                 start_timeout_s: float = 120.0):
        if n_envs < 1:
            raise ValueError(f"n_envs must be >= 1, got {n_envs}")
        self.spec, self.n_envs = spec, n_envs
        self.n_workers = max(1, min(n_envs, n_workers or os.cpu_count() or 1))
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self._ctx = mp.get_context("spawn")
        bounds = np.linspace(0, n_envs, self.n_workers + 1).round().astype(int)
        self._workers: list[_Worker | None] = [None] * self.n_workers
        self._assign = [list(range(bounds[w], bounds[w + 1])) for w in range(self.n_workers)]
        self.needs_reset = np.ones(n_envs, dtype=bool)
        self.restarts = 0
        for w in range(self.n_workers):
            self._start(w)
        self._wait_ready(range(self.n_workers))

    # ---- workers --------------------------------------------------------------------------------
    def _start(self, w: int) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child, self.spec, len(self._assign[w])), daemon=True,
                                 name=f"vlamux-env-{w}")
        proc.start()
        child.close()
        self._workers[w] = _Worker(proc, parent, self._assign[w])
        self.needs_reset[self._assign[w]] = True

    def _wait_ready(self, ws) -> None:
        for w in ws:
            worker = self._workers[w]
            if not worker.conn.poll(self.start_timeout_s):
                self._kill(w)
                raise EnvTimeoutError(f"env worker {w} ({self.spec.backend}/{self.spec.task}) did not start within "
                                      f"{self.start_timeout_s:.0f}s")
            try:
                status, value = worker.conn.recv()
            except EOFError:
                self.close()
                raise EnvWorkerCrashed(f"env worker {w} died while creating {self.spec.backend}/{self.spec.task}; "
                                       f"exit code {worker.proc.exitcode}") from None
            if status != "ready":
                self.close()
                last = value.strip().splitlines()[-1]
                raise EnvError(f"env worker {w} could not create {self.spec.backend}/{self.spec.task}: {last}")
            self.action_low, self.action_high = value["low"], value["high"]

    def _kill(self, w: int) -> None:
        worker = self._workers[w]
        if worker is None:
            return
        worker.proc.kill()
        worker.proc.join(timeout=5)
        worker.conn.close()
        self._workers[w] = None

    def _replace(self, w: int) -> None:
        self._kill(w)
        self.restarts += 1
        self._start(w)
        self._wait_ready([w])

    @property
    def action_dim(self) -> int:
        return len(self.action_low)

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    # ---- calls ----------------------------------------------------------------------------------
    def _call(self, cmd: str, payloads: dict[int, object], timeout_s: float | None = None) -> dict[int, object]:
        """Send one command to each worker in `payloads`; gather replies by a shared deadline."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        for w, payload in payloads.items():
            try:
                self._workers[w].conn.send((cmd, payload))
            except (BrokenPipeError, OSError):
                pass  # found dead below
        replies, failures, errors = {}, [], []  # every reply is read before raising: pipes stay in step
        for w in payloads:
            worker = self._workers[w]
            try:
                if not worker.conn.poll(max(0.0, deadline - time.monotonic())):
                    failures.append((w, EnvTimeoutError, f"did not answer {cmd!r} within "
                                                        f"{timeout_s or self.timeout_s:.1f}s"))
                    continue
                status, value = worker.conn.recv()
            except (EOFError, OSError):
                failures.append((w, EnvWorkerCrashed, f"died during {cmd!r} (exit code {worker.proc.exitcode})"))
                continue
            if status != "ok":
                errors.append(f"env worker {w} ({self.spec.backend}/{self.spec.task}) failed {cmd!r}:\n{value}")
                continue
            replies[w] = value
        if failures:
            for w, _, _ in failures:
                log.warning("replacing env worker %d", w)
                self._replace(w)
            w, kind, why = failures[0]
            envs = sorted(i for f in failures for i in self._assign[f[0]])
            err = kind(f"env worker {w} ({self.spec.backend}/{self.spec.task}, envs {envs}) {why}; replaced — "
                       f"reset those envs before stepping them")
            err.failed_envs, err.partial = envs, replies
            raise err
        if errors:
            err = EnvError("\n".join(errors))
            err.partial = replies
            raise err
        return replies

    def reset(self, seed: int | None = None, indices: list[int] | None = None):
        """Reset sub-envs (all by default); sub-env i gets seed + i. Returns (obs, infos) for `indices`."""
        indices = list(range(self.n_envs)) if indices is None else list(indices)
        seeds = {i: None if seed is None else seed + i for i in indices}
        by_worker = {w: self._assign[w] for w in range(self.n_workers) if any(i in seeds for i in self._assign[w])}
        payloads = {w: [seeds.get(i, "keep") for i in envs] for w, envs in by_worker.items()}
        replies = self._call("reset_some", payloads)
        out = {}
        for w, results in replies.items():
            for i, r in zip(by_worker[w], results):
                if r is not None:
                    out[i] = r
        self.needs_reset[indices] = False
        return stack_obs([out[i][0] for i in indices]), [out[i][1] for i in indices]

    def step(self, actions: np.ndarray):
        """actions [n, A] (one step) or [n, H, A] (a chunk; the first `n_action_steps` run)."""
        actions = np.asarray(actions, dtype=np.float32)
        if actions.ndim == 2:
            actions = actions[:, None]
        if actions.ndim != 3 or actions.shape[0] != self.n_envs or actions.shape[2] != self.action_dim:
            raise ValueError(f"actions: expected [{self.n_envs}, {self.action_dim}] or "
                             f"[{self.n_envs}, H, {self.action_dim}], got {list(actions.shape)}")
        if self.needs_reset.any():
            raise EnvError(f"envs {np.flatnonzero(self.needs_reset).tolist()} need reset before step")
        chunk = actions[:, : self.spec.n_action_steps]
        replies = self._call("step", {w: [chunk[i] for i in envs] for w, envs in enumerate(self._assign)})
        results = [r for w in range(self.n_workers) for r in replies[w]]
        obs = stack_obs([r[0] for r in results])
        reward = np.array([r[1] for r in results], dtype=np.float32)
        term = np.array([r[2] for r in results])
        trunc = np.array([r[3] for r in results])
        self.needs_reset |= term | trunc
        return obs, reward, term, trunc, [r[4] for r in results]

    def debug_sleep(self, worker: int, seconds: float, timeout_s: float | None = None) -> None:
        self._call("debug_sleep", {worker: seconds}, timeout_s)

    def close(self) -> None:
        for w, worker in enumerate(self._workers):
            if worker is None:
                continue
            try:
                worker.conn.send(("close", None))
                if worker.conn.poll(5):
                    worker.conn.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
            worker.proc.join(timeout=5)
            if worker.proc.is_alive():
                worker.proc.kill()
            self._workers[w] = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def stack_obs(obs: list[dict]) -> dict:
    """Stack single-env observations into the batched schema."""
    return {
        "images": {c: np.stack([o["images"][c] for o in obs]) for c in obs[0]["images"]},
        "state": np.stack([o["state"] for o in obs]),
        "instruction": [o["instruction"] for o in obs],
    }
