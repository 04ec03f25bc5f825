"""Slots below resident (vlamux/model/parking.py): a slot parked to the host or stored on disk and
brought back continues bit for bit, beside tenants that never moved."""

import pytest
import torch

from conftest import TENANTS, same_bytes, snapshot
from vlamux.errors import CorruptCheckpointError, InvalidInputError
from vlamux.model import ForwardBackward, HeadSpec, ModelRunner, OptimizerSpec, Sample
from vlamux.model.parking import park, read_stored, spool, store, unpark, unspool
from vlamux.model.synthetic import make_batch
from vlamux.model.slot_file import read_slot_file

# a flow head (its loss draws from the tenant's RNG), a bins head and a Gaussian head with an adapter on
# the built-in backbone; query tokens (alone and with an adapter) on a VLM's: each moves its own parts
# (the adapter's matrices and their moments, the query vectors)
MOVED = {"bolt": TENANTS["bolt"], "delta": TENANTS["delta"],
         "lora": (HeadSpec("gaussian", 4, 8, 4, width=32, depth=1, adapter={"rank": 4}), TENANTS["cobalt"][1])}
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
MOVED_ON_A_VLM = {
    "queries": (HeadSpec("l1_chunk", 4, 8, 4, width=32, depth=1, query_tokens=2), TENANTS["acme"][1]),
    "both": (HeadSpec("gaussian", 4, 8, 4, width=32, depth=1, query_tokens=2, adapter=LORA), TENANTS["cobalt"][1]),
    "plain": (HeadSpec("bins", 5, 4, 2, width=32, options={"n_bins": 16}), TENANTS["delta"][1]),
}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A random-weight Qwen2.5-VL directory in the hub's layout, built as a backbone."""
    pytest.importorskip("transformers")
    from vlamux.model import BackboneSpec, build_backbone
    from vlamux.model.backbones.hf.random_init import write_random_model

    path = write_random_model("qwen2_5_vl", "tiny", tmp_path_factory.mktemp("qwen") / "model")
    return build_backbone(BackboneSpec(kind="hf", path=str(path), image_size=56))


def runner(backbone, fuse_heads, tenants=MOVED):
    r = ModelRunner(backbone, fuse_heads=fuse_heads)
    for i, (name, (spec, _)) in enumerate(tenants.items()):
        r.create_slot(name, spec, OptimizerSpec(lr=1e-3), seed=100 + i)
    return r


def move(r: ModelRunner, tenant: str, path=None, spooled: bool = False) -> None:
    """Out of the runner and back: parked, or (with `path`) stored and read back (spooled: as a
    service's spool does it)."""
    parked = park(r.remove_slot(tenant))
    if path is not None and spooled:
        parked = unspool(path, spool(parked, path))
    elif path is not None:
        store(parked, path)
        parked = read_stored(path)
    backbone = r.backbones[parked.backbone_id]
    r.add_slot(unpark(parked, backbone.meta, backbone.device, **r.adapter_targets(parked.backbone_id)))


@pytest.mark.parametrize("on,fuse_heads", [("builtin", True), ("vlm", False)])
def test_parked_and_stored_slots_continue_bit_identically(request, tmp_path, on, fuse_heads):
    """50 steps of every tenant on two runners; on one, at each step a tenant is parked between its
    forward_backward and its step (gradients held), another parked after its step, a third stored and
    read back: losses, sampled actions (from each tenant's RNG), parameters, optimizer state, RNG and
    version stay byte-equal to the other runner's."""
    backbone, tenants = (request.getfixturevalue("backbone"), MOVED) if on == "builtin" else \
        (request.getfixturevalue("vlm"), MOVED_ON_A_VLM)
    still, moved = runner(backbone, fuse_heads, tenants), runner(backbone, fuse_heads, tenants)
    first = next(iter(tenants))  # a learning rate changed since creation moves with the slot
    moved.slot(first).optimizer.param_groups[0]["lr"] = still.slot(first).optimizer.param_groups[0]["lr"] = 3e-3
    names, g = list(tenants), torch.Generator().manual_seed(0)
    for step in range(50):
        data = {t: make_batch(profile, 1, g) for t, (_, profile) in tenants.items()}
        fb = [ForwardBackward(t, obs, act) for t, (obs, act) in data.items()]
        out_still, out_moved = still.execute(fb), moved.execute(fb)
        for a, b in zip(out_still, out_moved):
            assert a.unwrap()["loss"] == b.unwrap()["loss"], (step, a.tenant)
        with_grads, parked, stored = (names[(step + k) % len(names)] for k in range(3))
        move(moved, with_grads)
        for t in names:
            assert still.optim_step(t).unwrap()["policy_version"] == moved.optim_step(t).unwrap()["policy_version"]
        move(moved, parked)
        move(moved, stored, tmp_path / f"{stored}.safetensors", spooled=step % 2 == 1)
        if step % 10 == 9:
            samples = [Sample(t, obs) for t, (obs, _) in data.items()]
            for a, b in zip(still.execute(samples), moved.execute(samples)):
                assert torch.equal(a.unwrap()["actions"], b.unwrap()["actions"]), (step, a.tenant)
    for t in tenants:
        a, b = still.slot(t), moved.slot(t)
        assert same_bytes(snapshot(a), snapshot(b)), t  # module, optimizer moments and step, stats, rng, version
        assert torch.equal(a.generator.get_state(), b.generator.get_state()) and a.version == b.version == 50
        assert a.optimizer.param_groups[0]["lr"] == b.optimizer.param_groups[0]["lr"]


