"""Any gymnasium env as a vlamux backend, given a key mapping.

    key_map = {
        "images": {"agentview": "render", "wrist": "pixels/wrist"},   # camera -> image source
        "state": ["observation", "desired_goal"],                    # state source(s), concatenated
    }

A source is ``"render"`` (the env's ``render()``, so the env needs ``render_mode="rgb_array"``),
``"obs"`` (the whole observation, for envs whose observation is not a dict), or a key of a dict
observation (``"a/b"`` reaches into nested dicts). Images may be HWC or CHW, grey, RGB or RGBA,
uint8 or float (floats are read as [0, 1] when the source space's upper bound is <= 1, else as
[0, 255]); they come out uint8 [3, S, S] at ``image_size`` through an area-average resize (plain
pixel copies when enlarging), which is deterministic and stretches non-square frames. The state
is the named sources flattened and concatenated as float32.

``info["is_success"]`` is ``bool(info[success_key])`` when the env reports that key, else False;
``terminated`` is the env's own termination or success; ``truncated`` the env's own truncation or
``max_steps``. Box action spaces pass through (declared as `ActionSpace` with the given
``control``); a Discrete(n) space becomes a 1-D action in [0, n-1], rounded to the nearest integer.
"""

from __future__ import annotations

import sys

import gymnasium as gym
import numpy as np

from vlamux.envs.render import configure_gl

configure_gl()  # before any gymnasium env module imports mujoco

from vlamux.envs.base import INSTRUCTION_CHARSET, ActionSpace, EnvSpec, observation_space  # noqa: E402

OPTIONS = {"key_map", "instruction", "success_key", "env_kwargs", "control"}  # EnvSpec.options understood
SPECIAL_SOURCES = ("render", "obs")


