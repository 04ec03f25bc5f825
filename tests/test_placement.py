"""Placement by resource in the embedded runtime: the model services' threads on their cores, the
simulator workers on theirs (CPU affinity), restored when the runtime stops; bad core lists refused."""

from __future__ import annotations

import os

import pytest

from vlamux.model import BackboneSpec
from vlamux.services.runtime import EmbeddedRuntime, RuntimeConfig

CORES = sorted(os.sched_getaffinity(0))
ENV = {"task": "goal/touch-red-cube", "image_size": 32, "max_steps": 10, "n_action_steps": 2}


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to split")
def test_services_and_simulators_run_on_their_own_cores():
    from vlamux.envs import EnvSpec

    before = os.sched_getaffinity(0)
    services, sims = (CORES[0],), (CORES[1],)
    cfg = RuntimeConfig(backbone=BackboneSpec(preset="tiny"), group_cap=None, service_cpus=services, env_cpus=sims)
    with EmbeddedRuntime(cfg) as rt:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
        assert all(os.sched_getaffinity(t) == set(services) for t in threads)  # every service thread
        sid = rt.environment.open_session("acme", EnvSpec(**ENV), n_envs=2, n_workers=2)
        pids = rt.environment._lookup_session("acme", sid).vec.worker_pids()
        assert pids and all(os.sched_getaffinity(pid) == set(sims) for pid in pids)
        rt.environment.close_session("acme", sid)
    assert os.sched_getaffinity(0) == before  # the caller gets its cores back


def test_core_lists_are_checked():
    with pytest.raises(ValueError, match="service_cpus: cores \\[4096\\] are not available"):
        RuntimeConfig(service_cpus=(4096,))
    with pytest.raises(ValueError, match="env_cpus: a non-empty list"):
        RuntimeConfig(env_cpus=(-1,))
