"""The built-in tabletop environment: one MuJoCo scene per task, gymnasium API."""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from vlamux.envs.render import close_renderer, configure_gl

configure_gl()
import mujoco  # noqa: E402  (after the GL backend is chosen)

from vlamux.envs.base import ActionSpace, observation_space  # noqa: E402
from vlamux.envs.tabletop.scene import FINGER_DROP, HOME, ZONE_HALF, build_xml, object_half_height  # noqa: E402
from vlamux.envs.tabletop.tasks import Task, get_task  # noqa: E402

ACTION_SPACE = ActionSpace(4, (-1.0,) * 4, (1.0,) * 4, "delta_ee_pos+gripper",
                           ("dx", "dy", "dz", "gripper(+1 close, -1 open)"))
STATE_NAMES = ("ee_x", "ee_y", "ee_z", "finger_gap", "ee_vx", "ee_vy", "ee_vz", "gripper_cmd")
MAX_DELTA = 0.03  # metres per step at |action| = 1
SUBSTEPS = 25  # 0.1 s of physics per control step
WORKSPACE = ((-0.25, 0.25), (-0.22, 0.22), (FINGER_DROP - 0.005, 0.3))  # gripper body position bounds
LIFT_HEIGHT = 0.06  # an object counts as picked up when its bottom is this far above the table
REWARDS = ("sparse", "dense")


