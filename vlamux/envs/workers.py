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

from vlamux.envs.base import ActionSpace, EnvError, EnvSpec, EnvTimeoutError, EnvWorkerCrashed
from vlamux.envs.render import configure_gl, gl_choice
from vlamux.envs.processes import apply_environ, environ, worker_context

log = logging.getLogger(__name__)


def _worker_main(conn, spec: EnvSpec, n_envs: int, render_device: int | None = None,
                 cpus: tuple[int, ...] | None = None, env: dict[str, str] | None = None) -> None:
    from vlamux.utils.placement import pin_self

    apply_environ(env)  # the parent's, as it is now (the fork server's is as it was when the server started)
    pin_self(cpus)  # before the simulator starts threads of its own: they inherit it
    _configure_rendering(render_device)
    from vlamux.envs import make_env  # after the GL backend and device are fixed: it may import mujoco

    try:
        envs = [make_env(spec) for _ in range(n_envs)]
    except Exception as e:  # noqa: BLE001 - the caller gets the reason, not just a dead worker
        conn.send(("error", _reason(e)))
        return
    conn.send(("ready", envs[0].action_spec))
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
            elif cmd == "render_info":
                conn.send(("ok", {**gl_choice(), "egl_device": os.environ.get("MUJOCO_EGL_DEVICE_ID")}))
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
        except Exception as e:  # noqa: BLE001 - reported to the caller, the worker lives on
            conn.send(("error", _reason(e)))


def _reason(e: Exception) -> str:
    """What the caller (a tenant, in the end) is told of a simulator's exception: its type and message.
    The traceback names the service's files and code: it goes to this worker's log only."""
    log.warning("env worker %d: %s", os.getpid(), "".join(traceback.format_exception(e)).rstrip())
    return f"{type(e).__name__}: {e}"


def _configure_rendering(render_device: int | None) -> None:
    """MuJoCo (and robosuite) read MUJOCO_EGL_DEVICE_ID when they make a GL context, so it is set
    in this process's environment before either is imported."""
    if render_device is not None:
        os.environ["MUJOCO_EGL_DEVICE_ID"] = str(render_device)
    backend = configure_gl()
    if render_device is not None and backend != "egl":
        log.debug("render_device %d recorded but unused: MUJOCO_GL=%s has no device choice", render_device, backend)