def test_a_parked_slot_keeps_its_accumulated_gradients_and_their_norm(backbone):
    r = runner(backbone, False)
    obs, act = make_batch(MOVED["lora"][1], 3, torch.Generator().manual_seed(1))
    r.execute([ForwardBackward("lora", obs, act)])
    parked = park(r.slot("lora"))
    assert parked.holds_gradients and parked.nbytes().grads > 0
    grads = [None if p.grad is None else p.grad.clone() for p in r.slot("lora").params]
    assert any(g is not None for g in grads)
    r.execute([ForwardBackward("lora", obs, act)])  # the slot goes on; the parked copy does not
    again = unpark(parked, backbone.meta, **r.adapter_targets(parked.backbone_id))
    assert again.accumulated == 1 and again._grad_norm is not None
    assert all((p.grad is None and g is None) or torch.equal(p.grad, g) for p, g in zip(again.params, grads))
    with pytest.raises(InvalidInputError, match="un-stepped gradients"):
        store(parked, "/nonexistent/never-written.safetensors")
    with pytest.raises(InvalidInputError, match="un-stepped gradients"):
        spool(parked, "/nonexistent/never-written.safetensors")


def test_a_spooled_slot_whose_bytes_changed_is_refused(backbone, tmp_path):
    r = runner(backbone, False)
    path = tmp_path / "spooled.safetensors"
    digest = spool(park(r.slot("lora")), path)
    assert read_stored(path).tenant == "lora"  # a spooled slot is a slot file too
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # one bit of the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="not those written"):
        unspool(path, digest)


def test_parked_bytes_are_the_slots_parts(backbone, tmp_path):
    r = runner(backbone, False)
    obs, act = make_batch(MOVED["lora"][1], 2, torch.Generator().manual_seed(2))
    r.execute([ForwardBackward("lora", obs, act)])
    r.optim_step("lora").unwrap()
    slot = r.slot("lora")
    parked = park(slot)
    size = parked.nbytes()
    memory = slot.memory_bytes()
    buffers = sum(b.numel() * b.element_size() for m in (slot.head, slot.adapter) for b in m.buffers())
    assert size.params == memory["head"] + memory["adapter"] + buffers
    assert size.optimizer >= memory["optimizer"] > 0 and size.grads == 0 and size.stats > 0
    store(parked, tmp_path / "lora.safetensors")
    tensors, meta = read_slot_file(tmp_path / "lora.safetensors")  # a stored slot is a checkpoint
    assert meta["tenant"] == "lora" and "accumulated" not in meta and int(tensors["version"][0]) == 1


def test_a_slot_unparks_only_onto_its_backbone(backbone):
    from vlamux.model import BackboneSpec, build_backbone

    other = build_backbone(BackboneSpec(preset="tiny", seed=1))
    parked = park(runner(backbone, False).slot("delta"))
    if other.backbone_id == backbone.backbone_id:
        pytest.skip("the two tiny backbones share an id")
    with pytest.raises(InvalidInputError, match="parked from backbone"):
        unpark(parked, other.meta)


