"""An inference replica that pages its serving slots (slot_budget): tenants beyond the budget are
parked or stored and come back when asked, answering as a replica that keeps every slot resident."""

import random

import pytest
import torch

from vlamux.errors import InvalidInputError
from vlamux.model import HeadSpec, ModelRunner, OptimizerSpec
from vlamux.model.synthetic import TaskProfile, make_batch
from vlamux.services.inference import InferenceModelService
from vlamux.services.pager import SlotBudget
from vlamux.services.queues import InferenceQueueConfig

PROFILE = TaskProfile({"top": (32, 32)}, 4, 6, 3, "reach the {color} block")
HEAD = HeadSpec("gaussian", 4, 6, 3, width=16, depth=1)


def trained(backbone, n):
    r = ModelRunner(backbone)
    for i in range(n):
        r.create_slot(f"t{i:02d}", HEAD, OptimizerSpec(), seed=i)
    return r


def replica(backbone, trainer, budget=None):
    svc = InferenceModelService(backbone, InferenceQueueConfig(batch_rows=4, max_wait_s=0.002), slot_budget=budget,
                                group_cap=None)
    for slot in trainer.slots.values():
        svc.stage_policy(slot.export_policy())
    return svc.start()


def serving_bytes(trainer) -> int:
    slot = next(iter(trainer.slots.values()))
    return sum(v.numel() * v.element_size() for v in slot.module_state().values())


def test_fifty_tenants_taking_turns_with_room_for_ten(backbone):
    trainer = trained(backbone, 50)
    paged = replica(backbone, trainer, SlotBudget(resident_bytes=10 * serving_bytes(trainer)))
    free = replica(backbone, trainer)
    try:
        rng, g = random.Random(0), torch.Generator().manual_seed(0)
        obs = {t: make_batch(PROFILE, 1, g)[0] for t in trainer.slots}
        for turn in range(30):
            tenants = rng.sample(sorted(trainer.slots), 5)  # five tenants ask at once, sampling from their RNG
            got = [(paged.predict(t, obs[t]), free.predict(t, obs[t])) for t in tenants]
            for t, (a, b) in zip(tenants, got):
                a, b = a.result(60), b.result(60)
                assert torch.allclose(a["actions"], b["actions"], atol=1e-5) and a["policy_version"] == 0, (turn, t)
            slots = paged.metrics()["slots"]
            assert slots["resident"]["count"] <= 10 and slots["resident"]["bytes"] <= 10 * serving_bytes(trainer)
            assert slots["resident"]["count"] + slots["parked"]["count"] == 50
        assert paged.metrics()["slots"]["moves"]["load"] > 0 and free.metrics().get("slots") is None
    finally:
        paged.stop()
        free.stop()


def test_a_version_staged_while_parked_is_served_when_it_returns(backbone):
    trainer = trained(backbone, 2)
    svc = replica(backbone, trainer, SlotBudget(resident_bytes=serving_bytes(trainer)))
    try:
        obs, act = make_batch(PROFILE, 1, torch.Generator().manual_seed(1))
        assert svc.predict("t01", obs).result(60)["policy_version"] == 0  # t00 goes down to make room
        trainer.slot("t00").forward_backward(trainer.backbones[trainer.default_backbone].forward_group(
            [trainer.backbones[trainer.default_backbone].prepare(obs)])[0], obs.state, act)
        trainer.slot("t00").optim_step()
        svc.stage_policy(trainer.slot("t00").export_policy())
        assert svc.policy_version("t00") == 1
        out = svc.predict("t00", obs, deterministic=True).result(60)
        assert out["policy_version"] == 1
        ref = ModelRunner(trainer.backbones[trainer.default_backbone])
        ref.apply_policy(trainer.slot("t00").export_policy())
        from vlamux.model import Sample

        expected = ref.execute([Sample("t00", obs, deterministic=True)])[0].unwrap()["actions"]
        assert torch.allclose(out["actions"], expected, atol=1e-6)
    finally:
        svc.stop()


def test_stored_slots_come_back_from_disk(backbone):
    trainer = trained(backbone, 8)
    one = serving_bytes(trainer)
    paged = replica(backbone, trainer, SlotBudget(resident_bytes=2 * one, parked_bytes=2 * one))
    free = replica(backbone, trainer)
    try:
        g = torch.Generator().manual_seed(2)
        obs = {t: make_batch(PROFILE, 1, g)[0] for t in trainer.slots}
        stored = 0
        for _ in range(2):
            for t in sorted(trainer.slots):
                a, b = paged.predict(t, obs[t]).result(60), free.predict(t, obs[t]).result(60)
                assert torch.allclose(a["actions"], b["actions"], atol=1e-5), t
                stored = max(stored, paged.metrics()["slots"]["stored"]["count"])
        moves = paged.metrics()["slots"]["moves"]
        assert stored >= 4 and moves["store"] > 0 and moves["load"] >= 14  # most of them from disk
    finally:
        paged.stop()
        free.stop()


