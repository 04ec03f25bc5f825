"""Headless rendering: the GL backend probe and its fallback, and the per-session render GPU."""

import json
import logging
import os
import subprocess
import sys

import pytest

from vlamux.envs import EnvSpec
from vlamux.envs import render
from vlamux.envs.workers import VectorEnv
from vlamux.errors import InvalidInputError
from vlamux.services.environment import EnvironmentService

GL_VARS = ("MUJOCO_GL", "PYOPENGL_PLATFORM", "VLAMUX_GL_CHOICE", "MUJOCO_EGL_DEVICE_ID")
SPEC = EnvSpec(task="goal/touch-red-cube", image_size=16)


@pytest.fixture
def fresh(monkeypatch):
    """A process that has not chosen a backend yet; everything is restored afterwards."""
    for name in GL_VARS:
        monkeypatch.setenv(name, "")  # recorded, so the value configure_gl writes is undone too
        monkeypatch.delenv(name)
    monkeypatch.setattr(render, "_choice", None)
    return monkeypatch


def _no_probe(*_a, **_kw):
    raise AssertionError("the EGL probe ran")


def test_failed_egl_probe_falls_back_to_osmesa_and_says_why(fresh, caplog):
    # a real probe subprocess; an EGL device that does not exist makes EGL fail on any machine
    fresh.setenv("MUJOCO_EGL_DEVICE_ID", "99")
    with caplog.at_level(logging.INFO, logger="vlamux.envs.render"):
        assert render.configure_gl(force_probe=True) == "osmesa"
    choice = render.gl_choice()
    assert choice["backend"] == "osmesa"
    assert choice["reason"].startswith("EGL probe failed: ") and "MUJOCO_EGL_DEVICE_ID" in choice["reason"]
    assert choice["reason"].endswith("; using OSMesa")
    assert os.environ["MUJOCO_GL"] == os.environ["PYOPENGL_PLATFORM"] == "osmesa"  # what workers inherit
    assert any(r.levelno == logging.WARNING and "EGL probe failed" in r.getMessage() for r in caplog.records)
    assert any(r.levelno == logging.INFO and "MUJOCO_GL=osmesa" in r.getMessage() for r in caplog.records)
    fresh.setattr(render, "probe_egl", _no_probe)
    assert render.configure_gl() == "osmesa"  # cached: once per process


def test_hung_egl_probe_times_out_to_osmesa(fresh):
    fresh.setattr(render, "_PROBE_CODE", "import time; time.sleep(60)")
    assert render.configure_gl(force_probe=True, probe_timeout_s=0.5) == "osmesa"
    assert render.gl_choice()["reason"] == "EGL probe failed: timed out after 0.5s; using OSMesa"


def test_user_set_mujoco_gl_is_honoured_without_a_probe(fresh):
    fresh.setattr(render, "probe_egl", _no_probe)
    fresh.setattr(render, "gpu_visible", lambda: True)
    fresh.setenv("MUJOCO_GL", "egl")
    assert render.configure_gl() == "egl"
    assert render.gl_choice() == {"backend": "egl", "reason": "MUJOCO_GL=egl set by the user"}
    assert os.environ["PYOPENGL_PLATFORM"] == "egl"
    assert render.configure_gl(force_probe=True) == "egl"  # forcing never overrides the user


def test_no_gpu_means_osmesa_without_a_probe(fresh):
    fresh.setattr(render, "probe_egl", _no_probe)
    fresh.setattr(render, "gpu_visible", lambda: False)
    assert render.configure_gl() == "osmesa"
    assert render.gl_choice()["reason"].startswith("no GPU visible")


def test_a_working_probe_chooses_egl_and_children_inherit_it(fresh):
    fresh.setattr(render, "gpu_visible", lambda: True)
    fresh.setattr(render, "probe_egl", lambda timeout_s: (True, "NVIDIA H200/PCIe/SSE2"))
    assert render.configure_gl() == "egl"
    assert render.gl_choice()["reason"] == "EGL probe succeeded (renderer: NVIDIA H200/PCIe/SSE2)"
    # a child process (a worker) takes the parent's choice instead of deciding (here: "no GPU") again
    code = "import json; from vlamux.envs.render import gl_choice; print(json.dumps(gl_choice()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child == {"backend": "egl", "reason": "chosen by the parent process: EGL probe succeeded "
                                                 "(renderer: NVIDIA H200/PCIe/SSE2)"}


