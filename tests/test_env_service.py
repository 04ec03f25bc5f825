"""Environment Service: sessions, isolation, idle timeouts, quotas, simulator failures, datasets, accounting."""

import os
import signal
import threading
import time
import uuid

import numpy as np
import pytest
import torch

from vlamux.data import DatasetError
from vlamux.envs import EnvError, EnvSpec, EnvWorkerCrashed
from vlamux.errors import InvalidInputError
from vlamux.model.batch import Observation
from vlamux.model.normalize import NormStats
from vlamux.services.environment import (
    DatasetNotFound,
    EnvironmentService,
    QuotaExceeded,
    ServiceClosed,
    SessionNotFound,
    obs_to_observation,
)

SPEC = EnvSpec(task="goal/touch-red-cube", image_size=32)
CAMS = {"observation.images.agentview": "agentview", "observation.images.wrist": "wrist"}


@pytest.fixture
def svc():
    s = EnvironmentService(env_timeout_s=20, start_timeout_s=60)
    yield s
    s.close()


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory):
    from demos import demo_dataset

    root = tmp_path_factory.mktemp("envsvc") / "d"
    demo_dataset(root, 2)
    return root


def _open(svc, tenant, n_envs=1, **kw):
    return svc.open_session(tenant, kw.pop("spec", SPEC), n_envs, n_workers=1, **kw)


def _workers(svc, sid, tenant="acme"):
    return svc.worker_pids(tenant, sid)


def test_round_trip_shapes_and_observation(svc):
    sid = _open(svc, "acme", 2, seed=0)
    assert isinstance(sid, str) and uuid.UUID(sid).version == 4
    obs, infos = svc.reset("acme", sid)
    assert obs["images"]["agentview"].shape == (2, 3, 32, 32) and obs["images"]["agentview"].dtype == np.uint8
    assert obs["state"].shape == (2, 8) and obs["state"].dtype == np.float32 and len(infos) == 2
    o = obs_to_observation(obs)
    assert isinstance(o, Observation) and o.instruction == obs["instruction"] and o.batch_size == 2
    assert o.images["wrist"].dtype == torch.uint8 and o.state.dtype == torch.float32
    assert np.shares_memory(o.images["agentview"].numpy(), obs["images"]["agentview"])  # no copy
    assert np.shares_memory(o.state.numpy(), obs["state"])

    obs, reward, term, trunc, infos = svc.step("acme", sid, np.zeros((2, 4), np.float32))
    assert reward.shape == (2,) and term.shape == trunc.shape == (2,) and len(infos) == 2
    obs, *_ = svc.step("acme", sid, torch.zeros(2, 5, 4))  # a chunk, as a tensor
    assert obs["state"].shape == (2, 8)

    info = svc.session_info("acme", sid)
    assert info["spec"] == SPEC and info["n_envs"] == 2 and info["env_steps"] == 4 and info["step_calls"] == 2
    assert info["needs_reset"] == [False, False] and info["created"] <= info["last_used"] <= time.time()
    assert info["action_spec"].dim == 4
    assert [s["session_id"] for s in svc.list_sessions("acme")] == [sid]

    # bad input: a clear error naming the field, the session unharmed
    with pytest.raises(InvalidInputError, match="actions"):
        svc.step("acme", sid, np.zeros((3, 4)))
    with pytest.raises(InvalidInputError, match="NaN"):
        svc.step("acme", sid, np.full((2, 4), np.nan))
    with pytest.raises(InvalidInputError, match="indices"):
        svc.reset("acme", sid, indices=[5])
    with pytest.raises(InvalidInputError, match="backend"):
        svc.open_session("acme", EnvSpec(backend="nope"), 1)
    assert svc.step("acme", sid, np.zeros((2, 4)))[1].shape == (2,)

    svc.close_session("acme", sid)
    with pytest.raises(SessionNotFound, match="closed"):
        svc.step("acme", sid, np.zeros((2, 4)))
    assert svc.list_sessions("acme") == []