def test_a_replicas_serving_copy_has_no_optimizer_and_parks_as_one(backbone):
    """An inference replica's slot (made from a policy snapshot) holds the module and statistics only:
    no optimizer, a forward_backward on it refused; parked, it is its parameters and statistics, and it
    comes back a serving copy whose samples (its RNG included) are a never-parked replica's."""
    trainer = runner(backbone, False)
    moved, still = ModelRunner(backbone), ModelRunner(backbone)
    for r in (moved, still):
        r.apply_policy(trainer.slot("bolt").export_policy())
    served = moved.slot("bolt")
    assert served.optimizer is None and served.memory_bytes()["optimizer"] == 0
    obs, act = make_batch(MOVED["bolt"][1], 2, torch.Generator().manual_seed(3))
    with pytest.raises(InvalidInputError, match="serving copy"):
        moved.execute([ForwardBackward("bolt", obs, act)])[0].unwrap()
    for r in (moved, still):  # the flow head draws its starting noise from the slot's RNG
        r.execute([Sample("bolt", obs)])
    parked = park(served)
    assert parked.nbytes().optimizer == 0 and parked.nbytes().params == sum(
        v.numel() * v.element_size() for v in served.module_state().values())
    moved.remove_slot("bolt")
    moved.add_slot(unpark(parked, backbone.meta))
    assert moved.slot("bolt").optimizer is None
    for _ in range(2):
        a, b = (r.execute([Sample("bolt", obs)])[0].unwrap() for r in (moved, still))
        assert torch.equal(a["actions"], b["actions"]) and a["policy_version"] == b["policy_version"]


def test_a_parked_serving_slot_comes_back_the_same_into_another_tenants_shell(backbone):
    """unpark(shell=): the state lands in a slot object another tenant left (no head built anew), and
    samples exactly as the slot built afresh; a shell of another kind is refused."""
    from vlamux.model.parking import shell_key

    spec = MOVED["lora"][0]
    train = runner(backbone, False)
    serve = ModelRunner(backbone, fuse_heads=False)
    for t in ("lora", "bolt"):
        serve.apply_policy(train.slot(t).export_policy())
    serve.create_slot("other", spec, seed=9)  # a trainable slot: not a serving shell
    parked = park(serve.slot("lora"))
    kw = serve.adapter_targets(parked.backbone_id)
    fresh = unpark(park(serve.slot("lora")), backbone.meta, **kw)
    shell = ModelRunner(backbone).apply_policy(train.slot("lora").export_policy())  # any serving slot of that kind
    shell.tenant = "somebody-else"
    assert shell_key(shell.head_spec.to_json(), shell.backbone_id, False) == \
        shell_key(spec.to_json(), parked.backbone_id, False)
    with pytest.raises(ValueError, match="another kind"):
        unpark(park(serve.slot("lora")), backbone.meta, shell=serve.slot("bolt"), **kw)
    with pytest.raises(ValueError, match="another kind"):
        unpark(park(serve.slot("lora")), backbone.meta, shell=serve.slot("other"), **kw)
    again = unpark(parked, backbone.meta, shell=shell, **kw)
    assert again is shell and again.tenant == "lora"
    assert same_bytes(snapshot(again), snapshot(fresh))
    obs, _ = make_batch(MOVED["lora"][1], 2, torch.Generator().manual_seed(3))
    a, b = ModelRunner(backbone, fuse_heads=False), ModelRunner(backbone, fuse_heads=False)
    a.add_slot(again), b.add_slot(fresh)
    assert torch.equal(a.execute([Sample("lora", obs)])[0].unwrap()["actions"],
                       b.execute([Sample("lora", obs)])[0].unwrap()["actions"])


def test_tenants_admitted_straight_to_host_memory_park_as_slots_built_afresh(backbone):
    """`SlotTiers.admit_parked` copies each new tenant's policy through one host slot of its kind: what
    it parks is byte for byte what a slot built for that tenant alone parks (module, statistics,
    version, RNG), tenant after tenant, with and without an adapter."""
    import dataclasses

    from vlamux.model import Slot
    from vlamux.services.pager import SlotBudget
    from vlamux.services.slot_tiers import SlotTiers

    train = runner(backbone, False)
    for name in ("bolt2", "lora2"):  # two tenants of each kind, trained apart: different weights and statistics
        spec = MOVED[name[:-1]][0]
        train.create_slot(name, spec, OptimizerSpec(lr=1e-3), seed=7 if "bolt" in name else 8)
    tiers = SlotTiers(ModelRunner(backbone), SlotBudget(resident_bytes=1))
    for t in ("bolt", "lora", "bolt2", "lora2"):
        snap = dataclasses.replace(train.slot(t).export_policy(), version=3)
        tiers.admit_parked(snap)
        fresh = Slot(t, snap.head_spec, backbone.meta, init=False, trainable=False,
                     **tiers.runner.adapter_targets(snap.backbone_id))
        fresh.apply_policy(snap.ready())
        want = park(fresh)
        got = tiers.parked[t]
        assert got.meta == want.meta and same_bytes(got.tensors, want.tensors), t
    assert len(tiers._registrars) == 2 and tiers.versions["lora2"] == 3
    tiers.close()
