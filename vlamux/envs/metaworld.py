"""Meta-World (v3, the `metaworld` 3.x package) as a vlamux backend.

One Sawyer task per env, e.g. ``"reach-v3"`` (also ``"mt10/reach-v3"`` or ``"mt50/reach-v3"``, which
only check that the task belongs to that benchmark). Each task has Meta-World's 50 fixed
goal/object variations (``metaworld.MT1(name, seed=task_seed)``); ``reset(seed)`` picks one with the
env's seeded RNG and calls ``set_task`` on it, so the same seed gives the same variation and the
same first frame.

Observation (the vlamux contract): ``images`` — one uint8 [3, H, W] frame per camera, rendered at
``image_size`` by our own ``mujoco.Renderer`` (shadows, reflections, multisampling off); ``state`` —
Meta-World's full 39-D observation as float32 (hand xyz, gripper opening, 14 object dims, the same
18 dims of the previous step, then the 3-D goal, which the MT setting makes visible);
``instruction`` — a sentence we wrote for each MT50 task (`INSTRUCTIONS`). Actions are 4-D in
[-1, 1]: end-effector xyz deltas (1 cm per unit) and the gripper effort (+1 closes). Reward is
Meta-World's shaped reward (0..10) or, with ``reward: "success"``, 1 on the step that succeeds and 0
otherwise; the episode terminates on ``info["success"]`` and is truncated at ``max_steps``. (The shaped
reward and that termination pull RL apart: a policy hovering near the goal collects up to 10 a step
until ``max_steps``, one that succeeds stops collecting, so maximising the shaped return can mean
avoiding success; the success reward is what VLA RL on these suites optimises.) The shaped reward is
in ``info["shaped_reward"]`` either way.

Options: ``state: "ee"`` gives the 4-D state LeRobot's MetaWorld setup gives a policy (hand xyz and
gripper opening, no object or goal dims); ``reward: "success"`` (above); ``randomize: true`` draws the
object and goal positions afresh at every reset, as Meta-World's own sampler does (LeRobot's setting),
instead of one of the 50 fixed variations; ``view: "lerobot"`` moves ``corner2`` where LeRobot puts it; ``expert: true``
runs the task's scripted policy (``metaworld.policies``) on the full state inside the simulator's
process and returns its action as ``info["expert_action"]``, so demonstrations can be recorded
through the environment service while the policy's observation stays the 4-D one.

Cameras: Meta-World's ``topview``, ``corner``, ``corner2``, ``corner3``, ``corner4``,
``behindGripper``, ``gripperPOV``, plus the aliases ``agentview`` (= corner) and ``wrist``
(= gripperPOV) so that the default `EnvSpec` cameras work. The corner cameras are mounted upside
down in the Meta-World model; frames from any camera whose up axis points below the horizon are
rotated 180 degrees so they come out upright (not mirrored).
"""

from __future__ import annotations

import warnings
from functools import lru_cache

import gymnasium as gym
import numpy as np

from vlamux.envs.render import close_renderer, configure_gl

configure_gl()
import mujoco  # noqa: E402  (after the GL backend is chosen)

from vlamux.envs.base import ActionSpace, EnvSpec, observation_space  # noqa: E402

ACTION_SPACE = ActionSpace(4, (-1.0,) * 4, (1.0,) * 4, "delta_ee_pos+gripper",
                           ("dx", "dy", "dz", "gripper(+1 close, -1 open)"))
STATE_DIM = 39
STATE_BOUND = 10.0  # metres / unit quaternions; the state is clipped to it (only a blown-up sim reaches it)
STATE_NAMES = (
    ("hand_x", "hand_y", "hand_z", "gripper_open")
    + tuple(f"obj_{i}" for i in range(14))
    + ("prev_hand_x", "prev_hand_y", "prev_hand_z", "prev_gripper_open")
    + tuple(f"prev_obj_{i}" for i in range(14))
    + ("goal_x", "goal_y", "goal_z")
)

MT10_TASKS: tuple[str, ...] = (
    "reach-v3", "push-v3", "pick-place-v3", "door-open-v3", "drawer-open-v3", "drawer-close-v3",
    "button-press-topdown-v3", "peg-insert-side-v3", "window-open-v3", "window-close-v3",
)

