"""Per-tenant LoRA adapters in mixed groups, on the built-in backbone and an hf one: grouping stays
invisible (outputs, gradients, 50-step trajectories), tenants stay isolated byte for byte, a NaN
stays in its tenant, adapters save and resume, travel to inference between groups, and speak PEFT."""

import pytest
import torch

from conftest import BF16_LOSS_REL, assert_losses_agree, same_bytes, snapshot, train_grouped_and_serial
from vlamux.errors import InvalidInputError, NonFiniteError
from vlamux.model import (BackboneSpec, ForwardBackward, HeadSpec, ModelRunner, OptimizerSpec, Sample, Slot,
                          build_backbone)
from vlamux.model.synthetic import TaskProfile, make_batch

TOL = 1e-5
PROFILES = {
    "t0": (TaskProfile({"top": (32, 32)}, 4, 6, 3, "reach the {color} block"), 2),
    "t1": (TaskProfile({"top": (48, 48), "wrist": (32, 32)}, 4, 6, 3, "please push the {color} cube away"), 3),
    "t2": (TaskProfile({"top": (32, 32)}, 4, 6, 3, "{color}"), 1),
    "t3": (TaskProfile({"top": (40, 40)}, 4, 6, 3, "grab the {color} one"), 2),
    "t4": (TaskProfile({"top": (32, 32)}, 4, 6, 3, "touch {color}"), 2),
}


def adapters_for(kind: str) -> dict:
    """Five tenants: three LoRAs of different ranks, targets and blocks, two without an adapter."""
    if kind == "builtin":
        return {"t0": {"rank": 4}, "t1": {"rank": 8, "target_modules": ["qkv", "mlp.0"], "layers": [1, 2]},
                "t2": None, "t3": {"rank": 2, "alpha": 4, "target_modules": ["proj", "mlp.2"]}, "t4": None}
    return {"t0": {"rank": 4}, "t1": {"rank": 8, "target_modules": ["q_proj", "v_proj"], "layers": [1]},
            "t2": None, "t3": {"rank": 2, "alpha": 4, "target_modules": ["down_proj", "o_proj"]}, "t4": None}


HEADS = {"t0": "gaussian", "t1": "l1_chunk", "t2": "gaussian", "t3": "bins", "t4": "flow"}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    pytest.importorskip("transformers")
    from vlamux.model.backbones.hf.random_init import write_random_model

    path = write_random_model("qwen2_5_vl", "tiny", tmp_path_factory.mktemp("lora") / "qwen")
    return path, build_backbone(BackboneSpec(kind="hf", path=str(path), image_size=56))


@pytest.fixture(scope="module", params=["builtin", "hf"])
def setup(request, backbone, qwen):
    return request.param, (backbone if request.param == "builtin" else qwen[1])


def head(t: str, adapter) -> HeadSpec:
    options = {"n_bins": 16} if HEADS[t] == "bins" else {"steps": 2} if HEADS[t] == "flow" else {}
    return HeadSpec(HEADS[t], 4, 6, 3, width=32, depth=1, options=options, adapter=adapter)


def runner(kind, bb, **kw) -> ModelRunner:
    r = ModelRunner(bb, **kw)
    for i, (t, a) in enumerate(adapters_for(kind).items()):
        r.create_slot(t, head(t, a), OptimizerSpec(lr=3e-3), seed=20 + i)
    return r


def data(seed: int, tenants=PROFILES):
    g = torch.Generator().manual_seed(seed)
    return {t: make_batch(p, b, g) for t, (p, b) in tenants.items()}


def close(a, b) -> bool:
    return (a - b).abs().max().item() <= TOL * max(1.0, b.abs().max().item())


