"""The embedded runtime: every service in one process (simulators in worker processes), started by
one call, with the Health Manager watching them. It also routes: action requests go to the least
loaded live inference replica, and a request whose replica went away is re-sent to another, so
adding, removing or restarting a replica drops nothing.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vlamux.errors import UnknownBackboneError, UnknownTenantError
from vlamux.model import Backbone, BackboneSpec, HeadSpec, Observation, OptimizerSpec, build_backbone
from vlamux.model.device import resolve_device, resolve_dtype
from vlamux.model.snapshot import PolicySnapshot
from vlamux.services.control import PolicyPublisher, Retired
from vlamux.services.environment import EnvironmentService
from vlamux.services.health import HealthManager, Role
from vlamux.services.inference import InferenceModelService
from vlamux.services.pager import SlotBudget
from vlamux.services.queues import InferenceQueueConfig, QueueClosed
from vlamux.services.routing import Router
from vlamux.services.slot_book import SlotBook, SlotRecipe
from vlamux.services.training import TrainingModelService
from vlamux.utils.once import SingleFlight

log = logging.getLogger(__name__)
CALIBRATE_TIMEOUT_S = 300.0  # a model service's re-measurement of its group caps
RESTORE_TIMEOUT_S = 120.0  # one tenant's restore after a training restart


@dataclass
class RuntimeConfigBase:
    """What both runtimes are configured with: backbones, devices, queues, grouping, health."""

    backbone: BackboneSpec = field(default_factory=BackboneSpec)  # the default: slots that name none read it
    backbones: dict = field(default_factory=dict)  # more backbones the services hold at once, by name
    # Placement. `device` is every model service's unless its role names one: "auto" is CUDA where
    # present; training and each inference replica may sit on different GPUs ("cuda:0", "cuda:1";
    # replica i takes inference_devices[i % len]). `dtype` is the backbone's precision ("auto":
    # bfloat16 on CUDA, float32 on a CPU); heads keep fp32 weights and run under autocast.
    device: str = "auto"
    dtype: str = "auto"
    training_device: str | None = None
    inference_devices: tuple[str, ...] = ()
    fuse_heads: bool = True  # heads of one architecture in a group run as one call (vlamux.model.fused)
    inference_replicas: int = 1
    inference_queue: InferenceQueueConfig = field(default_factory=InferenceQueueConfig)
    max_staleness: int | None = None
    max_group_rows: int | None = None
    # "learned": each model service measures its backbones' forward time by rows at start (and on
    # `calibrate()`) and caps groups where a bigger one stops paying; None: groups are uncapped
    group_cap: str | None = "learned"
    group_budget_s: float | None = None  # and at most this long a group forward (latency)
    # at most this many distinct tenants' adapters in one backbone call (each is one more segment of
    # every adapted Linear); the others join the next group. None: no cap
    max_adapters_per_group: int | None = None
    # Serving slots an inference replica keeps resident, in MiB (the least recently used beyond it are
    # parked in host memory, and past slot_host_mb stored on disk; a request for one waits while it
    # comes back). "auto": a quarter of a GPU's free memory at the replica's start, all on a CPU
    # (vlamux.services.pager.SlotBudget.placed); None: every slot stays resident
    slot_memory_mb: float | str | None = "auto"
    slot_host_mb: float | None = None
    # Inference before training where they share a GPU or the services' own cores (vlamux.model.device:
    # stream priorities on CUDA, the training thread's nice on the embedded runtime's service_cpus);
    # False: the defaults.
    prioritize_inference: bool = True
    health_interval_s: float = 0.5
    hung_after_s: float = 30.0
    env_check_every_s: float = 5.0
    environment: dict = field(default_factory=dict)  # EnvironmentService keyword arguments

    def __post_init__(self):
        self.inference_devices = tuple(self.inference_devices)
        for name in ("slot_memory_mb", "slot_host_mb"):
            value = getattr(self, name)
            if value is not None and not (name == "slot_memory_mb" and value == "auto") and not (
                    isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"runtime config: {name} is a positive number of MiB"
                                 f"{', auto' if name == 'slot_memory_mb' else ''} or None, got {value!r}")
        if self.max_adapters_per_group is not None and (not isinstance(self.max_adapters_per_group, int)
                                                        or self.max_adapters_per_group < 1):
            raise ValueError(f"runtime config: max_adapters_per_group is a whole number >= 1 or None (no cap), "
                             f"got {self.max_adapters_per_group!r}")
        for name in (self.device, self.training_device, *self.inference_devices):
            if name is not None and not isinstance(name, str):
                raise ValueError(f"runtime config: devices are strings such as 'auto', 'cpu', 'cuda:1'; got {name!r}")

    def named_backbones(self) -> dict[str, BackboneSpec]:
        """Every backbone by the name job specs and slots use: the default first (named after its preset,
        or its directory), then `backbones`."""
        out = {backbone_name(self.backbone): self.backbone}
        for name, spec in self.backbones.items():
            if name in out:
                raise ValueError(f"runtime config: two backbones are named {name!r}")
            out[name] = spec
        return out

    def slot_budget(self) -> SlotBudget | None:
        """An inference replica's slot budget (vlamux.services.pager), from slot_memory_mb / slot_host_mb."""
        if self.slot_memory_mb is None:
            return None
        mib = 1 << 20
        return SlotBudget("auto" if self.slot_memory_mb == "auto" else int(self.slot_memory_mb * mib),
                          None if self.slot_host_mb is None else int(self.slot_host_mb * mib))

    def role_device(self, role: str, index: int = 0) -> str:
        """The device a role is placed on: "training" or "inference" (replica `index`), unresolved."""
        if role == "training":
            return self.training_device or self.device
        if role == "inference":
            return self.inference_devices[index % len(self.inference_devices)] if self.inference_devices \
                else self.device
        raise ValueError(f"unknown role {role!r}")