def test_two_tenants_concurrently_get_their_own_results(svc):
    sids = {"acme": _open(svc, "acme", 2, seed=0), "bolt": _open(svc, "bolt", 1, seed=7, as_observation=True)}
    n = {"acme": 2, "bolt": 1}
    rng = np.random.default_rng(0)
    plans = {t: rng.uniform(-1, 1, (6, n[t], 4)).astype(np.float32) for t in sids}

    def state(obs):
        return (obs["state"] if isinstance(obs, dict) else obs.state.numpy()).copy()

    def run(tenant, seed=None):  # seed None: the first reset uses the session's seed
        obs, _ = svc.reset(tenant, sids[tenant], seed=seed)
        states = [state(obs)]
        for a in plans[tenant]:
            states.append(state(svc.step(tenant, sids[tenant], a)[0]))
        return np.stack(states)

    got, errors, barrier = {}, [], threading.Barrier(2)

    def worker(tenant):
        try:
            barrier.wait(10)
            got[tenant] = run(tenant)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in sids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert got["acme"].shape == (7, 2, 8) and got["bolt"].shape == (7, 1, 8)
    # the same episodes replayed one tenant at a time: identical, so nothing leaked between tenants
    serial = {"acme": run("acme", seed=0), "bolt": run("bolt", seed=7)}
    for t in sids:
        np.testing.assert_array_equal(got[t], serial[t])
    assert not np.array_equal(got["acme"][:, 0], got["bolt"][:, 0])  # different seeds, different episodes

    # several threads of one tenant on one session: its calls run one at a time, none is lost
    before = svc.session_info("acme", sids["acme"])["step_calls"]
    threads = [threading.Thread(target=lambda: [svc.step("acme", sids["acme"], np.zeros((2, 4))) for _ in range(3)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert svc.session_info("acme", sids["acme"])["step_calls"] == before + 12


def test_cross_tenant_access_is_not_found_and_reveals_nothing(svc):
    sid = _open(svc, "acme", 1)
    svc.reset("acme", sid, seed=0)
    ghost = uuid.uuid4().hex
    ops = {
        "reset": lambda t, i: svc.reset(t, i),
        "step": lambda t, i: svc.step(t, i, np.zeros((1, 4))),
        "session_info": lambda t, i: svc.session_info(t, i),
        "action_spec": lambda t, i: svc.action_spec(t, i),
        "close_session": lambda t, i: svc.close_session(t, i),
    }
    for name, op in ops.items():
        with pytest.raises(SessionNotFound) as theirs:
            op("bolt", sid)
        with pytest.raises(SessionNotFound) as unknown:
            op("bolt", ghost)
        assert isinstance(theirs.value, KeyError), name
        # word for word what an id that never existed gets
        assert str(theirs.value).replace(sid, "<id>") == str(unknown.value).replace(ghost, "<id>"), name
        assert "acme" not in str(theirs.value), name
    assert svc.list_sessions("bolt") == [] and svc.usage("bolt")["env_steps"] == 0
    assert svc.usage("bolt")["sessions"] == {}
    # the owner's session is untouched by all of that
    assert svc.step("acme", sid, np.zeros((1, 4)))[0]["state"].shape == (1, 8)
    assert svc.session_info("acme", sid)["step_calls"] == 1


def test_idle_sessions_are_reaped(svc):
    idle = _open(svc, "acme", 1, idle_timeout_s=0.05)
    busy = _open(svc, "acme", 1, idle_timeout_s=60)
    svc.reset("acme", idle, seed=0)
    time.sleep(0.15)
    assert svc.reap() == [idle]
    with pytest.raises(SessionNotFound, match="expired"):
        svc.step("acme", idle, np.zeros((1, 4)))
    with pytest.raises(SessionNotFound) as other:  # another tenant is not told it ever existed
        svc.step("bolt", idle, np.zeros((1, 4)))
    assert "expired" not in str(other.value)
    assert [s["session_id"] for s in svc.list_sessions("acme")] == [busy]

    # the background reaper does the same on its own
    auto = _open(svc, "acme", 1, idle_timeout_s=0.05)
    svc.start_reaper(0.02)
    deadline = time.monotonic() + 10
    while auto in [s["session_id"] for s in svc.list_sessions("acme")] and time.monotonic() < deadline:
        time.sleep(0.02)
    svc.stop()
    assert [s["session_id"] for s in svc.list_sessions("acme")] == [busy]
    assert svc.metrics()["sessions_reaped"] == 2


def test_quotas():
    with EnvironmentService(max_sessions_per_tenant=2, max_envs_per_tenant=2) as svc:
        a = _open(svc, "acme", 1)
        with pytest.raises(QuotaExceeded, match="env quota is 2 envs; 1 in use, 2 requested"):
            _open(svc, "acme", 2)
        _open(svc, "acme", 1)
        with pytest.raises(QuotaExceeded, match="session quota"):
            _open(svc, "acme", 1)
        _open(svc, "bolt", 2)  # quotas are per tenant
        svc.close_session("acme", a)
        _open(svc, "acme", 1)  # closing frees the quota
        assert svc.metrics()["open_sessions"] == 3


def test_killed_worker_fails_only_its_tenant_and_session_recovers(svc):
    mine, theirs = _open(svc, "acme", 1), _open(svc, "bolt", 1)
    svc.reset("acme", mine, seed=0)
    svc.reset("bolt", theirs, seed=1)
    stop, other_errors, other_steps = threading.Event(), [], []

    def other_tenant():
        while not stop.is_set():
            try:
                other_steps.append(svc.step("bolt", theirs, np.zeros((1, 4)))[1])
                if svc.session_info("bolt", theirs)["needs_reset"][0]:
                    svc.reset("bolt", theirs)
            except Exception as e:  # noqa: BLE001
                other_errors.append(e)
                return

    t = threading.Thread(target=other_tenant)
    t.start()
    try:
        os.kill(_workers(svc, mine)[0], signal.SIGKILL)
        with pytest.raises(EnvWorkerCrashed, match="died") as err:
            svc.step("acme", mine, np.zeros((1, 4)))
        assert err.value.failed_envs == [0] and err.value.session_id == mine
        n_before = len(other_steps)
        time.sleep(0.3)
    finally:
        stop.set()
        t.join(30)
    assert not other_errors and len(other_steps) > n_before > 0  # the other tenant kept stepping throughout
    assert svc.session_info("acme", mine)["needs_reset"] == [True]
    assert svc.session_info("acme", mine)["worker_restarts"] == 1
    with pytest.raises(EnvError, match="need reset"):
        svc.step("acme", mine, np.zeros((1, 4)))
    svc.reset("acme", mine, seed=0)
    assert svc.step("acme", mine, np.zeros((1, 4)))[0]["state"].shape == (1, 8)
    assert svc.usage("acme")["errors"] == 2 and svc.usage("bolt")["errors"] == 0


def test_datasets(svc, demo_root):
    did = svc.open_dataset("acme", demo_root, horizon=4, batch_size=8, camera_map=CAMS, seed=0)
    obs, actions, mask = svc.sample("acme", did)
    assert obs.images["agentview"].shape == (8, 3, 32, 32) and obs.images["wrist"].dtype == torch.uint8
    assert obs.state.shape == (8, 8) and len(obs.instruction) == 8
    assert actions.shape == (8, 4, 4) and actions.dtype == torch.float32 and mask.shape == (8, 4)
    assert mask.dtype == torch.bool and mask[:, 0].all()

    stats = svc.dataset_stats("acme", did)
    assert isinstance(stats["action"], NormStats) and stats["action"].dim == 4 and stats["state"].dim == 8
    stats["action"].mean += 100  # a private copy: the handle's statistics are unchanged
    assert svc.dataset_stats("acme", did)["action"].mean.abs().max() < 100

    # same seed, same batches; the handle walks whole epochs and rolls over
    other = svc.open_dataset("acme", demo_root, horizon=4, batch_size=8, camera_map=CAMS, seed=0)
    assert torch.equal(svc.sample("acme", other)[1], actions)
    info = svc.dataset_info("acme", did)
    for _ in range(info["batches_per_epoch"]):
        svc.sample("acme", did)
    info = svc.dataset_info("acme", did)
    assert info["epoch"] == 1 and info["next_batch"] == 1 and info["samples"] == 8 * (info["batches_per_epoch"] + 1)

    # isolation: another tenant's dataset id is not found, word for word like an unknown one
    ghost = uuid.uuid4().hex
    for op in (svc.sample, svc.dataset_stats, svc.dataset_info, svc.close_dataset):
        with pytest.raises(DatasetNotFound) as theirs:
            op("bolt", did)
        with pytest.raises(DatasetNotFound) as unknown:
            op("bolt", ghost)
        assert str(theirs.value).replace(did, "<id>") == str(unknown.value).replace(ghost, "<id>")
    assert svc.list_datasets("bolt") == [] and len(svc.list_datasets("acme")) == 2

    with pytest.raises(DatasetError, match="no-such-dir"):
        svc.open_dataset("acme", demo_root.parent / "no-such-dir", 4, 8, CAMS)
    with pytest.raises(DatasetError, match=f"^{demo_root.parent.name}: no meta/info.json"):
        svc.open_dataset("acme", demo_root.parent, 4, 8, CAMS)  # a directory, but not a dataset (named, not placed)
    with pytest.raises(DatasetError, match="observation.images.top"):
        svc.open_dataset("acme", demo_root, 4, 8, {"observation.images.top": "top"})

    svc.close_dataset("acme", did)
    with pytest.raises(DatasetNotFound, match="closed"):
        svc.sample("acme", did)
    assert svc.usage("acme")["samples"] == 8 * (info["batches_per_epoch"] + 1) + 8


def test_usage_and_utilization_are_plausible(svc):
    spec = EnvSpec(task="goal/touch-red-cube", image_size=32, n_action_steps=2)
    sid = _open(svc, "acme", 2, spec=spec)
    other = _open(svc, "bolt", 1)
    svc.reset("acme", sid, seed=0)
    svc.reset("bolt", other, seed=0)
    for _ in range(3):
        svc.step("acme", sid, np.zeros((2, 5, 4)))  # a chunk of 5: n_action_steps=2 of them run
    svc.step("acme", sid, np.zeros((2, 4)))  # a single action
    svc.step("bolt", other, np.zeros((1, 4)))
    u = svc.usage("acme")
    assert u["env_steps"] == 3 * 2 * 2 + 2 * 1 and u["step_calls"] == 4 and u["reset_calls"] == 1
    assert u["sessions"][sid]["env_steps"] == u["env_steps"] and u["open_envs"] == 2
    assert 0 < u["sim_s"] < 30 and svc.usage("bolt")["env_steps"] == 1
    util = svc.utilization()
    assert 0 < util["busy_s"] <= util["wall_s"] and 0 < util["utilization"] <= 1
    # sim_s and busy_s are read on different clocks around the same calls: equal to within a little
    assert util["sim_s"] >= util["busy_s"] * 0.98 and util["sim_s"] <= u["sim_s"] + svc.usage("bolt")["sim_s"] + 1e-6
    m = svc.metrics()
    assert m["open_sessions"] == 2 and m["open_envs"] == 3 and m["total_env_steps"] == 15 and m["tenants"] == 2


def test_close_shuts_everything_down():
    svc = EnvironmentService()
    sid = _open(svc, "acme", 1)
    pids = _workers(svc, sid)
    svc.start_reaper(10)
    reaper = svc._reaper
    svc.close()
    assert not reaper.is_alive()
    for pid in pids:  # the worker processes are gone (reaped by their parent's join)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(ServiceClosed):
        svc.step("acme", sid, np.zeros((1, 4)))
    with pytest.raises(ServiceClosed):
        _open(svc, "acme", 1)
    svc.close()  # idempotent


def test_elastic_workers_resize_a_running_session_at_its_next_reset(svc):
    """Workers added while a tenant steps: no call fails, the running episodes finish on the old
    workers, and after the next full reset the session runs the same episodes on more processes."""
    sid = _open(svc, "acme", 3, seed=0)
    plan = np.random.default_rng(1).uniform(-1, 1, (4, 3, 4)).astype(np.float32)

    def episode(seed):
        obs, _ = svc.reset("acme", sid, seed=seed)
        states = [obs["state"].copy()]
        for a in plan:
            states.append(svc.step("acme", sid, a)[0]["state"].copy())
        return np.stack(states)

    before = episode(5)
    svc.reset("acme", sid, seed=5)
    pids = _workers(svc, sid)
    svc.step("acme", sid, plan[0])
    assert svc.resize_session("acme", sid, 3) == 3
    info = svc.session_info("acme", sid)
    assert info["n_workers"] == 1 and info["pending_workers"] == 3
    for a in plan[1:]:  # the episode in progress keeps its simulators
        svc.step("acme", sid, a)
    assert _workers(svc, sid) == pids
    after = episode(5)
    info = svc.session_info("acme", sid)
    assert info["n_workers"] == 3 and info["pending_workers"] is None and len(set(_workers(svc, sid))) == 3
    assert not set(_workers(svc, sid)) & set(pids)
    np.testing.assert_array_equal(before, after)
    assert svc.resize_session("acme", sid, 1) == 1
    np.testing.assert_array_equal(episode(5), before)
    assert len(_workers(svc, sid)) == 1
    with pytest.raises(InvalidInputError, match="n_workers"):
        svc.resize_session("acme", sid, 0)
    with pytest.raises(SessionNotFound):
        svc.resize_session("bolt", sid, 2)
