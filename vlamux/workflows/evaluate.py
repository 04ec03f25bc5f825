"""Evaluation: N seeded episodes per task through the Inference Queue; success per task with a 95%
Wilson interval. It only asks for actions, so it never touches a tenant's training state.

Each task's result also keeps its episodes' outcomes in seed order ("1" success, "0" failure), so
two evaluations of one task on the same seeds can be compared episode by episode (`paired`): far
more sensitive than comparing two success rates, whose intervals overlap long before a
difference this size is noise."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING

import numpy as np

from vlamux.envs import EnvSpec
from vlamux.errors import VlamuxError
from vlamux.model.device import to_numpy
from vlamux.model.batch import obs_to_observation
from vlamux.workflows.rollout import replace_rows

if TYPE_CHECKING:  # the contract, for annotations only
    from vlamux.services.contract import Runtime


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a success rate."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def evaluate(services: Runtime, tenant: str, env: EnvSpec, tasks: list[str], episodes: int, seed: int = 10_000,
             n_envs: int = 8, env_workers: int = 1, deterministic: bool = True, timeout_s: float = 120.0,
             on_episode=None, policy_version: int | None = None) -> dict:
    """Success of `tenant`'s served policy on each task: {task: {successes, episodes, rate, ci95}},
    plus the policy versions that acted. Episode k of a task is seeded seed + k on every run, so two
    evaluations of one policy see the same episodes. policy_version: fail (rather than report a
    mixture) if any chunk comes from another version, e.g. because the tenant is still training."""
    if episodes < 1:
        raise VlamuxError(f"episodes: expected >= 1, got {episodes}")
    out, versions, t0 = {}, set(), time.monotonic()
    env_api = services.environment
    for task in tasks:
        spec = dataclasses.replace(env, task=task)
        n = min(n_envs, episodes)
        sid = env_api.open_session(tenant, spec, n, n_workers=env_workers, timeout_s=timeout_s)
        outcomes = ["0"] * episodes
        successes = counted = 0
        try:
            for first in range(0, episodes, n):  # a round: every env starts one seeded episode
                obs, _ = env_api.reset(tenant, sid, seed=seed + first)
                counts = np.arange(n) < episodes - first  # the last round may have spare envs
                alive = np.ones(n, dtype=bool)
                while alive.any():
                    res = services.predict(tenant, obs_to_observation(obs), deterministic=deterministic).result(timeout_s)
                    versions.add(int(res["policy_version"]))
                    if policy_version is not None and versions != {policy_version}:
                        raise VlamuxError(f"policy_version: asked to evaluate version {policy_version}, the "
                                          f"replica served {sorted(versions)}")
                    obs, _, term, trunc, infos = env_api.step(tenant, sid, to_numpy(res["actions"]))
                    ended = np.asarray(term) | np.asarray(trunc)
                    for i in np.flatnonzero(ended & alive & counts):
                        ok = bool(infos[i].get("is_success", False))
                        outcomes[first + i] = "1" if ok else "0"
                        successes += ok
                        counted += 1
                        if on_episode:
                            on_episode(task, ok)
                    alive &= ~ended
                    if alive.any() and ended.any():  # finished envs idle in a throwaway episode
                        obs = replace_rows(obs, np.flatnonzero(ended),
                                            env_api.reset(tenant, sid, seed=2**30 + first,
                                                          indices=np.flatnonzero(ended).tolist())[0])
        finally:
            env_api.close_session(tenant, sid)
        out[task] = {"successes": successes, "episodes": counted, "rate": successes / counted,
                     "ci95": wilson(successes, counted), "outcomes": "".join(outcomes), "seed": seed}
    total = sum(r["successes"] for r in out.values())
    count = sum(r["episodes"] for r in out.values())
    return {"tasks": out, "success": total / count, "ci95": wilson(total, count), "policy_versions": sorted(versions),
            "wall_s": time.monotonic() - t0}


def paired(before: dict, after: dict) -> dict:
    """Two evaluations compared episode by episode on the tasks and seeds they share: episodes
    gained (failed before, succeed after) and lost, and the exact two-sided McNemar p-value of
    that split (the chance of one at least this lopsided if neither policy were better)."""
    gained = lost = shared = 0
    for task, b in before["tasks"].items():
        a = after["tasks"].get(task)
        if a is None or "outcomes" not in a or "outcomes" not in b or a.get("seed") != b.get("seed"):
            continue
        for x, y in zip(b["outcomes"], a["outcomes"]):
            gained += x == "0" and y == "1"
            lost += x == "1" and y == "0"
            shared += 1
    if shared == 0:
        raise VlamuxError("paired: the two evaluations share no task evaluated on the same seeds")
    return {"episodes": shared, "gained": gained, "lost": lost, "p_value": mcnemar(gained, lost)}


def mcnemar(b: int, c: int) -> float:
    """Exact two-sided McNemar test: the discordant pairs split as a fair coin would."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)
