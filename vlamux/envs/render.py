"""Headless OpenGL for MuJoCo: pick a backend before mujoco is imported.

MuJoCo fixes its GL backend when it is first imported, so the choice is made once per process, by
the first `configure_gl()` call (an env module's import or a worker's start), and exported in
``MUJOCO_GL`` / ``PYOPENGL_PLATFORM`` so the processes it spawns inherit it without choosing again.

* ``MUJOCO_GL`` set by the user: honoured, nothing is probed.
* No GPU visible (no ``/dev/nvidia0``, no ``nvidia-smi``): OSMesa (software), nothing is probed.
* A GPU visible: EGL is tried for real in a short-lived subprocess (a GL context is created and made
  current). A GPU node alone does not mean EGL works — containers often lack NVIDIA's EGL library —
  so if the probe fails or times out, OSMesa is used instead and a warning says why.

``MUJOCO_EGL_DEVICE_ID`` (the GPU EGL renders on) is honoured by the probe and by MuJoCo; OSMesa has
no device choice and ignores it. `gl_choice()` reports the backend and the reason it was chosen.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 20.0
_EXPORTED = "VLAMUX_GL_CHOICE"  # "<backend>|<reason>": tells a child process the parent chose MUJOCO_GL
# Run in a fresh interpreter: MuJoCo binds EGL at import, so a failed attempt would poison the caller.
# It reports on one tagged line and leaves by os._exit, because a half-made context's destructors
# print errors at exit that would hide the real one.
_PROBE_CODE = """
import os
try:
    import mujoco
    ctx = mujoco.GLContext(64, 64)
    ctx.make_current()
    try:
        from OpenGL import GL
        renderer = GL.glGetString(GL.GL_RENDERER).decode()
    except Exception:
        renderer = "unknown renderer"
    ctx.free()
    print("PROBE-OK", renderer, flush=True)
    os._exit(0)
except BaseException as e:
    print("PROBE-ERROR", f"{type(e).__name__}: {e}".replace(chr(10), " "), flush=True)
    os._exit(1)
"""
_SOFTWARE_RENDERERS = ("llvmpipe", "softpipe", "swrast")

_lock = threading.Lock()
_choice: dict[str, str] | None = None


def gpu_visible() -> bool:
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


def probe_egl(timeout_s: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """Create an EGL context in a subprocess. Returns (it worked, the renderer or why it failed)."""
    env = {**os.environ, "MUJOCO_GL": "egl", "PYOPENGL_PLATFORM": "egl"}
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE_CODE], env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout_s:g}s"
    except OSError as e:
        return False, f"could not start {sys.executable!r}: {e}"
    tagged = {line.split(" ", 1)[0]: line.partition(" ")[2].strip() for line in done.stdout.splitlines()
              if line.startswith("PROBE-")}
    if done.returncode == 0 and "PROBE-OK" in tagged:
        return True, tagged["PROBE-OK"]
    if "PROBE-ERROR" in tagged:
        return False, tagged["PROBE-ERROR"]
    # died without reporting (a driver crash): stderr's last line is the best clue
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    return False, lines[-1] if lines else f"exit code {done.returncode}"


def configure_gl(*, force_probe: bool = False, probe_timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """Choose the GL backend for this process (once) and export it; returns "egl", "osmesa", ...

    force_probe: decide again even if this process already has, and probe EGL even with no GPU
    visible (for tests and diagnostics). A user-set MUJOCO_GL is still honoured.
    """
    global _choice
    with _lock:
        if _choice is None or force_probe:
            _choice = _decide(force_probe, probe_timeout_s)
        return _choice["backend"]


def gl_choice() -> dict[str, str]:
    """{"backend", "reason"} of this process's choice (made now if it was not yet)."""
    configure_gl()
    return dict(_choice)


def _decide(force_probe: bool, probe_timeout_s: float) -> dict[str, str]:
    current = os.environ.get("MUJOCO_GL")
    if current and not (force_probe and _exported_by_us(current)):
        return _honour(current)
    if force_probe or gpu_visible():
        backend, reason = _probe_choice(probe_timeout_s)
    else:
        backend, reason = "osmesa", "no GPU visible (no /dev/nvidia0, no nvidia-smi); using OSMesa"
    os.environ["MUJOCO_GL"] = backend
    os.environ["PYOPENGL_PLATFORM"] = backend  # a mismatch makes mujoco's GL import fail
    os.environ[_EXPORTED] = f"{backend}|{reason}"
    log.info("headless rendering: MUJOCO_GL=%s (%s)", backend, reason)
    return {"backend": backend, "reason": reason}


def _probe_choice(timeout_s: float) -> tuple[str, str]:
    ok, detail = probe_egl(timeout_s)
    if not ok:
        reason = f"EGL probe failed: {detail}; using OSMesa"
        log.warning("headless rendering: %s", reason)
        return "osmesa", reason
    if any(s in detail.lower() for s in _SOFTWARE_RENDERERS):  # e.g. Mesa's EGL answering for a missing NVIDIA one
        log.warning("EGL works but renders in software (%s); is NVIDIA's EGL library installed?", detail)
    return "egl", f"EGL probe succeeded (renderer: {detail})"


def _exported_by_us(backend: str) -> bool:
    """Whether MUJOCO_GL=backend was set by configure_gl (here or in a parent), not by the user."""
    return os.environ.get(_EXPORTED, "").partition("|")[0] == backend


def _honour(backend: str) -> dict[str, str]:
    if backend in ("egl", "osmesa"):
        os.environ.setdefault("PYOPENGL_PLATFORM", backend)
    if _exported_by_us(backend):
        reason = "chosen by the parent process: " + os.environ[_EXPORTED].partition("|")[2]
    else:
        reason = f"MUJOCO_GL={backend} set by the user"
    log.info("headless rendering: MUJOCO_GL=%s (%s)", backend, reason)
    return {"backend": backend, "reason": reason}


def close_renderer(renderer) -> None:
    """Free a `mujoco.Renderer` without breaking the other renderers of this process.

    mujoco's `Renderer.close()` frees its GL context first and its MjrContext after, so the MjrContext's
    framebuffers and textures are deleted in whatever context is current then: with several envs in
    one worker, another env's. That env then renders the wrong images (measured: the object suite,
    whose resets swap models and so renderers, evaluated with 10 envs a worker showed other scenes
    and scored at chance). Freeing the MjrContext with its own context current first avoids it.
    """
    gl, mjr = getattr(renderer, "_gl_context", None), getattr(renderer, "_mjr_context", None)
    if gl is not None and mjr is not None:
        gl.make_current()
        mjr.free()
        renderer._mjr_context = None
    renderer.close()
