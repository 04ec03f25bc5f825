"""The service host: what `vlamux serve` runs behind the HTTP API.

It owns the runtime (embedded or Ray), the Master Service and the store, and composes what the
routes call, one concept each: `access` (keys, principals, quotas, rate), `jobs`, `slots` (training
slots), `policies`, `sessions`, `futures`, `files`, and the `ledger` of what tenants hold. Each looks
every resource id up *for the calling tenant*, so a route cannot reach another tenant's job, policy,
session or checkpoint by accident.

Inside the services a policy is a slot keyed ``<tenant id>/<policy id>`` (vlamux.api.slots.slot_key):
a tenant may run several jobs and training slots at once, and their states never mix. A job's policy
id is its job id.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from vlamux.api.access import Access
from vlamux.api.faults import QuotaExceeded
from vlamux.api.futures import Futures
from vlamux.api.jobs import Jobs
from vlamux.api.metering import Meter
from vlamux.api.policies import Policies
from vlamux.api.queued_jobs import JobQueue
from vlamux.api.quotas import Ledger, Need, QuotaRefused
from vlamux.api.served import ServedPolicies
from vlamux.api.sessions import Sessions
from vlamux.api.slots import TrainingSlots
from vlamux.api.tenant_files import TenantFiles
from vlamux.jobs.master import MasterService
from vlamux.store import Store

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
    # "learned": each service times its backbones at start and caps groups where a bigger one stops
    # paying (vlamux/model/calibrate.py); None: groups are capped by the queues' batch rows only
    group_cap: str | None = "learned"
    max_adapters_per_group: int | None = None  # distinct tenants' adapters in one backbone call; None: no cap
    # serving slots a replica keeps resident (the rest paged); "auto": a quarter of a GPU's free memory,
    # all on a CPU; None: all
    slot_memory_mb: float | str | None = "auto"
    slot_host_mb: float | None = None  # parked ones in host memory (the rest stored on disk); None: all
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
    # jobs running at once, all tenants together (None: no limit); past it jobs are accepted and queued
    max_running_jobs: int | None = None
    # finished jobs kept per tenant (record, events, checkpoints, files); older ones go as a job ends
    # (their usage stays in the tenant's totals; a policy being served is kept). None: all kept
    job_history: int | None = 100
    # backend "gym" for tenants: the gymnasium ids the operator allows, each with the env_kwargs it may
    # take. Empty: off. A tenant's string never reaches gym.make unless it is one of these ids exactly
    # (gymnasium imports the module an id like "pkg:Env-v0" names).
    gym_envs: dict = field(default_factory=dict)


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
        self.ledger = Ledger({"processes": cap if cap is not None else 8 * (os.cpu_count() or 1),
                              "jobs": self.config.max_running_jobs})
        self.futures = Futures(self.config.max_waits_per_tenant)
        self.responses: Counter = Counter()  # HTTP answers by status class (vlamux.api.responses)
        self.responses_lock = threading.Lock()
        self.sessions = Sessions(lambda: self.runtime.environment, self.ledger, self._reserve, self.config.gym_envs,
                                 self.config.env_workers)
        self.files = TenantFiles(self.data_dir, self.access.quotas, self._backbone_hashes)
        self._own_ray = False
        self.started_at = time.time()
        self.served: ServedPolicies | None = None
        # made at start, over the runtime: what the routes call
        self.jobs: Jobs | None = None
        self.slots: TrainingSlots | None = None
        self.policies: Policies | None = None
        self._janitor_stop = threading.Event()

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self, admin_key: str | None = None) -> str | None:
        """Start the services and resume every job that was running; returns a new admin key, once."""
        (self.data_dir / "datasets").mkdir(parents=True, exist_ok=True)
        new_admin = self.store.ensure_admin_key(admin_key or os.environ.get("VLAMUX_ADMIN_KEY") or None)
        self.runtime = self._runtime or self._build_runtime()
        self.master = MasterService(self.runtime, self.data_dir / "jobs")
        self.served = ServedPolicies(self.runtime, idle_s=self.config.serve_idle_s)
        queue = JobQueue(self.ledger, lambda job_id: self.jobs.fraction(job_id))
        self.jobs = Jobs(self.store, self.master, self.files, self.data_dir, self.config.gym_envs,
                         self.access.quotas, self._reserve, self.ledger.release, queue,
                         history=self.config.job_history, serving=self.served.serving)
        self.ledger.on_release = queue.pump
        self.slots = TrainingSlots(self.store, self.runtime, self.futures, self.data_dir, self._reserve,
                                   self.ledger.release)
        self.policies = Policies(self.store, self.runtime, self.served, self.data_dir)
        self.slots.restore_all()
        self.jobs.resume_all()
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

            if not ray.is_initialized():
                self._own_ray = True
                # Ray's own "local" starts a new instance; address=None would join whatever cluster
                # /tmp/ray/ray_current_cluster last named, even a dead one (then init hangs on its GCS)
                ray.init(address=self.config.ray_address, include_dashboard=False, log_to_driver=False)
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
                "inference_replicas": c.inference_replicas, "group_cap": c.group_cap,
                "max_adapters_per_group": c.max_adapters_per_group, "slot_memory_mb": c.slot_memory_mb,
                "slot_host_mb": c.slot_host_mb}

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

    def _reserve(self, tenant_id: str, holder: str, need: Need, retry_after_s: float, force: bool = False,
                 admit: bool = True) -> None:
        try:
            self.ledger.reserve(tenant_id, holder, need, self.access.quotas(tenant_id), force=force, admit=admit)
        except QuotaRefused as e:
            raise QuotaExceeded(str(e), retry_after_s=retry_after_s, numbers=e.numbers()) from None

    def set_disabled(self, tenant_id: str, disabled: bool):
        """Disable (or enable) a tenant. Disabled, its keys answer 401 at once, its running jobs are
        cancelled (their checkpoints stay) and its env sessions closed: it holds nothing any more."""
        t = self.store.set_disabled(tenant_id, disabled)
        self.access.forget(tenant_id=tenant_id)
        if disabled:
            self.jobs.cancel_all(tenant_id, detail="the tenant was disabled")
            for s in self.sessions.list(tenant_id):
                try:
                    self.sessions.close(tenant_id, s["session_id"])
                except Exception:  # noqa: BLE001 - closed meanwhile (reaped); nothing left to free
                    log.debug("session %s of disabled tenant %s was already gone", s["session_id"], tenant_id)
        return t