# Short imperative instructions, one per MT50 task (goal colours named where the goal marker is drawn).
INSTRUCTIONS: dict[str, str] = {
    "assembly-v3": "pick up the nut and place it onto the peg",
    "basketball-v3": "pick up the ball and dunk it into the basket",
    "bin-picking-v3": "pick up the puck and move it into the other bin",
    "box-close-v3": "pick up the lid and place it on the box",
    "button-press-topdown-v3": "press the button from the top",
    "button-press-topdown-wall-v3": "reach over the wall and press the button from the top",
    "button-press-v3": "press the button",
    "button-press-wall-v3": "reach around the wall and press the button",
    "coffee-button-v3": "push the button on the coffee machine",
    "coffee-pull-v3": "pull the mug away from the coffee machine",
    "coffee-push-v3": "push the mug under the coffee machine",
    "dial-turn-v3": "turn the dial",
    "disassemble-v3": "pick the nut off the peg",
    "door-close-v3": "close the door",
    "door-lock-v3": "lock the door by turning the lock",
    "door-open-v3": "open the door",
    "door-unlock-v3": "unlock the door by turning the lock",
    "hand-insert-v3": "insert the gripper into the hole",
    "drawer-close-v3": "push the drawer closed",
    "drawer-open-v3": "pull the drawer open",
    "faucet-open-v3": "turn the faucet handle to open the faucet",
    "faucet-close-v3": "turn the faucet handle to close the faucet",
    "hammer-v3": "pick up the hammer and hammer the nail into the wall",
    "handle-press-side-v3": "press the handle down from the side",
    "handle-press-v3": "press the handle down",
    "handle-pull-side-v3": "pull the handle up from the side",
    "handle-pull-v3": "pull the handle up",
    "lever-pull-v3": "pull the lever up",
    "pick-place-wall-v3": "pick up the puck and place it at the blue goal behind the wall",
    "pick-out-of-hole-v3": "pick the puck out of the hole",
    "pick-place-v3": "pick up the puck and place it at the blue goal",
    "plate-slide-v3": "slide the plate into the goal",
    "plate-slide-side-v3": "slide the plate sideways into the goal",
    "plate-slide-back-v3": "slide the plate back out of the goal",
    "plate-slide-back-side-v3": "slide the plate sideways back out of the goal",
    "peg-insert-side-v3": "pick up the peg and insert it sideways into the hole",
    "peg-unplug-side-v3": "unplug the peg sideways",
    "soccer-v3": "kick the ball into the goal",
    "stick-push-v3": "grasp the stick and push the box with it",
    "stick-pull-v3": "grasp the stick and pull the box with it",
    "push-v3": "push the puck to the green goal",
    "push-wall-v3": "push the puck around the wall to the green goal",
    "push-back-v3": "pull the puck back to the green goal",
    "reach-v3": "reach the red goal point",
    "reach-wall-v3": "reach over the wall to the red goal point",
    "shelf-place-v3": "pick up the puck and place it on the shelf",
    "sweep-into-v3": "sweep the puck into the hole",
    "sweep-v3": "sweep the puck off the table",
    "window-open-v3": "slide the window open",
    "window-close-v3": "slide the window closed",
}
MT50_TASKS: tuple[str, ...] = tuple(INSTRUCTIONS)
# MT50 by difficulty, the grouping LeRobot's MetaWorld evaluation and the SmolVLA paper report by
# (from Seo et al.'s split): 28 easy, 11 medium, 6 hard, 5 very hard
DIFFICULTY: dict[str, tuple[str, ...]] = {
    "easy": ("button-press-v3", "button-press-topdown-v3", "button-press-topdown-wall-v3", "button-press-wall-v3",
             "coffee-button-v3", "dial-turn-v3", "door-close-v3", "door-lock-v3", "door-open-v3",
             "door-unlock-v3", "drawer-close-v3", "drawer-open-v3", "faucet-close-v3", "faucet-open-v3",
             "handle-press-v3", "handle-press-side-v3", "handle-pull-v3", "handle-pull-side-v3",
             "lever-pull-v3", "plate-slide-v3", "plate-slide-back-v3", "plate-slide-back-side-v3",
             "plate-slide-side-v3", "reach-v3", "reach-wall-v3", "window-close-v3", "window-open-v3",
             "peg-unplug-side-v3"),
    "medium": ("basketball-v3", "bin-picking-v3", "box-close-v3", "coffee-pull-v3", "coffee-push-v3", "hammer-v3",
               "peg-insert-side-v3", "push-wall-v3", "soccer-v3", "sweep-v3", "sweep-into-v3"),
    "hard": ("assembly-v3", "hand-insert-v3", "pick-out-of-hole-v3", "pick-place-v3", "push-v3", "push-back-v3"),
    "very_hard": ("shelf-place-v3", "disassemble-v3", "stick-pull-v3", "stick-push-v3", "pick-place-wall-v3"),
}

