"""Environments: one contract (`base.py`), backends, and worker-process vectorisation (`workers.py`)."""

from __future__ import annotations

from vlamux.envs.base import ActionSpace, EnvError, EnvSpec, EnvTimeoutError, EnvWorkerCrashed


def make_env(spec: EnvSpec):
    """A single gymnasium env for `spec`, in this process (workers call this; callers use VectorEnv)."""
    if spec.backend == "tabletop":
        from vlamux.envs.tabletop.env import TabletopEnv

        unknown = set(spec.options) - {"render"}
        if unknown:
            raise ValueError(f"env spec: unknown options {sorted(unknown)} for backend 'tabletop'")
        return TabletopEnv(spec.task, spec.image_size, spec.cameras, spec.max_steps,
                           render=spec.options.get("render", True))
    raise ValueError(f"env spec: unknown backend {spec.backend!r}; available: ['tabletop']")


__all__ = ["ActionSpace", "EnvError", "EnvSpec", "EnvTimeoutError", "EnvWorkerCrashed", "make_env"]