def test_grouped_equals_serial_with_mixed_adapters_over_50_steps(setup):
    kind, bb = setup
    grouped, serial = runner(kind, bb), runner(kind, bb)
    losses = {t: ([], []) for t in PROFILES}
    for step in range(50):
        batch = data(step)
        reqs = [ForwardBackward(t, obs, act) for t, (obs, act) in batch.items()]
        for k, (r, g) in enumerate(((grouped, True), (serial, False))):
            for res in r.execute(reqs, grouped=g):
                losses[res.tenant][k].append(res.unwrap()["loss"])
        if step == 0:  # the first gradients, adapters' and heads', per tenant
            for t in PROFILES:
                for pg, ps in zip(grouped.slot(t).params, serial.slot(t).params):
                    assert (pg.grad is None) == (ps.grad is None)
                    if pg.grad is not None:
                        assert close(pg.grad, ps.grad), t
                if grouped.slot(t).adapter is not None:
                    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in grouped.slot(t).adapter.parameters())
        for r in (grouped, serial):
            for t in PROFILES:
                r.optim_step(t).unwrap()
    for t, (g, s) in losses.items():  # the first steps at TOL; Adam's 50 steps let fp32 rounding grow (the
        g, s = torch.tensor(g), torch.tensor(s)  # hf backbone's padded group: 1.04e-5 by step 50 on an EPYC)
        assert (g[:10] - s[:10]).abs().max() <= TOL * max(1.0, s.abs().max().item()), (t, (g - s).abs().max())
        assert (g - s).abs().max() <= 3 * TOL * max(1.0, s.abs().max().item()), (t, (g - s).abs().max())
    for t in ("t0", "t1", "t3"):  # the adapters learned something, each its own
        assert max(b.abs().max().item() for b in grouped.slot(t).adapter.B.values()) > 0
    obs = {t: b[0] for t, b in data(99).items()}
    a = grouped.execute([Sample(t, o, True) for t, o in obs.items()])
    b = serial.execute([Sample(t, o, True) for t, o in obs.items()], grouped=False)
    for x, y in zip(a, b):  # after 50 Adam steps fp32 rounding has grown (1.3e-5 with one torch thread), as in
        # tests/test_grouping.py's 50-step trajectories
        diff = (x.output["actions"] - y.output["actions"]).abs().max().item()
        assert diff <= 1e-4 * max(1.0, y.output["actions"].abs().max().item()), (x.tenant, diff)


def test_tenants_without_an_adapter_keep_their_no_grad_path(setup):
    kind, bb = setup
    r = runner(kind, bb)
    batch = data(1)
    alone = runner(kind, bb)
    plain = [ForwardBackward(t, *batch[t]) for t in ("t2", "t4")]
    reference = alone.execute(plain)
    before = dict(r.adapter_stats)
    mixed = r.execute([ForwardBackward(t, obs, act) for t, (obs, act) in batch.items()])
    by = {res.tenant: res for res in mixed}
    for ref in reference:  # same outputs as with no adapter tenant beside them, to the bit
        assert by[ref.tenant].unwrap()["loss"] == ref.unwrap()["loss"]
        assert by[ref.tenant].group_size == 2  # their backbone call was their own, without gradients
    assert by["t0"].group_size == 3
    assert r.adapter_stats["groups"] == before["groups"] + 1 and r.adapter_stats["last_activation_bytes"] > 0


def test_a_step_of_one_adapter_tenant_leaves_every_other_slot_byte_identical(setup):
    kind, bb = setup
    r = runner(kind, bb)
    batch = data(2)
    before = {t: snapshot(r.slot(t)) for t in PROFILES}
    reqs = [ForwardBackward("t1", *batch["t1"])] + [Sample(t, batch[t][0], True) for t in PROFILES if t != "t1"]
    assert all(res.ok for res in r.execute(reqs))
    r.optim_step("t1").unwrap()
    for t in PROFILES:
        if t == "t1":
            assert not same_bytes(before[t], snapshot(r.slot(t)))
        else:  # adapter, head, optimizer state, RNG, version
            assert same_bytes(before[t], snapshot(r.slot(t))), t
            assert r.slot(t).version == 0 and r.slot(t).accumulated == 0


def test_one_adapter_tenants_nan_fails_only_that_tenant(setup):
    kind, bb = setup
    r, ref = runner(kind, bb), runner(kind, bb)
    for x in (r, ref):
        with torch.no_grad():
            next(iter(x.slot("t3").adapter.A.values())).fill_(float("nan"))
            next(iter(x.slot("t3").adapter.B.values())).fill_(1.0)
    poisoned = snapshot(r.slot("t3"))
    batch = data(3)
    reqs = [ForwardBackward(t, obs, act) for t, (obs, act) in batch.items()]
    a, b = r.execute(reqs), ref.execute(reqs, grouped=False)
    by = {x.tenant: x for x in a}
    assert isinstance(by["t3"].error, NonFiniteError)
    assert same_bytes(poisoned, snapshot(r.slot("t3"))) and r.slot("t3").accumulated == 0
    for x, y in zip(a, b):
        if x.tenant != "t3":
            assert x.ok and abs(x.output["loss"] - y.output["loss"]) <= TOL
            for pg, ps in zip(r.slot(x.tenant).params, ref.slot(x.tenant).params):
                if pg.grad is not None:
                    assert torch.isfinite(pg.grad).all() and close(pg.grad, ps.grad)


