"""Slots: checkpoints that resume bit-identically, policy versions, atomic saves, statistics, accumulation."""

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import TENANTS, same_bytes, snapshot
from vlamux.errors import CorruptCheckpointError, IncompatibleError, InvalidInputError
from vlamux.model import ForwardBackward, HeadSpec, ModelRunner, NormStats, OptimizerSpec, Sample, Slot, canonicalize
from vlamux.model.synthetic import make_batch
from vlamux.utils.io import atomic_save_safetensors

def batches(tenant, n=10, rows=2):
    profile = TENANTS[tenant][1]
    return [make_batch(profile, rows, torch.Generator().manual_seed(1000 + i)) for i in range(n)]


def train(runner, tenant, data) -> list[float]:
    losses = []
    for obs, actions in data:
        losses.append(runner.execute([ForwardBackward(tenant, obs, actions)])[0].unwrap()["loss"])
        runner.optim_step(tenant).unwrap()
    return losses


def runner_with(backbone, tenant, seed):
    runner = ModelRunner(backbone)
    runner.create_slot(tenant, TENANTS[tenant][0], OptimizerSpec(lr=1e-3), seed=seed)
    return runner


# ---- resume ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("tenant", ["bolt", "cobalt"])  # flow (draws from the slot RNG) and gaussian
def test_resume_is_bit_identical(backbone, tmp_path, tenant):
    data = batches(tenant)
    a = runner_with(backbone, tenant, seed=1)
    train(a, tenant, data[:5])
    path = tmp_path / f"{tenant}.safetensors"
    a.slot(tenant).save(path)
    saved = snapshot(a.slot(tenant))
    expected = train(a, tenant, data[5:])
    final = [p.detach().clone() for p in a.slot(tenant).head.parameters()]
    assert a.slot(tenant).version == 10

    b = runner_with(backbone, tenant, seed=2)  # a different seed: everything must come from the file
    assert not same_bytes(saved, snapshot(b.slot(tenant)))
    b.slot(tenant).load_state(path)
    assert b.slot(tenant).version == 5
    assert same_bytes(saved, snapshot(b.slot(tenant)))
    assert train(b, tenant, data[5:]) == expected
    assert all(torch.equal(p, q) for p, q in zip(b.slot(tenant).head.parameters(), final))
    assert b.slot(tenant).version == 10

    c = ModelRunner(backbone)
    c.add_slot(Slot.from_file(path, backbone.meta))
    assert c.slot(tenant).version == 5 and c.slot(tenant).seed == 1
    assert c.slot(tenant).optim_spec == a.slot(tenant).optim_spec
    assert train(c, tenant, data[5:]) == expected
    assert all(torch.equal(p, q) for p, q in zip(c.slot(tenant).head.parameters(), final))


def test_resume_restores_sampling_rng(backbone, tmp_path):
    a = runner_with(backbone, "bolt", seed=1)
    obs, _ = batches("bolt", n=1)[0]
    a.execute([Sample("bolt", obs)])  # advance the RNG past its seed
    path = tmp_path / "bolt.safetensors"
    a.slot("bolt").save(path)
    expected = a.execute([Sample("bolt", obs)])[0].unwrap()
    b = runner_with(backbone, "bolt", seed=9)
    b.slot("bolt").load_state(path)
    got = b.execute([Sample("bolt", obs)])[0].unwrap()
    assert torch.equal(got["actions"], expected["actions"]) and got["policy_version"] == expected["policy_version"]


# ---- refusing foreign files -----------------------------------------------------------------------

def test_load_refuses_other_tenant_head_or_format(backbone, tmp_path):
    spec = TENANTS["acme"][0]
    mine = Slot("acme", spec, backbone.meta)
    theirs = Slot("zed", spec, backbone.meta)
    path = tmp_path / "zed.safetensors"
    theirs.save(path)
    before = snapshot(mine)
    with pytest.raises(IncompatibleError) as e:
        mine.load_state(path)
    assert "'zed'" in str(e.value) and "'acme'" in str(e.value)

    other_head = Slot("acme", HeadSpec("l1_chunk", spec.action_dim, spec.horizon, spec.state_dim, width=64),
                      backbone.meta)
    path2 = tmp_path / "acme-w64.safetensors"
    other_head.save(path2)
    with pytest.raises(IncompatibleError, match="head spec"):
        mine.load_state(path2)

    path3 = tmp_path / "plain.safetensors"
    save_file({"head.out.weight": torch.zeros(2, 2)}, str(path3), metadata={"tenant": "acme"})
    with pytest.raises(IncompatibleError, match="not a vlamux slot file"):
        mine.load_state(path3)
    with pytest.raises(FileNotFoundError):
        mine.load_state(tmp_path / "missing.safetensors")
    assert same_bytes(before, snapshot(mine))  # refused loads change nothing