def test_render_device_reaches_the_worker_environment(fresh):
    fresh.setattr(render, "gpu_visible", lambda: False)  # the parent chooses OSMesa; device 0 is then recorded only
    with VectorEnv(SPEC, n_envs=1, n_workers=1, render_device=0, timeout_s=20) as vec:
        info = vec.render_info(0)
        assert info["egl_device"] == "0" and info["backend"] == "osmesa"
        assert info["reason"].startswith("chosen by the parent process: no GPU visible")
        assert vec.reset(seed=0)[0]["images"]["agentview"].shape == (1, 3, 16, 16)  # it still renders
    assert "MUJOCO_EGL_DEVICE_ID" not in os.environ  # set in the worker only
    with VectorEnv(SPEC, n_envs=1, n_workers=1, timeout_s=20) as vec:
        assert vec.render_info(0)["egl_device"] is None


class _Recorder:
    """A stand-in VectorEnv factory that records the render device each session got."""

    def __init__(self):
        self.devices = []

    def __call__(self, spec, n_envs, n_workers=None, timeout_s=None, start_timeout_s=None, **kw):
        self.devices.append(kw.get("render_device"))
        return _FakeVec(n_envs)


class _FakeVec:
    def __init__(self, n):
        self.n_workers, self.needs_reset = 1, [True] * n

    def close(self):
        pass


def test_service_assigns_render_devices_round_robin_unless_the_session_names_one():
    rec = _Recorder()
    with EnvironmentService(vector_env_factory=rec, render_devices=[2, 3]) as svc:
        sids = [svc.open_session("acme", SPEC, 1) for _ in range(3)]
        sids.append(svc.open_session("acme", SPEC, 1, render_device=5))
        assert rec.devices == [2, 3, 2, 5]
        assert [svc.session_info("acme", s)["render_device"] for s in sids] == [2, 3, 2, 5]


def test_service_without_render_devices_leaves_the_factory_call_unchanged():
    def old_factory(spec, n_envs, n_workers=None, timeout_s=None, start_timeout_s=None):  # no render_device
        return _FakeVec(n_envs)

    with EnvironmentService(vector_env_factory=old_factory) as svc:
        sid = svc.open_session("acme", SPEC, 1)
        assert svc.session_info("acme", sid)["render_device"] is None


@pytest.mark.parametrize("bad", [-1, "1", 1.0, True])
def test_invalid_render_device_is_refused(bad):
    rec = _Recorder()
    with EnvironmentService(vector_env_factory=rec) as svc:
        with pytest.raises(InvalidInputError, match=r"render_device: expected a non-negative GPU index"):
            svc.open_session("acme", SPEC, 1, render_device=bad)
    assert rec.devices == []  # refused before any simulator started
    with pytest.raises(InvalidInputError, match=r"render_devices\[\]: expected a non-negative GPU index"):
        EnvironmentService(render_devices=[0, bad])
    with pytest.raises(ValueError, match="render_device"):
        VectorEnv(SPEC, n_envs=1, render_device=bad)


def test_render_devices_must_be_a_list():
    with pytest.raises(InvalidInputError, match="render_devices: expected a list"):
        EnvironmentService(render_devices=0)


def test_libero_explains_a_render_device_robosuite_would_reject(fresh):
    from vlamux.envs.libero import _check_egl_device

    fresh.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    fresh.setenv("MUJOCO_EGL_DEVICE_ID", "3")
    _check_egl_device("egl")  # one of the visible GPUs: fine
    fresh.setenv("MUJOCO_EGL_DEVICE_ID", "0")
    with pytest.raises(ValueError, match=r"EGL_DEVICE_ID=0 \(render_device\) is not among CUDA_VISIBLE_DEVICES=2,3"):
        _check_egl_device("egl")
    _check_egl_device("osmesa")  # no device choice without EGL: dropped, so robosuite's import check passes
    assert "MUJOCO_EGL_DEVICE_ID" not in os.environ
