"""Headless OpenGL for MuJoCo: pick a backend before mujoco is imported.

MUJOCO_GL is honoured when set. Otherwise: EGL where a GPU is visible,
OSMesa (software) elsewhere — EGL without a GPU fails on Mesa's headless
drivers, OSMesa always works.
"""

from __future__ import annotations

import os
import shutil


def configure_gl() -> str:
    if "MUJOCO_GL" not in os.environ:
        has_gpu = os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None
        os.environ["MUJOCO_GL"] = "egl" if has_gpu else "osmesa"
    if os.environ["MUJOCO_GL"] in ("egl", "osmesa"):
        os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])
    return os.environ["MUJOCO_GL"]
