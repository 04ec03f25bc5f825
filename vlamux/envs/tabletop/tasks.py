"""The built-in task suites, mirroring LIBERO's axes.

* spatial — identical red cubes; the instruction picks one by position.
* object  — distinct objects; the instruction picks one by identity.
* goal    — the same scene; the instruction says what to do.
"""

from __future__ import annotations

from dataclasses import dataclass

COLORS = {"red": (0.85, 0.15, 0.15), "green": (0.15, 0.7, 0.25), "blue": (0.15, 0.3, 0.85),
          "yellow": (0.9, 0.8, 0.15)}
SHAPES = ("cube", "ball", "block")


@dataclass(frozen=True)
class Task:
    task_id: str  # "suite/name"
    instruction: str
    goal: str  # touch | lift | push
    objects: tuple[tuple[str, str], ...]  # (shape, color); fixed set, or a pool when `sample_objects`
    target: int  # index into objects of the object the goal is about
    zone: str | None = None  # colour of the zone a push goal ends in
    order_by_x: bool = False  # spatial tasks: objects laid out left to right, target picked by rank
    sample_objects: int = 0  # >0: distractors drawn from `objects` so this many are on the table

    @property
    def suite(self) -> str:
        return self.task_id.split("/")[0]


def _spatial() -> list[Task]:
    cubes = (("cube", "red"),) * 3
    out = []
    for goal, verb in (("touch", "touch"), ("lift", "pick up")):
        for rank, word in ((0, "left"), (2, "right")):
            out.append(Task(f"spatial/{goal}-{word}-cube", f"{verb} the cube on the {word}", goal, cubes, rank,
                            order_by_x=True))
    return out


def _object() -> list[Task]:
    pool = (("cube", "red"), ("ball", "blue"), ("block", "yellow"), ("cube", "green"))
    return [Task(f"object/touch-{c}-{s}", f"touch the {c} {s}", "touch", pool, i, sample_objects=3)
            for i, (s, c) in enumerate(pool)]


def _goal() -> list[Task]:
    objs = (("cube", "red"), ("ball", "blue"))
    return [
        Task("goal/touch-red-cube", "touch the red cube", "touch", objs, 0, zone="green"),
        Task("goal/lift-red-cube", "pick up the red cube", "lift", objs, 0, zone="green"),
        Task("goal/push-red-cube-green-zone", "push the red cube into the green zone", "push", objs, 0, zone="green"),
        # A ball push is left out: the scripted pusher (closed fingers, a 2 cm pad) lands only about half of
        # them, far below the 95% an expert must reach.
        Task("goal/touch-blue-ball", "touch the blue ball", "touch", objs, 1, zone="green"),
    ]


TASKS: dict[str, Task] = {t.task_id: t for t in (*_spatial(), *_object(), *_goal())}
SUITES: dict[str, list[str]] = {}
for _t in TASKS.values():
    SUITES.setdefault(_t.suite, []).append(_t.task_id)


def get_task(task_id: str) -> Task:
    if task_id not in TASKS:
        raise ValueError(f"unknown tabletop task {task_id!r}; suites: "
                         + "; ".join(f"{s}: {', '.join(ids)}" for s, ids in SUITES.items()))
    return TASKS[task_id]