CAMERAS = ("topview", "corner", "corner2", "corner3", "corner4", "behindGripper", "gripperPOV")
CAMERA_ALIASES = {"agentview": "corner", "wrist": "gripperPOV"}
DEFAULT_CAMERAS = ("corner", "gripperPOV")
OPTIONS = {"render", "task_seed", "state", "randomize", "view", "expert", "reward"}  # EnvSpec.options it understands
EE_STATE_NAMES = STATE_NAMES[:4]  # state "ee": what LeRobot's MetaWorld policies see (its agent_pos)
# LeRobot's MetaWorld env moves the corner2 camera here (as in arXiv 2206.14244's setup)
LEROBOT_CORNER2_POS = (0.75, 0.075, 0.7)


def parse_task(task: str) -> str:
    """'reach-v3', 'mt10/reach-v3' or 'mt50/reach-v3' -> 'reach-v3' (ValueError naming the valid names)."""
    suite, _, name = task.rpartition("/")
    valid = {"": MT50_TASKS, "mt50": MT50_TASKS, "mt10": MT10_TASKS}
    names = valid.get(suite.lower())
    if names is None:
        raise ValueError(f"unknown metaworld task {task!r}: prefix must be 'mt10/' or 'mt50/' (or none); "
                         f"tasks: {list(MT50_TASKS)}")
    if name not in names:
        raise ValueError(f"unknown metaworld task {task!r}; valid {'MT50' if names is MT50_TASKS else 'MT10'} "
                         f"names: {list(names)}")
    return name


@lru_cache(maxsize=8)
def _variations(name: str, task_seed: int) -> tuple:
    """Meta-World's 50 fixed variations of one task (about 1 s to build; cached per process)."""
    import metaworld

    return tuple(metaworld.MT1(name, seed=task_seed).train_tasks)