def _poison(path, tensor: str, value: float) -> None:
    """Overwrite the bytes of one float32 tensor in a safetensors file in place, as damage would."""
    import json
    import struct

    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    start, end = header[tensor]["data_offsets"]
    assert header[tensor]["dtype"] == "F32"
    raw[8 + n + start:8 + n + end] = struct.pack("<f", value) * ((end - start) // 4)
    path.write_bytes(bytes(raw))


def test_damaged_checkpoints_are_refused_before_anything_changes(backbone, tmp_path):
    """A checkpoint whose bytes changed since it was saved (NaN written into a weight, or any other
    value), that is truncated, or that holds NaN although it hashes right, is refused with an error
    that says which; the slot keeps its state."""
    spec = TENANTS["acme"][0]
    slot = Slot("acme", spec, backbone.meta)
    good = tmp_path / "good.safetensors"
    slot.save(good)
    weight = next(k for k in slot.state_tensors()[0] if k.startswith("head.") and k.endswith("weight"))
    before = snapshot(slot)

    nan = tmp_path / "nan.safetensors"
    nan.write_bytes(good.read_bytes())
    _poison(nan, weight, float("nan"))
    with pytest.raises(CorruptCheckpointError, match="sha256"):
        slot.load_state(nan)
    changed = tmp_path / "changed.safetensors"
    changed.write_bytes(good.read_bytes())
    _poison(changed, weight, 0.5)  # finite, but not what was saved
    with pytest.raises(CorruptCheckpointError, match="sha256"):
        slot.load_state(changed)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        slot.load_state(cut)

    # written non-finite (a diverged run saved by an earlier version, with no digest): still refused
    tensors, meta = slot.state_tensors()
    tensors[weight] = torch.full_like(tensors[weight], float("inf"))
    legacy = tmp_path / "legacy.safetensors"
    save_file(tensors, str(legacy), metadata=meta)
    with pytest.raises(CorruptCheckpointError, match=f"{weight!r} holds NaN or infinite"):
        slot.load_state(legacy)
    assert same_bytes(before, snapshot(slot))
    slot.load_state(good)  # the undamaged file still loads
    assert same_bytes(before, snapshot(slot))


# ---- versions and step preconditions --------------------------------------------------------------

def test_version_and_step_preconditions(backbone, tmp_path):
    runner = runner_with(backbone, "acme", seed=0)
    slot = runner.slot("acme")
    data = batches("acme", n=3)
    assert slot.version == 0
    with pytest.raises(InvalidInputError, match="optim_step"):
        slot.optim_step()
    res = runner.optim_step("acme")
    assert isinstance(res.error, InvalidInputError) and "acme" in str(res.error)
    for i, (obs, actions) in enumerate(data):
        runner.execute([ForwardBackward("acme", obs, actions)])[0].unwrap()
        assert slot.version == i and slot.accumulated == 1
        assert runner.execute([Sample("acme", obs, True)])[0].unwrap()["policy_version"] == i
        assert slot.optim_step()["policy_version"] == i + 1
        assert slot.version == i + 1 and slot.accumulated == 0
    with pytest.raises(InvalidInputError):
        slot.optim_step()
    runner.execute([ForwardBackward("acme", *data[0])])[0].unwrap()
    with pytest.raises(InvalidInputError, match="un-stepped"):
        slot.save(tmp_path / "acme.safetensors")
    assert list(tmp_path.iterdir()) == []


# ---- atomic save ----------------------------------------------------------------------------------

def test_save_is_atomic_and_self_contained(backbone, tmp_path):
    runner = ModelRunner(backbone)
    for name in ("acme", "cobalt"):
        runner.create_slot(name, TENANTS[name][0])
    train(runner, "acme", batches("acme", n=2))
    path = tmp_path / "ckpt" / "acme.safetensors"
    runner.slot("acme").save(path)
    runner.slot("acme").save(path)  # overwriting is fine too
    assert os.listdir(path.parent) == ["acme.safetensors"]  # no temp files left behind
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        keys = set(f.keys())
        assert meta["format"] == "vlamux.slot/1"
        assert meta["tenant"] == "acme"
        assert meta["backbone_id"] == backbone.backbone_id
        assert HeadSpec.from_json(meta["head_spec"]) == TENANTS["acme"][0]
        assert int(f.get_tensor("version")[0]) == 2
    assert all(k.split(".")[0] in {"head", "optim", "stats", "rng", "version"} for k in keys)
    own = {f"head.{k}" for k in runner.slot("acme").head.state_dict()}
    assert own <= keys
    other = {f"head.{k}" for k in runner.slot("cobalt").head.state_dict()} - own
    assert other and not (other & keys)  # nothing of the other tenant


def test_atomic_writer_cleans_up_on_failure(tmp_path):
    path = tmp_path / "x.safetensors"
    atomic_save_safetensors({"a": torch.ones(3)}, path, {"format": "old"})
    with pytest.raises(Exception):
        atomic_save_safetensors({"a": torch.ones(4, 4).t()}, path, {"format": "new"})  # non-contiguous: refused
    assert os.listdir(tmp_path) == ["x.safetensors"]
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["format"] == "old"  # the old file is intact


# ---- statistics -----------------------------------------------------------------------------------

def test_set_stats_rejects_wrong_dimensions(backbone):
    spec = TENANTS["acme"][0]  # action_dim 4, state_dim 4
    slot = Slot("acme", spec, backbone.meta)
    with pytest.raises(InvalidInputError, match="action"):
        slot.set_stats(action=NormStats.identity(spec.action_dim + 1, "mean_std"))
    with pytest.raises(InvalidInputError, match="state"):
        slot.set_stats(state=NormStats.identity(spec.state_dim - 1, "mean_std"))
    assert torch.equal(slot.stats["action"].mean, torch.zeros(spec.action_dim))  # left as it was
    assert torch.equal(slot.stats["state"].std, torch.ones(spec.state_dim))


def _features(backbone, obs):
    with torch.no_grad():
        return backbone(canonicalize(obs, backbone.schema, backbone.tokenizer))


def test_stats_apply_to_sample_and_loss(backbone):
    spec = TENANTS["acme"][0]  # l1_chunk: mean_std actions
    obs, actions = batches("acme", n=1, rows=3)[0]
    f = _features(backbone, obs)
    mean = torch.tensor([100.0, -50.0, 3.0, 0.0])
    std = torch.tensor([2.0, 0.5, 1.0, 10.0])
    stats = NormStats(mean, std, mean - 3 * std, mean + 3 * std, "mean_std")
    raw = actions * std + mean  # the tenant's units

    plain = Slot("acme", spec, backbone.meta, seed=4)
    scaled = Slot("acme", spec, backbone.meta, seed=4)
    scaled.set_stats(action=stats)
    a0 = plain.sample(f, obs.state, deterministic=True)["actions"]
    a1 = scaled.sample(f, obs.state, deterministic=True)["actions"]
    assert torch.allclose(a1, a0 * std + mean, atol=1e-4)
    assert (a1.mean((0, 1)) - mean).abs().max() < 3 * std.max()  # around the tenant's mean, not around 0

    loss_raw = scaled.forward_backward(f, obs.state, raw)["loss"]
    loss_pre = plain.forward_backward(f, obs.state, (raw - mean) / std)["loss"]
    assert abs(loss_raw - loss_pre) <= 1e-5
    for p, q in zip(scaled.head.parameters(), plain.head.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad, atol=1e-5)


def test_state_stats_normalise_state(backbone):
    spec = TENANTS["acme"][0]
    obs, actions = batches("acme", n=1, rows=3)[0]
    f = _features(backbone, obs)
    mean, std = torch.tensor([5.0, -5.0, 1.0, 2.0]), torch.tensor([3.0, 0.25, 1.0, 4.0])
    with_stats = Slot("acme", spec, backbone.meta, seed=4)
    with_stats.set_stats(state=NormStats(mean, std, mean - std, mean + std, "mean_std"))
    plain = Slot("acme", spec, backbone.meta, seed=4)
    shifted = obs.state * std + mean
    a = with_stats.sample(f, shifted, deterministic=True)["actions"]
    b = plain.sample(f, obs.state, deterministic=True)["actions"]
    assert torch.allclose(a, b, atol=1e-5)


def test_bins_stats_use_min_max_and_stay_in_range(backbone):
    spec = TENANTS["delta"][0]  # bins
    obs, actions = batches("delta", n=1, rows=3)[0]
    f = _features(backbone, obs)
    raw = actions * 7.0 + 20.0
    slot = Slot("delta", spec, backbone.meta)
    stats = NormStats.from_data(raw, "mean_std")
    slot.set_stats(action=stats)
    assert slot.stats["action"].mode == "min_max"  # the head's own mode wins over the data's
    out = slot.sample(f, obs.state)["actions"]
    assert (out >= stats.min - 1e-4).all() and (out <= stats.max + 1e-4).all()
    identity = Slot("delta", spec, backbone.meta)
    identity.set_stats(action=NormStats.identity(spec.action_dim))
    assert identity.stats["action"].mode == "identity"


# ---- gradient accumulation ------------------------------------------------------------------------

@pytest.mark.parametrize("tenant", ["acme", "cobalt"])
def test_gradient_accumulation_sums(backbone, tenant):
    spec = TENANTS[tenant][0]
    (o1, a1), (o2, a2) = batches(tenant, n=2, rows=2)
    f1, f2 = _features(backbone, o1), _features(backbone, o2)
    both, first, second = (Slot(tenant, spec, backbone.meta, seed=3) for _ in range(3))
    both.forward_backward(f1, o1.state, a1)
    both.forward_backward(f2, o2.state, a2)
    first.forward_backward(f1, o1.state, a1)
    second.forward_backward(f2, o2.state, a2)
    assert both.accumulated == 2 and both.version == 0
    n = 0
    for p, q, r in zip(both.head.parameters(), first.head.parameters(), second.head.parameters()):
        if p.grad is None:
            assert q.grad is None and r.grad is None
            continue
        n += 1
        assert torch.allclose(p.grad, q.grad + r.grad, atol=1e-6)
    assert n > 0
    both.optim_step()
    assert both.version == 1 and all(p.grad is None for p in both.head.parameters())


def test_a_step_on_strided_gradients_equals_the_step_on_dense_ones(backbone):
    """A tenant's slice of a stacked gradient may be strided (a batched matmul's layout); its step must
    be the dense gradient's (torch's fused AdamW reads a strided one as if it were dense)."""
    spec = TENANTS["cobalt"][0]
    dense, strided = Slot("cobalt", spec, backbone.meta, seed=3), Slot("cobalt", spec, backbone.meta, seed=3)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=g) for p in dense.params]
    views = [torch.empty_strided(x.shape, (1, x.shape[0])).copy_(x) if x.dim() == 2 and x.shape[0] > 1 else x.clone()
             for x in grads]  # the values, column-major
    assert any(not v.is_contiguous() for v in views)
    for slot, gs in ((dense, grads), (strided, views)):  # (each slot's step scales its own gradients)
        pending = Slot.pending(torch.tensor(1.0), {}, {}, list(gs), slot.generator.get_state())
        slot.settle(pending, True, {"loss": 1.0})
        slot.optim_step()
    # (the norms for clipping may differ in the last bit: a strided reduction sums in another order)
    assert max((p - q).abs().max().item() for p, q in zip(dense.params, strided.params)) <= 1e-7