def test_a_slot_with_an_adapter_saves_and_resumes_bit_identically(setup, tmp_path):
    kind, bb = setup
    r = runner(kind, bb)
    batch = data(4)
    for _ in range(2):
        r.execute([ForwardBackward("t0", *batch["t0"])])
        r.optim_step("t0").unwrap()
    r.slot("t0").save(tmp_path / "t0.safetensors")
    back = Slot.from_file(tmp_path / "t0.safetensors", bb.meta, **r.adapter_targets(bb.backbone_id))
    assert same_bytes(snapshot(r.slot("t0")), snapshot(back))
    other = ModelRunner(bb)
    other.add_slot(back)
    for runner_ in (r, other):
        runner_.execute([ForwardBackward("t0", *batch["t0"])])
        runner_.optim_step("t0").unwrap()
    assert same_bytes(snapshot(r.slot("t0")), snapshot(other.slot("t0")))  # one more step, the same bytes


def test_adapter_specs_are_checked_naming_the_field(backbone):
    r = ModelRunner(backbone)
    for bad, field in (({"rank": 0}, "adapter.rank"), ({"kind": "ia3"}, "adapter.kind"),
                       ({"rank": 4, "dropout": 0.1}, "adapter.dropout"), ({"rnk": 4}, "adapter.rnk")):
        with pytest.raises(InvalidInputError, match=field.replace(".", r"\.")):
            HeadSpec("gaussian", 4, 6, adapter=bad)
    with pytest.raises(InvalidInputError, match="target_modules.*q_proj"):
        r.create_slot("x", HeadSpec("gaussian", 4, 6, adapter={"target_modules": ["q_proj"]}))
    with pytest.raises(InvalidInputError, match="layers"):
        r.create_slot("y", HeadSpec("gaussian", 4, 6, adapter={"layers": [40]}))