class MetaWorldEnv(gym.Env):
    action_spec = ACTION_SPACE  # the declared action space (dims, bounds, control mode)
    metadata = {"render_modes": ["rgb_array"], "render_fps": 80}

    def __init__(self, task: str = "reach-v3", image_size: int = 128,
                 cameras: tuple[str, ...] = DEFAULT_CAMERAS, max_steps: int = 200, render: bool = True,
                 task_seed: int = 0, state: str = "full", randomize: bool = False, view: str = "metaworld",
                 expert: bool = False, reward: str = "shaped"):
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS

        self.task_name = parse_task(task)
        if not cameras:
            raise ValueError("metaworld: at least one camera is needed")
        unknown = [c for c in cameras if CAMERA_ALIASES.get(c, c) not in CAMERAS]
        if unknown:
            raise ValueError(f"metaworld cameras are {list(CAMERAS)} (aliases {CAMERA_ALIASES}); "
                             f"unknown: {unknown}")
        if image_size < 1 or max_steps < 1:
            raise ValueError(f"metaworld: image_size and max_steps must be >= 1, got {image_size}, {max_steps}")
        if state not in ("full", "ee"):
            raise ValueError(f"metaworld option state: 'full' (39-D) or 'ee' (hand xyz + gripper), got {state!r}")
        if view not in ("metaworld", "lerobot"):
            raise ValueError(f"metaworld option view: 'metaworld' or 'lerobot' (corner2 moved as LeRobot's), "
                             f"got {view!r}")
        if reward not in ("shaped", "success"):
            raise ValueError(f"metaworld option reward: 'shaped' (Meta-World's, 0..10 a step) or 'success' "
                             f"(1 on success, else 0), got {reward!r}")
        self.state_kind, self.randomize, self.reward_kind = state, bool(randomize), reward
        self.image_size, self.cameras, self.max_steps = int(image_size), tuple(cameras), int(max_steps)
        self.do_render, self.task_seed = bool(render), int(task_seed)
        self.instruction = INSTRUCTIONS[self.task_name]
        self._variations = _variations(self.task_name, self.task_seed)
        # render_mode None: gymnasium's own renderer stays unused; we render every camera ourselves.
        self._env = ALL_V3_ENVIRONMENTS[self.task_name](width=self.image_size, height=self.image_size)
        self._env.max_path_length = 2**31  # we truncate at max_steps; Meta-World would raise past its own horizon
        model = self._env.model
        if view == "lerobot":
            model.cam_pos[mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, "corner2")] = LEROBOT_CORNER2_POS
        self._expert = None
        if expert:
            from metaworld.policies import ENV_POLICY_MAP

            self._expert = ENV_POLICY_MAP[self.task_name]()
        self._raw: np.ndarray | None = None  # the full state, for the expert (never returned with state "ee")
        model.vis.quality.shadowsize = 0
        model.vis.quality.offsamples = 0
        self._cam_ids = {c: mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, CAMERA_ALIASES.get(c, c))
                         for c in self.cameras}
        self._flip: dict[str, bool] = {}
        self._renderer = None
        self.action_space = gym.spaces.Box(-1.0, 1.0, (ACTION_SPACE.dim,), np.float32)
        dim = STATE_DIM if state == "full" else len(EE_STATE_NAMES)
        self.observation_space = observation_space(
            self.cameras, self.image_size, gym.spaces.Box(-STATE_BOUND, STATE_BOUND, (dim,), np.float32))
        self.steps = 0
        self.variation: int | None = None

    # ---- rendering ------------------------------------------------------------------------------
    def _render_images(self) -> dict[str, np.ndarray]:
        s = self.image_size
        if not self.do_render:
            return {c: np.zeros((3, s, s), np.uint8) for c in self.cameras}
        if self._renderer is None:
            self._renderer = mujoco.Renderer(self._env.model, s, s)
            self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
            self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
        data, out = self._env.data, {}
        for cam in self.cameras:
            cid = self._cam_ids[cam]
            if cam not in self._flip:  # decided once: the image's up axis (camera y) points downwards
                self._flip[cam] = bool(data.cam_xmat[cid].reshape(3, 3)[2, 1] < 0)
            self._renderer.update_scene(data, camera=cid)
            img = self._renderer.render()
            if self._flip[cam]:
                img = img[::-1, ::-1]
            out[cam] = np.ascontiguousarray(img.transpose(2, 0, 1))
        return out

    def close_renderer(self) -> None:
        if self._renderer is not None:
            close_renderer(self._renderer)
            self._renderer = None

    # ---- gymnasium API --------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.variation = int(self.np_random.integers(len(self._variations)))
        self._env.set_task(self._variations[self.variation])
        # set_task freezes the positions to the variation's; randomize draws them at each reset instead,
        # from Meta-World's own RNG (seeded from ours, so a seed still gives one episode)
        self._env._freeze_rand_vec = not self.randomize
        self._env.seeded_rand_vec = True  # else Meta-World draws them from numpy's global RNG, unseeded
        self._env.seed(int(self.np_random.integers(2**31)))  # Meta-World's own RNG, derived from ours
        obs, _ = self._env.reset()
        self.steps = 0
        info = {"is_success": False, "task": self.task_name, "variation": -1 if self.randomize else self.variation}
        return self._obs(obs), self._with_expert(info)

    def step(self, action):
        a = ACTION_SPACE.check(action)
        if self.variation is None:
            raise RuntimeError("metaworld: call reset() before step()")
        obs, reward, _, _, info = self._env.step(a.astype(np.float32))
        self.steps += 1
        success = bool(info.get("success", 0.0))
        truncated = not success and self.steps >= self.max_steps
        out = {"is_success": success, "shaped_reward": float(reward)}
        out.update({k: float(v) for k, v in info.items() if k != "success" and np.isscalar(v)})
        if self.reward_kind == "success":
            reward = float(success)
        return self._obs(obs), float(reward), success, truncated, self._with_expert(out)

    def _with_expert(self, info: dict) -> dict:
        if self._expert is not None:  # what the scripted policy would do next, from the full state
            with warnings.catch_warnings():  # its gains exceed [-1, 1] by design: it says so at every step
                warnings.simplefilter("ignore", UserWarning)
                action = self._expert.get_action(self._raw)
            info["expert_action"] = np.clip(action, -1.0, 1.0).astype(np.float32)
        return info

    def render(self):
        return self._render_images()[self.cameras[0]].transpose(1, 2, 0)

    def close(self):
        self.close_renderer()
        self._env.close()

    def _obs(self, obs: np.ndarray) -> dict:
        self._raw = np.asarray(obs, dtype=np.float64).reshape(STATE_DIM)
        state = np.clip(self._raw.astype(np.float32), -STATE_BOUND, STATE_BOUND)
        if self.state_kind == "ee":
            state = state[: len(EE_STATE_NAMES)].copy()
        return {"images": self._render_images(), "state": state,
                "instruction": self.instruction}


def make_metaworld_env(spec: EnvSpec) -> MetaWorldEnv:
    """The `make_env` entry for backend 'metaworld'; options: render (bool), task_seed (int, default 0),
    state ("full" | "ee"), randomize (bool), view ("metaworld" | "lerobot"), expert (bool), reward ("shaped" |
    "success")."""
    unknown = set(spec.options) - OPTIONS
    if unknown:
        raise ValueError(f"env spec: unknown options {sorted(unknown)} for backend 'metaworld'; "
                         f"known: {sorted(OPTIONS)}")
    o = spec.options
    return MetaWorldEnv(spec.task, spec.image_size, spec.cameras, spec.max_steps, render=o.get("render", True),
                        task_seed=o.get("task_seed", 0), state=o.get("state", "full"),
                        randomize=bool(o.get("randomize", False)), view=o.get("view", "metaworld"),
                        expert=bool(o.get("expert", False)), reward=o.get("reward", "shaped"))