def test_load_state_is_all_or_nothing(backbone, tmp_path):
    runner = runner_with(backbone, "bolt", seed=3)
    slot = runner.slot("bolt")
    path = tmp_path / "bolt.safetensors"
    slot.save(path)
    tensors, meta = slot.state_tensors()
    tensors["rng"] = torch.zeros(16, dtype=torch.uint8)  # a CUDA generator's state: cannot load on CPU
    atomic_save_safetensors(tensors, tmp_path / "broken.safetensors", meta)
    with torch.no_grad():
        next(slot.head.parameters()).add_(1.0)
    before = snapshot(slot)
    with pytest.raises(IncompatibleError, match="unchanged"):
        slot.load_state(tmp_path / "broken.safetensors")
    assert same_bytes(before, snapshot(slot))
    meta = dict(meta, rng_device="cuda")
    atomic_save_safetensors(slot.state_tensors()[0], tmp_path / "gpu.safetensors", meta)
    with pytest.raises(IncompatibleError, match="cuda"):
        slot.load_state(tmp_path / "gpu.safetensors")


def test_load_state_restores_the_optimizer_spec(backbone, tmp_path):
    a = Slot("t", TENANTS["acme"][0], backbone.meta, OptimizerSpec(lr=1e-3, grad_clip=0.5))
    a.save(tmp_path / "t.safetensors")
    b = Slot("t", TENANTS["acme"][0], backbone.meta, OptimizerSpec(lr=5e-2, grad_clip=None))
    b.load_state(tmp_path / "t.safetensors")
    assert b.optim_spec.grad_clip == 0.5 and b.optim_spec.lr == 1e-3
    assert b.optimizer.param_groups[0]["lr"] == 1e-3


def test_set_stats_checks_both_before_installing_either(backbone):
    slot = Slot("t", TENANTS["acme"][0], backbone.meta)
    before = {k: v.mean.clone() for k, v in slot.stats.items()}
    good = NormStats.from_data(torch.randn(10, 4) + 3, "mean_std")
    with pytest.raises(InvalidInputError, match="state"):
        slot.set_stats(action=good, state=NormStats.identity(7))
    assert all(torch.equal(before[k], slot.stats[k].mean) for k in before)
    slot.set_stats(action=good)
    assert slot.stats["action"].mean.data_ptr() != good.mean.data_ptr()  # a private copy


def test_all_padding_action_mask_is_refused(backbone):
    runner = runner_with(backbone, "acme", seed=0)
    obs, actions = batches("acme", n=1)[0]
    res = runner.execute([ForwardBackward("acme", obs, actions, torch.zeros(2, 8, dtype=torch.bool))])[0]
    assert isinstance(res.error, InvalidInputError) and "no valid step" in str(res.error)