def test_a_slot_larger_than_the_whole_budget_is_refused_naming_both_sizes(backbone):
    trainer = trained(backbone, 1)
    svc = replica(backbone, trainer, SlotBudget(resident_bytes=1024))
    try:
        obs, _ = make_batch(PROFILE, 1, torch.Generator().manual_seed(3))
        with pytest.raises(InvalidInputError, match=r"tenant 't00' \(\d+ bytes\) is larger than .* \(1024 bytes\)"):
            svc.predict("t00", obs).result(60)
    finally:
        svc.stop()


def test_the_runtime_pages_its_replicas_slots_within_slot_memory_mb():
    from vlamux.model import BackboneSpec
    from vlamux.services.runtime import EmbeddedRuntime, RuntimeConfig

    with pytest.raises(ValueError, match="slot_memory_mb"):
        RuntimeConfig(backbone=BackboneSpec(preset="tiny"), slot_memory_mb=0)
    one_mib_of_slots = 1.0  # a gaussian head of width 16 here is 35 kB: about 29 fit
    rt = EmbeddedRuntime(RuntimeConfig(backbone=BackboneSpec(preset="tiny"), group_cap=None,
                                       slot_memory_mb=one_mib_of_slots / 8)).start()
    try:
        for i in range(8):
            rt.create_slot(f"t{i}", HEAD, OptimizerSpec(), seed=i).result(60)
        assert rt.flush(30)
        g = torch.Generator().manual_seed(4)
        for _ in range(2):
            for i in range(8):
                obs, _ = make_batch(PROFILE, 1, g)
                assert rt.predict(f"t{i}", obs).result(60)["policy_version"] == 0
        slots = next(iter(rt.metrics()["inference"].values()))["slots"]
        assert slots["resident"]["bytes"] <= (1 << 20) / 8 and slots["moves"]["load"] > 0
        assert slots["resident"]["count"] + slots["parked"]["count"] == 8
    finally:
        rt.stop()


def test_an_operator_sees_the_tiers_in_metrics(tmp_path):
    """Through the HTTP API: a service whose replica keeps about two slots resident, five tenants'
    training slots predicted in turn; /metrics shows the tiers' counts and bytes and the moves."""
    import numpy as np

    import vlamux
    from api_server import running_server

    head = {"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8, "width": 32}
    with running_server(tmp_path, slot_memory_mb=0.4) as (url, admin_key, host):  # 2.4 slots of 172 kB
        admin = vlamux.Client(url, api_key=admin_key, timeout_s=30)
        rng = np.random.default_rng(0)
        obs = {"images": {"agentview": rng.integers(0, 255, (1, 3, 32, 32), dtype=np.uint8)},
               "state": rng.standard_normal((1, 8)).astype(np.float32), "instructions": ["touch the red cube"]}
        clients = []
        for i in range(5):
            _, key = admin.admin.create_tenant(f"pager{i}")
            c = vlamux.Client(url, api_key=key, timeout_s=30)
            clients.append((c, c.training_client(head=head)))
        for _ in range(2):
            for c, tc in clients:
                assert tc.policy().predict(obs)["actions"].shape == (1, 4, 4)
        import httpx

        text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30).text
        lines = [line for line in text.splitlines() if line.startswith(("vlamux_slot_tier", "vlamux_slot_moves"))]
        values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines}
        resident = values['vlamux_slot_tier{service="inference-0",tier="resident",what="count"}']
        parked = values['vlamux_slot_tier{service="inference-0",tier="parked",what="count"}']
        assert 1 <= resident <= 3 and resident + parked == 5, lines
        assert values['vlamux_slot_moves_total{move="load",service="inference-0"}'] > 0, lines
        tiers = admin.backbones()[0]["slot_tiers"]["inference-0"]  # what `vlamux backbones` shows
        assert tiers["resident"]["count"] + tiers["parked"]["count"] == 5, tiers
        for c, _ in clients:
            c.close()
        admin.close()