def _check_device(render_device) -> int | None:
    if render_device is None:
        return None
    if isinstance(render_device, bool) or not isinstance(render_device, (int, np.integer)) or render_device < 0:
        raise ValueError(f"render_device: expected a non-negative GPU index or None, got {render_device!r}")
    return int(render_device)


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
    """n sub-environments of one `EnvSpec`, spread over worker processes.

    render_device: the GPU the workers' EGL renders on (their MUJOCO_EGL_DEVICE_ID; None: the
    inherited one or MuJoCo's default). Ignored when the GL backend is not EGL. cpus: the cores the
    worker processes run on (CPU affinity; None: wherever the OS puts them).
    """

    def __init__(self, spec: EnvSpec, n_envs: int, n_workers: int | None = None, timeout_s: float = 30.0,
                 start_timeout_s: float = 120.0, render_device: int | None = None, cpus=None):
        if n_envs < 1:
            raise ValueError(f"n_envs must be >= 1, got {n_envs}")
        from vlamux.utils.placement import check_cpus

        self.render_device = _check_device(render_device)
        self.cpus = check_cpus(cpus, "env worker cpus", machine=True)  # the cores the workers run on (None: any)
        configure_gl()  # probed here once, so the workers inherit the choice instead of each probing
        self.spec, self.n_envs = spec, n_envs
        self.n_workers = max(1, min(n_envs, n_workers or os.cpu_count() or 1))
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self._ctx = worker_context()
        self._workers: list[_Worker | None] = []
        self._assign: list[list[int]] = []
        self.needs_reset = np.ones(n_envs, dtype=bool)
        self.restarts = 0
        self.pending_workers: int | None = None  # a resize waiting for the next full reset
        try:
            self._start_all()
        except BaseException:
            self.close()
            raise

    def _start_all(self) -> None:
        bounds = np.linspace(0, self.n_envs, self.n_workers + 1).round().astype(int)
        self._workers = [None] * self.n_workers
        self._assign = [list(range(bounds[w], bounds[w + 1])) for w in range(self.n_workers)]
        for w in range(self.n_workers):
            self._start(w)
        for w in range(self.n_workers):
            self._wait_ready(w)

    def resize(self, n_workers: int) -> int:
        """Ask for `n_workers` worker processes (capped at n_envs). A sub-env's simulator state lives
        in its worker, so the change waits for the next reset of all envs, where it is free: the
        episodes running now finish where they are. Returns the worker count that will apply."""
        n = max(1, min(self.n_envs, int(n_workers)))
        self.pending_workers = None if n == self.n_workers else n
        return n

    def _apply_resize(self) -> None:
        n, self.pending_workers = self.pending_workers, None
        log.info("env %s/%s: %d -> %d workers", self.spec.backend, self.spec.task, self.n_workers, n)
        self.close()
        self.n_workers = n
        self._start_all()

    # ---- workers --------------------------------------------------------------------------------
    def _start(self, w: int) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child, self.spec, len(self._assign[w]), self.render_device,
                                                            self.cpus, environ()),
                                 daemon=True, name=f"vlamux-env-{w}")
        proc.start()
        child.close()
        self._workers[w] = _Worker(proc, parent, self._assign[w])
        self.needs_reset[self._assign[w]] = True

    def _wait_ready(self, w: int) -> None:
        """Wait for worker w's envs to exist; on failure the worker is killed and the reason raised."""
        worker, what = self._workers[w], f"{self.spec.backend}/{self.spec.task}"
        try:
            if not worker.conn.poll(self.start_timeout_s):
                raise EnvTimeoutError(f"env worker {w} ({what}) did not start within {self.start_timeout_s:.0f}s")
            status, value = worker.conn.recv()
        except (EOFError, OSError):
            self._kill(w)
            raise EnvWorkerCrashed(f"env worker {w} died while creating {what}; "
                                   f"exit code {worker.proc.exitcode}") from None
        except BaseException:
            self._kill(w)
            raise
        if status != "ready":
            self._kill(w)
            raise EnvError(f"env worker {w} could not create {what}: {value.strip().splitlines()[-1]}")
        self.action_spec: ActionSpace = value

    def _kill(self, w: int) -> None:
        worker = self._workers[w]
        if worker is None:
            return
        worker.proc.kill()
        worker.proc.join(timeout=5)
        worker.conn.close()
        self._workers[w] = None

    def _replace(self, w: int) -> str:
        """Kill and restart worker w; returns '' or why the restart failed (it is retried on the next call)."""
        self._kill(w)
        self.restarts += 1
        self.needs_reset[self._assign[w]] = True
        log.warning("replacing env worker %d", w)
        try:
            self._start(w)
            self._wait_ready(w)
            return ""
        except EnvError as e:
            return f"; its restart failed too ({e})"

    def _live(self, w: int) -> _Worker:
        if self._workers[w] is None:  # an earlier restart failed: try again now
            self._start(w)
            self._wait_ready(w)
        return self._workers[w]

    @property
    def action_dim(self) -> int:
        return self.action_spec.dim

    def worker_pids(self) -> list[int | None]:
        return [None if w is None else w.proc.pid for w in self._workers]

    # ---- calls ----------------------------------------------------------------------------------
    def _call(self, cmd: str, payloads: dict[int, object], timeout_s: float | None = None
              ) -> tuple[dict[int, object], EnvError | None]:
        """Send one command to each worker in `payloads`; gather replies by a shared deadline.

        Returns the replies of the workers that answered and the error to raise (None if all did).
        Every reply is read or its worker replaced before returning, even if the caller is
        interrupted, so a later call never reads an earlier call's reply.
        """
        limit = timeout_s or self.timeout_s
        deadline = time.monotonic() + limit
        for w, payload in payloads.items():
            try:
                self._live(w).conn.send((cmd, payload))
            except (BrokenPipeError, OSError):
                pass  # found dead below
        replies: dict[int, object] = {}
        failures: list[tuple[int, type, str]] = []
        pending = list(payloads)
        try:
            while pending:
                w = pending[0]
                worker = self._workers[w]
                try:
                    if not worker.conn.poll(max(0.0, deadline - time.monotonic())):
                        failures.append((w, EnvTimeoutError, f"did not answer {cmd!r} within {limit:.1f}s"))
                    else:
                        status, value = worker.conn.recv()
                        if status == "ok":
                            replies[w] = value
                        else:
                            failures.append((w, EnvError, f"failed {cmd!r}: {value}"))
                except (EOFError, OSError):
                    failures.append((w, EnvWorkerCrashed, f"died during {cmd!r} (exit code {worker.proc.exitcode})"))
                pending.pop(0)
        except BaseException:
            for w in pending:  # owed a reply we will never read
                self._replace(w)
            raise
        if not failures:
            return replies, None
        notes = []
        for w, kind, why in failures:
            if kind is not EnvError:  # hung or dead: replace; a simulator exception leaves the worker usable
                why += self._replace(w) or "; replaced"
            self.needs_reset[self._assign[w]] = True
            notes.append(f"env worker {w} ({self.spec.backend}/{self.spec.task}, envs {self._assign[w]}) {why}")
        kind = failures[0][1]
        err = kind("\n".join(notes) + "\nreset those envs before stepping them")
        err.failed_envs = sorted(i for w, _, _ in failures for i in self._assign[w])
        return replies, err

    def reset(self, seed: int | None = None, indices: list[int] | None = None):
        """Reset sub-envs (all by default); sub-env i gets seed + i. Returns (obs, infos) for `indices`."""
        indices = list(range(self.n_envs)) if indices is None else [int(i) for i in indices]
        bad = [i for i in indices if not 0 <= i < self.n_envs]
        if bad:
            raise ValueError(f"indices: {bad} out of range for {self.n_envs} envs")
        if self.pending_workers is not None and len(set(indices)) == self.n_envs:
            self._apply_resize()
        seeds = {i: None if seed is None else seed + i for i in indices}
        payloads = {w: [seeds.get(i, "keep") for i in envs] for w, envs in enumerate(self._assign)
                    if any(i in seeds for i in envs)}
        replies, err = self._call("reset_some", payloads)
        out = {}
        for w, results in replies.items():
            for i, r in zip(self._assign[w], results):
                if r is not None:
                    out[i] = r
                    self.needs_reset[i] = False
        if err is not None:
            err.partial = out  # env index -> (obs, info) of the envs that did reset
            raise err
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
        replies, err = self._call("step", {w: [chunk[i] for i in envs] for w, envs in enumerate(self._assign)})
        results = {i: r for w, rs in replies.items() for i, r in zip(self._assign[w], rs)}
        for i, (_, _, term, trunc, _) in results.items():
            self.needs_reset[i] |= term or trunc
        if err is not None:
            err.partial = results  # env index -> (obs, reward, terminated, truncated, info)
            raise err
        ordered = [results[i] for i in range(self.n_envs)]
        obs = stack_obs([r[0] for r in ordered])
        reward = np.array([r[1] for r in ordered], dtype=np.float32)
        term = np.array([r[2] for r in ordered])
        trunc = np.array([r[3] for r in ordered])
        return obs, reward, term, trunc, [r[4] for r in ordered]

    def check_workers(self, timeout_s: float = 5.0) -> list[int]:
        """Health check: replace every worker that died or does not answer a ping in `timeout_s`.
        Returns the replaced workers; their envs then need a reset."""
        dead = [w for w, worker in enumerate(self._workers) if worker is None or not worker.proc.is_alive()]
        for w in dead:
            self._replace(w)
        alive = {w: None for w in range(self.n_workers) if w not in dead}
        _, err = self._call("ping", alive, timeout_s) if alive else ({}, None)
        hung = [w for w in alive if err is not None and any(i in err.failed_envs for i in self._assign[w])]
        return sorted(dead + hung)

    def render_info(self, worker: int = 0) -> dict:
        """Worker `worker`'s GL choice: {"backend", "reason", "egl_device"} (its MUJOCO_EGL_DEVICE_ID)."""
        replies, err = self._call("render_info", {worker: None})
        if err is not None:
            raise err
        return replies[worker]

    def debug_sleep(self, worker: int, seconds: float, timeout_s: float | None = None) -> None:
        _, err = self._call("debug_sleep", {worker: seconds}, timeout_s)
        if err is not None:
            raise err

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
                worker.proc.join(timeout=5)
            worker.conn.close()
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
