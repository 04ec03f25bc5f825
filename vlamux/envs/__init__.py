"""Environments: one contract (`base.py`), backends, and worker-process vectorisation (`workers.py`)."""

from __future__ import annotations

import importlib

from vlamux.envs.base import ActionSpace, EnvError, EnvSpec, EnvTimeoutError, EnvWorkerCrashed

# backend -> "module:factory"; imported on first use so a missing optional extra only matters to its users.
BACKENDS = {
    "tabletop": "vlamux.envs.tabletop.env:make_tabletop_env",
    "metaworld": "vlamux.envs.metaworld:make_metaworld_env",
    "libero": "vlamux.envs.libero:make_libero_env",
    "maniskill": "vlamux.envs.maniskill:make_maniskill_env",
    "gym": "vlamux.envs.gym_adapter:make_gym_env",
}


def check_task(backend: str, task: str) -> str | None:
    """Why (backend, task) cannot be simulated, found without starting a simulator; None if nothing
    is known to be wrong (backends other than the built-in one name their tasks only when built)."""
    if backend not in BACKENDS:
        return f"unknown backend {backend!r}; available: {sorted(BACKENDS)}"
    if backend == "tabletop":
        from vlamux.envs.tabletop.tasks import TASKS

        if task not in TASKS:
            return f"unknown tabletop task {task!r}; tasks: {sorted(TASKS)}"
    return None


def make_env(spec: EnvSpec):
    """A single gymnasium env for `spec`, in this process (workers call this; callers use VectorEnv)."""
    if spec.backend not in BACKENDS:
        raise ValueError(f"env spec: unknown backend {spec.backend!r}; available: {sorted(BACKENDS)}")
    module, factory = BACKENDS[spec.backend].split(":")
    return getattr(importlib.import_module(module), factory)(spec)


__all__ = ["ActionSpace", "BACKENDS", "EnvError", "check_task", "EnvSpec", "EnvTimeoutError", "EnvWorkerCrashed", "make_env"]