class TabletopEnv(gym.Env):
    action_spec = ACTION_SPACE  # the declared action space (dims, bounds, control mode)
    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, task: str = "goal/touch-red-cube", image_size: int = 128,
                 cameras: tuple[str, ...] = ("agentview", "wrist"), max_steps: int = 120, render: bool = True,
                 reward: str = "sparse"):
        self.task: Task = get_task(task)
        if reward not in REWARDS:
            raise ValueError(f"tabletop reward: expected one of {REWARDS}, got {reward!r}")
        self.reward_mode = reward
        unknown = set(cameras) - {"agentview", "wrist"}
        if unknown:
            raise ValueError(f"tabletop cameras are 'agentview' and 'wrist'; unknown: {sorted(unknown)}")
        self.image_size, self.cameras, self.max_steps, self.do_render = image_size, tuple(cameras), max_steps, render
        n_obj = self.task.sample_objects or len(self.task.objects)
        self._shapes = [None] * n_obj
        # The model holds the pool's first n objects; reset re-colours and re-shapes nothing, it
        # swaps which pool entries are shown by building one model per object subset lazily.
        self._models: dict[tuple, tuple] = {}
        self.action_space = gym.spaces.Box(-1.0, 1.0, (ACTION_SPACE.dim,), np.float32)
        self.observation_space = observation_space(
            self.cameras, image_size, gym.spaces.Box(-10.0, 10.0, (len(STATE_NAMES),), np.float32))
        self.model = self.data = None
        self._renderer = None

    # ---- scene ----------------------------------------------------------------------------------
    def _load(self, objects: tuple[tuple[str, str], ...]) -> None:
        if objects not in self._models:
            model = mujoco.MjModel.from_xml_string(build_xml(list(objects), self.task.zone, self.image_size))
            model.vis.quality.shadowsize = 0
            model.vis.quality.offsamples = 0
            self._models[objects] = (model, mujoco.MjData(model))
        model, data = self._models[objects]
        if model is not self.model:
            self.close_renderer()
            self.model, self.data = model, data
            self._gid = {n: mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_GEOM, n)
                         for n in ("finger_l", "finger_r", "palm", *[f"obj{i}" for i in range(len(objects))])}
        self.objects = objects

    def close_renderer(self) -> None:
        if self._renderer is not None:
            close_renderer(self._renderer)
            self._renderer = None

    def _render_images(self) -> dict[str, np.ndarray]:
        if not self.do_render:
            return {c: np.zeros((3, self.image_size, self.image_size), np.uint8) for c in self.cameras}
        if self._renderer is None:
            self._renderer = mujoco.Renderer(self.model, self.image_size, self.image_size)
            self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
            self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
        out = {}
        for cam in self.cameras:
            self._renderer.update_scene(self.data, camera=cam)
            out[cam] = self._renderer.render().transpose(2, 0, 1).copy()
        return out

    # ---- gymnasium API --------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        rng = self.np_random
        t = self.task
        if t.sample_objects:
            others = [i for i in range(len(t.objects)) if i != t.target]
            picks = [t.target] + list(rng.choice(others, t.sample_objects - 1, replace=False))
            objects = tuple(t.objects[i] for i in picks)
            self.target = 0
        else:
            objects, self.target = t.objects, t.target
        self._load(objects)
        m, d = self.model, self.data
        mujoco.mj_resetData(m, d)
        # Spatial tasks name objects by left/right: keep them apart along x so the words are unambiguous.
        xy = _place(rng, len(objects) + (1 if t.zone else 0), min_dist=0.1, min_dx=0.06 if t.order_by_x else 0.0,
                    n_dx=len(objects))
        if t.zone:
            zone_xy, xy = xy[-1], xy[:-1]
            m.geom_pos[mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_GEOM, "zone")][:2] = zone_xy
            self.zone_xy = zone_xy
        if t.order_by_x:
            xy = xy[np.argsort(xy[:, 0])]
        for i, (shape, _) in enumerate(objects):
            qadr = m.jnt_qposadr[mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_JOINT, f"obj{i}")]
            d.qpos[qadr:qadr + 7] = [xy[i, 0], xy[i, 1], object_half_height(shape) + 0.001, 1, 0, 0, 0]
        self._ctrl_target = np.array(HOME)
        self._grip_cmd = -1.0
        self._apply_ctrl()
        mujoco.mj_forward(m, d)
        for _ in range(10):  # let objects settle on the table
            mujoco.mj_step(m, d)
        self.steps = 0
        self._obj_z0 = self.object_pos(self.target)[2]
        self._potential = self.progress()
        return self._obs(), {"is_success": False, "task": t.task_id}

    def step(self, action):
        a = ACTION_SPACE.check(action)
        pos = self.ee_pos()
        self._ctrl_target = np.clip(pos + a[:3] * MAX_DELTA, [w[0] for w in WORKSPACE], [w[1] for w in WORKSPACE])
        self._grip_cmd = 1.0 if a[3] > 0 else -1.0
        self._apply_ctrl()
        mujoco.mj_step(self.model, self.data, nstep=SUBSTEPS)
        self.steps += 1
        success = self.is_success()
        truncated = not success and self.steps >= self.max_steps
        reward = float(success)
        if self.reward_mode == "dense":
            # Potential-based shaping (Ng et al., 1999): the step's change in progress. An episode's
            # shaping sums to its final progress minus its first, so dawdling earns nothing and the
            # best policy is the sparse reward's.
            potential = self.progress()
            reward += potential - self._potential
            self._potential = potential
        return self._obs(), reward, success, truncated, {"is_success": success}

    def render(self):
        return self._render_images()[self.cameras[0]].transpose(1, 2, 0)

    def close(self):
        self.close_renderer()

    # ---- state and predicates -------------------------------------------------------------------
    def _apply_ctrl(self) -> None:
        self.data.ctrl[:3] = self._ctrl_target - np.array(HOME)
        self.data.ctrl[3:5] = 0.03 if self._grip_cmd > 0 else 0.0

    def ee_pos(self) -> np.ndarray:
        return self.data.qpos[:3] + np.array(HOME)

    def object_pos(self, i: int) -> np.ndarray:
        return self.data.xpos[mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_BODY, f"obj{i}")].copy()

    def fingers_centre(self) -> np.ndarray:
        """The point between the two fingers: where a grasped object sits."""
        return (self.data.geom_xpos[self._gid["finger_l"]] + self.data.geom_xpos[self._gid["finger_r"]]) / 2

    def finger_gap(self) -> float:
        return 0.06 - float(self.data.qpos[3] + self.data.qpos[4])

    def _touching(self, i: int) -> bool:
        return self._contact(self._gid[f"obj{i}"], {self._gid[p] for p in ("finger_l", "finger_r", "palm")})

    def _contact(self, obj: int, grip: set) -> bool:
        for c in self.data.contact[: self.data.ncon]:
            if (c.geom1 == obj and c.geom2 in grip) or (c.geom2 == obj and c.geom1 in grip):
                return True
        return False

    def progress(self) -> float:
        """How far the task has got, in [0, 1): the dense reward's potential. For a touch it is the
        fingers' closeness to the target; for a lift that is under half, and a grip and the height
        add the rest; for a push, the object's closeness to the zone is the other half."""
        goal, i = self.task.goal, self.target
        obj = self.object_pos(i)
        reach = 1.0 - np.tanh(5.0 * np.linalg.norm(self.fingers_centre() - obj))
        if goal == "touch":
            return 0.9 * reach
        if goal == "lift":
            gripped = self._touching_with(i, "finger_l") and self._touching_with(i, "finger_r")
            height = np.clip((obj[2] - self._obj_z0) / LIFT_HEIGHT, 0.0, 1.0) if gripped else 0.0
            return 0.45 * reach + 0.2 * gripped + 0.25 * height
        to_zone = 1.0 - np.tanh(5.0 * np.linalg.norm(obj[:2] - self.zone_xy))
        return 0.45 * reach + 0.45 * to_zone

    def _touching_with(self, i: int, part: str) -> bool:
        return self._contact(self._gid[f"obj{i}"], {self._gid[part]})

    def is_success(self) -> bool:
        goal, i = self.task.goal, self.target
        if goal == "touch":
            return self._touching(i)
        p = self.object_pos(i)
        if goal == "lift":
            return bool(p[2] - self._obj_z0 > LIFT_HEIGHT)
        return bool(np.all(np.abs(p[:2] - self.zone_xy) < ZONE_HALF - 0.01))

    def _obs(self) -> dict:
        vel = self.data.qvel[:3]
        state = np.concatenate([self.ee_pos(), [self.finger_gap()], vel, [self._grip_cmd]]).astype(np.float32)
        return {"images": self._render_images(), "state": state, "instruction": self.task.instruction}


def _place(rng: np.random.Generator, n: int, min_dist: float, min_dx: float = 0.0, n_dx: int = 0) -> np.ndarray:
    """n points on the table, pairwise at least min_dist apart, the first n_dx also min_dx apart in x
    (rejection sampling, seeded)."""
    for _ in range(10_000):
        xy = np.stack([rng.uniform(-0.18, 0.18, n), rng.uniform(-0.14, 0.16, n)], axis=1)
        dists = np.linalg.norm(xy[:, None] - xy[None], axis=-1) + np.eye(n)
        dx = np.abs(xy[:n_dx, None, 0] - xy[None, :n_dx, 0]) + np.eye(n_dx)
        if dists.min() >= min_dist and (n_dx < 2 or dx.min() >= min_dx):
            return xy
    raise RuntimeError("could not place objects")



def make_tabletop_env(spec) -> TabletopEnv:
    unknown = set(spec.options) - {"render", "reward"}
    if unknown:
        raise ValueError(f"env spec: unknown options {sorted(unknown)} for backend 'tabletop' "
                         "(it takes 'render' and 'reward')")
    return TabletopEnv(spec.task, spec.image_size, spec.cameras, spec.max_steps, render=spec.options.get("render", True),
                       reward=spec.options.get("reward", "sparse"))