@dataclass
class RuntimeConfig(RuntimeConfigBase):
    """The embedded runtime's: the common settings, and placement by this process's cores."""

    # Placement by resource (vlamux.utils.placement): the model services (this process's threads, and
    # torch's intra-op threads, one per core) on `service_cpus`, the simulator workers on `env_cpus`.
    # None: wherever the OS puts them (today's shared setting).
    service_cpus: tuple[int, ...] | None = None
    env_cpus: tuple[int, ...] | None = None

    def __post_init__(self):
        from vlamux.utils.placement import check_cpus

        super().__post_init__()
        self.service_cpus = check_cpus(self.service_cpus, "service_cpus")
        self.env_cpus = check_cpus(self.env_cpus, "env_cpus")

    def lane_priority(self, role: str) -> str:
        """A model service's lane priority (`lane_priority` below), its device resolved in this process."""
        return lane_priority(role, self.prioritize_inference, self.service_cpus is not None,
                             resolve_device(self.role_device(role)))


def lane_priority(role: str, prioritize_inference: bool, own_cores: bool, device) -> str:
    """A model service's lane priority: inference "high"; training "low" where it shares a GPU, or
    cores of the services' own (`own_cores`), with inference; else both "normal". On cores the
    simulators share too, a low-priority training thread would yield to every simulator and could
    stall for as long as they keep the cores busy: there the OS's fair share stays. `device`: the
    role's, resolved where it runs (a Ray actor resolves its own: "auto" there is the GPU Ray gave it)."""
    if not prioritize_inference:
        return "normal"
    if role == "inference":
        return "high"
    return "low" if own_cores or torch.device(device).type == "cuda" else "normal"


def backbone_name(spec: BackboneSpec) -> str:
    """A backbone's name in a service: a built-in one's preset, an hf (or lerobot) one's directory name."""
    return Path(spec.path).name if spec.kind in ("hf", "lerobot") else spec.preset


def placed_backbones(specs: dict[str, BackboneSpec], device: str, dtype: str) -> dict[str, Backbone]:
    return {name: placed_backbone(spec, device, dtype) for name, spec in specs.items()}


def placed_backbone(spec: BackboneSpec, device: str, dtype: str) -> Backbone:
    """A backbone built for a role's placement (its device and dtype resolved where the role runs)."""
    dev = resolve_device(device)
    return build_backbone(spec, device=dev, dtype=resolve_dtype(dtype, dev))


