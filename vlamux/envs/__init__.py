"""Environments: one contract (`base.py`), backends, and worker-process vectorisation (`workers.py`)."""

from __future__ import annotations

import importlib

from vlamux.envs.base import BACKENDS, ActionSpace, EnvError, EnvSpec, EnvTimeoutError, EnvWorkerCrashed, check_task


def make_env(spec: EnvSpec):
    """A single gymnasium env for `spec`, in this process (workers call this; callers use VectorEnv)."""
    if spec.backend not in BACKENDS:
        raise ValueError(f"env spec: unknown backend {spec.backend!r}; available: {sorted(BACKENDS)}")
    module, factory = BACKENDS[spec.backend].split(":")
    return getattr(importlib.import_module(module), factory)(spec)


__all__ = ["ActionSpace", "BACKENDS", "EnvError", "check_task", "EnvSpec", "EnvTimeoutError", "EnvWorkerCrashed", "make_env"]
