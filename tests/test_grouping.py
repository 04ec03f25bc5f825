"""Group batching is invisible: grouped results equal serial ones, and tenants stay isolated."""

import logging

import pytest
import torch

from conftest import TENANTS, make_runner, same_bytes, snapshot, tenant_batches
from vlamux.errors import InvalidInputError, NonFiniteError
from vlamux.model import BackboneSpec, ForwardBackward, HeadSpec, ModelRunner, Sample, build_backbone

TOL = 1e-5


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a if isinstance(a[k], torch.Tensor))


@pytest.mark.parametrize("deterministic", [True, False])
def test_grouped_inference_equals_serial(backbone, deterministic):
    grouped, serial = make_runner(backbone), make_runner(backbone)
    data = tenant_batches(batch=3)
    reqs = [Sample(t, obs, deterministic) for t, (obs, _) in data.items()]
    for _ in range(3):  # stochastic heads draw from each slot's RNG: later draws must match too
        g = grouped.execute(reqs, grouped=True)
        s = serial.execute(reqs, grouped=False)
        for rg, rs in zip(g, s):
            assert rg.ok and rs.ok, (rg.error, rs.error)
            assert rg.group_size == len(TENANTS) and rs.group_size == 1
            assert rg.output["actions"].shape == (3, TENANTS[rg.tenant][0].horizon, TENANTS[rg.tenant][0].action_dim)
            assert max_diff(rg.output, rs.output) <= TOL, rg.tenant


def test_grouped_training_equals_serial_over_50_steps(backbone):
    grouped, serial = make_runner(backbone), make_runner(backbone)
    losses = {"grouped": {t: [] for t in TENANTS}, "serial": {t: [] for t in TENANTS}}
    for step in range(50):
        data = tenant_batches(batch=2, seed=step)
        reqs = [ForwardBackward(t, obs, act) for t, (obs, act) in data.items()]
        for mode, runner in (("grouped", grouped), ("serial", serial)):
            for r in runner.execute(reqs, grouped=mode == "grouped"):
                losses[mode][r.tenant].append(r.unwrap()["loss"])
            for t in TENANTS:
                assert runner.optim_step(t).unwrap()["policy_version"] == step + 1
    for t in TENANTS:
        g, s = torch.tensor(losses["grouped"][t]), torch.tensor(losses["serial"][t])
        print(t, "max loss diff", (g - s).abs().max().item())
        assert (g - s).abs().max() <= 1e-4, (t, (g - s).abs().max())
        assert g[-10:].mean() < g[:10].mean(), f"{t} did not learn"  # the trajectory is a real one
        for pg, ps in zip(grouped.slot(t).head.parameters(), serial.slot(t).head.parameters()):
            assert (pg - ps).abs().max() <= 1e-3  # Adam turns float noise in near-zero gradients into lr-sized steps


def test_features_do_not_depend_on_group_partners(backbone):
    runner = make_runner(backbone)
    data = tenant_batches(batch=2)
    alone = runner.execute([Sample("acme", data["acme"][0], True)])[0]
    for partners in (["delta"], ["bolt", "cobalt", "delta"]):
        reqs = [Sample(t, data[t][0], True) for t in partners] + [Sample("acme", data["acme"][0], True)]
        together = runner.execute(reqs)[-1]
        assert together.group_size == len(partners) + 1
        assert max_diff(alone.output, together.output) <= TOL


def test_step_of_one_tenant_leaves_other_slots_byte_identical(backbone):
    runner = make_runner(backbone)
    data = tenant_batches(batch=2)
    before = {t: snapshot(runner.slot(t)) for t in TENANTS}
    # acme trains while the others only read features in the same group (deterministically).
    reqs = [ForwardBackward("acme", *data["acme"])] + [Sample(t, data[t][0], True) for t in TENANTS if t != "acme"]
    assert all(r.ok for r in runner.execute(reqs))
    runner.optim_step("acme").unwrap()
    after = {t: snapshot(runner.slot(t)) for t in TENANTS}
    assert not same_bytes(before["acme"], after["acme"])
    for t in TENANTS:
        if t != "acme":
            assert same_bytes(before[t], after[t]), t
            assert runner.slot(t).version == 0 and runner.slot(t).accumulated == 0


def test_nan_in_one_tenant_fails_only_that_tenant(backbone):
    runner, clean = make_runner(backbone), make_runner(backbone)
    with torch.no_grad():
        next(runner.slot("bolt").head.parameters()).fill_(float("nan"))
    poisoned = snapshot(runner.slot("bolt"))
    data = tenant_batches(batch=2)
    reqs = [ForwardBackward(t, obs, act) for t, (obs, act) in data.items()]
    results = runner.execute(reqs)
    expected = clean.execute(reqs, grouped=False)
    for r, e in zip(results, expected):
        if r.tenant == "bolt":
            assert isinstance(r.error, NonFiniteError) and "bolt" in str(r.error)
        else:
            assert r.ok and abs(r.output["loss"] - e.output["loss"]) <= TOL
    assert same_bytes(poisoned, snapshot(runner.slot("bolt")))  # the failed request changed nothing
    assert runner.slot("bolt").accumulated == 0


