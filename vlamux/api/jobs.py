"""Jobs: a tenant's SFT, RL and eval runs from job specs, each a Master Service job (vlamux.jobs.master)
whose record, events, progress and checkpoints live in the store. A spec is compiled here: its slot key,
and only paths inside the service."""

from __future__ import annotations

import csv
import logging
import shutil
import time
import uuid
from pathlib import Path
from typing import Callable

from vlamux.api.checkpoints import checkpoint_view
from vlamux.api.faults import Conflict, NotFound
from vlamux.api.futures import jsonable
from vlamux.api.queued_jobs import JobQueue
from vlamux.api.quotas import WHAT, Need
from vlamux.api.sessions import check_allowed
from vlamux.api.slots import slot_key
from vlamux.api.tenant_files import TenantFiles
from vlamux.errors import InvalidInputError, public_error, public_message
from vlamux.jobs.job_queue import job_fraction
from vlamux.jobs.master import MasterService
from vlamux.jobs.spec import JobSpecError, load_spec
from vlamux.store import Store
from vlamux.store.records import UNFINISHED
from vlamux.utils.io import file_sha256

log = logging.getLogger(__name__)


class Jobs:
    """`reserve(tenant, holder, need, retry_after_s, force, admit)` holds a job's share of the tenant's
    quotas (the ledger's), `release(tenant, holder)` gives it back; `quotas(tenant)` are the tenant's.
    A job the service has no room for yet waits in `queue` (vlamux.api.queued_jobs)."""

    def __init__(self, store: Store, master: MasterService, files: TenantFiles, data_dir: Path, gym_envs: dict,
                 quotas: Callable[[str], dict], reserve: Callable[..., None], release: Callable[[str, str], None],
                 queue: JobQueue, history: int | None = None, serving: Callable[[], list[str]] = list):
        """history: finished jobs kept per tenant (None: all); serving() -> the slot keys of the
        policies being served (kept whatever their age)."""
        self.store, self.master, self.files, self.data_dir, self.gym_envs = store, master, files, data_dir, gym_envs
        self._quotas, self._reserve, self._release, self.queue = quotas, reserve, release, queue
        self.history, self._serving = history, serving

    def submit(self, tenant_id: str, spec: dict) -> dict:
        """Accept a job: its tenant's quotas are checked now (429 past them); it starts at once if the
        service has room, else it is queued and starts when room frees."""
        if not isinstance(spec, dict):
            raise JobSpecError("spec: expected a JSON object")
        job_id = uuid.uuid4().hex[:12]
        spec = self._compile(tenant_id, job_id, spec)
        need = job_need(spec, self._quotas(tenant_id))
        self._reserve(tenant_id, f"job:{job_id}", need, retry_after_s=30.0, admit=False)
        try:
            workdir = self.data_dir / "tenants" / tenant_id / "jobs" / job_id
            rec = self.store.create_job(tenant_id, spec.name, spec.kind, spec.to_dict(), str(workdir), job_id=job_id)
        except BaseException:
            self._release(tenant_id, f"job:{job_id}")
            raise
        self._enqueue(rec.id, tenant_id, spec, workdir, need, rec.created_at)
        return self.view(tenant_id, rec.id)

    def _enqueue(self, job_id: str, tenant_id: str, spec, workdir: Path, need: Need, submitted: float) -> None:
        def start() -> None:
            try:
                self._start(job_id, tenant_id, spec, workdir)
            except Exception as e:  # a job that cannot start is not left "queued" against the tenant's quota
                self.queue.ended(job_id)
                self.store.set_job_state(job_id, "failed", error=f"{type(e).__name__}: {e}")
                self._release(tenant_id, f"job:{job_id}")
                raise

        if not self.queue.submit(job_id, tenant_id, spec.kind, need, start, submitted):
            place = self.queue.place(job_id)
            if place is not None:  # else it started meanwhile
                self.store.set_job_state(job_id, "queued", detail=f"waiting for {place['waiting_for']}")

    def _compile(self, tenant_id: str, job_id: str, raw: dict) -> object:
        """The tenant's spec, made safe to run: its slot key, and only paths inside the service."""
        raw = dict(raw)
        raw.setdefault("name", f"job-{job_id}")
        raw["tenant"] = slot_key(tenant_id, job_id)
        if raw.get("init_from") is not None:  # over the API: the name of a policy file the tenant uploaded
            try:
                raw["init_from"] = str(self.files.policy_file_path(tenant_id, raw["init_from"], "init_from"))
            except InvalidInputError as e:
                raise JobSpecError(str(e)) from None
        if raw.get("init_adapter") is not None:
            raise JobSpecError("init_adapter: not available over the API (a path on the service's machine)")
        sft = raw.get("sft")
        if isinstance(sft, dict) and "dataset" in sft:
            sft = dict(sft)
            sft["dataset"] = str(self.dataset_path(sft["dataset"], "sft.dataset", tenant_id))
            raw["sft"] = sft
        spec = load_spec(raw)
        check_envs(spec, self.gym_envs)
        held = self.master.services.backbone_names()  # checked now: a queued job would fail at its start
        if spec.backbone is not None and spec.backbone not in held:
            raise JobSpecError(f"backbone: this service holds {held}, the spec asks for {spec.backbone!r}")
        return spec

    def dataset_path(self, name, field_name: str, tenant_id: str | None = None) -> Path:
        try:
            return self.files.dataset_path(name, field_name, tenant_id)
        except InvalidInputError as e:
            raise JobSpecError(str(e)) from None

    def _start(self, job_id: str, tenant_id: str, spec, workdir: Path) -> None:
        def on_event(job, kind: str, detail: dict) -> None:
            if kind == "state":
                if detail["state"] == "queued":  # the store logged it when the job was created
                    return
                if detail["state"] in ("succeeded", "failed", "cancelled"):
                    self.queue.ended(job_id)
                    self._release(tenant_id, f"job:{job_id}")
                result = detail.get("result") if detail["state"] == "succeeded" else None
                error = detail.get("error")  # what the tenant reads: no path of the service's
                self.store.set_job_state(job_id, detail["state"], error=public_message(error) if error else None,
                                         result=json_safe(jsonable(result)) if result is not None else None)
                if detail["state"] in ("succeeded", "failed", "cancelled"):
                    self.prune(tenant_id)
            elif kind == "checkpoint":
                self.store.set_job_progress(job_id, json_safe(jsonable(job.progress)))
                path = Path(detail["path"])
                self.store.add_checkpoint(tenant_id, job_id, int(detail["policy_version"]), str(path),
                                          path.stat().st_size, file_sha256(path), job_id=job_id)

        self.master.submit(spec, job_id=job_id, job_dir=workdir, on_event=on_event)

    def prune(self, tenant_id: str) -> None:
        """The tenant's finished jobs past the history kept leave the store and the disk."""
        if self.history is None:
            return
        try:
            served = {key.partition("/")[2] for key in self._serving() if key.startswith(f"{tenant_id}/")}
            for rec in self.store.prune_jobs(tenant_id, self.history, spare=served):
                shutil.rmtree(rec.workdir, ignore_errors=True)
        except Exception:  # noqa: BLE001 - the next job's end tries again; the job itself is done
            log.exception("pruning the job history of tenant %s failed", tenant_id)

    def resume_all(self) -> None:
        """Jobs that ran before a restart start again at once (they were admitted: they hold their
        share again, whatever the quotas say now); jobs that were still waiting queue again, in the
        order they were submitted."""
        for rec in sorted(self.store.unfinished_jobs(), key=lambda r: r.created_at):
            try:
                spec = load_spec(rec.spec)
                need = job_need(spec, None)
                log.info("resuming job %s (%s) of tenant %s", rec.id, rec.name, rec.tenant_id)
                started = any(e.state == "running" for e in self.store.job_events(rec.id))
                self._reserve(rec.tenant_id, f"job:{rec.id}", need, 0.0, force=True, admit=started)
                if started:
                    self.store.set_job_state(rec.id, "queued", detail="resumed after a restart")
                    self.queue.admitted(rec.id, rec.tenant_id, spec.kind, need)
                    self._start(rec.id, rec.tenant_id, spec, Path(rec.workdir))
                else:
                    self._enqueue(rec.id, rec.tenant_id, spec, Path(rec.workdir), need, rec.created_at)
            except Exception as e:  # noqa: BLE001 - one bad record must not keep the service down
                log.exception("cannot resume job %s", rec.id)
                self.queue.remove(rec.id)
                self.queue.ended(rec.id)
                self._release(rec.tenant_id, f"job:{rec.id}")
                self.store.set_job_state(rec.id, "failed", error=f"resume failed: {public_error(e)}")

    def _record(self, tenant_id: str, job_id: str):
        rec = self.store.get_job(job_id, tenant_id)
        if rec is None:
            raise NotFound(f"no job {job_id!r}")
        return rec

    def view(self, tenant_id: str, job_id: str) -> dict:
        """The job's record; a job waiting for room has "queue": its position, of, eta_s, eta_at (None:
        not known) and what it waits for."""
        rec = self._record(tenant_id, job_id)
        live = self.master.jobs.get(job_id)
        return {"id": rec.id, "name": rec.name, "kind": rec.kind, "state": rec.state,
                "created_at": rec.created_at, "updated_at": rec.updated_at,
                "progress": (live.progress if live is not None else rec.progress) or {},
                "queue": self.queue.place(job_id) if rec.state == "queued" else None,
                "result": _public_result(rec.result, tenant_id),
                "error": public_message(rec.error) if rec.error else None,
                "events": [{"at": e.at, "state": e.state, "detail": e.detail} for e in self.store.job_events(rec.id)]}

    def list(self, tenant_id: str, state: str | None = None) -> list[dict]:
        recs = self.store.list_jobs(tenant_id, (state,) if state else None)
        live = dict(self.master.jobs)  # a job leaves it when it ends, on its own thread
        return [{"id": r.id, "name": r.name, "kind": r.kind, "state": r.state, "created_at": r.created_at,
                 "updated_at": r.updated_at,
                 "progress": (live[r.id].progress if r.id in live else r.progress) or {},
                 "queue": self.queue.place(r.id) if r.state == "queued" else None}
                for r in recs]

    def fraction(self, job_id: str) -> float | None:
        """How much of a running job is done (its estimate for the jobs that wait on it)."""
        live = self.master.jobs.get(job_id)
        if live is None:
            return None
        spec = live.spec
        phases = [p for p in ("sft", "rl", "eval") if getattr(spec, p) is not None]
        return job_fraction(phases, live.progress or {})

    def cancel_all(self, tenant_id: str, detail: str) -> None:
        """Cancel every queued or running job of the tenant (their checkpoints stay)."""
        for rec in self.store.list_jobs(tenant_id, UNFINISHED):
            live = self.master.jobs.get(rec.id)
            if live is not None:
                self.master.cancel(live)
            else:
                self._drop_waiting(tenant_id, rec.id, detail)

    def _drop_waiting(self, tenant_id: str, job_id: str, detail: str = "") -> None:
        """A job that never started: out of the queue, its share given back, cancelled."""
        self.queue.remove(job_id)
        self.store.set_job_state(job_id, "cancelled", detail=detail)
        self._release(tenant_id, f"job:{job_id}")

    def cancel(self, tenant_id: str, job_id: str) -> dict:
        rec = self._record(tenant_id, job_id)
        if rec.state not in ("queued", "running"):
            raise Conflict(f"job {job_id!r} is already {rec.state}")
        live = self.master.jobs.get(job_id)
        if live is not None:
            self.master.cancel(live)
            live.thread.join(30)
        else:
            self._drop_waiting(tenant_id, job_id)
        return self.view(tenant_id, job_id)

    def metrics(self, tenant_id: str, job_id: str, since: int = 0) -> tuple[list[dict], int]:
        rec = self._record(tenant_id, job_id)
        path = Path(rec.workdir) / "metrics.csv"
        if not path.exists():
            return [], since
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        out = [{k: _num(v) for k, v in r.items()} for r in rows[since:]]
        return out, since + len(out)

    def entries(self, tenant_id: str, job_id: str, since: int = 0) -> tuple[list[dict], int, str]:
        """The job's record as one sequence in time order, from entry `since` on: its state
        transitions (kind "state"), one "progress" entry per metrics row, and its "error" when it
        failed; each with its `data` and a log `line`. New entries only ever come at the end, so a
        position in it (an SSE event id, `logs?since=`) names the same entry on every read.
        Returns (entries, the next position, the job's state)."""
        rec = self._record(tenant_id, job_id)
        entries = [(e.at, "state", {"state": e.state, "detail": e.detail, "at": e.at},
                    f"{time.strftime('%H:%M:%S', time.localtime(e.at))} state {e.state}"
                    + (f" ({e.detail})" if e.detail else "")) for e in self.store.job_events(rec.id)]
        rows, _ = self.metrics(tenant_id, job_id)
        for r in rows:
            parts = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                     if v not in ("", None) and k not in ("time_s", "at")]
            entries.append((r.get("at") or 0.0, "progress", r, " ".join(parts)))
        entries.sort(key=lambda e: e[0])
        if rec.error and rec.state == "failed":
            error = public_message(rec.error)
            entries.append((time.time(), "error", {"error": error}, f"error: {error}"))
        out = [{"kind": kind, "data": data, "line": line} for _, kind, data, line in entries[since:]]
        return out, max(since, len(entries)), rec.state

    def logs(self, tenant_id: str, job_id: str, since: int = 0) -> tuple[list[str], int]:
        """The entries' log lines: what `vlamux logs -f` prints."""
        entries, nxt, _ = self.entries(tenant_id, job_id, since)
        return [e["line"] for e in entries], nxt

    def checkpoints(self, tenant_id: str, job_id: str) -> list[dict]:
        self._record(tenant_id, job_id)
        return [checkpoint_view(c) for c in self.store.list_checkpoints(tenant_id, job_id=job_id)]


