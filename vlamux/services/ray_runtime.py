"""The distributed runtime: the same services as Ray actors, placed by per-role resources.

Each service stays a plain class; a thin actor here holds one and exposes blocking methods (the
actors are threaded, so concurrent requests still meet in one group). The data plane moves by
ObjectRef: an observation returned by the Environment actor can be handed to `predict` as a ref and
goes straight from one actor to the other, never through the driver or a relay. The control plane
is the Training actor's publisher calling `stage_policy` on each replica.

The driver keeps what a restart needs (each tenant's slot recipe, last checkpoint and newest
published policy) and a Health Manager that pings every actor: a dead, hung or restarted actor is
brought back (Ray restarts it; a hung one is killed first) and its tenants restored.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch

from vlamux.errors import UnknownBackboneError, UnknownTenantError
from vlamux.model import BackboneSpec, HeadSpec, Observation, OptimizerSpec
from vlamux.model.batch import obs_to_observation
from vlamux.model.slot import PolicySnapshot
from vlamux.services.control import PolicyPublisher, Retired
from vlamux.services.env_inputs import check_dataset_root
from vlamux.services.environment import EnvironmentService
from vlamux.services.shipping import Shipment
from vlamux.services.health import HealthManager, Role
from vlamux.services.inference import InferenceModelService
from vlamux.services import shipping
from vlamux.services.queues import InferenceQueueConfig
from vlamux.services.runtime import RuntimeConfig, _Recipe, lane_priority, placed_backbones
from vlamux.services.training import TrainingModelService
from vlamux.utils.once import SingleFlight

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 120.0
RESTORE_WAIT_S = 60.0  # how long a request waits for a replica being restarted and restored


class _Actor:
    def _init(self, torch_threads: int | None) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)  # Ray gives fractional actors one thread otherwise
        self.incarnation = uuid.uuid4().hex

    def calibrate(self) -> dict:
        """The model service measures its group caps again (between its groups)."""
        return self.svc.calibrate().result(CALL_TIMEOUT_S)

    def ping(self) -> dict:
        svc = self.svc
        alive = svc.alive() if hasattr(svc, "alive") else True
        beat = getattr(svc, "heartbeat", time.monotonic())
        return {"incarnation": self.incarnation, "alive": alive, "heartbeat_age_s": time.monotonic() - beat}

    def metrics(self) -> dict:
        return self.svc.metrics()

    def accounting(self) -> dict:
        """Busy time and per-tenant usage (what the API's metering reads)."""
        return self.svc.accounting.snapshot()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


class InferenceActor(_Actor):
    def __init__(self, backbones: dict[str, BackboneSpec], queue: InferenceQueueConfig, name: str,
                 device: str = "auto", torch_threads: int | None = None, dtype: str = "auto", fuse_heads: bool = True,
                 group_cap: str | None = None, group_budget_s: float | None = None,
                 prioritize_inference: bool = True):
        self._init(torch_threads)
        placed = list(placed_backbones(backbones, device, dtype).values())
        priority = lane_priority("inference", prioritize_inference, False, placed[0].device)
        self.svc = InferenceModelService(placed, queue, name, fuse_heads=fuse_heads, group_cap=group_cap,
                                         group_budget_s=group_budget_s, priority=priority).start()

    def stage_policy(self, snap: PolicySnapshot) -> None:
        self.svc.stage_policy(snap)

    async def predict(self, tenant: str, obs, deterministic: bool = False, deadline_s: float | None = None) -> dict:
        """Async, so every request enters the Inference Queue at once: its fair scheduler, not Ray's
        first-come mailbox, decides the order (a blocking method would leave requests queued in Ray
        behind whichever tenant sent the most)."""
        if isinstance(obs, dict):  # an environment observation, as the Environment actor returns it
            obs = obs_to_observation(obs)
        return await asyncio.wait_for(asyncio.wrap_future(self.svc.predict(tenant, obs, deterministic, deadline_s)),
                                      CALL_TIMEOUT_S)

    def policy_version(self, tenant: str) -> int | None:
        return self.svc.policy_version(tenant)

    def debug_hang(self, seconds: float) -> None:
        """Make the engine stall the way a stuck model call would (for health tests)."""
        self.svc.run_once = lambda timeout=None: time.sleep(seconds)

    def queue_rows(self) -> int:
        return self.svc.queue.depth()[1]


class TrainingActor(_Actor):
    def __init__(self, backbones: dict[str, BackboneSpec], max_staleness: int | None, max_group_rows: int | None,
                 device: str = "auto", torch_threads: int | None = None, dtype: str = "auto",
                 fuse_heads: bool = True, group_cap: str | None = None, group_budget_s: float | None = None,
                 prioritize_inference: bool = True):
        self._init(torch_threads)
        self.publisher = PolicyPublisher()
        self.publisher.start()
        self._sent: list = []  # stage_policy calls not yet known to have landed (flush waits for them)
        self._sent_lock = threading.Lock()
        self.backbones = placed_backbones(backbones, device, dtype)
        # decided here, on the device this actor resolved (the driver may see no GPU where the actor has one)
        priority = lane_priority("training", prioritize_inference, False, next(iter(self.backbones.values())).device)
        self.svc = TrainingModelService(list(self.backbones.values()), self.publisher, max_staleness,
                                        max_group_rows, fuse_heads=fuse_heads, group_cap=group_cap,
                                        group_budget_s=group_budget_s, priority=priority).start()

    def subscribe(self, name: str, replica) -> None:
        """New versions go to `replica` from now on, and every tenant's current one goes now: a new or
        restored replica must not wait for a tenant's next step (nor trust the driver's copies,
        which are fetched after the fact) to serve it. A replica keeps the newest of what it gets."""
        self.publisher.subscribe(name, lambda snap: self._track(replica.stage_policy.remote(snap)))
        current = [self.export_policy(t) for t in list(self.svc.runner.slots)]
        ray.get([replica.stage_policy.remote(s) for s in current], timeout=CALL_TIMEOUT_S)

    def _track(self, ref) -> None:
        # sent without waiting (a hung replica must not hold up the others' versions), remembered so
        # that a flush can wait until they landed
        with self._sent_lock:
            self._sent.append(ref)
            if len(self._sent) > 256:
                _, self._sent = ray.wait(self._sent, num_returns=len(self._sent), timeout=0)

    def unsubscribe(self, name: str) -> None:
        self.publisher.unsubscribe(name)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """True once every published version has reached every replica (landed, not only sent)."""
        end = time.monotonic() + timeout_s
        if not self.publisher.flush(timeout_s):
            return False
        with self._sent_lock:
            sent, self._sent = self._sent, []
        if not sent:
            return True
        _, pending = ray.wait(sent, num_returns=len(sent), timeout=max(0.0, end - time.monotonic()))
        with self._sent_lock:
            self._sent.extend(pending)
        return not pending

    def create_slot(self, tenant, head_spec, optim=None, seed=0, stats=None, backbone_id=None):
        return self.svc.create_slot(tenant, head_spec, optim, seed, stats, backbone_id).result(CALL_TIMEOUT_S)

    def remove_slot(self, tenant) -> dict:
        """Removed here, and retired on every replica before this returns (so a policy served to them
        afterwards, from a checkpoint, cannot be overtaken by the retirement)."""
        out = self.svc.remove_slot(tenant).result(CALL_TIMEOUT_S)
        self.flush(CALL_TIMEOUT_S)
        return out

    def describe_backbones(self) -> list[dict]:
        curves = self.svc.runner.group_curves
        return [{"name": n, "default": i == 0, **b.describe(),
                 "group_caps": {"training": curves[b.backbone_id].describe()} if b.backbone_id in curves else {}}
                for i, (n, b) in enumerate(self.backbones.items())]

    def forward_backward(self, tenant, obs, actions, action_mask=None, policy_version=None, priority=0, loss=None):
        if isinstance(obs, dict):
            obs = obs_to_observation(obs)
        return self.svc.forward_backward(tenant, obs, actions, action_mask, policy_version,
                                         priority, loss).result(CALL_TIMEOUT_S)

    def optim_step(self, tenant, priority=0):
        return self.svc.optim_step(tenant, priority).result(CALL_TIMEOUT_S)

    # Files come and go as bytes (vlamux.services.shipping): this actor's node shares no directory
    # with the driver, so it writes and reads only copies in its own temporary directory.
    def save_state(self, tenant) -> tuple[Shipment, dict]:
        """The tenant's slot file, as bytes for the driver to write where it keeps checkpoints."""
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "slot.safetensors"
            out = self.svc.save_state(tenant, path).result(CALL_TIMEOUT_S)
            return shipping.pack(path), {k: v for k, v in out.items() if k != "path"}

    def load_state(self, tenant, shipment: Shipment):
        """Load a slot file or a policy file the driver sent."""
        with shipping.received(shipment) as path:
            return self.svc.load_state(tenant, path).result(CALL_TIMEOUT_S)

    def version(self, tenant):
        return self.svc.version(tenant)

    def set_lr(self, tenant, lr, fresh_moments=False):
        return self.svc.set_lr(tenant, lr, fresh_moments).result(CALL_TIMEOUT_S)

    def import_adapter(self, tenant, shipment: Shipment):
        with shipping.received(shipment) as path:
            return self.svc.import_adapter(tenant, path).result(CALL_TIMEOUT_S)

    def export_adapter(self, tenant, base_model=None) -> Shipment:
        with tempfile.TemporaryDirectory() as d:
            self.svc.export_adapter(tenant, Path(d) / "adapter", base_model).result(CALL_TIMEOUT_S)
            return shipping.pack(Path(d) / "adapter")

    def tenants(self) -> list:
        return self.svc.tenants()

    def export_policy(self, tenant) -> PolicySnapshot:
        # through the Training Queue (never from the middle of a step), complete before it is pickled
        return self.svc.export_policy(tenant).result(CALL_TIMEOUT_S).ready()

    def restore(self, tenant, head_spec, optim, seed, checkpoint=None, snapshot=None, backbone_id=None) -> int:
        """Rebuild a tenant's slot after a restart: from its checkpoint, else its newest published policy."""
        slot = self.svc.runner.slots.get(tenant) or self.svc.runner.create_slot(tenant, head_spec, optim, seed,
                                                                               backbone_id)
        if checkpoint is not None:  # a Shipment of the slot file the driver kept
            with shipping.received(checkpoint) as path:
                slot.load_state(path)
            if snapshot is not None and snapshot.version >= slot.version:
                slot.newer_than(snapshot.version)
                self.svc._publish(tenant)  # the replicas serve what training now holds
        elif snapshot is not None:
            self.svc.runner.apply_policy(snapshot)
        return slot.version


class EnvironmentActor(_Actor):
    def __init__(self, torch_threads: int | None = None, **kwargs):
        self._init(torch_threads)
        if kwargs.get("allowed_dataset_roots") is not None:  # the driver checked the paths it shipped
            kwargs["allowed_dataset_roots"] = [*kwargs["allowed_dataset_roots"], shipping.node_dir()]
        self.svc = EnvironmentService(**kwargs)
        self.svc.start_reaper()

    def open_shipped_dataset(self, tenant, shipment: Shipment, *args, **kwargs) -> str:
        """`open_dataset` on this node's copy of a dataset the driver sent (unpacked once per node)."""
        return self.svc.open_dataset(tenant, shipping.unpack(shipment), *args, **kwargs)

    @ray.method(num_returns=2)
    def reset(self, tenant, session_id, seed=None, indices=None):
        """(observations, infos) as two objects, so the observations can travel on by reference."""
        return self.svc.reset(tenant, session_id, seed, indices)

    @ray.method(num_returns=2)
    def step(self, tenant, session_id, actions):
        """(observations, (reward, terminated, truncated, infos)) as two objects."""
        obs, *rest = self.svc.step(tenant, session_id, actions)
        return obs, tuple(rest)

    def call(self, method: str, *args, **kwargs):
        if method.startswith("_"):
            raise AttributeError(method)
        return getattr(self.svc, method)(*args, **kwargs)

    def worker_pids(self, tenant: str, session_id: str) -> list:
        return self.svc.worker_pids(tenant, session_id)


@dataclass
class RayRuntimeConfig(RuntimeConfig):
    """RuntimeConfig plus where each role runs. Ray options per role: num_cpus, num_gpus (fractions
    allowed), resources (e.g. {"node_a": 0.01} pins a role to the node that has that resource).
    A role given num_gpus sees only its own GPUs (Ray sets CUDA_VISIBLE_DEVICES in the actor), so
    its device is "auto" or "cuda:0" there; the RuntimeConfig device fields are read in the actor."""

    training_actor: dict = field(default_factory=lambda: {"num_cpus": 0.5})
    inference_actor: dict = field(default_factory=lambda: {"num_cpus": 0.5})
    environment_actor: dict = field(default_factory=lambda: {"num_cpus": 0.5})
    environment_replicas: int = 1
    torch_threads: int | None = None  # Ray gives fractional actors a single torch thread otherwise
    ping_timeout_s: float = 5.0

    def __post_init__(self):
        super().__post_init__()
        if self.service_cpus is not None or self.env_cpus is not None:  # never silently ignored
            raise ValueError("service_cpus / env_cpus pin cores of this process (the embedded runtime); on Ray "
                             "place each role with training_actor / inference_actor / environment_actor "
                             "(num_cpus, num_gpus, resources)")


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
        self._incarnations: dict[str, str] = {}
        self._recipes: dict[str, _Recipe] = {}
        self._checkpoints: dict[str, str] = {}
        self._datasets_shipped: dict[tuple, ray.ObjectRef] = {}
        self.latest: dict[str, PolicySnapshot] = {}
        self.health = HealthManager(self.config.health_interval_s, self.config.hung_after_s,
                                    env_check=self._check_env_workers, env_check_every_s=self.config.env_check_every_s)
        # Future callbacks run on Ray's own threads, which must never block on ray.get: follow-up work
        # (re-routing, keeping the newest policy) goes to this driver thread instead.
        self._followups = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vlamux-ray-driver")
        self.training = None
        self.environments: dict[str, ray.actor.ActorHandle] = {}
        self._draining: set[str] = set()
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
            c.dtype, c.fuse_heads, c.group_cap, c.group_budget_s, c.prioritize_inference)
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
        for handle in [self.training, *self.environments.values(), *self.replicas.values()]:
            if handle is not None:
                ray.kill(handle, no_restart=True)
        self.replicas.clear()
        self.environments.clear()

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
        with self._lock:
            self._recipes[tenant] = _Recipe(head_spec, optim, seed, backbone_id)
        return self._remember_after(tenant, self.training.create_slot.remote(tenant, head_spec, optim, seed, stats,
                                                                            backbone_id))

    def remove_slot(self, tenant: str) -> Future:
        """Free the tenant's slot in training and in every replica (the training actor's publisher
        retires it there), after its queued operations; a restart no longer brings it back."""
        with self._lock:
            self._recipes.pop(tenant, None)
            self._checkpoints.pop(tenant, None)

        def gone(out):
            with self._lock:
                self.latest.pop(tenant, None)
            return out

        def failed(e: BaseException) -> None:  # the replicas drop it all the same (it may never have been made)
            with self._lock:
                self.latest.pop(tenant, None)
            if not self._stopping:
                self._followups.submit(self._stage_everywhere, Retired(tenant), CALL_TIMEOUT_S)

        fut = _then(self.training.remove_slot.remote(tenant).future(), gone)
        fut.add_done_callback(lambda f: f.exception() is not None and failed(f.exception()))
        return fut

    def serve(self, snap: PolicySnapshot, timeout_s: float = 30.0) -> None:
        """Serve a policy version that no training slot holds: every replica takes it before this returns."""
        self.latest[snap.tenant] = snap
        self._stage_everywhere(snap, timeout_s)

    def retire(self, tenant: str, timeout_s: float = 30.0) -> None:
        """Stop serving a policy `serve` put on the replicas."""
        self.latest.pop(tenant, None)
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
        return self.training.forward_backward.remote(tenant, obs, actions, action_mask, policy_version,
                                                     priority, loss).future()

    def optim_step(self, tenant: str, priority: int = 0) -> Future:
        return self._remember_after(tenant, self.training.optim_step.remote(tenant, priority))

    # No directory is shared with the actors: the driver writes and reads the files, the actors get
    # and give bytes (vlamux.services.shipping).
    def save_state(self, tenant: str, path: str | Path) -> Future:
        path = Path(path).absolute()

        def written(out):
            shipment, info = out
            shipping.write_back(shipment, path)
            self._checkpoints[tenant] = str(path)
            return {"path": str(path), **info}

        return _then(self.training.save_state.remote(tenant).future(), written)

    def load_state(self, tenant: str, path: str | Path) -> Future:
        path = Path(path).absolute()
        fut = self._remember_after(tenant, self.training.load_state.remote(tenant, shipping.pack(path)))
        fut.add_done_callback(lambda f: f.exception() is None and self._checkpoints.__setitem__(tenant, str(path)))
        return fut

    def set_lr(self, tenant: str, lr: float, fresh_moments: bool = False) -> Future:
        return self.training.set_lr.remote(tenant, lr, fresh_moments).future()

    def import_adapter(self, tenant: str, path) -> Future:
        return self._remember_after(tenant, self.training.import_adapter.remote(tenant, shipping.pack(path)))

    def export_adapter(self, tenant: str, path, base_model: str | None = None) -> Future:
        path = Path(path).absolute()
        return _then(self.training.export_adapter.remote(tenant, base_model).future(),
                     lambda shipment: {"path": str(shipping.write_back(shipment, path))})

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
        envs = {n: ray.get(r, timeout=CALL_TIMEOUT_S) for n, r in self.env_all("metrics").items()}
        env = next(iter(envs.values())) if len(envs) == 1 else sum_numbers(list(envs.values()))
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
            if tenant not in self._recipes:  # its slot was removed meanwhile: nothing to keep
                return
            try:
                snap = ray.get(self.training.export_policy.remote(tenant), timeout=CALL_TIMEOUT_S)
                with self._lock:  # removed while it was fetched: not brought back
                    old = self.latest.get(tenant)
                    if tenant in self._recipes and (old is None or old.version <= snap.version):
                        self.latest[tenant] = snap
            except Exception:  # noqa: BLE001 - the next version will be kept
                if not self._stopping:
                    log.exception("keeping tenant %r's policy failed", tenant)

        fut.add_done_callback(keep)
        return fut

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every published policy version reached every replica."""
        return ray.get(self.training.flush.remote(timeout_s), timeout=timeout_s + 10)

    def _restore_training(self) -> None:
        with self._lock:
            recipes, checkpoints = dict(self._recipes), dict(self._checkpoints)
        ray.get([self.training.subscribe.remote(name, handle) for name, handle in list(self.replicas.items())],
                timeout=CALL_TIMEOUT_S)
        refs = [self.training.restore.remote(t, r.head_spec, r.optim, r.seed,
                                             shipping.pack(checkpoints[t]) if t in checkpoints else None,
                                             self.latest.get(t), r.backbone_id) for t, r in recipes.items()]
        ray.get(refs, timeout=CALL_TIMEOUT_S)
        for t in recipes:
            snap = ray.get(self.training.export_policy.remote(t), timeout=CALL_TIMEOUT_S)
            if t not in self.latest or self.latest[t].version < snap.version:
                self.latest[t] = snap

    # ---- inference --------------------------------------------------------------------------------
    def add_inference_replica(self) -> str:
        c = self.config
        index = next(self._names)
        name = f"inference-{index}"
        handle = self._actor(InferenceActor, c.inference_actor, max_concurrency=4096).remote(
            c.named_backbones(), c.inference_queue, name, c.role_device("inference", index), c.torch_threads, c.dtype,
            c.fuse_heads, c.group_cap, c.group_budget_s, c.prioritize_inference)
        self._incarnations[name] = self._ping(handle)["incarnation"]
        with self._lock:
            self.replicas[name] = handle
        self._restore_replica(name)
        self.health.watch(self._role(name, lambda: self.replicas[name], lambda: self._restore_replica(name)))
        return name

    def _restore_replica(self, name: str) -> None:
        handle = self.replicas[name]
        ray.get([handle.stage_policy.remote(s) for s in list(self.latest.values())], timeout=CALL_TIMEOUT_S)
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
                deadline_s: float | None = None, tries: int = 3) -> Future:
        """A future of {"actions", "policy_version"}; `obs` may be an ObjectRef (it travels by reference)."""
        out: Future = Future()
        self._route(out, tenant, obs, deterministic, deadline_s, tries, frozenset(), time.monotonic() + RESTORE_WAIT_S)
        return out

    def _route(self, out: Future, tenant, obs, deterministic, deadline_s, tries: int, avoid: frozenset,
               give_up_at: float) -> None:
        with self._lock:
            names = [n for n in self.replicas if n not in avoid and n not in self._restoring] or \
                [n for n in self.replicas if n not in avoid] or list(self.replicas)
        if not names:
            out.set_exception(RuntimeError("no inference replica"))
            return
        with self._lock:  # the replica with the fewest requests outstanding from this driver
            name = min(names, key=lambda n: self._outstanding.get(n, 0))
            self._outstanding[name] = self._outstanding.get(name, 0) + 1
        inner = self.replicas[name].predict.remote(tenant, obs, deterministic, deadline_s).future()

        def done(f: Future) -> None:
            with self._lock:
                self._outstanding[name] -= 1
            e = f.exception()
            args = (out, tenant, obs, deterministic, deadline_s, tries - 1, avoid | {name}, give_up_at)
            if isinstance(e, ray.exceptions.RayActorError) and tries > 1:  # replica went away: another one
                self._followup(out, self._route, *args)
            elif (isinstance(e, ray.exceptions.RayActorError) or
                  isinstance(e, UnknownTenantError) and tenant in self._recipes) and time.monotonic() < give_up_at:
                # a replica being restarted, or restarted and still being restored: another one, or this
                # one a moment later (bounded by give_up_at, not by a count: a restart takes seconds)
                self._followup(out, self._reroute_later, *args)
            elif e is not None:
                out.set_exception(e)
            else:
                out.set_result(f.result())

        inner.add_done_callback(done)

    def _followup(self, out: Future, fn, *args) -> None:
        try:
            self._followups.submit(fn, *args)
        except RuntimeError as e:  # the runtime is stopping
            if not out.done():
                out.set_exception(e)

    def _reroute_later(self, *args) -> None:
        time.sleep(0.2)
        self._route(*args)

    # ---- environment ------------------------------------------------------------------------------
    # Several Environment Service replicas may run; each prefixes its session and dataset ids with its
    # name, so a call that names an id goes straight to the replica holding it.
    @property
    def environment(self) -> ray.actor.ActorHandle:
        """The first environment replica (the only one, by default)."""
        return next(iter(self.environments.values()))

    def add_environment_replica(self) -> str:
        c = self.config
        name = f"environment-{next(self._env_names)}"
        handle = self._actor(EnvironmentActor, c.environment_actor).remote(c.torch_threads, name=name,
                                                                           **c.environment)
        self._incarnations[name] = self._ping(handle)["incarnation"]
        with self._lock:
            self.environments[name] = handle
        # a restarted replica comes back empty: its sessions' simulators died with it, and their ids
        # answer SessionNotFound, so the tenant opens a new session
        self.health.watch(self._role(name, lambda: self.environments[name], lambda: None))
        return name

    def remove_environment_replica(self, name: str, timeout_s: float = 60.0) -> None:
        """Drain a replica: it takes no new sessions or datasets; once its open ones are closed (by
        their tenants or the idle reaper) it stops. Raises TimeoutError, leaving it draining and
        serving, if they are still open after `timeout_s`."""
        with self._lock:
            if name not in self.environments:
                raise KeyError(f"no environment replica {name!r}")
            if len(self.environments) - len(self._draining - {name}) <= 1:
                raise ValueError("cannot remove the last environment replica")
            self._draining.add(name)
            handle = self.environments[name]
        end = time.monotonic() + timeout_s
        while True:
            m = ray.get(handle.call.remote("metrics"), timeout=CALL_TIMEOUT_S)
            held = m["open_sessions"] + m["open_datasets"]
            if held == 0:
                break
            if time.monotonic() > end:
                raise TimeoutError(f"environment replica {name!r} still holds {m['open_sessions']} sessions and "
                                   f"{m['open_datasets']} datasets after {timeout_s:.0f}s; it keeps draining")
            time.sleep(0.2)
        self.health.unwatch(name)
        with self._lock:
            self.environments.pop(name)
            self._draining.discard(name)
        ray.kill(handle, no_restart=True)

    def env_actor(self, handle_id: str) -> ray.actor.ActorHandle:
        """The environment replica that holds a session or dataset id."""
        owner = handle_id.split(".", 1)[0] if isinstance(handle_id, str) else None
        with self._lock:
            if owner in self.environments:
                return self.environments[owner]
        raise KeyError(f"no environment replica holds {handle_id!r}")

    def _open_on(self) -> ray.actor.ActorHandle:
        """The serving (not draining) replica holding the fewest simulators and datasets."""
        with self._lock:
            serving = {n: h for n, h in self.environments.items() if n not in self._draining}
        if len(serving) == 1:
            return next(iter(serving.values()))
        names = list(serving)
        loads = ray.get([serving[n].call.remote("metrics") for n in names], timeout=CALL_TIMEOUT_S)
        best = min(range(len(names)), key=lambda i: (loads[i]["open_envs"] + loads[i]["open_datasets"], i))
        return serving[names[best]]

    def _check_env_workers(self) -> dict:
        with self._lock:
            handles = list(self.environments.values())
        out: dict = {}
        for replaced in ray.get([h.call.remote("check_workers") for h in handles], timeout=CALL_TIMEOUT_S):
            out.update(replaced)
        return out

    def env(self, method: str, *args, **kwargs) -> ray.ObjectRef:
        """Call an Environment Service method; the result stays in the object store (an ObjectRef).
        `open_*` goes to the least loaded serving replica; a call naming a session or dataset id to
        the replica holding it; other calls need a single replica (see `env_all`)."""
        if method == "open_dataset":
            tenant, root, *rest = args if len(args) >= 2 else (*args, kwargs.pop("root"))
            return self._open_on().open_shipped_dataset.remote(tenant, self._shipped(root), *rest, **kwargs)
        if method.startswith("open_"):
            return self._open_on().call.remote(method, *args, **kwargs)
        if len(args) >= 2 and isinstance(args[1], str) and "." in args[1]:
            try:
                return self.env_actor(args[1]).call.remote(method, *args, **kwargs)
            except KeyError:
                pass  # the service answers with its own not-found error
        if len(self.environments) > 1:
            raise ValueError(f"env({method!r}) names no session or dataset and {len(self.environments)} "
                             f"environment replicas run; use env_all")
        return self.environment.call.remote(method, *args, **kwargs)

    def _shipped(self, root) -> ray.ObjectRef:
        """A dataset on the driver's disk, in the object store (put once per content: reopening it, or
        opening it on another replica, sends no bytes again)."""
        allowed = self.config.environment.get("allowed_dataset_roots")
        path = check_dataset_root(root, None if allowed is None else [Path(a).expanduser().resolve() for a in allowed])
        key = (str(path.resolve()), shipping.identity(path))
        with self._lock:
            ref = self._datasets_shipped.get(key)
        if ref is None:
            ref = ray.put(shipping.pack(path))
            with self._lock:
                self._datasets_shipped[key] = ref
        return ref

    def env_all(self, method: str, *args, **kwargs) -> dict[str, ray.ObjectRef]:
        """Call a method on every environment replica: {replica name: ObjectRef}."""
        with self._lock:
            return {n: h.call.remote(method, *args, **kwargs) for n, h in self.environments.items()}


def _then(fut: Future, fn) -> Future:
    """A future of `fn(fut's result)`, computed on the thread that completes `fut` (Ray's: `fn` must not
    wait on Ray)."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:  # noqa: BLE001 - the caller's future carries it
            out.set_exception(e)

    fut.add_done_callback(done)
    return out


def sum_numbers(dicts: list[dict]) -> dict:
    """Several environment replicas' metrics as one: numbers add up (utilisation averages)."""
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    for k in ("utilization", "concurrency"):
        if k in out:
            out[k] /= len(dicts)
    return out
