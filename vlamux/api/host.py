"""The service host: what `vlamux serve` runs behind the HTTP API.

It owns the runtime (embedded or Ray), the Master Service and the store, and is where a tenant's
request becomes service calls: every resource id is looked up *for the calling tenant* here, so a
route cannot reach another tenant's job, policy, session or checkpoint by accident.

Inside the services a policy is a slot keyed ``<tenant id>/<policy id>``: a tenant may run several
jobs and training slots at once, and their states never mix. A job's policy id is its job id.
"""

from __future__ import annotations

import csv
import logging
import os
import shutil
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from vlamux.api.access import Access
from vlamux.api.faults import Conflict, NotFound, QuotaExceeded
from vlamux.api.futures import Futures, jsonable
from vlamux.api.metering import Meter
from vlamux.api.served import ServedPolicies
from vlamux.api.sessions import Sessions, check_allowed
from vlamux.api.quotas import WHAT, Ledger, Need, QuotaRefused
from vlamux.api.tenant_files import TenantFiles
from vlamux.errors import CorruptCheckpointError, InvalidInputError, UnknownTenantError, public_message
from vlamux.jobs.master import MasterService
from vlamux.jobs.spec import JobSpecError, load_spec
from vlamux.model.slot_file import read_slot_file
from vlamux.store import Store
from vlamux.utils.io import file_sha256

if TYPE_CHECKING:  # the contract, for annotations only
    from vlamux.services.contract import Runtime

log = logging.getLogger(__name__)

DEFAULT_QUOTAS = {"max_concurrent_jobs": 4, "max_training_slots": 8, "max_env_sessions": 8, "max_envs": 64,
                  "max_env_processes": 16, "max_dataset_mb": 2048, "requests_per_s": 50.0}


@dataclass
class ServiceConfig:
    data_dir: Path = Path("data/service")
    store_url: str | None = None
    backbone: str = "tiny"  # the default backbone: a built-in preset, or a model directory (hf)
    extra_backbones: tuple = ()  # more the services hold at once: "NAME=PRESET_OR_DIRECTORY" each
    vlm: str | None = None  # the VLM/tokenizer directory a "lerobot:CKPT_DIR" backbone's checkpoint names
    # Placement (RuntimeConfig's): "auto" is CUDA where present; dtype "auto": bf16 on CUDA, fp32 on a CPU.
    device: str = "auto"
    dtype: str = "auto"
    training_device: str | None = None
    inference_devices: tuple = ()
    inference_replicas: int = 1
    ray_address: str | None = None  # None: the embedded runtime; "local": a Ray instance of its own
    max_body_mb: float = 64.0  # msgpack bodies (observations, action batches)
    max_json_kb: float = 1024.0  # every other body (job specs, settings): parsed on the event loop
    max_upload_mb: float = 4096.0  # a dataset archive (streamed to disk)
    body_timeout_s: float = 60.0  # a request body must arrive whole within this long (else 408)
    max_waits_per_tenant: int = 8  # long polls (GET /v1/futures/{id}?wait=) of one tenant at once
    auth_cache_s: float = 5.0  # keys and quotas changed outside this host take effect within this long
    meter_every_s: float = 0.25  # a kill -9 loses at most this (and one tick) of metered usage
    serve_idle_s: float = 600.0  # a finished job's policy, served on demand, leaves the replicas after this idle
    default_quotas: dict = field(default_factory=lambda: dict(DEFAULT_QUOTAS))
    env_workers: int | None = None  # simulator processes per session (None: the service's default)
    # simulator processes of all tenants together (None: 8 per CPU); past it opens and jobs are refused
    max_env_processes_total: int | None = None
    # backend "gym" for tenants: the gymnasium ids the operator allows, each with the env_kwargs it may
    # take. Empty: off. A tenant's string never reaches gym.make unless it is one of these ids exactly
    # (gymnasium imports the module an id like "pkg:Env-v0" names).
    gym_envs: dict = field(default_factory=dict)


