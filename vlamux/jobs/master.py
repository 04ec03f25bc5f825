"""The Master Service: compiles job specs into workflow runs on the shared services and tracks them.

A job's life, in one place (`_run`): create the tenant's slot (from the dataset's statistics when
it learns from demonstrations) -> resume from its own last checkpoint if it has one, else start from
`init_from` -> evaluate (before) -> SFT and/or RL, checkpointing every `checkpoint_every` steps and
appending a row per step to metrics.csv -> evaluate (after) -> result.json. Jobs of many tenants run
at once, each on its own thread; their requests meet in the services' queues. With `max_simulating`,
at most that many jobs are in a phase that runs simulators (evaluation, validation, RL) at once: each
such phase opens its own worker processes (Meta-World's take 0.4-1 GB each), so fifty tenants
evaluating together would exhaust a small machine's memory; the others wait their turn, while
training-only phases (SFT) go on for every job.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import threading
import time
import typing
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from vlamux.errors import VlamuxError
from vlamux.jobs.spec import JobSpec, JobSpecError, load_spec
from vlamux.model.heads.lerobot import checkpoint_of
from vlamux.utils.io import atomic_path, atomic_write_text
from vlamux.workflows.evaluate import evaluate, paired
from vlamux.workflows.rl import RLRun, success_rate
from vlamux.workflows.sft import SFTRun

if TYPE_CHECKING:  # the contract, for annotations only
    from vlamux.services.contract import Runtime

log = logging.getLogger(__name__)

METRIC_FIELDS = ["time_s", "at", "phase", "step", "loss", "success_rate", "env_steps", "env_steps_per_s",
                 "policy_version", "staleness"]


class JobCancelled(VlamuxError):
    pass


@dataclasses.dataclass
class Job:
    id: str
    spec: JobSpec
    dir: Path
    state: str = "queued"  # queued | running | succeeded | failed | cancelled
    progress: dict = dataclasses.field(default_factory=dict)
    result: dict | None = None
    error: str | None = None
    transitions: list = dataclasses.field(default_factory=list)  # (wall time, state)
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    # Called as on_event(job, "state" | "checkpoint", detail) from the job's thread: how a service
    # that outlives this process (the HTTP API's store) hears of transitions and checkpoints.
    on_event: typing.Callable | None = None

    def _set(self, state: str) -> None:
        self.state = state
        self.transitions.append((time.time(), state))
        self._emit("state", {"state": state, "error": self.error, "result": self.result})

    def _emit(self, kind: str, detail: dict) -> None:
        if self.on_event is not None:
            try:
                self.on_event(self, kind, detail)
            except Exception:  # noqa: BLE001 - a listener's failure must not fail the job
                log.exception("job %s: %s listener failed", self.id, kind)


class MasterService:
    def __init__(self, services: Runtime, workdir: str | Path = "runs", max_simulating: int | None = None):
        if max_simulating is not None and (isinstance(max_simulating, bool) or not isinstance(max_simulating, int)
                                           or max_simulating < 1):
            raise VlamuxError(f"max_simulating: expected an integer >= 1 or None, got {max_simulating!r}")
        self.services = services
        self.workdir = Path(workdir)
        self.jobs: dict[str, Job] = {}  # the jobs not yet ended
        self._lock = threading.Lock()
        self._simulating = None if max_simulating is None else threading.BoundedSemaphore(max_simulating)

    # ---- API ----------------------------------------------------------------------------------------
    def submit(self, spec: JobSpec | dict | str | Path, job_id: str | None = None, job_dir: str | Path | None = None,
               on_event: typing.Callable | None = None) -> Job:
        """Start a job. `job_dir` (default workdir/name) holds its checkpoint: a job submitted again
        with the same directory resumes from there."""
        spec = spec if isinstance(spec, JobSpec) else load_spec(spec)
        held = self.services.backbone_names()
        if spec.backbone is not None and spec.backbone not in held:
            raise JobSpecError(f"backbone: this service holds {held}, the spec asks for {spec.backbone!r}")
        with self._lock:
            if any(j.spec.tenant == spec.tenant and j.state in ("queued", "running") for j in self.jobs.values()):
                raise JobSpecError(f"tenant: {spec.tenant!r} already has a running job (one slot per tenant)")
            job = Job(job_id or uuid.uuid4().hex[:12], spec, Path(job_dir) if job_dir else self.workdir / spec.name,
                      on_event=on_event)
            self.jobs[job.id] = job
        job._set("queued")
        job.thread = threading.Thread(target=self._run, args=(job,), name=f"vlamux-job-{spec.name}", daemon=True)
        job.thread.start()
        return job

    def wait(self, job: Job, timeout_s: float | None = None) -> Job:
        job.thread.join(timeout_s)
        if job.thread.is_alive():
            raise TimeoutError(f"job {job.spec.name} still {job.state} after {timeout_s}s")
        return job

    def cancel(self, job: Job) -> None:
        job.cancel.set()

    # ---- a job's life ----------------------------------------------------------------------------------
    def _run(self, job: Job) -> None:
        spec, svc = job.spec, self.services
        job.dir.mkdir(parents=True, exist_ok=True)
        (job.dir / "spec.json").write_text(json.dumps(spec.to_dict(), indent=1, default=str))
        ckpt, state_file = job.dir / "checkpoint.safetensors", job.dir / "state.json"
        resume = json.loads(state_file.read_text()) if state_file.exists() and ckpt.exists() else None
        job._set("running")
        t0 = time.monotonic()
        # a resumed job's steps since its checkpoint run again: their rows are replaced, not repeated
        metrics = _MetricsFile(job.dir / "metrics.csv", keep=resume.get("metric_rows") if resume else 0)
        slot = False  # this job's slot exists: freed before the job's end is told (training and every replica)
        try:
            sft = None
            stats = None
            if spec.sft is not None and (resume is None or resume["phase"] == "sft"):
                sft = SFTRun(svc, spec.tenant, spec.head.horizon, spec.sft)
                stats = sft.open(_stats_mode(spec))
            made = svc.create_slot(spec.tenant, spec.head, spec.optimizer, spec.seed, stats, backbone=spec.backbone)
            try:
                made.result(120)
            finally:  # made, or maybe made later (timed out): not a slot of the same name this job was refused
                slot = made.done() is False or made.exception() is None
            if resume is not None:
                svc.load_state(spec.tenant, ckpt).result(120)
                log.info("job %s resumes from %s (%s)", spec.name, ckpt, resume)
            elif spec.init_from and checkpoint_of(spec.head) is None:  # (an imported checkpoint made the slot)
                svc.load_state(spec.tenant, spec.init_from).result(120)
            if resume is None and spec.init_adapter:
                svc.import_adapter(spec.tenant, spec.init_adapter).result(120)
            result = {"name": spec.name, "tenant": spec.tenant, "kind": spec.kind}
            partial = job.dir / "result.partial.json"  # what finished before a restart: kept, not redone
            if resume is not None and partial.exists():
                result.update(json.loads(partial.read_text()))

            def keep(key: str, value) -> None:
                result[key] = value
                _write_json(partial, {k: v for k, v in result.items()
                                      if k in ("before", "after_sft", "sft", "validation_start", "rl", "validation")})

            if spec.eval is not None and spec.eval.before and resume is None:
                keep("before", self._evaluate(job))

            def checkpoint(phase: str, step: int, env_steps: int = 0, **extra) -> None:
                svc.save_state(spec.tenant, ckpt).result(120)
                _write_json(state_file, {"phase": phase, "step": step, "env_steps": env_steps,
                                         "metric_rows": metrics.rows, **extra})
                job._emit("checkpoint", {"path": str(ckpt), "phase": phase, "step": step, "env_steps": env_steps,
                                         "policy_version": svc.version(spec.tenant)})

            if sft is not None:
                keep("sft", self._sft(job, sft, metrics, checkpoint, resume))
            in_sft = resume is None or resume["phase"] in ("sft", "sft-done")  # (a restart may fall in between)
            if spec.kind == "rl" and spec.sft is not None and spec.eval is not None and in_sft \
                    and "after_sft" not in result:
                keep("after_sft", self._evaluate(job))  # where RL starts from
            start_file = job.dir / "rl_start.safetensors"  # the policy RL starts from, while validation may want it
            validating = spec.kind == "rl" and spec.eval is not None and spec.eval.validation_episodes > 0
            if validating and "validation_start" not in result:
                svc.save_state(spec.tenant, start_file).result(120)
                keep("validation_start", self._evaluate(job, validation=True))
            if spec.kind == "rl" and not (resume and resume["phase"] == "rl-done"):
                keep("rl", self._rl(job, metrics, checkpoint, resume))
            if validating and "validation" not in result:  # (a finished job resubmitted chose already)
                keep("validation", self._select(job, result["validation_start"], start_file))
                if result["validation"]["kept"] == "start":  # the job's newest checkpoint is what it keeps
                    done = json.loads(state_file.read_text())
                    checkpoint("rl-done", done["step"], done["env_steps"], segments=done.get("segments", 0))
            result.pop("validation_start", None)  # in result["validation"]
            if spec.eval is not None:
                result["after"] = self._evaluate(job)
                start = result.get("after_sft") or result.get("before")
                if start is not None:  # the same seeds: did training change which episodes succeed?
                    result["paired"] = paired(start, result["after"])
            if spec.head.adapter is not None:  # the adapter as PEFT reads it, beside the slot file
                result["adapter"] = svc.export_adapter(spec.tenant, job.dir / "adapter").result(120)["path"]
            result["wall_s"] = time.monotonic() - t0
            result["policy_version"] = svc.version(spec.tenant)
            job.result = result
            _write_json(job.dir / "result.json", result)
            ended = "succeeded"
        except JobCancelled:
            ended = "cancelled"
        except Exception as e:  # noqa: BLE001 - the job fails, the service goes on
            log.exception("job %s failed", spec.name)
            job.error = f"{type(e).__name__}: {e}"
            ended = "failed"
        finally:
            metrics.close()
        if slot:  # its policy lives on in its checkpoints; nothing holds its slot any more
            self._free(spec.tenant)
        with self._lock:  # the caller holds the Job it was given; this service keeps the unfinished
            self.jobs.pop(job.id, None)
        job._set(ended)

    def _free(self, tenant: str) -> None:
        """Its slot goes from training and every replica; once this returns, the replicas have it (so
        the policy, served again later from a checkpoint, is not overtaken by the retirement)."""
        try:
            self.services.remove_slot(tenant).result(120)
        except Exception as e:  # noqa: BLE001 - the job's end is told all the same
            log.warning("freeing the slot of %s: %s: %s", tenant, type(e).__name__, e)

    @contextmanager
    def _simulators(self, job: Job):
        """Hold one of the `max_simulating` turns for a phase that runs simulators (no bound: at once).
        A waiting job stays cancellable and says that it waits."""
        if self._simulating is None:
            yield
            return
        waiting = False
        while not self._simulating.acquire(timeout=0.5):
            self._check(job)
            if not waiting:
                waiting = True
                job.progress = {**job.progress, "waiting": "for a turn to run simulators (max_simulating)"}
        try:
            yield
        finally:
            self._simulating.release()

    def _check(self, job: Job) -> None:
        if job.cancel.is_set():
            raise JobCancelled(f"job {job.spec.name} was cancelled")

    def _sft(self, job: Job, run: SFTRun, metrics, checkpoint, resume) -> dict:
        spec, t0 = job.spec, time.monotonic()
        start = resume["step"] if resume else 0

        def on_step(st) -> None:
            self._check(job)
            job.progress = {"phase": "sft", "step": st.step, "of": spec.sft.steps, "loss": st.losses[-1],
                            "policy_version": st.version}
            metrics.row(phase="sft", step=st.step, loss=st.losses[-1], policy_version=st.version)
            if st.step % spec.checkpoint_every == 0 or st.step == spec.sft.steps:
                checkpoint("sft" if st.step < spec.sft.steps else "sft-done", st.step)

        run.on_step = on_step
        st = run.run(start)
        return {"steps": st.step, "final_loss": st.losses[-1] if st.losses else None, "wall_s": time.monotonic() - t0}

    def _rl(self, job: Job, metrics, checkpoint, resume) -> dict:
        spec = job.spec
        before = resume if resume and resume["phase"] == "rl" else {}  # what ran before a restart
        done, trained = before.get("env_steps", 0), before.get("segments", 0)
        earlier = before.get("record", {})  # the episodes and updates before the restart, from its state file
        updates = [before.get("step", 0)]  # a metrics row's step: the learner's update, counted across restarts
        # a resumed RL phase keeps the optimizer moments its checkpoint holds
        cfg = dataclasses.replace(spec.rl, env_steps=max(0, spec.rl.env_steps - done),
                                  fresh_optimizer=spec.rl.fresh_optimizer and not done)
        run = RLRun(self.services, spec.tenant, cfg)

        def record(st) -> dict:
            """The phase's episodes (at env steps counted from the phase's start) and updates, over restarts."""
            tasks = {t: list(v) for t, v in earlier.get("by_task", {}).items()}
            for t, (ok, n) in list(st.by_task.items()):
                tasks[t] = [a + b for a, b in zip(tasks.get(t, [0, 0]), (ok, n))]
            return {"curve": earlier.get("curve", []) + [[done + n, ok] for n, ok in list(st.episodes)],
                    "by_task": tasks, **{k: earlier.get(k, []) + list(getattr(st, k))
                                         for k in ("approx_kl", "clip_frac", "passes")}}

        def on_progress(st) -> None:
            self._check(job)
            updates[0] += 1
            wall = max(time.monotonic() - st.started, 1e-9)  # from sampling's start, not the wait for a turn
            rate = st.success_rate()
            job.progress = {"phase": "rl", "env_steps": done + st.env_steps, "of": spec.rl.env_steps,
                            "success_rate": rate, "policy_version": st.version,
                            "staleness": st.lags[-1] if st.lags else 0, "env_steps_per_s": st.env_steps / wall,
                            "loss": st.losses[-1] if st.losses else None}
            metrics.row(phase="rl", step=updates[0], loss=job.progress["loss"], success_rate=rate,
                        env_steps=done + st.env_steps, env_steps_per_s=st.env_steps / wall, policy_version=st.version,
                        staleness=job.progress["staleness"])
            if st.segments_trained and st.segments_trained % spec.checkpoint_every == 0:
                checkpoint("rl", updates[0], done + st.env_steps, segments=trained + st.segments_trained,
                           record=record(st))

        run.on_progress = on_progress
        with self._simulators(job):
            st = run.run()
        checkpoint("rl-done", updates[0], done + st.env_steps, segments=trained + st.segments_trained)  # kept
        wall, rec = time.monotonic() - st.started, record(st)  # (as the progress rows' rate)
        # the episodes, updates, env steps and segments trained are the whole phase's; the rates, drops,
        # staleness and lanes' times this process's
        return {"env_steps": done + st.env_steps, "episodes": len(rec["curve"]),
                "success_rate": success_rate(rec["curve"]),
                "segments_trained": trained + st.segments_trained, "segments_dropped": st.segments_dropped,
                "rows_dropped": st.rows_dropped, "max_staleness_seen": max(st.lags, default=0),
                "env_steps_per_s": st.env_steps / max(wall, 1e-9), **rec, "lane_busy_s": st.lane_busy_s}

    def _select(self, job: Job, start: dict, start_file: Path) -> dict:
        """RL's policy against the one it started from, on the validation episodes: RL's stays only where it
        validated higher; else the start is loaded back (and published). A tie keeps the start: in the
        main job's run 6, two tenants whose RL validated level with the start (88% and 88%) ended 96% and
        88% against 92% on the reported seeds, so a level validation says nothing RL's way."""
        spec = job.spec
        end = self._evaluate(job, validation=True)
        kept = "rl" if end["success"] > start["success"] else "start"
        if kept == "start":
            self.services.load_state(spec.tenant, start_file).result(120)
            log.info("job %s keeps the policy RL started from: validation %.3f against RL's %.3f",
                     spec.name, start["success"], end["success"])
        start_file.unlink(missing_ok=True)
        return {"start": start, "rl": end, "kept": kept, "paired": paired(start, end)}

    def _evaluate(self, job: Job, validation: bool = False) -> dict:
        spec, ev = job.spec, job.spec.eval
        env = ev.env or spec.env
        if env is None:
            raise JobSpecError("eval.env: an sft job's evaluation needs an env spec")
        tasks = ev.tasks or (list(spec.rl.tasks) if spec.rl is not None and spec.rl.tasks else [env.task])
        job.progress = {"phase": "validation" if validation else "eval", "tasks": tasks}
        episodes, seed = (ev.validation_episodes, ev.validation_seed) if validation else (ev.episodes, ev.seed)
        with self._simulators(job):
            return evaluate(self.services, spec.tenant, env, tasks, episodes, seed=seed, n_envs=ev.n_envs)