def test_a_stored_slot_read_back_does_not_hold_up_resident_tenants(backbone, monkeypatch):
    """While a stored slot is read back (held here until the resident tenants have been served 20
    times), their groups go on; then the stored tenant is answered as an unpaged replica answers."""
    import threading

    from vlamux.services import slot_tiers

    trainer = trained(backbone, 4)
    one = serving_bytes(trainer)
    paged = replica(backbone, trainer, SlotBudget(resident_bytes=3 * one, parked_bytes=1))
    free = replica(backbone, trainer)
    gate, read = threading.Event(), slot_tiers.unspool
    monkeypatch.setattr(slot_tiers, "unspool", lambda path, digest: gate.wait(60) and read(path, digest))
    try:
        g = torch.Generator().manual_seed(5)
        obs = {t: make_batch(PROFILE, 1, g)[0] for t in trainer.slots}
        for t in ("t00", "t01", "t02"):
            paged.predict(t, obs[t]).result(60)
            free.predict(t, obs[t]).result(60)
        # t03 came when three slots filled the budget: it went straight to host memory, then (past the
        # host budget) to disk, and the others were not moved for it
        assert paged.metrics()["slots"]["stored"]["count"] == 1 and paged.metrics()["slots"]["moves"]["park"] == 0
        cold = paged.predict("t03", obs["t03"])
        for _ in range(10):
            for t in ("t01", "t02"):
                a, b = paged.predict(t, obs[t]).result(60), free.predict(t, obs[t]).result(60)
                assert torch.allclose(a["actions"], b["actions"], atol=1e-5)
        assert not cold.done()
        gate.set()
        a, b = cold.result(60), free.predict("t03", obs["t03"]).result(60)
        assert torch.allclose(a["actions"], b["actions"], atol=1e-5)
        assert paged.metrics()["slots"]["moves"]["read"] >= 1
    finally:
        gate.set()
        paged.stop()
        free.stop()


def test_a_failed_move_leaves_the_slot_where_it_was_and_a_retired_one_is_answered_at_once(backbone, monkeypatch):
    """A full disk while storing: the slot stays parked and is served (the store is tried again later);
    a tenant retired while its slot is parked: its waiting request is answered at once, not at its deadline."""
    from vlamux.errors import UnknownTenantError
    from vlamux.services import slot_tiers
    from vlamux.services.control import Retired

    trainer = trained(backbone, 3)
    one = serving_bytes(trainer)
    free = replica(backbone, trainer)

    def full_disk(parked, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(slot_tiers, "spool", full_disk)
    paged = replica(backbone, trainer, SlotBudget(resident_bytes=one, parked_bytes=1))
    try:
        g = torch.Generator().manual_seed(6)
        obs = {t: make_batch(PROFILE, 1, g)[0] for t in trainer.slots}
        for t in sorted(trainer.slots):
            a, b = paged.predict(t, obs[t]).result(60), free.predict(t, obs[t]).result(60)
            assert torch.allclose(a["actions"], b["actions"], atol=1e-5), t
        slots = paged.metrics()["slots"]
        assert slots["stored"]["count"] == 0 and slots["resident"]["count"] + slots["parked"]["count"] == 3
        parked = next(t for t in sorted(trainer.slots) if t not in paged.runner.slots)
        waiting = paged.predict(parked, obs[parked])
        paged.stage_policy(Retired(parked))
        try:  # served if its slot came back before the retirement landed, else refused: never left to wait
            waiting.result(5)
        except UnknownTenantError:
            pass
        assert not paged.serves(parked)
    finally:
        paged.stop()
        free.stop()


def test_a_parked_slot_comes_up_while_a_group_runs(backbone):
    """The mover brings a parked slot up while the engine is inside a group (held here): a request for
    it waits for its copy, not for the group running; both are then answered as an unpaged replica."""
    import threading

    from conftest import wait_until

    trainer = trained(backbone, 4)
    one = serving_bytes(trainer)
    paged = replica(backbone, trainer, SlotBudget(resident_bytes=2 * one))
    free = replica(backbone, trainer)
    entered, gate, execute = threading.Event(), threading.Event(), paged.runner.execute

    def held(requests, grouped=True):
        if any(r.tenant == "t00" for r in requests):
            entered.set()
            gate.wait(60)
        return execute(requests, grouped)

    try:
        g = torch.Generator().manual_seed(7)
        obs = {t: make_batch(PROFILE, 1, g)[0] for t in trainer.slots}
        for t in ("t00", "t01"):  # both replicas draw from each tenant's RNG alike
            paged.predict(t, obs[t]).result(60)
            free.predict(t, obs[t]).result(60)
        parked = sorted(t for t in trainer.slots if not paged.tiers.resident(t))
        assert parked == ["t02", "t03"], parked
        paged.runner.execute = held
        hot = paged.predict("t00", obs["t00"])
        assert entered.wait(30)
        cold = paged.predict("t02", obs["t02"])
        wait_until(lambda: paged.tiers.resident("t02"), 30, "t02's slot to come up while t00's group is held")
        assert not hot.done() and not cold.done()
        assert paged.tiers.resident("t00")  # a running group's slot is not taken down to make room
        gate.set()
        for t, fut in (("t00", hot), ("t02", cold)):
            a, b = fut.result(60), free.predict(t, obs[t]).result(60)
            assert torch.allclose(a["actions"], b["actions"], atol=1e-5), t
        assert paged.metrics()["slots"]["load_wait_s"]["n"] >= 1
    finally:
        gate.set()
        paged.stop()
        free.stop()
