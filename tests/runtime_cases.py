"""What every runtime must do when its roles fail or change, written once over the runtime contract
(vlamux/services/contract.py) and run on the embedded runtime (tests/test_runtime.py) and on Ray
(tests/test_ray_runtime.py). A case takes a started runtime holding conftest's TENANTS and `Roles`:
how a test reaches that runtime's roles to break them, which the contract rightly does not offer."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest

from conftest import TENANTS, tenant_batches
from vlamux.envs import EnvSpec


@dataclass
class Roles:
    kill_replica: Callable[[Any, str], None]  # (runtime, replica name): its engine or process dies
    kill_training: Callable[[Any], None]  # (runtime): the training role's engine or process dies
    replica_version: Callable[[Any, str, str], int]  # (runtime, replica name, tenant): the version it serves
    hang_replica: Callable[[Any, str], Callable[[], None]]  # (runtime, replica name): stuck in a model call; returns
    # what frees it
    timeout_s: float  # a restart's bound there: an engine thread, or a new actor process beside a neighbour


def wait_for(cond, timeout_s: float = 20.0, every_s: float = 0.05) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(every_s)
    return False


class Clients:
    """Every tenant sends action requests in a loop from its own thread; counts successes and errors
    and checks each answer's shape against the tenant's head."""

    def __init__(self, rt, tenants, timeout_s: float = 30.0):
        data = tenant_batches(batch=1)
        self.ok, self.errors, self.stop = {t: 0 for t in tenants}, [], threading.Event()
        self.timeout_s = timeout_s
        self.threads = [threading.Thread(target=self._run, args=(rt, t, data[t][0])) for t in tenants]

    def _run(self, rt, tenant, obs):
        head = TENANTS[tenant][0]
        while not self.stop.is_set():
            try:
                out = rt.predict(tenant, obs, deterministic=True).result(self.timeout_s)
                assert tuple(out["actions"].shape) == (1, head.horizon, head.action_dim), out["actions"].shape
                self.ok[tenant] += 1
            except Exception as e:  # noqa: BLE001
                self.errors.append((tenant, repr(e)))

    def serving(self, timeout_s: float) -> bool:
        """Every tenant has been answered since the clients started."""
        return wait_for(lambda: all(n > 0 for n in self.ok.values()), timeout_s)

    def more(self, n: int, timeout_s: float) -> bool:
        """Every tenant is answered `n` more times from now."""
        before = dict(self.ok)
        return wait_for(lambda: all(self.ok[t] > before[t] + n for t in before), timeout_s)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()


def restarts(rt) -> dict[str, int]:
    """Each role's restarts, as the Health Manager counts them (`metrics()["health"]` would also ask
    the replica that is down for its metrics)."""
    return {name: role.restarts for name, role in rt.health.roles.items()}


def killed_inference_replica_restarts(rt, roles: Roles) -> None:
    """A replica dies while every tenant is acting: it is restarted once (the other not at all), with
    its tenants' current versions, and no request fails."""
    victim, other = rt.replica_names()[:2]
    before = restarts(rt)
    with Clients(rt, list(TENANTS), roles.timeout_s) as c:
        assert c.serving(roles.timeout_s)
        roles.kill_replica(rt, victim)
        assert wait_for(lambda: restarts(rt)[victim] > before[victim], roles.timeout_s)
        assert c.more(3, roles.timeout_s)
    assert c.errors == []
    after = restarts(rt)
    assert after[victim] == before[victim] + 1 and after[other] == before[other]
    assert rt.flush(roles.timeout_s)
    for t in TENANTS:
        assert roles.replica_version(rt, victim, t) == rt.version(t), t