def check_envs(spec, gym_envs: dict) -> None:
    """Every env a job will open, checked at submission as far as it can be without a simulator."""
    from vlamux.envs import BACKENDS, check_task

    for where, section in (("rl", spec.rl), ("eval", spec.eval)):
        if section is None:
            continue
        env = section.env or spec.env
        if env is None:
            raise JobSpecError(f"{where}.env: an {spec.kind} job's evaluation needs an env spec")
        if env.backend not in BACKENDS:
            raise JobSpecError(f"{where}.env.backend: {check_task(env.backend, env.task)}")
        try:
            for task in (env.task, *section.tasks):
                check_allowed(env.backend, task, env.options, f"{where}.env", gym_envs)
        except InvalidInputError as e:
            raise JobSpecError(str(e)) from None
        named = [(f"{where}.env.task", env.task), *((f"{where}.tasks[{i}]", t) for i, t in enumerate(section.tasks))]
        for field_, task in named:
            why = check_task(env.backend, task)
            if why is not None:
                raise JobSpecError(f"{field_}: {why}")


def job_need(spec, quotas: dict | None) -> Need:
    """What a job holds at its peak: its RL sub-batches' sessions, envs and worker processes, or its
    evaluation's (one session at a time, one worker), whichever is more, and one job. With `quotas`,
    a job that could never fit them is a spec error naming the field (not a wait for quota)."""
    rl = ev = Need()
    if spec.rl is not None:
        r = spec.rl
        rl = Need(sessions=r.sub_batches, envs=r.n_envs * r.sub_batches,
                  processes=r.sub_batches * min(r.env_workers, r.n_envs))
    if spec.eval is not None:
        ev = Need(sessions=1, envs=min(spec.eval.n_envs, spec.eval.episodes), processes=1)
    need = Need(jobs=1).peak(rl).peak(ev)
    for resource, quota, rl_field, ev_field in (("sessions", "max_env_sessions", "rl.sub_batches", "eval.n_envs"),
                                                ("envs", "max_envs", "rl.n_envs", "eval.n_envs"),
                                                ("processes", "max_env_processes", "rl.env_workers", "eval.n_envs")):
        limit = (quotas or {}).get(quota)
        if limit is not None and getattr(need, resource) > int(limit):
            where = rl_field if getattr(rl, resource) > int(limit) else ev_field
            raise JobSpecError(f"{where}: the job needs {getattr(need, resource)} {WHAT[resource]} at once, more "
                               f"than the tenant's {quota} of {limit}")
    return need


def _public_result(result: dict | None, tenant_id: str) -> dict | None:
    """A job's result as its tenant sees it: the service's slot key is the tenant's own id."""
    if not isinstance(result, dict):
        return result
    return {k: (tenant_id if k == "tenant" else v) for k, v in result.items()}


def _num(v: str):
    if v == "":
        return None
    try:
        x = float(v)
    except ValueError:
        return v
    return int(x) if x.is_integer() and "." not in v and "e" not in v.lower() else x


def json_safe(x):
    """JSON the store accepts: NaN and infinities (a diverged loss) become None."""
    if isinstance(x, float):
        return x if x == x and abs(x) != float("inf") else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [json_safe(v) for v in x]
    return x