def slot_key(tenant_id: str, policy_id: str) -> str:
    return f"{tenant_id}/{policy_id}"


class ServiceHost:
    def __init__(self, config: ServiceConfig | None = None, runtime: Runtime | None = None):
        self.config = config or ServiceConfig()
        self.data_dir = Path(self.config.data_dir)
        self.store = Store(self.config.store_url, self.data_dir)
        self._runtime = runtime
        self.runtime: Runtime | None = None
        self.master: MasterService | None = None
        self.meter: Meter | None = None
        self.access = Access(self.store, self.config.default_quotas, self.config.auth_cache_s)
        cap = self.config.max_env_processes_total
        self.ledger = Ledger({"processes": cap if cap is not None else 8 * (os.cpu_count() or 1)})
        self.futures = Futures(self.config.max_waits_per_tenant)
        self.sessions = Sessions(lambda: self.runtime.environment, self.ledger, self._reserve, self.config.gym_envs,
                                 self.config.env_workers)
        self.files = TenantFiles(self.data_dir, self.access.quotas, self._backbone_hashes)
        self._own_ray = False
        self.started_at = time.time()
        self.served: ServedPolicies | None = None
        self._janitor_stop = threading.Event()

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self, admin_key: str | None = None) -> str | None:
        """Start the services and resume every job that was running; returns a new admin key, once."""
        (self.data_dir / "datasets").mkdir(parents=True, exist_ok=True)
        new_admin = self.store.ensure_admin_key(admin_key or os.environ.get("VLAMUX_ADMIN_KEY") or None)
        self.runtime = self._runtime or self._build_runtime()
        self.master = MasterService(self.runtime, self.data_dir / "jobs")
        self.served = ServedPolicies(self.runtime, idle_s=self.config.serve_idle_s)
        self._restore_slots()
        self._resume_jobs()
        self.meter = Meter(self, self.config.meter_every_s).start()
        threading.Thread(target=self._janitor, name="vlamux-janitor", daemon=True).start()
        return new_admin

    def _janitor(self, every_s: float = 10.0) -> None:
        """What ages out: served policies of finished jobs nobody asks for, finished futures."""
        while not self._janitor_stop.wait(every_s):
            try:
                self.served.sweep()
                self.futures.sweep()
            except Exception:  # noqa: BLE001 - housekeeping must not take the service down
                log.exception("janitor round failed")

    def _build_runtime(self):

        env = {"allowed_dataset_roots": [self.data_dir / "datasets", self.data_dir / "tenants"]}
        if self.config.ray_address:
            import ray

            from vlamux.services.ray_runtime import RayRuntime, RayRuntimeConfig

            if not ray.is_initialized():  # "local": a Ray instance of this process's own
                self._own_ray = True
                ray.init(address=None if self.config.ray_address == "local" else self.config.ray_address,
                         include_dashboard=False, log_to_driver=False)
            return RayRuntime(RayRuntimeConfig(**self._placement(), environment=env)).start()
        from vlamux.services.runtime import EmbeddedRuntime, RuntimeConfig

        return EmbeddedRuntime(RuntimeConfig(**self._placement(), environment=env)).start()

    def _placement(self) -> dict:
        """The runtime's backbones and placement, as the service was configured."""
        from vlamux.model.backbones import named_backbones, spec_from_arg

        c = self.config
        return {"backbone": spec_from_arg(c.backbone, vlm=c.vlm), "backbones": named_backbones(c.extra_backbones, c.vlm),
                "device": c.device, "dtype": c.dtype,
                "training_device": c.training_device, "inference_devices": tuple(c.inference_devices),
                "inference_replicas": c.inference_replicas}

    def stop(self) -> None:
        self._janitor_stop.set()
        if self.meter is not None:
            self.meter.stop()  # never raises: the runtime below must stop regardless
        if self.master is not None:  # jobs stay "running" in the store: the next start resumes them
            for job in list(self.master.jobs.values()):
                job.on_event = None
                job.cancel.set()
            for job in list(self.master.jobs.values()):
                if job.thread is not None:
                    job.thread.join(30)
        if self.runtime is not None and self._runtime is None:
            self.runtime.stop()
        if self._own_ray:
            import ray

            ray.shutdown()

    def backbones(self) -> list[dict]:
        """The backbones the services hold (GET /v1/backbones): name, id, kind, parameters, dtype,
        resident memory, tokens per camera."""
        return self.runtime.describe_backbones()

    def _backbone_hashes(self) -> dict[str, str]:
        """{content sha256: name} of the backbones held (a policy file must fit one of them)."""
        return {b["sha256"]: b["name"] for b in self.runtime.describe_backbones() if b.get("sha256")}

    # ---- jobs -----------------------------------------------------------------------------------
    def submit_job(self, tenant_id: str, spec: dict) -> dict:
        if not isinstance(spec, dict):
            raise JobSpecError("spec: expected a JSON object")
        job_id = uuid.uuid4().hex[:12]
        spec = self._compile(tenant_id, job_id, spec)
        need = job_need(spec, self.access.quotas(tenant_id))
        self._reserve(tenant_id, f"job:{job_id}", need, retry_after_s=30.0)
        try:
            workdir = self.data_dir / "tenants" / tenant_id / "jobs" / job_id
            rec = self.store.create_job(tenant_id, spec.name, spec.kind, spec.to_dict(), str(workdir), job_id=job_id)
        except BaseException:
            self.ledger.release(tenant_id, f"job:{job_id}")
            raise
        try:
            self._start_job(rec.id, tenant_id, spec, workdir)
        except Exception as e:  # a refused job is not left "queued" against the tenant's quota
            self.ledger.release(tenant_id, f"job:{job_id}")
            self.store.set_job_state(rec.id, "failed", error=f"{type(e).__name__}: {e}")
            raise
        return self.job_view(tenant_id, rec.id)

    def _reserve(self, tenant_id: str, holder: str, need: Need, retry_after_s: float, force: bool = False) -> None:
        try:
            self.ledger.reserve(tenant_id, holder, need, self.access.quotas(tenant_id), force=force)
        except QuotaRefused as e:
            raise QuotaExceeded(str(e), retry_after_s=retry_after_s) from None

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
        _check_envs(spec, self.config.gym_envs)
        return spec

    def dataset_path(self, name, field_name: str, tenant_id: str | None = None) -> Path:
        try:
            return self.files.dataset_path(name, field_name, tenant_id)
        except InvalidInputError as e:
            raise JobSpecError(str(e)) from None

    def _start_job(self, job_id: str, tenant_id: str, spec, workdir: Path) -> None:
        def on_event(job, kind: str, detail: dict) -> None:
            if kind == "state":
                if detail["state"] == "queued":  # the store logged it when the job was created
                    return
                if detail["state"] in ("succeeded", "failed", "cancelled"):
                    self.ledger.release(tenant_id, f"job:{job_id}")
                result = detail.get("result") if detail["state"] == "succeeded" else None
                error = detail.get("error")  # what the tenant reads: no path of the service's
                self.store.set_job_state(job_id, detail["state"], error=public_message(error) if error else None,
                                         result=json_safe(jsonable(result)) if result is not None else None)
            elif kind == "checkpoint":
                self.store.set_job_progress(job_id, json_safe(jsonable(job.progress)))
                path = Path(detail["path"])
                self.store.add_checkpoint(tenant_id, job_id, int(detail["policy_version"]), str(path),
                                          path.stat().st_size, file_sha256(path), job_id=job_id)

        self.master.submit(spec, job_id=job_id, job_dir=workdir, on_event=on_event)

    def _resume_jobs(self) -> None:
        for rec in self.store.unfinished_jobs():
            if rec.kind == "slot":
                continue
            try:
                spec = load_spec(rec.spec)
                log.info("resuming job %s (%s) of tenant %s", rec.id, rec.name, rec.tenant_id)
                # admitted before the restart: it holds its share again, whatever the quotas say now
                self._reserve(rec.tenant_id, f"job:{rec.id}", job_need(spec, None), 0.0, force=True)
                self.store.set_job_state(rec.id, "queued", detail="resumed after a restart")
                self._start_job(rec.id, rec.tenant_id, spec, Path(rec.workdir))
            except Exception as e:  # noqa: BLE001 - one bad record must not keep the service down
                log.exception("cannot resume job %s", rec.id)
                self.store.set_job_state(rec.id, "failed", error=f"resume failed: {_scrub(e)}")

    def _job(self, tenant_id: str, job_id: str):
        rec = self.store.get_job(job_id, tenant_id)
        if rec is None or rec.kind == "slot":
            raise NotFound(f"no job {job_id!r}")
        return rec

    def job_view(self, tenant_id: str, job_id: str) -> dict:
        rec = self._job(tenant_id, job_id)
        live = self.master.jobs.get(job_id)
        return {"id": rec.id, "name": rec.name, "kind": rec.kind, "state": rec.state,
                "created_at": rec.created_at, "updated_at": rec.updated_at,
                "progress": (live.progress if live is not None else rec.progress) or {},
                "result": _public_result(rec.result, tenant_id),
                "error": public_message(rec.error) if rec.error else None,
                "events": [{"at": e.at, "state": e.state, "detail": e.detail} for e in self.store.job_events(rec.id)]}

    def list_jobs(self, tenant_id: str, state: str | None = None) -> list[dict]:
        recs = self.store.list_jobs(tenant_id, (state,) if state else None)
        live = dict(self.master.jobs)  # a job leaves it when it ends, on its own thread
        return [{"id": r.id, "name": r.name, "kind": r.kind, "state": r.state, "created_at": r.created_at,
                 "updated_at": r.updated_at,
                 "progress": (live[r.id].progress if r.id in live else r.progress) or {}}
                for r in recs if r.kind != "slot"]

    def set_disabled(self, tenant_id: str, disabled: bool):
        """Disable (or enable) a tenant. Disabled, its keys answer 401 at once, its running jobs are
        cancelled (their checkpoints stay) and its env sessions closed: it holds nothing any more."""
        t = self.store.set_disabled(tenant_id, disabled)
        self.access.forget(tenant_id=tenant_id)
        if disabled:
            for rec in self.store.list_jobs(tenant_id):
                if rec.kind != "slot" and rec.state in ("queued", "running"):
                    live = self.master.jobs.get(rec.id)
                    if live is not None:
                        self.master.cancel(live)
                    else:
                        self.store.set_job_state(rec.id, "cancelled", detail="the tenant was disabled")
            for s in self.sessions.list(tenant_id):
                try:
                    self.sessions.close(tenant_id, s["session_id"])
                except Exception:  # noqa: BLE001 - closed meanwhile (reaped); nothing left to free
                    log.debug("session %s of disabled tenant %s was already gone", s["session_id"], tenant_id)
        return t

    def cancel_job(self, tenant_id: str, job_id: str) -> dict:
        rec = self._job(tenant_id, job_id)
        if rec.state not in ("queued", "running"):
            raise Conflict(f"job {job_id!r} is already {rec.state}")
        live = self.master.jobs.get(job_id)
        if live is not None:
            self.master.cancel(live)
            live.thread.join(30)
        else:
            self.store.set_job_state(job_id, "cancelled")
        return self.job_view(tenant_id, job_id)

    def job_metrics(self, tenant_id: str, job_id: str, since: int = 0) -> tuple[list[dict], int]:
        rec = self._job(tenant_id, job_id)
        path = Path(rec.workdir) / "metrics.csv"
        if not path.exists():
            return [], since
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        out = [{k: _num(v) for k, v in r.items()} for r in rows[since:]]
        return out, since + len(out)

    def job_entries(self, tenant_id: str, job_id: str, since: int = 0) -> tuple[list[dict], int, str]:
        """The job's record as one sequence in time order, from entry `since` on: its state
        transitions (kind "state"), one "progress" entry per metrics row, and its "error" when it
        failed; each with its `data` and a log `line`. New entries only ever come at the end, so a
        position in it (an SSE event id, `logs?since=`) names the same entry on every read.
        Returns (entries, the next position, the job's state)."""
        rec = self._job(tenant_id, job_id)
        entries = [(e.at, "state", {"state": e.state, "detail": e.detail, "at": e.at},
                    f"{time.strftime('%H:%M:%S', time.localtime(e.at))} state {e.state}"
                    + (f" ({e.detail})" if e.detail else "")) for e in self.store.job_events(rec.id)]
        rows, _ = self.job_metrics(tenant_id, job_id)
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

    def job_logs(self, tenant_id: str, job_id: str, since: int = 0) -> tuple[list[str], int]:
        """The entries' log lines: what `vlamux logs -f` prints."""
        entries, nxt, _ = self.job_entries(tenant_id, job_id, since)
        return [e["line"] for e in entries], nxt

    def policy_file(self, tenant_id: str, policy_id: str, version: int | None = None, fmt: str = "vlamux"
                    ) -> tuple[Path, int]:
        """A policy file (vlamux.policy) of the tenant's policy: version `version` (a checkpoint's),
        or the live one; fmt "lerobot": a tar of the LeRobot checkpoint directory an imported policy
        leaves as (vlamux.model.vla.export). Written under the tenant's directory; the caller deletes
        it once sent."""
        if fmt not in ("vlamux", "lerobot"):
            raise InvalidInputError(f"format: 'vlamux' or 'lerobot', got {str(fmt)[:40]!r}")
        from vlamux.policy import snapshot_of, write_policy

        rec = self._policy(tenant_id, policy_id)
        if rec.kind == "slot" and version is None:  # a deleted or failed slot's checkpoints stay downloadable
            _usable(rec)
        key = slot_key(tenant_id, policy_id)
        out_dir = self.data_dir / "tenants" / tenant_id / "downloads"
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f"{uuid.uuid4().hex}.slot.safetensors"
        try:
            if version is None and key in self.runtime.tenants():
                self.runtime.save_state(key, tmp).result(120)  # the live version, as the trainer holds it
                source = tmp
            else:
                cps = self.store.list_checkpoints(tenant_id, **({"policy_id": policy_id} if rec.kind == "slot"
                                                                  else {"job_id": policy_id}))
                cps = [c for c in cps if version is None or c.policy_version == version]
                if not cps:
                    have = sorted({c.policy_version for c in self.store.list_checkpoints(tenant_id, policy_id=policy_id)}
                                  | {c.policy_version for c in self.store.list_checkpoints(tenant_id, job_id=policy_id)})
                    raise NotFound(f"policy {policy_id!r} has no checkpoint of version {version}; versions: {have}")
                self._verify(cps[0])
                source = Path(cps[0].path)
            snap = snapshot_of(source)
        finally:
            tmp.unlink(missing_ok=True)
        held = next((b for b in self.runtime.describe_backbones() if b["id"] == snap.backbone_id), {})
        if held.get("sha256") is None:
            raise Conflict(f"policy {policy_id!r} was trained on backbone {snap.backbone_id!r}, which this service "
                           f"no longer holds: its content hash is unknown")
        if fmt == "lerobot":
            return _lerobot_tar(snap, held, out_dir), snap.version
        path = write_policy(snap, held["sha256"], out_dir / f"{uuid.uuid4().hex}.policy.safetensors")
        return path, snap.version

    def job_checkpoints(self, tenant_id: str, job_id: str) -> list[dict]:
        self._job(tenant_id, job_id)
        return [_checkpoint_view(c) for c in self.store.list_checkpoints(tenant_id, job_id=job_id)]

    # ---- policies and low-level training --------------------------------------------------------
    def _policy(self, tenant_id: str, policy_id: str):
        rec = self.store.get_job(policy_id, tenant_id)
        if rec is None:
            raise NotFound(f"no policy {policy_id!r}")
        return rec

    def policy_view(self, tenant_id: str, policy_id: str) -> dict:
        rec = self._policy(tenant_id, policy_id)
        key = slot_key(tenant_id, policy_id)
        try:
            version = self.runtime.version(key)  # a live slot's
        except UnknownTenantError:
            version = None
        if version is None and rec.kind != "slot":  # an ended job's policy: its newest checkpoint's
            cps = self.store.list_checkpoints(tenant_id, job_id=policy_id)
            version = cps[0].policy_version if cps else None
        head = rec.spec.get("head") if isinstance(rec.spec, dict) else None
        view = {"id": rec.id, "source": "training_slot" if rec.kind == "slot" else "job", "name": rec.name,
                "head": head, "policy_version": version, "created_at": rec.created_at}
        if rec.kind == "slot" and rec.state == "failed":
            view.update(state="failed", error=public_message(rec.error or ""), policy_version=None)
        elif rec.kind == "slot" and rec.state == "cancelled":
            view.update(state="deleted", policy_version=None)
        return view

    def list_policies(self, tenant_id: str) -> list[dict]:
        # a slot whose creation was refused never existed; one that had saved state and failed or was
        # deleted stays listed (its checkpoints can still be downloaded)
        return [self.policy_view(tenant_id, r.id) for r in self.store.list_jobs(tenant_id)
                if not (r.kind == "slot" and r.state in ("failed", "cancelled")
                        and not self.store.list_checkpoints(tenant_id, policy_id=r.id))]

    def policy_versions(self, tenant_id: str, policy_id: str) -> dict:
        view = self.policy_view(tenant_id, policy_id)
        cps = self.store.list_checkpoints(tenant_id, policy_id=policy_id)
        return {"live": view["policy_version"], "checkpoints": [_checkpoint_view(c) for c in cps]}

    def create_training_slot(self, tenant_id: str, body: dict) -> dict:
        from vlamux.jobs.spec import build  # the spec loader's field-path checking
        from vlamux.model import HeadSpec, OptimizerSpec

        if not isinstance(body, dict):
            raise InvalidInputError("body: expected a JSON object")
        unknown = set(body) - {"head", "optimizer", "seed", "name", "backbone"}
        if unknown:
            raise InvalidInputError(f"{sorted(unknown)[0]}: unknown field; allowed: head, optimizer, seed, name, "
                                    f"backbone")
        backbone = body.get("backbone")
        if backbone is not None and backbone not in self.runtime.backbone_names():
            raise InvalidInputError(f"backbone: this service holds {self.runtime.backbone_names()}, not {backbone!r}")
        if "head" not in body:
            raise InvalidInputError("head: required")
        head = build(HeadSpec, body["head"], "head")
        optim = build(OptimizerSpec, body.get("optimizer") or {}, "optimizer")
        seed = body.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise InvalidInputError(f"seed: expected an integer, got {seed!r}")
        policy_id = uuid.uuid4().hex[:12]
        workdir = self.data_dir / "tenants" / tenant_id / "slots" / policy_id
        spec = {"head": asdict(head), "optimizer": asdict(optim), "seed": seed, "backbone": backbone}
        self._reserve(tenant_id, f"slot:{policy_id}", Need(slots=1), retry_after_s=60.0)
        try:
            rec = self.store.create_job(tenant_id, body.get("name") or f"slot-{policy_id}", "slot", spec,
                                        str(workdir), job_id=policy_id)
        except BaseException:
            self.ledger.release(tenant_id, f"slot:{policy_id}")
            raise
        try:
            self.runtime.create_slot(slot_key(tenant_id, policy_id), head, optim, seed, backbone=backbone).result(60)
        except Exception as e:
            self.ledger.release(tenant_id, f"slot:{policy_id}")
            self.store.set_job_state(rec.id, "failed", error=f"{type(e).__name__}: {e}")
            raise
        self.store.set_job_state(rec.id, "running")
        self.runtime.flush(30)  # the replicas serve the new policy before its id is handed out
        return self.policy_view(tenant_id, rec.id)

    def delete_training_slot(self, tenant_id: str, policy_id: str) -> None:
        """Free a training slot for good (training and every replica) and its place in the tenant's
        max_training_slots; its saved checkpoints stay downloadable. A restart does not bring it back."""
        rec = self._policy(tenant_id, policy_id)
        if rec.kind != "slot" or rec.state == "cancelled":
            raise NotFound(f"no training slot {policy_id!r}")
        if rec.state != "failed":  # a failed slot has nothing in the services
            try:
                self.runtime.remove_slot(slot_key(tenant_id, policy_id)).result(120)
            except UnknownTenantError:
                log.info("training slot %s had no slot in the services", policy_id)
        self.store.set_job_state(rec.id, "cancelled", detail="deleted by its tenant")
        self.ledger.release(tenant_id, f"slot:{policy_id}")

    def _restore_slots(self) -> None:
        """Training slots come back at their last saved state (what `save_state` promised), or, when
        that state cannot be read back, as failed slots that say why: never at version 0 as if new."""
        from vlamux.jobs.spec import build
        from vlamux.model import HeadSpec, OptimizerSpec

        for rec in self.store.unfinished_jobs():
            if rec.kind != "slot":
                continue
            key = slot_key(rec.tenant_id, rec.id)
            self._reserve(rec.tenant_id, f"slot:{rec.id}", Need(slots=1), 0.0, force=True)  # failed or not: it exists
            try:
                head = build(HeadSpec, rec.spec["head"], "head")
                optim = build(OptimizerSpec, rec.spec["optimizer"], "optimizer")
                cps = self.store.list_checkpoints(rec.tenant_id, policy_id=rec.id)
                if cps:
                    self._verify(cps[0])
                    read_slot_file(cps[0].path)  # readable, its digest and finite: checked before a slot exists
                self.runtime.create_slot(key, head, optim, rec.spec.get("seed", 0),
                                         backbone=rec.spec.get("backbone")).result(60)
                if cps:
                    self.runtime.load_state(key, cps[0].path).result(60)
            except Exception as e:  # noqa: BLE001 - one slot's damage must not keep the service down
                log.exception("cannot restore training slot %s", rec.id)
                self.store.set_job_state(rec.id, "failed", error=f"restore failed at start-up: {_scrub(e)}")

    def _verify(self, cp) -> None:
        """The checkpoint file still is the one the store recorded (sha256), before anything loads it."""
        path = Path(cp.path)
        if not path.is_file():
            raise CorruptCheckpointError(f"checkpoint {cp.id}: its file is missing")
        if file_sha256(path) != cp.sha256:
            raise CorruptCheckpointError(f"checkpoint {cp.id}: the file does not match the sha256 recorded when "
                                         f"it was saved (altered or damaged since)")

    def _slot(self, tenant_id: str, policy_id: str) -> str:
        rec = self._policy(tenant_id, policy_id)
        if rec.kind != "slot":
            raise NotFound(f"no training slot {policy_id!r} (a job's policy is trained by its job)")
        if rec.state == "cancelled":
            raise NotFound(f"training slot {policy_id!r} was deleted")
        _usable(rec)
        return slot_key(tenant_id, policy_id)

    def forward_backward(self, tenant_id: str, policy_id: str, obs, actions, action_mask) -> dict:
        key = self._slot(tenant_id, policy_id)
        return self.futures.track(tenant_id, "forward_backward",
                           self.runtime.forward_backward(key, obs, actions, action_mask))

    def optim_step(self, tenant_id: str, policy_id: str, lr: float | None = None) -> dict:
        key = self._slot(tenant_id, policy_id)
        if lr is not None:
            self.runtime.set_lr(key, lr)  # queued ahead of the step, in order
        return self.futures.track(tenant_id, "optim_step", self.runtime.optim_step(key))

    def save_state(self, tenant_id: str, policy_id: str) -> dict:
        key = self._slot(tenant_id, policy_id)
        rec = self._policy(tenant_id, policy_id)
        path = Path(rec.workdir) / f"{uuid.uuid4().hex[:12]}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        out: Future = Future()

        def saved(f: Future) -> None:
            if f.exception() is not None:
                out.set_exception(f.exception())
                return
            # Calls of a slot run in order, so at completion the slot still holds the saved version.
            version = self.runtime.version(key)
            cp = self.store.add_checkpoint(tenant_id, policy_id, version, str(path), path.stat().st_size,
                                           file_sha256(path))
            out.set_result({"checkpoint": _checkpoint_view(cp)})

        self.runtime.save_state(key, path).add_done_callback(saved)
        return self.futures.track(tenant_id, "save_state", out)

    def load_state(self, tenant_id: str, policy_id: str, checkpoint_id) -> dict:
        key = self._slot(tenant_id, policy_id)
        cp = self.store.get_checkpoint(checkpoint_id, tenant_id) if isinstance(checkpoint_id, str) else None
        if cp is None or cp.policy_id != policy_id:
            raise NotFound(f"no checkpoint {checkpoint_id!r} of policy {policy_id!r}")
        self._verify(cp)
        return self.futures.track(tenant_id, "load_state", self.runtime.load_state(key, cp.path))

    def predict(self, tenant_id: str, policy_id: str, obs, deterministic: bool) -> Future:
        rec = self._policy(tenant_id, policy_id)
        key = slot_key(tenant_id, policy_id)
        if rec.kind == "slot":
            _usable(rec)
        elif rec.state not in ("queued", "running"):  # its slot is gone: its newest checkpoint is served
            self.served.ensure(key, tenant_id, self.store.list_checkpoints(tenant_id, job_id=policy_id), self._verify)
        return self.runtime.predict(key, obs, deterministic)


