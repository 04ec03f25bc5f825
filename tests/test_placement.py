"""Placement by resource in the embedded runtime: the model services' threads on their cores, the
simulator workers on theirs (CPU affinity), restored when the runtime stops; bad core lists refused."""

from __future__ import annotations

import os

import pytest
import torch

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
        pids = rt.environment.worker_pids("acme", sid)
        assert pids and all(os.sched_getaffinity(pid) == set(sims) for pid in pids)
        rt.environment.close_session("acme", sid)
    assert os.sched_getaffinity(0) == before  # the caller gets its cores back


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to split")
def test_datasets_decode_on_the_simulators_cores(tmp_path):
    """In the split, an SFT batch is read and decoded on the simulators' cores (the caller, on the
    services' cores, waits for it); the batches are the same as without a split."""
    from demos import demo_dataset

    root = tmp_path / "d"
    demo_dataset(root, 2)
    cams = {"observation.images.agentview": "agentview", "observation.images.wrist": "wrist"}
    services, sims = (CORES[0],), (CORES[1],)
    batches = {}
    for split in (False, True):
        cfg = RuntimeConfig(backbone=BackboneSpec(preset="tiny"), group_cap=None,
                            **({"service_cpus": services, "env_cpus": sims} if split else {}))
        with EmbeddedRuntime(cfg) as rt:
            env = rt.environment
            did = env.open_dataset("acme", root, horizon=4, batch_size=8, camera_map=cams, seed=0)
            batches[split] = [env.sample("acme", did) for _ in range(3)]
            if split:
                assert env._decode(lambda: os.sched_getaffinity(0)) == set(sims)
                assert os.sched_getaffinity(0) == set(services)  # the caller stays where it was
            else:
                assert env._data_threads is None
    for (obs_a, act_a, mask_a), (obs_b, act_b, mask_b) in zip(batches[False], batches[True]):
        assert torch.equal(act_a, act_b) and torch.equal(mask_a, mask_b)
        assert all(torch.equal(obs_a.images[k], obs_b.images[k]) for k in obs_a.images)


def test_core_lists_are_checked():
    with pytest.raises(ValueError, match="service_cpus: cores \\[4096\\] are not available"):
        RuntimeConfig(service_cpus=(4096,))
    with pytest.raises(ValueError, match="env_cpus: a non-empty list"):
        RuntimeConfig(env_cpus=(-1,))


def _nice(thread) -> int:
    return os.getpriority(os.PRIO_PROCESS, thread.native_id)


@pytest.mark.parametrize("prioritize", [True, False])
def test_training_yields_the_services_cores_to_inference(prioritize):
    """With cores of their own, the training engine's thread runs at a lower OS priority than
    inference's (which the simulators wait on); prioritize_inference=False leaves both at the
    process's own."""
    from vlamux.model.device import LOW_NICE

    base = os.getpriority(os.PRIO_PROCESS, 0)
    cfg = RuntimeConfig(backbone=BackboneSpec(preset="tiny"), group_cap=None, prioritize_inference=prioritize,
                        service_cpus=tuple(CORES))
    with EmbeddedRuntime(cfg) as rt:
        train, infer = rt.training, rt.replicas[next(iter(rt.replicas))]
        assert train.runner.lane.priority == ("low" if prioritize else "normal")
        assert infer.runner.lane.priority == ("high" if prioritize else "normal")
        assert _nice(train._thread) == (min(19, base + LOW_NICE) if prioritize else base)
        assert _nice(infer._thread) == base
        assert rt.metrics()["training"]["priority"] == train.runner.lane.priority
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the caller's own thread is untouched


def test_training_keeps_its_share_on_cores_the_simulators_share():
    """Without cores of their own (the shared setting, on a CPU), training stays at the OS's fair
    share: at a lower priority it would yield to every busy simulator."""
    cfg = RuntimeConfig(backbone=BackboneSpec(preset="tiny"), group_cap=None, device="cpu")
    with EmbeddedRuntime(cfg) as rt:
        assert rt.training.runner.lane.priority == "normal"
        assert _nice(rt.training._thread) == os.getpriority(os.PRIO_PROCESS, 0)


def test_the_priority_follows_the_device_the_role_runs_on():
    """One decision for both runtimes: training yields where it shares a GPU or the services' own cores
    with inference. A Ray actor makes it with the device it resolved itself (the driver may have none)."""
    from vlamux.services.runtime import lane_priority

    assert lane_priority("training", True, False, torch.device("cuda", 0)) == "low"
    assert lane_priority("training", True, False, torch.device("cpu")) == "normal"
    assert lane_priority("training", True, True, torch.device("cpu")) == "low"
    assert lane_priority("inference", True, False, torch.device("cpu")) == "high"
    assert {lane_priority(r, False, True, torch.device("cuda", 0)) for r in ("training", "inference")} == {"normal"}


def test_lane_priority_is_checked():
    from vlamux.model.device import Lane

    with pytest.raises(ValueError, match="lane priority: one of high, normal, low; got 'urgent'"):
        Lane("cpu", priority="urgent")
