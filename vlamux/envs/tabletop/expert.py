"""Scripted experts: a state machine per goal, reading the simulator's true state."""

from __future__ import annotations

import numpy as np

from vlamux.envs.tabletop.env import MAX_DELTA, TabletopEnv
from vlamux.envs.tabletop.scene import FINGER_DROP, object_half_height


class ScriptedExpert:
    """Call `act(env)` each step after `reset`; returns a 4-D action in [-1, 1]."""

    def __init__(self):
        self.phase = 0
        self.wait = 0

    def reset(self) -> None:
        self.phase, self.wait = 0, 0

    @staticmethod
    def _towards(env: TabletopEnv, target: np.ndarray, grip: float, gain: float = 1.0) -> tuple[np.ndarray, float]:
        delta = target - env.ee_pos()
        move = np.clip(delta / MAX_DELTA * gain, -1.0, 1.0)
        return np.append(move, grip), float(np.linalg.norm(delta))

    def act(self, env: TabletopEnv) -> np.ndarray:
        goal = env.task.goal
        obj = env.object_pos(env.target)
        shape = env.objects[env.target][0]
        h = object_half_height(shape)
        above = obj + [0, 0, FINGER_DROP + h + 0.06]
        if goal == "touch":  # closed fingers make a pad that comes down on the object's top
            if self.phase == 0:
                a, dist = self._towards(env, above, 1.0)
                self.phase += dist < 0.01
                return a
            return self._towards(env, obj + [0, 0, FINGER_DROP + h - 0.015], 1.0)[0]
        if goal == "lift":
            grasp = obj + [0, 0, FINGER_DROP - 0.01]
            if self.phase == 0:
                a, dist = self._towards(env, above, -1)
                self.phase += dist < 0.008
                return a
            if self.phase == 1:
                a, dist = self._towards(env, np.array([obj[0], obj[1], grasp[2]]), -1)
                self.phase += dist < 0.006
                return a
            if self.phase == 2:  # close and let the fingers settle
                self.wait += 1
                self.phase += self.wait >= 4
                return np.array([0, 0, 0, 1.0])
            return np.array([0, 0, 1.0, 1.0])
        # push: come in low from the side opposite the zone, then drive through to the zone centre
        direction = env.zone_xy - obj[:2]
        direction = direction / (np.linalg.norm(direction) + 1e-9)
        low = FINGER_DROP + 0.012
        behind = np.append(obj[:2] - direction * (h + 0.06), low)
        if self.phase == 0:
            a, dist = self._towards(env, behind + [0, 0, 0.08], 1.0)
            self.phase += dist < 0.01
            return a
        if self.phase == 1:
            a, dist = self._towards(env, behind, 1.0)
            self.phase += dist < 0.01
            return a
        # re-aim at every step so the object is pushed along the line to the zone centre
        target = np.append(obj[:2] + direction * 0.03, low)
        lateral = obj[:2] - env.ee_pos()[:2]
        if np.linalg.norm(lateral) > h + 0.09:  # lost contact: go round again
            self.phase = 0
        return self._towards(env, target, 1.0, gain=0.4)[0]