def test_bad_input_fails_only_that_request(backbone):
    runner = make_runner(backbone)
    data = tenant_batches(batch=2)
    bad_actions = data["cobalt"][1].clone()
    bad_actions[0, 0, 0] = float("nan")
    reqs = [ForwardBackward("acme", *data["acme"]), ForwardBackward("cobalt", data["cobalt"][0], bad_actions),
            ForwardBackward("nobody", *data["acme"]), ForwardBackward("delta", *data["delta"])]
    res = runner.execute(reqs)
    # refused on the host before the group forms (checking a device tensor would wait for the device),
    # so it costs the group nothing
    assert res[0].ok and res[3].ok and res[0].group_size == 2
    assert isinstance(res[1].error, InvalidInputError) and "actions" in str(res[1].error)
    assert "nobody" in str(res[2].error)


def test_other_backbone_goes_to_separate_group(backbone, caplog):
    other = build_backbone(BackboneSpec(preset="tiny", seed=7))
    runner = ModelRunner([backbone, other])
    runner.create_slot("a", TENANTS["acme"][0])
    runner.create_slot("b", TENANTS["acme"][0], backbone_id=other.backbone_id)
    runner.create_slot("c", TENANTS["acme"][0])
    obs = tenant_batches(batch=2)["acme"][0]
    with caplog.at_level(logging.DEBUG, logger="vlamux.model.group"):
        res = runner.execute([Sample(t, obs, True) for t in "abc"])
    assert [r.group_size for r in res] == [2, 1, 2]
    assert any("needs backbone" in m and other.backbone_id in m for m in caplog.messages)
    # same head seed, different backbone: different actions
    assert (res[0].output["actions"] - res[1].output["actions"]).abs().max() > 1e-3


def test_max_group_rows_splits_groups(backbone, caplog):
    runner = make_runner(backbone, max_group_rows=4)
    data = tenant_batches(batch=2)
    with caplog.at_level(logging.DEBUG, logger="vlamux.model.group"):
        res = runner.execute([Sample(t, obs, True) for t, (obs, _) in data.items()])
    assert [r.group_size for r in res] == [2, 2, 2, 2]
    assert any("is full" in m for m in caplog.messages)


def test_accounting_splits_backbone_time_by_rows(backbone):
    runner = make_runner(backbone)
    data = tenant_batches(batch=2)
    data["acme"] = tenant_batches(batch=6)["acme"]
    res = runner.execute([Sample(t, obs, True) for t, (obs, _) in data.items()])
    assert all(r.backbone_s > 0 and r.head_s > 0 for r in res)
    # acme has 6 of 12 rows: its share of the forward is larger than any 2-row tenant's
    assert res[0].backbone_s > max(r.backbone_s for r in res[1:])


def test_padded_default_grouping_equals_packed(backbone):
    """Backbone.forward_group's default (pad, one forward, trim) — what adapters without packing get —
    gives the same per-request features as the built-in packed path and as running alone."""
    from vlamux.model import Backbone, canonicalize

    data = tenant_batches(batch=2)
    batches = [canonicalize(obs, backbone.schema, backbone.tokenizer) for obs, _ in data.values()]
    with torch.no_grad():
        packed = backbone.forward_group(batches, n_layers=2)
        padded = Backbone.forward_group(backbone, batches, n_layers=2)
        alone = [backbone(b, n_layers=2) for b in batches]
    assert len({b.text_len for b in batches}) > 1 and len({b.n_cameras for b in batches}) > 1
    for p, q, a in zip(packed, padded, alone):
        assert p.hidden.shape == q.hidden.shape == a.hidden.shape
        assert torch.equal(p.mask, a.mask) and torch.equal(q.token_type, a.token_type)
        for x, y in ((p, a), (q, a)):
            assert (x.hidden - y.hidden).abs().max() <= TOL
            assert all((lx - ly).abs().max() <= TOL for lx, ly in zip(x.layers, y.layers))


def test_bf16_backbone_serves_fp32_heads():
    bb16 = build_backbone(BackboneSpec(preset="tiny", seed=0), dtype=torch.bfloat16)
    runner = make_runner(bb16)
    data = tenant_batches(batch=2)
    res = runner.execute([ForwardBackward(t, obs, act) for t, (obs, act) in data.items()])
    assert all(r.ok for r in res), [r.error for r in res]
    out = runner.execute([Sample(t, obs, True) for t, (obs, _) in data.items()])
    assert all(r.ok and r.output["actions"].dtype == torch.float32 for r in out)


def test_head_reading_more_layers_than_the_backbone_has_is_refused(backbone):
    runner = ModelRunner(backbone)
    spec = HeadSpec("l1_chunk", 4, 8, 4, depth=8, feature_layers=8)
    with pytest.raises(ValueError, match="feature_layers=8"):
        runner.create_slot("deep", spec)