class EmbeddedRuntime:
    def __init__(self, config: RuntimeConfig | None = None):
        self.config = config or RuntimeConfig()
        self._backbones: dict[str, dict[str, Backbone]] = {}  # device -> name -> backbone, shared by its roles
        self.backbone = next(iter(self._backbones_on(self.config.role_device("training")).values()))
        self.publisher = PolicyPublisher()
        self.book = SlotBook()  # recipes, checkpoints and newest versions: what a restart restores
        self.publisher.subscribe("runtime", self._remember)
        self.training = self._new_training()
        self.replicas: dict[str, InferenceModelService] = {}
        env_kw = dict(self.config.environment)
        if self.config.env_cpus:
            env_kw.setdefault("worker_cpus", self.config.env_cpus)
        self.environment = EnvironmentService(**env_kw)
        self.health = HealthManager(self.config.health_interval_s, self.config.hung_after_s,
                                    env_check=self.environment.check_workers,
                                    env_check_every_s=self.config.env_check_every_s)
        self._lock = threading.RLock()
        self._sent: dict[str, int] = {}  # requests sent to each replica (`_candidates`)
        self.router = Router(self._candidates, self._send, (QueueClosed,), self.book.serves, self._no_replica,
                             self._later)
        self._calibration = SingleFlight()
        self._names = itertools.count()
        self._devices: dict[str, str] = {}  # replica -> its device
        self._started = False

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> EmbeddedRuntime:
        if self.config.service_cpus:
            import torch

            from vlamux.utils.placement import pin_process

            self._unpinned = (os.sched_getaffinity(0), torch.get_num_threads())  # restored by stop()
            pin_process(self.config.service_cpus)
            torch.set_num_threads(len(self.config.service_cpus))
        self.publisher.start()
        self.training.start()
        self.health.watch(Role("training", lambda: self.training.alive(), lambda: self.training.heartbeat,
                               self._restart_training))
        for _ in range(self.config.inference_replicas):
            self.add_inference_replica()
        self.health.start()
        self.environment.start_reaper()
        self._started = True
        return self

    def stop(self) -> None:
        if getattr(self, "_unpinned", None) is not None:
            import torch

            from vlamux.utils.placement import pin_process

            pin_process(self._unpinned[0])
            torch.set_num_threads(self._unpinned[1])
            self._unpinned = None
        self.health.stop()
        for name in list(self.replicas):
            self.replicas.pop(name).stop()
        self.training.stop()
        self.publisher.stop()
        self.environment.close()
        self._started = False

    def __enter__(self) -> EmbeddedRuntime:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- training (recorded so a restarted training role can rebuild its tenants) -----------------
    def create_slot(self, tenant: str, head_spec: HeadSpec, optim: OptimizerSpec | None = None, seed: int = 0,
                    stats: dict | None = None, backbone: str | None = None) -> Future:
        """backbone: the name of the backbone the tenant's head reads (default: the service's first)."""
        backbone_id = self.backbone_id(backbone)
        self.book.created(tenant, SlotRecipe(head_spec, optim, seed, backbone_id))
        return self.training.create_slot(tenant, head_spec, optim, seed, stats, backbone_id)

    def remove_slot(self, tenant: str) -> Future:
        """Free the tenant's slot in training and in every replica, after its queued operations (the
        future resolves once the replicas dropped it); a restart no longer brings it back."""
        self.book.removed(tenant)
        out: Future = Future()

        def removed(f: Future) -> None:
            e = f.exception()
            if e is not None:  # refused (never made, or the training role went down): the replicas drop it all the same
                self.publisher.retire(tenant)

            def delivered() -> None:  # resolved once every replica dropped it, as on Ray
                if not self.publisher.flush(30):
                    log.warning("removing %s: the replicas had not all dropped it after 30 s", tenant)
                out.set_exception(e) if e is not None else out.set_result(f.result())

            # off the training engine's thread, which must not wait for the replicas
            threading.Thread(target=delivered, name="vlamux-remove-slot", daemon=True).start()

        self.training.remove_slot(tenant).add_done_callback(removed)
        return out

    def serve(self, snap: PolicySnapshot, timeout_s: float = 30.0) -> None:
        """Serve a policy version that no training slot holds (a finished job's, from its checkpoint):
        every replica takes it before this returns."""
        self.book.keep(snap, served=True)
        self.publisher.publish(snap)
        self.publisher.flush(timeout_s)

    def retire(self, tenant: str, timeout_s: float = 30.0) -> None:
        """Stop serving a policy `serve` put on the replicas."""
        self.publisher.retire(tenant)
        self.publisher.flush(timeout_s)

    def backbone_names(self) -> list[str]:
        return list(self.config.named_backbones())

    def backbone_id(self, name: str | None = None) -> str:
        """The id of the backbone named `name` (None: the default)."""
        held = self._backbones_on(self.config.role_device("training"))
        if name is None:
            return next(iter(held.values())).backbone_id
        if name not in held:
            raise UnknownBackboneError(f"backbone: this service holds {sorted(held)}, not {name!r}")
        return held[name].backbone_id

    def describe_backbones(self) -> list[dict]:
        """Every backbone the services hold: name, id, kind, parameters, dtype, resident memory, ..."""
        held = self._backbones_on(self.config.role_device("training"))
        out = []
        for i, (name, b) in enumerate(held.items()):
            desc = {"name": name, "default": i == 0, **b.describe()}
            desc["devices"] = sorted({str(self._backbones[d][name].device) for d in self._backbones})
            desc["group_caps"] = {svc.name: svc.runner.group_curves[b.backbone_id].describe()
                                  for svc in (self.training, *self.replicas.values())
                                  if svc is not None and b.backbone_id in svc.runner.group_curves}
            # replicas that page their serving slots: each one's tiers (all its backbones' slots)
            desc["slot_tiers"] = {svc.name: svc.tiers.pager.usage() for svc in self.replicas.values()
                                  if svc.tiers is not None}
            out.append(desc)
        return out

    def calibrate(self) -> dict:
        """Every model service measures its group caps again (a probe forward at a time, serving in
        between): {service: curves}. A call while one runs gets that one's result."""
        def run() -> dict:
            futures = {svc.name: svc.calibrate() for svc in (self.training, *self.replicas.values())}
            return {name: f.result(CALIBRATE_TIMEOUT_S) for name, f in futures.items()}

        return self._calibration.run(run, CALIBRATE_TIMEOUT_S + 10)

    def save_state(self, tenant: str, path: str | Path) -> Future:
        return self._tracked(tenant, path, self.training.save_state(tenant, path))

    def load_state(self, tenant: str, path: str | Path) -> Future:
        return self._tracked(tenant, path, self.training.load_state(tenant, path))

    def _tracked(self, tenant: str, path, fut: Future) -> Future:
        """Remember the tenant's newest checkpoint once the call succeeds: a restart restores from it."""
        making = self.book.making(tenant)
        fut.add_done_callback(lambda f: f.exception() is None and self.book.file_used(tenant, path, making))
        return fut

    def set_lr(self, tenant: str, lr: float, fresh_moments: bool = False) -> Future:
        return self.training.set_lr(tenant, lr, fresh_moments)

    def import_adapter(self, tenant: str, path: str | Path) -> Future:
        return self.training.import_adapter(tenant, path)

    def export_adapter(self, tenant: str, path: str | Path, base_model: str | None = None) -> Future:
        return self.training.export_adapter(tenant, path, base_model)

    def forward_backward(self, tenant: str, *args, **kwargs) -> Future:
        return self.training.forward_backward(tenant, *args, **kwargs)

    def optim_step(self, tenant: str, **kwargs) -> Future:
        return self.training.optim_step(tenant, **kwargs)

    def _backbones_on(self, device: str) -> dict[str, Backbone]:
        key = str(resolve_device(device))
        if key not in self._backbones:
            self._backbones[key] = placed_backbones(self.config.named_backbones(), key, self.config.dtype)
        return self._backbones[key]

    def _new_training(self) -> TrainingModelService:
        held = list(self._backbones_on(self.config.role_device("training")).values())
        return TrainingModelService(held, self.publisher, self.config.max_staleness,
                                    self.config.max_group_rows, fuse_heads=self.config.fuse_heads,
                                    group_cap=self.config.group_cap, group_budget_s=self.config.group_budget_s,
                                    priority=self.config.lane_priority("training"),
                                    max_adapters_per_group=self.config.max_adapters_per_group)

    def _restart_training(self) -> None:
        """Rebuild the training role; each tenant comes back from its last checkpoint, else from its
        last published version (weights and statistics; the optimizer state starts afresh)."""
        old = self.training
        try:
            old.stop(join_timeout_s=1.0)
        except Exception:  # noqa: BLE001 - it is being replaced because it is broken
            log.exception("stopping the failed training role")
        new = self._new_training()
        # queued before the engine starts: each tenant's first operation is its restore
        restored = [new.restore_slot(r) for r in self.book.plan()]
        self.training = new.start()
        for f in restored:
            try:
                f.result(RESTORE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - that tenant's calls answer for it; the others are back
                log.exception("restoring a tenant after a training restart")

    def _remember(self, snap: PolicySnapshot | Retired) -> None:
        if isinstance(snap, Retired):
            self.book.dropped(snap.tenant)
        else:
            self.book.keep(snap)

    def version(self, tenant: str) -> int:
        return self.training.version(tenant)

    def tenants(self) -> list[str]:
        return self.training.tenants()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every published policy version reached every replica."""
        return self.publisher.flush(timeout_s)

    def accounting(self) -> dict[str, dict]:
        with self._lock:
            replicas = dict(self.replicas)
        return {"training": self.training.accounting.snapshot(),
                **{name: r.accounting.snapshot() for name, r in replicas.items()}}

    def replica_names(self) -> list[str]:
        with self._lock:
            return list(self.replicas)

    # ---- inference --------------------------------------------------------------------------------
    def add_inference_replica(self) -> str:
        index = next(self._names)
        name = f"inference-{index}"
        self._devices[name] = self.config.role_device("inference", index)
        self._start_replica(name)
        self.health.watch(Role(name, lambda: self.replicas[name].alive(), lambda: self.replicas[name].heartbeat,
                               lambda: self._restart_replica(name)))
        return name

    def _start_replica(self, name: str) -> InferenceModelService:
        svc = InferenceModelService(list(self._backbones_on(self._devices[name]).values()),
                                    self.config.inference_queue, name, fuse_heads=self.config.fuse_heads,
                                    group_cap=self.config.group_cap, group_budget_s=self.config.group_budget_s,
                                    priority=self.config.lane_priority("inference"),
                                    max_adapters_per_group=self.config.max_adapters_per_group,
                                    slot_budget=self.config.slot_budget())
        self.publisher.subscribe(name, svc.stage_policy)
        for snap in self.book.snapshots():  # it serves every tenant from its newest version on
            svc.stage_policy(snap)
        svc.start()
        with self._lock:
            self.replicas[name] = svc
        return svc

    def _restart_replica(self, name: str) -> None:
        with self._lock:
            old = self.replicas.get(name)
        self.publisher.unsubscribe(name)
        if old is not None:
            old.stop(join_timeout_s=1.0)  # its queued requests fail with QueueClosed; `predict` re-routes them
        self._start_replica(name)

    def remove_inference_replica(self, name: str) -> None:
        """Take a replica out of service: no new requests, the queued ones re-routed, then stopped."""
        with self._lock:
            if len(self.replicas) <= 1:
                raise ValueError("cannot remove the last inference replica")
            svc = self.replicas.pop(name)
        self.health.unwatch(name)
        self.publisher.unsubscribe(name)
        svc.stop()

    def predict(self, tenant: str, obs: Observation, deterministic: bool = False,
                deadline_s: float | None = None, explore=None) -> Future:
        """A future of {"actions", "policy_version"} from the least loaded live replica (`Router`)."""
        return self.router.predict(tenant, obs, deterministic, deadline_s, explore)

    def _candidates(self, tenant: str, avoid: frozenset) -> list[str]:
        with self._lock:
            live = [(n, s) for n, s in self.replicas.items() if s.alive() and s.serves(tenant)]
        fresh = [x for x in live if x[0] not in avoid] or live
        # the shortest queue; of equal ones the replica sent the fewest requests (a new one takes its share)
        return [n for n, _ in sorted(fresh, key=lambda x: (x[1].queue.depth()[1], self._sent.get(x[0], 0)))]

    def _send(self, name: str, tenant: str, obs, deterministic: bool, deadline_s: float | None,
              explore=None) -> Future:
        with self._lock:
            svc = self.replicas.get(name)
        if svc is None:
            raise QueueClosed(f"inference replica {name!r} was removed")
        with self._lock:
            self._sent[name] = self._sent.get(name, 0) + 1
        return svc.predict(tenant, obs, deterministic, deadline_s, explore)

    def _no_replica(self, tenant: str) -> Exception:
        if not self.book.serves(tenant):
            return UnknownTenantError(f"no policy for tenant {tenant!r}")
        return QueueClosed(f"no live inference replica serves tenant {tenant!r}")

    @staticmethod
    def _later(fn, delay_s: float) -> None:
        # a replica's queue closing answers on its engine's thread: sent on from there, as it is not
        # an engine's work; a wait for a restart goes to a timer
        if delay_s <= 0:
            fn()
        else:
            timer = threading.Timer(delay_s, fn)
            timer.daemon = True
            timer.start()

    def metrics(self) -> dict:
        return {
            "training": self.training.metrics(),
            "inference": {n: s.metrics() for n, s in self.replicas.items()},
            "environment": self.environment.metrics(),
            "health": {n: r.restarts for n, r in self.health.roles.items()},
            "control_plane": {"delivered": self.publisher.delivered, "bytes": self.publisher.bytes_sent,
                              "busy_s": self.publisher.busy_s},
        }
