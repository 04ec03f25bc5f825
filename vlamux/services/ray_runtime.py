"""The distributed runtime: the same services as Ray actors, placed by per-role resources.

Each service stays a plain class; a thin actor holds one (vlamux.services.ray_actors), the
environment replicas are reached through `RayEnvironments` (vlamux.services.ray_environments), and a
tenant's training calls keep their order (a threaded actor may start two calls in either order, so
each is sent once the tenant's previous one finished). The data plane moves by
ObjectRef: an observation returned by the Environment actor can be handed to `predict` as a ref and
goes straight from one actor to the other, never through the driver or a relay. The control plane
is the Training actor's publisher calling `stage_policy` on each replica.

The driver keeps what a restart needs (each tenant's slot recipe, last checkpoint and newest
published policy) and a Health Manager that pings every actor: a dead, hung or restarted actor is
brought back (Ray restarts it; a hung one is killed first) and its tenants restored.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import ray

from vlamux.errors import UnknownBackboneError
from vlamux.model import HeadSpec, Observation, OptimizerSpec
from vlamux.model.snapshot import PolicySnapshot
from vlamux.services import shipping
from vlamux.services.control import Retired
from vlamux.services.health import HealthManager, Role
from vlamux.services.ordering import TenantOrder, then
from vlamux.services.ray_actors import CALL_TIMEOUT_S, EnvironmentActor, InferenceActor, TrainingActor
from vlamux.services.ray_environments import RayEnvironments
from vlamux.services.routing import Router
from vlamux.services.runtime import RuntimeConfigBase
from vlamux.services.slot_book import SlotBook, SlotRecipe
from vlamux.utils.once import SingleFlight

log = logging.getLogger(__name__)
RESTORE_WAIT_S = 60.0  # how long a request waits for a replica being restarted and restored


@dataclass
class RayRuntimeConfig(RuntimeConfigBase):
    """The common runtime settings plus where each role runs. Ray options per role: num_cpus,
    num_gpus (fractions allowed), resources (e.g. {"node_a": 0.01} pins a role to the node that has
    that resource). A role given num_gpus sees only its own GPUs (Ray sets CUDA_VISIBLE_DEVICES in the
    actor), so its device is "auto" or "cuda:0" there; the device fields are read in the actor. (The
    embedded runtime's core pinning, service_cpus and env_cpus, is not one: place roles by resources.)"""

    training_actor: dict = field(default_factory=lambda: {"num_cpus": 0.5})
    inference_actor: dict = field(default_factory=lambda: {"num_cpus": 0.5})
    environment_actor: dict = field(default_factory=lambda: {"num_cpus": 0.5})
    environment_replicas: int = 1
    torch_threads: int | None = None  # Ray gives fractional actors a single torch thread otherwise
    ping_timeout_s: float = 5.0


class RayRuntime:
    """The services as Ray actors. Call `ray.init(...)` (or connect to a cluster) first."""

    def __init__(self, config: RayRuntimeConfig | None = None):
        if not ray.is_initialized():
            raise RuntimeError("RayRuntime needs a Ray connection: call ray.init(address=...) first")
        self.config = config or RayRuntimeConfig()
        self._names = itertools.count()
        self._env_names = itertools.count()
        self._lock = threading.RLock()
        self._calibration = SingleFlight()
        self.replicas: dict[str, ray.actor.ActorHandle] = {}
        self._outstanding: dict[str, int] = {}  # requests sent to each replica, not yet answered
        self._sent: dict[str, int] = {}  # requests sent to each replica
        self._incarnations: dict[str, str] = {}
        self.book = SlotBook()  # recipes, checkpoints and newest versions: what a restart restores
        # a tenant's training calls reach the actor in the order they are made, as the Training Queue's do in process
        self._in_order = TenantOrder()
        self.environment = RayEnvironments(self.config.environment.get("allowed_dataset_roots"))
        self.health = HealthManager(self.config.health_interval_s, self.config.hung_after_s,
                                    env_check=self.environment.check_workers,
                                    env_check_every_s=self.config.env_check_every_s)
        # Future callbacks run on Ray's own threads, which must never block on ray.get: follow-up work
        # (re-routing, keeping the newest policy) goes to this driver thread instead.
        self._followups = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vlamux-ray-driver")
        self.router = Router(self._candidates, self._send, (ray.exceptions.RayActorError,), self.book.known,
                             lambda tenant: RuntimeError("no inference replica"), self._later,
                             give_up_s=RESTORE_WAIT_S)
        self.training = None
        self._restoring: set[str] = set()  # roles the Health Manager is restarting
        self._stopping = False
        self._backbones: list[dict] | None = None  # the training actor's, read once

    def _actor(self, cls, role_options: dict, max_concurrency: int = 64):
        return ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=max_concurrency)(cls).options(
            **role_options)

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> RayRuntime:
        c = self.config
        self.training = self._actor(TrainingActor, c.training_actor).remote(
            c.named_backbones(), c.max_staleness, c.max_group_rows, c.role_device("training"), c.torch_threads,
            c.dtype, c.fuse_heads, c.group_cap, c.group_budget_s, c.prioritize_inference, c.max_adapters_per_group)
        self._incarnations["training"] = self._ping(self.training)["incarnation"]
        self.health.watch(self._role("training", lambda: self.training, self._restore_training))
        for _ in range(c.environment_replicas):
            self.add_environment_replica()
        for _ in range(c.inference_replicas):
            self.add_inference_replica()
        self.health.start()
        return self

    def stop(self) -> None:
        self._stopping = True
        self.health.stop()
        self._followups.shutdown(wait=False, cancel_futures=True)
        for handle in [self.training, *self.environment.clear(), *self.replicas.values()]:
            if handle is not None:
                ray.kill(handle, no_restart=True)
        self.replicas.clear()

    def __enter__(self) -> RayRuntime:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _ping(self, handle, timeout_s: float | None = None) -> dict:
        return ray.get(handle.ping.remote(), timeout=timeout_s or max(self.config.ping_timeout_s, 60.0))

    def _role(self, name: str, handle_of, restore) -> Role:
        """A health role for an actor: alive = answers a ping; a new incarnation (Ray restarted it)
        or a restart we forced is followed by `restore`."""
        state = {"beat": time.monotonic()}

        def alive() -> bool:
            try:
                handle = handle_of()
            except KeyError:  # removed while this check was under way: nothing to watch any more
                return True
            try:
                info = self._ping(handle, self.config.ping_timeout_s)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
                # slow, or being restarted by Ray: not dead. Its heartbeat goes stale, and only once it
                # is older than hung_after_s is the role declared hung; a Ray restart shows as a new
                # incarnation at the next ping, and is restored then
                return True
            except ray.exceptions.RayActorError:
                return False
            if info["incarnation"] != self._incarnations.get(name):
                return False  # Ray brought it back on its own: it must be restored
            state["beat"] = time.monotonic() - info["heartbeat_age_s"]
            return info["alive"]

        def restart() -> None:
            self._restoring.add(name)  # no requests are routed to it until it is restored
            try:
                _restart()
            finally:
                self._restoring.discard(name)

        def _restart() -> None:
            handle = handle_of()
            try:
                info = self._ping(handle, self.config.ping_timeout_s)
                fresh = info["incarnation"] != self._incarnations.get(name)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
                fresh = False
            if not fresh:  # hung or broken: have Ray restart it
                ray.kill(handle, no_restart=False)
            info = self._wait_up(handle)
            self._incarnations[name] = info["incarnation"]
            restore()
            state["beat"] = time.monotonic()

        return Role(name, alive, lambda: state["beat"], restart)

    def _wait_up(self, handle, timeout_s: float = 120.0) -> dict:
        end = time.monotonic() + timeout_s
        while True:
            try:
                return self._ping(handle, 5.0)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
                if time.monotonic() > end:
                    raise
                time.sleep(0.2)

    # ---- training ---------------------------------------------------------------------------------
    def create_slot(self, tenant: str, head_spec: HeadSpec, optim: OptimizerSpec | None = None, seed: int = 0,
                    stats: dict | None = None, backbone: str | None = None) -> Future:
        backbone_id = self.backbone_id(backbone)
        self.book.created(tenant, SlotRecipe(head_spec, optim, seed, backbone_id))
        return self._in_order(tenant, lambda: self._remember_after(
            tenant, self.training.create_slot.remote(tenant, head_spec, optim, seed, stats, backbone_id)))

    def remove_slot(self, tenant: str) -> Future:
        """Free the tenant's slot in training and in every replica (the training actor's publisher
        retires it there), after its queued operations; a restart no longer brings it back."""
        self.book.removed(tenant)

        def gone(out):
            self.book.dropped(tenant)
            return out

        def failed(e: BaseException) -> None:  # the replicas drop it all the same (it may never have been made)
            self.book.dropped(tenant)
            if not self._stopping:
                self._followups.submit(self._stage_everywhere, Retired(tenant), CALL_TIMEOUT_S)

        fut = self._in_order(tenant, lambda: then(self.training.remove_slot.remote(tenant).future(), gone))
        fut.add_done_callback(lambda f: f.exception() is not None and failed(f.exception()))
        return fut

    def serve(self, snap: PolicySnapshot, timeout_s: float = 30.0) -> None:
        """Serve a policy version that no training slot holds: every replica takes it before this returns."""
        self.book.keep(snap, served=True)
        self._stage_everywhere(snap, timeout_s)

    def retire(self, tenant: str, timeout_s: float = 30.0) -> None:
        """Stop serving a policy `serve` put on the replicas."""
        self.book.dropped(tenant)
        self._stage_everywhere(Retired(tenant), timeout_s)

    def _stage_everywhere(self, item, timeout_s: float) -> None:
        with self._lock:
            replicas = list(self.replicas.values())
        ray.get([h.stage_policy.remote(item) for h in replicas], timeout=timeout_s)

    def calibrate(self) -> dict:
        """Every model service measures its group caps again: {service: curves}. A call while one runs
        gets that one's result."""
        def run() -> dict:
            with self._lock:
                actors = {"training": self.training, **self.replicas}
            # one actor after another: each is a process of its own, and two probing at once on shared
            # cores (or a shared GPU) would time each other's load
            out = {name: ray.get(a.calibrate.remote(), timeout=CALL_TIMEOUT_S + 10) for name, a in actors.items()}
            self._backbones = None  # described afresh, with the new caps
            return out

        return self._calibration.run(run, CALL_TIMEOUT_S + 20)

    def describe_backbones(self) -> list[dict]:
        if self._backbones is None:
            self._backbones = ray.get(self.training.describe_backbones.remote(), timeout=CALL_TIMEOUT_S)
        return self._backbones

    def backbone_names(self) -> list[str]:
        return list(self.config.named_backbones())

    def backbone_id(self, name: str | None = None) -> str:
        held = {b["name"]: b["id"] for b in self.describe_backbones()}
        if name is None:
            return next(iter(held.values()))
        if name not in held:
            raise UnknownBackboneError(f"backbone: this service holds {sorted(held)}, not {name!r}")
        return held[name]

    def forward_backward(self, tenant: str, obs, actions, action_mask=None, policy_version=None,
                         priority: int = 0, loss=None) -> Future:
        return self._in_order(tenant, lambda: self.training.forward_backward.remote(
            tenant, obs, actions, action_mask, policy_version, priority, loss).future())

    def optim_step(self, tenant: str, priority: int = 0) -> Future:
        return self._in_order(tenant, lambda: self._remember_after(tenant, self.training.optim_step.remote(tenant,
                                                                                                          priority)))

    # No directory is shared with the actors: the driver writes and reads the files, the actors get
    # and give bytes (vlamux.services.shipping).
    def save_state(self, tenant: str, path: str | Path) -> Future:
        path, making = Path(path).absolute(), self.book.making(tenant)

        def written(out):
            shipment, info = out
            shipping.write_back(shipment, path)
            self.book.file_used(tenant, path, making)
            return {"path": str(path), **info}

        return self._in_order(tenant, lambda: then(self.training.save_state.remote(tenant).future(), written))

    def load_state(self, tenant: str, path: str | Path) -> Future:
        path, making = Path(path).absolute(), self.book.making(tenant)
        fut = self._in_order(tenant, lambda: self._remember_after(tenant, self.training.load_state.remote(
            tenant, shipping.pack(path))))
        fut.add_done_callback(lambda f: f.exception() is None and self.book.file_used(tenant, path, making))
        return fut

    def set_lr(self, tenant: str, lr: float, fresh_moments: bool = False) -> Future:
        return self._in_order(tenant, lambda: self.training.set_lr.remote(tenant, lr, fresh_moments).future())

    def import_adapter(self, tenant: str, path) -> Future:
        return self._in_order(tenant, lambda: self._remember_after(
            tenant, self.training.import_adapter.remote(tenant, shipping.pack(path))))

    def export_adapter(self, tenant: str, path, base_model: str | None = None) -> Future:
        path = Path(path).absolute()
        return self._in_order(tenant, lambda: then(self.training.export_adapter.remote(tenant, base_model).future(),
                                                    lambda shipment: {"path": str(shipping.write_back(shipment, path))}))

    def version(self, tenant: str) -> int:
        return ray.get(self.training.version.remote(tenant), timeout=CALL_TIMEOUT_S)

    def tenants(self) -> list[str]:
        return ray.get(self.training.tenants.remote(), timeout=CALL_TIMEOUT_S)

    def accounting(self) -> dict[str, dict]:
        with self._lock:
            replicas = dict(self.replicas)
        refs = {"training": self.training.accounting.remote(),
                **{name: h.accounting.remote() for name, h in replicas.items()}}
        return {name: ray.get(ref, timeout=CALL_TIMEOUT_S) for name, ref in refs.items()}

    def replica_names(self) -> list[str]:
        with self._lock:
            return list(self.replicas)

    def metrics(self) -> dict:
        """The embedded runtime's `metrics()` layout, gathered from the actors."""
        with self._lock:
            replicas = dict(self.replicas)
        refs = {n: h.metrics.remote() for n, h in replicas.items()}
        env = self.environment.metrics()
        return {"training": ray.get(self.training.metrics.remote(), timeout=CALL_TIMEOUT_S),
                "inference": {n: ray.get(r, timeout=CALL_TIMEOUT_S) for n, r in refs.items()},
                "environment": env,
                "health": {n: r.restarts for n, r in self.health.roles.items()},
                "control_plane": {}}

    def _remember_after(self, tenant: str, ref) -> Future:
        """After a version-changing call, keep the tenant's newest policy on the driver (restarts need it)."""
        fut = ref.future()

        def keep(f: Future) -> None:
            if f.exception() is None and not self._stopping:
                self._followups.submit(fetch)

        def fetch() -> None:
            if not self.book.known(tenant):  # its slot was removed meanwhile: nothing to keep
                return
            try:
                # kept only while the slot exists: one removed while this was fetched is not brought back
                self.book.keep(ray.get(self.training.export_policy.remote(tenant), timeout=CALL_TIMEOUT_S))
            except Exception:  # noqa: BLE001 - the next version will be kept
                if not self._stopping:
                    log.exception("keeping tenant %r's policy failed", tenant)

        fut.add_done_callback(keep)
        return fut

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every published policy version reached every replica."""
        return ray.get(self.training.flush.remote(timeout_s), timeout=timeout_s + 10)

    def _restore_training(self) -> None:
        ray.get([self.training.subscribe.remote(name, handle) for name, handle in list(self.replicas.items())],
                timeout=CALL_TIMEOUT_S)
        plan = self.book.plan()
        # the checkpoints travel as bytes: the actor's node shares no directory with the driver
        ray.get([self.training.restore.remote(r, None if r.checkpoint is None else shipping.pack(r.checkpoint))
                 for r in plan], timeout=CALL_TIMEOUT_S)
        for r in plan:
            self.book.keep(ray.get(self.training.export_policy.remote(r.tenant), timeout=CALL_TIMEOUT_S))

    # ---- inference --------------------------------------------------------------------------------
    def add_inference_replica(self) -> str:
        c = self.config
        index = next(self._names)
        name = f"inference-{index}"
        handle = self._actor(InferenceActor, c.inference_actor, max_concurrency=4096).remote(
            c.named_backbones(), c.inference_queue, name, c.role_device("inference", index), c.torch_threads, c.dtype,
            c.fuse_heads, c.group_cap, c.group_budget_s, c.prioritize_inference, c.max_adapters_per_group,
            c.slot_budget())
        self._incarnations[name] = self._ping(handle)["incarnation"]
        with self._lock:
            self.replicas[name] = handle
        self._restore_replica(name)
        self.health.watch(self._role(name, lambda: self.replicas[name], lambda: self._restore_replica(name)))
        return name

    def _restore_replica(self, name: str) -> None:
        handle = self.replicas[name]
        ray.get([handle.stage_policy.remote(s) for s in self.book.snapshots()], timeout=CALL_TIMEOUT_S)
        ray.get(self.training.subscribe.remote(name, handle), timeout=CALL_TIMEOUT_S)

    def remove_inference_replica(self, name: str) -> None:
        with self._lock:
            if len(self.replicas) <= 1:
                raise ValueError("cannot remove the last inference replica")
            handle = self.replicas.pop(name)
        self.health.unwatch(name)
        ray.get(self.training.unsubscribe.remote(name), timeout=CALL_TIMEOUT_S)
        # in-flight calls finish (the actor drains), then it goes; new calls go elsewhere
        threading.Thread(target=self._retire, args=(handle,), daemon=True).start()

    @staticmethod
    def _retire(handle, grace_s: float = 30.0) -> None:
        end = time.monotonic() + grace_s
        while time.monotonic() < end:
            try:
                if ray.get(handle.queue_rows.remote(), timeout=5) == 0:
                    break
            except Exception:  # noqa: BLE001
                break
            time.sleep(0.2)
        time.sleep(0.5)
        ray.kill(handle, no_restart=True)

    def predict(self, tenant: str, obs: Observation | dict | ray.ObjectRef, deterministic: bool = False,
                deadline_s: float | None = None, explore=None) -> Future:
        """A future of {"actions", "policy_version"} (`Router`); `obs` may be an ObjectRef (it travels by
        reference)."""
        return self.router.predict(tenant, obs, deterministic, deadline_s, explore)

    def _candidates(self, tenant: str, avoid: frozenset) -> list[str]:
        with self._lock:  # the replicas with the fewest requests outstanding from this driver first
            names = [n for n in self.replicas if n not in avoid and n not in self._restoring] or \
                [n for n in self.replicas if n not in avoid] or list(self.replicas)
            # of equal ones the replica sent the fewest requests (a new one takes its share)
            return sorted(names, key=lambda n: (self._outstanding.get(n, 0), self._sent.get(n, 0)))

    def _send(self, name: str, tenant: str, obs, deterministic: bool, deadline_s: float | None,
              explore=None) -> Future:
        with self._lock:
            handle = self.replicas[name]
            self._outstanding[name] = self._outstanding.get(name, 0) + 1
            self._sent[name] = self._sent.get(name, 0) + 1
        fut = handle.predict.remote(tenant, obs, deterministic, deadline_s, explore).future()

        def answered(_) -> None:
            with self._lock:
                self._outstanding[name] -= 1

        fut.add_done_callback(answered)
        return fut

    def _later(self, fn, delay_s: float) -> None:
        # Ray's callback threads must never block on Ray: re-sends go to the driver's own thread
        def run() -> None:
            time.sleep(delay_s)
            fn()

        self._followups.submit(run)


    # ---- environment ------------------------------------------------------------------------------
    def add_environment_replica(self) -> str:
        c = self.config
        name = f"environment-{next(self._env_names)}"
        handle = self._actor(EnvironmentActor, c.environment_actor).remote(c.torch_threads, name=name,
                                                                           **c.environment)
        self._incarnations[name] = self._ping(handle)["incarnation"]
        self.environment.add(name, handle)
        # a restarted replica comes back empty: its sessions' simulators died with it, and their ids
        # answer SessionNotFound, so the tenant opens a new session
        self.health.watch(self._role(name, lambda: self.environment.replicas[name], lambda: None))
        return name

    def remove_environment_replica(self, name: str, timeout_s: float = 60.0) -> None:
        """Drain a replica (`RayEnvironments.drain`), then stop it."""
        handle = self.environment.drain(name, timeout_s)
        self.health.unwatch(name)
        ray.kill(handle, no_restart=True)