def test_peft_round_trip_and_import(qwen, tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    from vlamux.errors import IncompatibleError
    from vlamux.model import adapters

    path, bb = qwen
    r = runner("hf", bb)
    batch = data(5)
    for _ in range(3):
        r.execute([ForwardBackward("t1", *batch["t1"])])
        r.optim_step("t1").unwrap()
    out = r.slot("t1").export_adapter(tmp_path / "peft", str(path))
    obs = batch["t1"][0]
    prepared = bb.prepare(obs)
    with torch.no_grad(), adapters.active(list(zip(bb.segments([prepared]), [r.slot("t1").adapter]))):
        mine = bb.forward_group([prepared])[0].hidden
    model = PeftModel.from_pretrained(Qwen2_5_VLForConditionalGeneration.from_pretrained(str(path)), str(out))
    with torch.no_grad():
        theirs = model.base_model.model.model(**bb.encode([prepared])).last_hidden_state
    assert (mine - theirs).abs().max() <= TOL
    with torch.no_grad():
        plain = bb.forward_group([prepared])[0].hidden
    assert (mine - plain).abs().max() > 1e-3  # the adapter does change the features
    fresh = ModelRunner(bb)
    slot = fresh.create_slot("t1", head("t1", adapters_for("hf")["t1"]), seed=20 + 1)
    slot.import_adapter(out)  # a PEFT directory as the tenant's starting adapter
    for k, v in r.slot("t1").adapter.state_dict().items():
        assert torch.equal(slot.adapter.state_dict()[k], v)
    assert slot.version == 1
    wrong = fresh.create_slot("t0", head("t0", adapters_for("hf")["t0"]))
    with pytest.raises(IncompatibleError, match="rank"):
        wrong.import_adapter(out)


def test_a_new_adapter_version_reaches_inference_between_groups():
    """Chunks asked for while an adapter tenant trains each come wholly from one version: recomputed
    with that version's published weights, they match exactly (a half-copied adapter would not)."""
    from conftest import chunks_while_training
    from vlamux.services.queues import InferenceQueueConfig
    from vlamux.services.runtime import EmbeddedRuntime, RuntimeConfig

    spec = head("t0", {"rank": 4})
    cfg = RuntimeConfig(backbone=BackboneSpec(preset="tiny"), device="cpu",
                        inference_queue=InferenceQueueConfig(batch_rows=4, max_wait_s=0.002))
    published = {}
    with EmbeddedRuntime(cfg) as rt:
        rt.publisher.subscribe("test", lambda snap: published.__setitem__(snap.version, snap))
        rt.create_slot("t0", spec, OptimizerSpec(lr=1e-2)).result(60)
        assert rt.publisher.flush(10)
        obs, act = data(6)["t0"]

        def train():
            rt.forward_backward("t0", obs, act).result(60)
            rt.optim_step("t0").result(60)

        chunks = chunks_while_training(lambda: rt.predict("t0", obs, deterministic=True).result(60), train, 5,
                                       lambda: rt.publisher.flush(10))
        reference = ModelRunner(rt.backbone)
        versions = sorted({c["policy_version"] for c in chunks})
        assert len(versions) >= 2  # it trained while being served
        for v in versions:
            if reference.slots:
                reference.remove_slot("t0")
            reference.apply_policy(published[v])
            want = reference.execute([Sample("t0", obs, True)])[0].unwrap()["actions"]
            for c in (c for c in chunks if c["policy_version"] == v):
                assert torch.equal(c["actions"], want), v


@pytest.mark.parametrize("shapes", ["equal", "padded"])
def test_both_paths_of_the_deltas_equal_serial(setup, monkeypatch, shapes):
    """Segments of one length and rank take the batched matmuls over views, others the in-place
    per-segment add; either way each tenant equals itself alone, in outputs and gradients, and a NaN
    adapter among them fails only its tenant."""
    from vlamux.model import adapters

    kind, bb = setup
    calls = []
    path = {"equal": "_uniform_group", "padded": "_segmented"}[shapes]
    real = getattr(adapters, path)
    monkeypatch.setattr(adapters, path, lambda *a: calls.append(1) or real(*a))
    same = {f"e{i}": (TaskProfile({"top": (32, 32)}, 4, 6, 3, "reach the block"), 2) for i in range(4)}
    if shapes == "padded":  # a longer instruction, more rows
        same["e3"] = (TaskProfile({"top": (32, 32)}, 4, 6, 3, "now please reach the {color} block"), 3)
    targets = {"builtin": ["qkv", "mlp.2"], "hf": ["q_proj", "down_proj"]}[kind]

    def build():
        r = ModelRunner(bb)
        for i, t in enumerate(same):
            spec = HeadSpec("gaussian", 4, 6, 3, width=32, depth=1,
                            adapter={"rank": 4, "alpha": 4.0 * (i + 1), "target_modules": targets})
            r.create_slot(t, spec, OptimizerSpec(lr=3e-3), seed=40 + i)
            with torch.no_grad():  # non-zero B: the deltas matter from the first step
                for b in r.slot(t).adapter.B.values():
                    b.normal_(0, 0.05, generator=torch.Generator().manual_seed(i))
        return r

    grouped, serial = build(), build()
    for r in (grouped, serial):
        with torch.no_grad():
            next(iter(r.slot("e2").adapter.A.values())).fill_(float("nan"))
    batch = data(7, same)
    reqs = [ForwardBackward(t, obs, act) for t, (obs, act) in batch.items()]
    a = grouped.execute(reqs)
    assert calls, f"{path} was not taken"
    b = serial.execute(reqs, grouped=False)
    for x, y in zip(a, b):
        if x.tenant == "e2":
            assert isinstance(x.error, NonFiniteError) and isinstance(y.error, NonFiniteError)
            continue
        assert abs(x.unwrap()["loss"] - y.unwrap()["loss"]) <= TOL * max(1.0, abs(y.output["loss"])), x.tenant
        for pg, ps in zip(grouped.slot(x.tenant).params, serial.slot(x.tenant).params):
            assert (pg.grad is None) == (ps.grad is None)
            if pg.grad is not None:
                assert torch.isfinite(pg.grad).all() and close(pg.grad, ps.grad), x.tenant
    obs = {t: o for t, (o, _) in data(8, same).items() if t != "e2"}
    s1 = grouped.execute([Sample(t, o, True) for t, o in obs.items()])
    s2 = serial.execute([Sample(t, o, True) for t, o in obs.items()], grouped=False)
    for x, y in zip(s1, s2):
        assert close(x.output["actions"], y.output["actions"]), x.tenant


@pytest.mark.parametrize("layout", ["mixed", "uniform"])
def test_bf16_backbone_with_fp32_adapters_groups_within_the_bf16_bound(layout):
    """The CUDA placement: a bf16 backbone, fp32 adapters and optimizer state. Grouped and serial agree
    to the bf16 bound of tests/test_device.py (losses of 10 steps), on both delta paths."""
    bb = build_backbone(BackboneSpec(preset="tiny", seed=0), dtype=torch.bfloat16)
    if layout == "mixed":
        profiles, specs = PROFILES, adapters_for("builtin")
    else:  # one length, one rank: the batched path over views
        profiles = {f"u{i}": (TaskProfile({"top": (32, 32)}, 4, 6, 3, "reach the block"), 2) for i in range(3)}
        specs = {t: {"rank": 4, "alpha": 8.0} for t in profiles}

    def build():
        r = ModelRunner(bb)
        for i, (t, a) in enumerate(specs.items()):
            r.create_slot(t, HeadSpec("gaussian", 4, 6, 3, width=32, depth=1, adapter=a), OptimizerSpec(lr=3e-3),
                          seed=60 + i)
        return r

    grouped, serial = build(), build()
    for slot in grouped.slots.values():
        if slot.adapter is not None:
            assert all(p.dtype == torch.float32 for p in slot.adapter.parameters())
    losses = train_grouped_and_serial(
        grouped, serial, lambda step: [ForwardBackward(t, obs, act) for t, (obs, act) in data(step, profiles).items()],
        10, profiles)
    assert_losses_agree(losses, BF16_LOSS_REL)
    for t, a in specs.items():
        if a is not None:  # the adapter trained, in fp32
            b = grouped.slot(t).adapter.B
            assert all(v.dtype == torch.float32 for v in b.values())
            assert max(v.abs().max().item() for v in b.values()) > 0, t


@pytest.mark.parametrize("layout", ["segmented", "uniform"])
def test_bf16_deltas_run_in_bf16_on_fp32_masters(layout):
    """On bf16 activations a delta runs in bf16: nothing it keeps for its backward is an fp32 copy of
    the activations (only the adapters' own fp32 weights are fp32), its output is bf16, and the
    gradients reach the fp32 A and B in fp32, equal to an fp32 computation within the bf16 bound."""
    from vlamux.model import adapters as lora
    from vlamux.model.adapters import LoRAAdapter, LoRASpec, Target

    torch.manual_seed(0)
    target = {"blk.0.q": Target("blk.0.q", 64, 48, 0)}
    ads = [LoRAAdapter(LoRASpec(rank=4, alpha=8.0), target) for _ in range(3)]
    for ad in ads:
        with torch.no_grad():
            ad.B["blk__0__q"].normal_(0, 0.1)
    sizes = [5, 5, 5] if layout == "uniform" else [5, 3, 7]
    use = ads if layout == "uniform" else [ads[0], None, ads[2]]
    x32 = torch.randn(sum(sizes), 6, 64)
    w = torch.randn(48, 64) * 0.1

    def run(dtype):
        x = x32.to(dtype).requires_grad_(True)
        out = x @ w.to(dtype).t()
        saved = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = _apply(lora, x, out, sizes, use)
        (y.float() ** 2).sum().backward()
        return y, saved, [p.grad.clone() for ad in use if ad is not None for p in (ad.A["blk__0__q"], ad.B["blk__0__q"])]

    def _apply(lora, x, out, sizes, use):
        with lora.active(list(zip(sizes, use))):
            return lora._hook("blk.0.q")(None, (x,), out)

    for ad in ads:
        ad.zero_grad()
    y16, saved, g16 = run(torch.bfloat16)
    masters = {p.data_ptr() for ad in ads for p in ad.parameters()}
    assert y16.dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 or t.data_ptr() in masters for t in saved), \
        {(t.dtype, tuple(t.shape)) for t in saved}
    assert all(g.dtype == torch.float32 for g in g16)
    for ad in ads:
        ad.zero_grad()
    y32, _, g32 = run(torch.float32)
    assert (y16.float() - y32).abs().max() <= 0.05 * y32.abs().max()
    for a, b in zip(g16, g32):
        assert (a - b).abs().max() <= 0.05 * b.abs().max(), (a - b).abs().max()
