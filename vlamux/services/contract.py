"""The runtime contract: what the API host, the Master Service, the workflows and metering may use of a
runtime, whichever one runs the services (`EmbeddedRuntime` in this process, `RayRuntime` over a Ray
cluster). Both satisfy `Runtime`; a caller that needs more than this is reaching into a runtime's
internals (tests/test_runtime_contract.py checks both runtimes' signatures against it).

A tenant's training calls run in the order they are made; a method that returns a Future never blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from vlamux.envs.base import EnvSpec
from vlamux.model import HeadSpec, Observation, OptimizerSpec
from vlamux.model.snapshot import PolicySnapshot


class Environments(Protocol):
    """The Environment Service as callers see it: one in this process, or every Ray replica behind one face."""

    def open_session(self, tenant: str, spec: EnvSpec | Mapping, n_envs: int, seed: int | None = None,
                     n_workers: int | None = None, idle_timeout_s: float | None = 300.0, *,
                     timeout_s: float | None = None, start_timeout_s: float | None = None,
                     as_observation: bool = False, render_device: int | None = None) -> str: ...
    def reset(self, tenant: str, session_id: str, seed: int | None = None,
              indices: Sequence[int] | None = None) -> tuple[dict, list]: ...
    def step(self, tenant: str, session_id: str, actions) -> tuple: ...
    def close_session(self, tenant: str, session_id: str) -> None: ...
    def list_sessions(self, tenant: str) -> list[dict]: ...
    def session_info(self, tenant: str, session_id: str) -> dict: ...
    def open_dataset(self, tenant: str, root: str | Path, horizon: int, batch_size: int,
                     camera_map: Mapping[str, str], state_key: str | None = "observation.state",
                     action_key: str = "action", seed: int = 0, *, idle_timeout_s: float | None = 3600.0,
                     episodes: Sequence[int] | None = None, cache_mb: float = 512.0,
                     options: Mapping[str, Any] | None = None) -> str: ...
    def dataset_stats(self, tenant: str, dataset_id: str, mode: str = "mean_std") -> dict: ...
    def sample(self, tenant: str, dataset_id: str) -> tuple: ...
    def close_dataset(self, tenant: str, dataset_id: str) -> None: ...
    def env_steps(self) -> dict[str, int]: ...


@runtime_checkable
class Runtime(Protocol):
    """The services of one deployment: training, inference replicas, environments."""

    @property
    def environment(self) -> Environments: ...

    def start(self) -> Runtime: ...
    def stop(self) -> None: ...

    # backbones
    def backbone_names(self) -> list[str]:
        """The backbones held, the default first."""
    def backbone_id(self, name: str | None = None) -> str:
        """The id of backbone `name` (None: the default); UnknownBackboneError names the ones there are."""
    def describe_backbones(self) -> list[dict]:
        """Each backbone's name, id, kind, digest, dtype and group caps."""
    def calibrate(self) -> dict:
        """Every model service re-measures its group caps."""

    # training slots
    def create_slot(self, tenant: str, head_spec: HeadSpec, optim: OptimizerSpec | None = None, seed: int = 0,
                    stats: dict | None = None, backbone: str | None = None) -> Future:
        """The tenant's slot, recorded so that a restart rebuilds it."""
    def remove_slot(self, tenant: str) -> Future:
        """Free the tenant's slot everywhere: resolved once training and every replica dropped it."""
    def forward_backward(self, tenant: str, obs: Observation, actions, action_mask=None, policy_version=None,
                         priority: int = 0, loss=None) -> Future:
        """Accumulate the gradients of one batch: {"loss", ...}."""
    def optim_step(self, tenant: str, priority: int = 0) -> Future:
        """Apply the accumulated step: {"policy_version", ...}."""
    def set_lr(self, tenant: str, lr: float, fresh_moments: bool = False) -> Future:
        """Change the learning rate, in order with the tenant's other calls."""
    def save_state(self, tenant: str, path: str | Path) -> Future:
        """Write the slot's file at `path` on this machine: {"path", "policy_version"}."""
    def load_state(self, tenant: str, path: str | Path) -> Future:
        """Load a slot file or a policy file: {"policy_version"}."""
    def import_adapter(self, tenant: str, path) -> Future:
        """Start the tenant's adapter from a PEFT directory."""
    def export_adapter(self, tenant: str, path, base_model: str | None = None) -> Future:
        """Write the tenant's adapter as a PEFT directory: {"path"}."""
    def version(self, tenant: str) -> int:
        """The slot's policy version; UnknownTenantError without a slot."""
    def tenants(self) -> list[str]:
        """The tenants that have a training slot."""

    # serving
    def predict(self, tenant: str, obs: Observation, deterministic: bool = False,
                deadline_s: float | None = None, explore=None) -> Future:
        """{"actions", "policy_version"} from a live replica, re-routed if one fails. `explore`: a
        `FlowExploration` (a flow policy sampling for RL; the sample carries its chain)."""
    def serve(self, snap: PolicySnapshot, timeout_s: float = 30.0) -> None:
        """Serve a policy no slot holds (a stored checkpoint); on every replica on return."""
    def retire(self, tenant: str, timeout_s: float = 30.0) -> None:
        """Stop serving what `serve` put up."""
    def flush(self, timeout_s: float = 30.0) -> bool:
        """True once every published policy version reached every replica."""

    # elasticity and observation
    def add_inference_replica(self) -> str: ...
    def remove_inference_replica(self, name: str) -> None: ...
    def replica_names(self) -> list[str]:
        """The inference replicas' names."""
    def accounting(self) -> dict[str, dict]:
        """{"training": ..., replica name: ...}: each model service's `Accounting.snapshot()`."""
    def metrics(self) -> dict:
        """{"training", "inference", "environment", "health", "control_plane"}."""

