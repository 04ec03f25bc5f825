"""The services as Ray actors: each holds one plain service and exposes blocking methods over its
futures (the actors are threaded, so concurrent requests still meet in one group).

Files come and go as bytes (vlamux.services.shipping): an actor's node shares no directory with the
driver, so it writes and reads only copies in its own temporary directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import tempfile
import threading
import time
import uuid
from pathlib import Path

import ray
import torch

from vlamux.model import BackboneSpec
from vlamux.model.batch import obs_to_observation
from vlamux.model.snapshot import PolicySnapshot
from vlamux.services import shipping
from vlamux.services.control import PolicyPublisher
from vlamux.services.environment import EnvironmentService
from vlamux.services.inference import InferenceModelService
from vlamux.services.pager import SlotBudget
from vlamux.services.queues import InferenceQueueConfig
from vlamux.services.runtime import lane_priority, placed_backbones
from vlamux.services.shipping import Shipment
from vlamux.services.slot_book import Restore
from vlamux.services.training import TrainingModelService

CALL_TIMEOUT_S = 120.0


class ServiceActor:
    """One service in a Ray actor: blocking methods over its futures, and what the driver pings."""

    def _init(self, torch_threads: int | None) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)  # Ray gives fractional actors one thread otherwise
        self.incarnation = uuid.uuid4().hex

    def calibrate(self) -> dict:
        """The model service measures its group caps again (between its groups)."""
        return self.svc.calibrate().result(CALL_TIMEOUT_S)

    def ping(self) -> dict:
        alive, beat = self._liveness()
        return {"incarnation": self.incarnation, "alive": alive, "heartbeat_age_s": time.monotonic() - beat}

    def _liveness(self) -> tuple[bool, float]:
        """(alive, the monotonic time of its last heartbeat): a model service's engine thread."""
        return self.svc.alive(), self.svc.heartbeat

    def metrics(self) -> dict:
        return self.svc.metrics()

    def accounting(self) -> dict:
        """Busy time and per-tenant usage (what the API's metering reads)."""
        return self.svc.accounting.snapshot()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


class InferenceActor(ServiceActor):
    def __init__(self, backbones: dict[str, BackboneSpec], queue: InferenceQueueConfig, name: str,
                 device: str = "auto", torch_threads: int | None = None, dtype: str = "auto", fuse_heads: bool = True,
                 group_cap: str | None = None, group_budget_s: float | None = None,
                 prioritize_inference: bool = True, max_adapters_per_group: int | None = None,
                 slot_budget: SlotBudget | None = None):
        self._init(torch_threads)
        placed = list(placed_backbones(backbones, device, dtype).values())
        priority = lane_priority("inference", prioritize_inference, False, placed[0].device)
        self.svc = InferenceModelService(placed, queue, name, fuse_heads=fuse_heads, group_cap=group_cap,
                                         group_budget_s=group_budget_s, priority=priority,
                                         max_adapters_per_group=max_adapters_per_group, slot_budget=slot_budget).start()

    def stage_policy(self, snap: PolicySnapshot) -> None:
        self.svc.stage_policy(snap)

    async def predict(self, tenant: str, obs, deterministic: bool = False, deadline_s: float | None = None,
                      explore=None) -> dict:
        """Async, so every request enters the Inference Queue at once: its fair scheduler, not Ray's
        first-come mailbox, decides the order (a blocking method would leave requests queued in Ray
        behind whichever tenant sent the most)."""
        if isinstance(obs, dict):  # an environment observation, as the Environment actor returns it
            obs = obs_to_observation(obs)
        return await asyncio.wait_for(asyncio.wrap_future(self.svc.predict(tenant, obs, deterministic, deadline_s,
                                                                                  explore)),
                                      CALL_TIMEOUT_S)

    def policy_version(self, tenant: str) -> int | None:
        return self.svc.policy_version(tenant)

    def debug_hang(self, seconds: float) -> None:
        """Make the engine stall the way a stuck model call would (for health tests)."""
        self.svc.run_once = lambda timeout=None: time.sleep(seconds)

    def queue_rows(self) -> int:
        return self.svc.queue.depth()[1]


class TrainingActor(ServiceActor):
    def __init__(self, backbones: dict[str, BackboneSpec], max_staleness: int | None, max_group_rows: int | None,
                 device: str = "auto", torch_threads: int | None = None, dtype: str = "auto",
                 fuse_heads: bool = True, group_cap: str | None = None, group_budget_s: float | None = None,
                 prioritize_inference: bool = True, max_adapters_per_group: int | None = None):
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
                                        group_budget_s=group_budget_s, priority=priority,
                                        max_adapters_per_group=max_adapters_per_group).start()

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

    def restore(self, restore: Restore, checkpoint: Shipment | None) -> dict:
        """`TrainingModelService.restore_slot`, its checkpoint the slot file the driver sent."""
        if checkpoint is None:
            return self.svc.restore_slot(restore).result(CALL_TIMEOUT_S)
        with shipping.received(checkpoint) as path:
            return self.svc.restore_slot(dataclasses.replace(restore, checkpoint=path)).result(CALL_TIMEOUT_S)


class EnvironmentActor(ServiceActor):
    """An Environment Service replica. Every method of the contract's `Environments` is the
    service's own, with its signature (`_forward` below); reset and step return two objects, so the
    observations can travel on by reference."""

    def __init__(self, torch_threads: int | None = None, **kwargs):
        self._init(torch_threads)
        if kwargs.get("allowed_dataset_roots") is not None:  # the driver checked the paths it shipped
            kwargs["allowed_dataset_roots"] = [*kwargs["allowed_dataset_roots"], shipping.node_dir()]
        self.svc = EnvironmentService(**kwargs)
        self.svc.start_reaper()

    def _liveness(self) -> tuple[bool, float]:
        return True, time.monotonic()  # no engine thread: answering the ping is being alive

    def open_shipped_dataset(self, tenant: str, shipment: Shipment, *args, **kwargs) -> str:
        """`open_dataset` on this node's copy of a dataset the driver sent (unpacked once per node)."""
        return self.svc.open_dataset(tenant, shipping.unpack(shipment), *args, **kwargs)

    @ray.method(num_returns=2)
    def reset(self, tenant: str, session_id: str, seed: int | None = None, indices=None):
        """(observations, infos) as two objects."""
        return self.svc.reset(tenant, session_id, seed, indices)

    @ray.method(num_returns=2)
    def step(self, tenant: str, session_id: str, actions):
        """(observations, (reward, terminated, truncated, infos)) as two objects."""
        obs, *rest = self.svc.step(tenant, session_id, actions)
        return obs, tuple(rest)


def _forward(name: str):
    method = getattr(EnvironmentService, name)

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        return method(self.svc, *args, **kwargs)

    return call


# the service's methods the driver calls, as the actor's (open_dataset goes as open_shipped_dataset)
ENVIRONMENT_METHODS = ("open_session", "resize_session", "close_session", "session_info", "action_spec",
                       "list_sessions", "sample", "dataset_stats", "dataset_info", "close_dataset", "list_datasets",
                       "tenants", "usage", "env_steps", "utilization", "check_workers", "worker_pids")
for _name in ENVIRONMENT_METHODS:
    setattr(EnvironmentActor, _name, _forward(_name))