def killed_training_role_comes_back(rt, roles: Roles, checkpoint) -> None:
    """The training role dies while other tenants act: it comes back, no request fails, a tenant with a
    checkpoint resumes from it (its weights under a new version number: the one after the checkpoint
    was already served, and a number never names two policies), the others from their last published
    version, and training goes on."""
    data = tenant_batches(batch=2)
    for t, (obs, act) in data.items():
        rt.forward_backward(t, obs, act).result(roles.timeout_s)
        rt.optim_step(t).result(roles.timeout_s)
    rt.save_state("acme", checkpoint).result(roles.timeout_s)
    obs, act = data["acme"]
    rt.forward_backward("acme", obs, act).result(roles.timeout_s)
    served = rt.optim_step("acme").result(roles.timeout_s)["policy_version"]  # after the checkpoint
    assert rt.flush(roles.timeout_s)
    versions, before = {t: rt.version(t) for t in TENANTS}, restarts(rt)["training"]
    with Clients(rt, ["bolt", "cobalt"], roles.timeout_s) as c:
        assert c.serving(roles.timeout_s)
        roles.kill_training(rt)
        assert wait_for(lambda: restarts(rt)["training"] > before, roles.timeout_s)
        assert c.more(3, roles.timeout_s)
    assert c.errors == []
    assert rt.version("acme") == served + 1
    assert all(rt.version(t) == versions[t] for t in ("bolt", "cobalt", "delta"))
    assert rt.flush(roles.timeout_s)
    for name in rt.replica_names():
        assert roles.replica_version(rt, name, "acme") == served + 1, name
    out = rt.predict("acme", obs, deterministic=True).result(roles.timeout_s)
    assert out["policy_version"] == served + 1
    assert rt.forward_backward("bolt", *data["bolt"]).result(roles.timeout_s)["loss"] > 0  # training goes on
    assert rt.optim_step("bolt").result(roles.timeout_s)["policy_version"] == versions["bolt"] + 1


def hung_inference_replica_is_replaced(rt, roles: Roles, hung_after_s: float) -> None:
    """A replica stops answering (its engine stuck in a model call): once its heartbeat is older than
    `hung_after_s` it is replaced, no request fails, and the new one serves every tenant's version."""
    victim = rt.replica_names()[-1]
    before = restarts(rt)
    bound, rt.health.hung_after_s = rt.health.hung_after_s, hung_after_s
    try:
        with Clients(rt, list(TENANTS), roles.timeout_s) as c:
            assert c.serving(roles.timeout_s)
            release = roles.hang_replica(rt, victim)
            try:
                assert wait_for(lambda: restarts(rt)[victim] > before[victim], roles.timeout_s)
                assert c.more(3, roles.timeout_s)
            finally:
                release()
    finally:
        rt.health.hung_after_s = bound
    assert c.errors == []
    assert rt.flush(roles.timeout_s)
    for t in TENANTS:
        assert roles.replica_version(rt, victim, t) == rt.version(t), t


def killed_environment_worker_is_replaced(rt, timeout_s: float) -> None:
    """A simulator worker is killed: the Health Manager replaces it, the session goes on after a reset,
    and another tenant's session never notices."""
    env = rt.environment
    spec = EnvSpec(task="goal/touch-red-cube", image_size=16)
    mine = env.open_session("acme", spec, 1, 0, 1)
    theirs = env.open_session("bolt", spec, 1, 0, 1)
    env.reset("acme", mine, 0)
    env.reset("bolt", theirs, 0)
    before = rt.health.env_replacements
    pid = env.worker_pids("acme", mine)[0]
    os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: rt.health.env_replacements > before, timeout_s)
    assert env.worker_pids("acme", mine)[0] not in (pid, None)
    zeros = np.zeros((1, 4), np.float32)
    env.step("bolt", theirs, zeros)  # the other tenant never noticed
    env.reset("acme", mine, 1)
    env.step("acme", mine, zeros)
    env.close_session("acme", mine)
    env.close_session("bolt", theirs)


def replicas_added_and_removed_under_load(rt, timeout_s: float) -> None:
    """While every tenant acts, a replica is added (and takes groups) and the others are removed: no
    request fails, and the last replica cannot be removed."""
    with Clients(rt, list(TENANTS), timeout_s) as c:
        assert c.serving(timeout_s)
        name = rt.add_inference_replica()
        # every 0.5 s: on Ray each look asks every actor for its metrics, which slowed the new replica's start
        assert wait_for(lambda: rt.metrics()["inference"][name]["queue"]["groups"] > 0, timeout_s, every_s=0.5)
        for old in [n for n in rt.replica_names() if n != name]:
            rt.remove_inference_replica(old)
        assert c.more(3, timeout_s)
    assert c.errors == [] and rt.replica_names() == [name]
    with pytest.raises(ValueError, match="last inference replica"):
        rt.remove_inference_replica(name)