def resize_area(img: np.ndarray, size: int) -> np.ndarray:
    """HWC array -> [size, size, C] float64: each output pixel is the mean of the input pixels it covers."""
    h, w = img.shape[:2]

    def bounds(n: int) -> tuple[np.ndarray, np.ndarray]:
        i = np.arange(size)
        start = (i * n) // size
        end = np.maximum(start + 1, -((-(i + 1) * n) // size))  # ceil((i + 1) * n / size)
        return start, end

    ys, ye = bounds(h)
    xs, xe = bounds(w)
    integral = np.zeros((h + 1, w + 1, img.shape[2]), np.float64)
    integral[1:, 1:] = img.astype(np.float64).cumsum(0).cumsum(1)
    total = (integral[ye][:, xe] - integral[ys][:, xe] - integral[ye][:, xs] + integral[ys][:, xs])
    area = ((ye - ys)[:, None] * (xe - xs)[None, :])[..., None]
    return total / area


def to_chw_uint8(img, size: int, unit_range: bool, where: str) -> np.ndarray:
    """Any HWC/CHW/HW image -> uint8 [3, size, size]; `where` names the source in errors."""
    a = np.asarray(img)
    if a.ndim == 2:
        a = a[..., None]
    if a.ndim != 3 or a.size == 0:
        raise ValueError(f"{where}: expected an image (HW, HWC or CHW), got shape {list(a.shape)}")
    if a.shape[-1] not in (1, 3, 4):
        if a.shape[0] not in (1, 3, 4):
            raise ValueError(f"{where}: cannot tell the channel axis of an image of shape {list(a.shape)} "
                             f"(expected 1, 3 or 4 channels first or last)")
        a = a.transpose(1, 2, 0)
    a = a[..., :3] if a.shape[-1] == 4 else (np.repeat(a, 3, axis=-1) if a.shape[-1] == 1 else a)
    if a.dtype == np.bool_:
        a = a.astype(np.uint8) * 255
    elif np.issubdtype(a.dtype, np.floating) and unit_range:
        a = a * 255.0
    if a.shape[:2] != (size, size):
        a = resize_area(a, size)
    if a.dtype != np.uint8:
        a = np.clip(np.rint(a), 0, 255).astype(np.uint8)
    return np.ascontiguousarray(a.transpose(2, 0, 1))


class GymAdapterEnv(gym.Env):
    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, env: str | gym.Env, key_map: dict, instruction: str, image_size: int = 128,
                 max_steps: int | None = None, success_key: str | None = "is_success",
                 env_kwargs: dict | None = None, control: str = "env-native"):
        if not isinstance(key_map, dict):
            raise ValueError(f"key_map: expected a dict with 'images' and 'state', got {type(key_map).__name__}")
        unknown = set(key_map) - {"images", "state"}
        if unknown:
            raise ValueError(f"key_map: unknown entries {sorted(unknown)}; expected 'images' and 'state'")
        cams = key_map.get("images") or {}
        if not isinstance(cams, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in cams.items()):
            raise ValueError(f"key_map['images']: expected {{camera: source}} with string names, got {cams!r}")
        state = key_map.get("state") or []
        state = [state] if isinstance(state, str) else list(state)
        if not all(isinstance(s, str) for s in state):
            raise ValueError(f"key_map['state']: expected a source name or a list of them, got {state!r}")
        if not isinstance(instruction, str) or len(instruction) > 256 or set(instruction) - set(INSTRUCTION_CHARSET):
            raise ValueError(f"instruction: expected printable ASCII text of at most 256 characters, "
                             f"got {instruction!r}")
        if image_size < 1 or (max_steps is not None and max_steps < 1):
            raise ValueError(f"gym adapter: image_size and max_steps must be >= 1, got {image_size}, {max_steps}")

        if isinstance(env, str):
            kwargs = dict(env_kwargs or {})
            if "render" in cams.values():
                kwargs.setdefault("render_mode", "rgb_array")
            if max_steps is not None:
                kwargs.setdefault("max_episode_steps", max_steps)
            try:
                env = gym.make(env, **kwargs)
            except gym.error.Error as e:
                raise ValueError(f"gym adapter: cannot make gymnasium env {env!r}: {e}") from e
        elif env_kwargs:
            raise ValueError("env_kwargs: only for an env given by id, not for an env instance")
        self.env: gym.Env = env
        self.cam_sources, self.state_sources = dict(cams), state
        self.instruction, self.success_key = instruction, success_key
        self.image_size, self.max_steps = int(image_size), max_steps
        self.cameras = tuple(cams)
        self._env_id = env.spec.id if env.spec is not None else type(env.unwrapped).__name__

        # ---- check the mapping against the env's spaces, naming what is missing ----
        self._unit = {}
        for cam, src in cams.items():
            sub = self._space_of(src, f"key_map['images'][{cam!r}]")
            if src == "render" and getattr(env, "render_mode", None) != "rgb_array":
                raise ValueError(f"key_map['images'][{cam!r}] = 'render' needs render_mode='rgb_array'; "
                                 f"env {self._env_id} has render_mode={getattr(env, 'render_mode', None)!r}")
            high = getattr(sub, "high", None)
            self._unit[cam] = bool(high is not None and np.all(np.isfinite(high)) and np.max(high) <= 1.0) \
                if src != "render" else True
        lows, highs = [], []
        for src in state:
            sub = self._space_of(src, "key_map['state']")
            if isinstance(sub, gym.spaces.Box):
                lows.append(np.broadcast_to(sub.low, sub.shape).ravel())
                highs.append(np.broadcast_to(sub.high, sub.shape).ravel())
            elif isinstance(sub, gym.spaces.Discrete):
                lows.append(np.array([sub.start]))
                highs.append(np.array([sub.start + sub.n - 1]))
            elif isinstance(sub, gym.spaces.MultiBinary | gym.spaces.MultiDiscrete):
                n = int(np.prod(sub.shape))
                lows.append(np.zeros(n))
                highs.append(np.full(n, np.inf) if isinstance(sub, gym.spaces.MultiDiscrete) else np.ones(n))
            else:
                raise ValueError(f"key_map['state']: source {src!r} of env {self._env_id} is a "
                                 f"{type(sub).__name__}, not a Box/Discrete/MultiBinary/MultiDiscrete space")
        low = np.concatenate(lows).astype(np.float32) if lows else np.zeros(0, np.float32)
        high = np.concatenate(highs).astype(np.float32) if highs else np.zeros(0, np.float32)

        # ---- actions ----
        act = env.action_space
        if isinstance(act, gym.spaces.Box):
            self._discrete = None
            self.action_space = gym.spaces.Box(act.low.astype(np.float32).ravel(),
                                               act.high.astype(np.float32).ravel(), dtype=np.float32)
            self._act_shape = act.shape
        elif isinstance(act, gym.spaces.Discrete):
            self._discrete = act
            self.action_space = gym.spaces.Box(0.0, float(act.n - 1), (1,), np.float32)
            control = "discrete_index" if control == "env-native" else control
        else:
            raise ValueError(f"gym adapter: env {self._env_id} has a {type(act).__name__} action space; "
                             f"only Box and Discrete are supported")
        self.action_spec = ActionSpace(int(self.action_space.shape[0]),
                                       tuple(float(x) for x in self.action_space.low),
                                       tuple(float(x) for x in self.action_space.high), control)

        self.observation_space = observation_space(self.cameras, self.image_size,
                                                   gym.spaces.Box(low, high, low.shape, np.float32))
        self._fast_render_settings()
        self.steps = 0

    # ---- helpers --------------------------------------------------------------------------------
    def _space_of(self, src: str, what: str):
        space = self.env.observation_space
        if src == "render":
            return None
        if src == "obs":
            if isinstance(space, gym.spaces.Dict):
                raise ValueError(f"{what}: source 'obs' means the whole observation, but env {self._env_id} "
                                 f"has a dict observation; use one of its keys: {list(space.spaces)}")
            return space
        if not isinstance(space, gym.spaces.Dict):
            raise ValueError(f"{what}: key {src!r} not found: env {self._env_id} has a {type(space).__name__} "
                             f"observation, not a dict; use 'obs' (or 'render' for images)")
        sub, path = space, []
        for part in src.split("/"):
            path.append(part)
            if not isinstance(sub, gym.spaces.Dict) or part not in sub.spaces:
                keys = list(sub.spaces) if isinstance(sub, gym.spaces.Dict) else []
                raise ValueError(f"{what}: key {src!r} not found in the observation of env {self._env_id} "
                                 f"(missing {'/'.join(path)!r}; available: {keys} or {list(SPECIAL_SOURCES)})")
            sub = sub.spaces[part]
        return sub

    def _get(self, obs, src: str):
        if src == "obs":
            return obs
        if src == "render":
            frame = self.env.render()
            if frame is None:
                raise ValueError(f"env {self._env_id}: render() returned None (render_mode="
                                 f"{getattr(self.env, 'render_mode', None)!r})")
            return frame
        value = obs
        for part in src.split("/"):
            try:
                value = value[part]
            except (KeyError, TypeError, IndexError):
                raise ValueError(f"env {self._env_id}: observation has no key {src!r}") from None
        return value

    def _fast_render_settings(self) -> None:
        """MuJoCo-based envs: no shadows or multisampling (set before the first render creates a context)."""
        mj = sys.modules.get("mujoco")
        model = getattr(self.env.unwrapped, "model", None)
        if mj is not None and isinstance(model, mj.MjModel):
            model.vis.quality.shadowsize = 0
            model.vis.quality.offsamples = 0

    def _obs(self, obs) -> dict:
        images = {c: to_chw_uint8(self._get(obs, src), self.image_size, self._unit[c], f"camera {c!r} ({src})")
                  for c, src in self.cam_sources.items()}
        parts = [np.asarray(self._get(obs, s), dtype=np.float32).ravel() for s in self.state_sources]
        state = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        if state.shape != self.observation_space["state"].shape:
            raise ValueError(f"env {self._env_id}: state sources {self.state_sources} gave {state.size} numbers, "
                             f"their spaces say {self.observation_space['state'].shape[0]}")
        return {"images": images, "state": state, "instruction": self.instruction}

    def _success(self, info: dict) -> bool:
        if self.success_key is None:
            return False
        return bool(np.any(info.get(self.success_key, False)))

    # ---- gymnasium API --------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        obs, info = self.env.reset(seed=seed, options=options)
        self.steps = 0
        return self._obs(obs), {**info, "is_success": self._success(info)}

    def step(self, action):
        a = self.action_spec.check(action)
        if self._discrete is not None:
            inner = self._discrete.start + int(np.rint(a[0]))
        else:
            inner = a.astype(self.env.action_space.dtype).reshape(self._act_shape)
        obs, reward, term, trunc, info = self.env.step(inner)
        self.steps += 1
        success = self._success(info)
        truncated = bool(trunc) or (self.max_steps is not None and self.steps >= self.max_steps)
        terminated = bool(term) or success
        return self._obs(obs), float(reward), terminated, truncated and not terminated, \
            {**info, "is_success": success}

    def render(self):
        if not self.cameras:
            return None
        src = self.cam_sources[self.cameras[0]]
        frame = self.env.render() if src == "render" else None
        if frame is None:
            raise ValueError("render(): only 'render' image sources can be rendered outside of step/reset")
        return to_chw_uint8(frame, self.image_size, True, "render()").transpose(1, 2, 0)

    def close(self):
        self.env.close()


def make_gym_env(spec: EnvSpec) -> GymAdapterEnv:
    """The `make_env` entry for backend 'gym': spec.task is the gymnasium id; spec.options carry
    key_map (required), instruction (required), success_key, env_kwargs, control. spec.cameras picks
    (and orders) the cameras of key_map['images'] that the observation carries; each must be mapped."""
    unknown = set(spec.options) - OPTIONS
    if unknown:
        raise ValueError(f"env spec: unknown options {sorted(unknown)} for backend 'gym'; known: {sorted(OPTIONS)}")
    missing = [k for k in ("key_map", "instruction") if k not in spec.options]
    if missing:
        raise ValueError(f"env spec: backend 'gym' needs options {missing}")
    o = spec.options
    key_map = o["key_map"]
    if isinstance(key_map, dict) and isinstance(key_map.get("images"), dict):
        images = key_map["images"]
        unmapped = [c for c in spec.cameras if c not in images]
        if unmapped:
            raise ValueError(f"env spec: cameras {unmapped} have no source in key_map['images'] "
                             f"(mapped: {list(images)}); set EnvSpec.cameras to the cameras you map")
        key_map = {**key_map, "images": {c: images[c] for c in spec.cameras}}
    return GymAdapterEnv(spec.task, key_map, o["instruction"], spec.image_size, spec.max_steps,
                         success_key=o.get("success_key", "is_success"), env_kwargs=o.get("env_kwargs"),
                         control=o.get("control", "env-native"))