def _check_envs(spec, gym_envs: dict) -> None:
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


def _usable(rec) -> None:
    if rec.state == "failed":
        raise Conflict(f"training slot {rec.id!r} failed and serves nothing: {rec.error}")
    if rec.state == "cancelled":
        raise NotFound(f"training slot {rec.id!r} was deleted")


def _scrub(e: BaseException) -> str:
    return public_message(f"{type(e).__name__}: {e}")


def _num(v: str):
    if v == "":
        return None
    try:
        x = float(v)
    except ValueError:
        return v
    return int(x) if x.is_integer() and "." not in v and "e" not in v.lower() else x


def _checkpoint_view(c) -> dict:
    return {"id": c.id, "policy_id": c.policy_id, "policy_version": c.policy_version, "bytes": c.bytes,
            "sha256": c.sha256, "created_at": c.created_at, "job_id": c.job_id}


def json_safe(x):
    """JSON the store accepts: NaN and infinities (a diverged loss) become None."""
    if isinstance(x, float):
        return x if x == x and abs(x) != float("inf") else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [json_safe(v) for v in x]
    return x


def _lerobot_tar(snap, backbone: dict, out_dir: Path) -> Path:
    """An imported policy's snapshot as a tar of the LeRobot checkpoint directory it leaves as."""
    import tarfile

    from vlamux.model.vla.export import write_lerobot

    if backbone.get("kind") != "lerobot":
        raise InvalidInputError(f"format: 'lerobot' is for policies imported from a LeRobot checkpoint; this one's "
                                f"head is of kind {snap.head_spec.kind!r} on backbone {snap.backbone_id!r}")
    work = out_dir / f".lerobot-{uuid.uuid4().hex}"
    path = out_dir / f"{uuid.uuid4().hex}.lerobot.tar"
    try:
        write_lerobot(work / "policy", backbone["checkpoint"], backbone["sha256"], snap.head_spec,
                      snap.ready().tensors, snap.stats_modes)
        with tarfile.open(path, "w") as tar:
            tar.add(work / "policy", arcname="policy")
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path