def _stats_mode(spec: JobSpec) -> str:
    """A dataset's statistics as the head normalises: min/max for bins and for π0.5's experts (lerobot's
    quantiles; the dataset's min and max stand in for its q01 and q99), else mean/std."""
    if spec.head.kind == "lerobot":
        return "min_max" if spec.head.options.get("family") == "pi05" else "mean_std"
    return "min_max" if spec.head.kind == "bins" else "mean_std"


class _MetricsFile:
    """Per-step metrics as CSV (one row per step, flushed as it goes), for plotting. `keep`: the rows
    of an earlier run to keep (a resumed job's, up to its checkpoint; None: all of them, for a
    checkpoint that did not count its rows); the file starts afresh otherwise."""

    def __init__(self, path: Path, keep: int | None = 0):
        fields, kept = METRIC_FIELDS, []
        if keep != 0 and path.exists() and path.stat().st_size:
            with path.open(newline="") as f:  # a resumed job keeps the columns its file started with
                reader = csv.reader(f)
                fields = next(reader, None) or METRIC_FIELDS
                kept = list(reader)
            kept = kept if keep is None else kept[:keep]
            with atomic_path(path) as tmp, tmp.open("x", newline="") as f:
                # the rows past the checkpoint are gone before any is written again
                csv.writer(f).writerows([fields, *kept])
        self.rows = len(kept)
        self._f = path.open("a" if kept else "w", newline="")
        self._w = csv.DictWriter(self._f, fields, extrasaction="ignore")
        if not kept:
            self._w.writeheader()
            self._f.flush()
        self._t0 = time.monotonic()

    def row(self, **values) -> None:
        self._w.writerow({"time_s": round(time.monotonic() - self._t0, 3), "at": round(time.time(), 3), **values})
        self._f.flush()
        self.rows += 1

    def close(self) -> None:
        self._f.close()


def _write_json(path: Path, data) -> None:
    atomic_write_text(path, json.dumps(data, indent=1, default=str))
