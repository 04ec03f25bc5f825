"""Bad input gets a clear error naming the field (DESIGN invariant 5), and fails only its own request."""

from dataclasses import replace

import pytest
import torch

from conftest import TENANTS, make_runner, snapshot, tenant_batches
from vlamux.errors import InvalidInputError, UnknownTenantError
from vlamux.model import ForwardBackward, Observation, Sample, canonicalize


@pytest.fixture(scope="module")
def data():
    return tenant_batches(batch=2, seed=3)


def with_obs(obs: Observation, **changes) -> Observation:
    return replace(obs, **changes)


def nan_state(obs):
    s = obs.state.clone()
    s[1, 0] = float("nan")
    return s


def inf_state(obs):
    s = obs.state.clone()
    s[0, 2] = float("inf")
    return s


def five_cameras(obs):
    img = obs.images["top"]
    return {f"cam{i}": img for i in range(5)}


# (id, tenant, function (obs, actions) -> request, substring the message must contain)
OBS_CASES = [
    ("float-image", "acme", lambda o: with_obs(o, images={"top": o.images["top"].float()}), "images['top']"),
    ("numpy-image", "acme", lambda o: with_obs(o, images={"top": o.images["top"].numpy()}), "images['top']"),
    ("four-channels", "acme", lambda o: with_obs(o, images={"top": torch.cat([o.images["top"], o.images["top"][:, :1]],
                                                                            dim=1)}), "images['top']"),
    ("gray-one-channel", "acme", lambda o: with_obs(o, images={"top": o.images["top"][:, :1]}), "images['top']"),
    ("rank-3", "acme", lambda o: with_obs(o, images={"top": o.images["top"][0]}), "images['top']"),
    ("rank-5", "acme", lambda o: with_obs(o, images={"top": o.images["top"][None]}), "images['top']"),
    ("empty-image", "acme", lambda o: with_obs(o, images={"top": o.images["top"][:, :, :0]}), "images['top']"),
    ("camera-batch-mismatch", "bolt", lambda o: with_obs(o, images={**o.images, "wrist": o.images["wrist"][:1]}),
     "images['wrist']"),
    ("no-cameras", "acme", lambda o: with_obs(o, images={}), "images"),
    ("too-many-cameras", "acme", lambda o: with_obs(o, images=five_cameras(o)), "images"),
    ("empty-instruction", "acme", lambda o: with_obs(o, images={"top": o.images["top"][:0]}, instruction=[],
                                                       state=o.state[:0]), "instruction"),
    ("instruction-str", "acme", lambda o: with_obs(o, instruction="reach the red block"), "instruction"),
    ("instruction-not-str", "acme", lambda o: with_obs(o, instruction=["reach", 7]), "instruction"),
    ("instruction-count", "acme", lambda o: with_obs(o, instruction=o.instruction + ["extra"]), "images['top']"),
    ("camera-mask-unknown", "acme", lambda o: with_obs(o, camera_mask={"ghost": torch.ones(2, dtype=torch.bool)}),
     "camera_mask['ghost']"),
    ("camera-mask-dtype", "acme", lambda o: with_obs(o, camera_mask={"top": torch.ones(2)}), "camera_mask['top']"),
    ("camera-mask-shape", "acme", lambda o: with_obs(o, camera_mask={"top": torch.ones(3, dtype=torch.bool)}),
     "camera_mask['top']"),
    ("state-nan", "acme", lambda o: with_obs(o, state=nan_state(o)), "state"),
    ("state-inf", "acme", lambda o: with_obs(o, state=inf_state(o)), "state"),
    ("state-int", "acme", lambda o: with_obs(o, state=o.state.long()), "state"),
    ("state-rank", "acme", lambda o: with_obs(o, state=o.state[:, None]), "state"),
    ("state-batch", "acme", lambda o: with_obs(o, state=o.state[:1]), "state"),
    ("state-list", "acme", lambda o: with_obs(o, state=o.state.tolist()), "state"),
]
# wrong per-tenant sizes are only known to the slot, not to canonicalize
SLOT_OBS_CASES = [
    ("state-width", "acme", lambda o: with_obs(o, state=o.state[:, :3]), "state"),
    ("state-missing", "acme", lambda o: with_obs(o, state=None), "state"),
]


def bad_mask(dtype, shape):
    return lambda a: torch.ones(shape, dtype=dtype)


ACTION_CASES = [  # (id, tenant, actions -> actions, actions -> action_mask or None, substring)
    ("actions-dim", "acme", lambda a: a[..., :3], None, "actions"),
    ("actions-horizon", "acme", lambda a: a[:, :5], None, "actions"),
    ("actions-batch", "acme", lambda a: a[:1], None, "actions"),
    ("actions-rank", "acme", lambda a: a.flatten(1), None, "actions"),
    ("actions-int", "acme", lambda a: a.long(), None, "actions"),
    ("actions-none", "acme", lambda a: None, None, "actions"),
    ("actions-nan", "cobalt", lambda a: a.masked_fill(torch.rand(a.shape) < 0.1, float("nan")), None, "actions"),
    ("mask-dtype", "acme", lambda a: a, bad_mask(torch.float32, (2, 8)), "action_mask"),
    ("mask-shape", "acme", lambda a: a, bad_mask(torch.bool, (2, 8, 4)), "action_mask"),
    ("mask-horizon", "acme", lambda a: a, bad_mask(torch.bool, (2, 7)), "action_mask"),
]


def run_alongside(runner, bad, data, tenant):
    """Run `bad` between two good requests: only `bad` fails, and its slot is unchanged."""
    before = snapshot(runner.slot(tenant)) if tenant in runner.slots else None
    others = [t for t in TENANTS if t != tenant][:2]
    reqs = [Sample(others[0], data[others[0]][0], True), bad, ForwardBackward(others[1], *data[others[1]])]
    res = runner.execute(reqs)
    assert res[0].ok and res[2].ok, (res[0].error, res[2].error)
    assert res[1].output is None and res[1].error is not None
    if before is not None:
        after = snapshot(runner.slot(tenant))
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        assert runner.slot(tenant).accumulated == 0
    return res[1].error


@pytest.mark.parametrize("case", OBS_CASES, ids=[c[0] for c in OBS_CASES])
def test_bad_observation(backbone, data, case):
    _, tenant, mutate, field = case
    obs, actions = data[tenant]
    bad = mutate(obs)
    with pytest.raises(InvalidInputError) as e:
        canonicalize(bad, backbone.schema, backbone.tokenizer)
    assert field in str(e.value), str(e.value)
    runner = make_runner(backbone)
    for req in (Sample(tenant, bad), ForwardBackward(tenant, bad, actions)):
        err = run_alongside(runner, req, data, tenant)
        assert isinstance(err, InvalidInputError) and field in str(err), repr(err)


@pytest.mark.parametrize("case", SLOT_OBS_CASES, ids=[c[0] for c in SLOT_OBS_CASES])
def test_bad_observation_for_the_head(backbone, data, case):
    _, tenant, mutate, field = case
    obs, actions = data[tenant]
    bad = mutate(obs)
    canonicalize(bad, backbone.schema, backbone.tokenizer)  # fine for the backbone
    runner = make_runner(backbone)
    for req in (Sample(tenant, bad), ForwardBackward(tenant, bad, actions)):
        err = run_alongside(runner, req, data, tenant)
        assert isinstance(err, InvalidInputError) and field in str(err), repr(err)


def test_state_is_ignored_by_a_head_without_state(backbone, data):
    obs, actions = data["bolt"]  # flow head, state_dim 0
    runner = make_runner(backbone)
    assert runner.execute([Sample("bolt", with_obs(obs, state=torch.ones(2, 9)))])[0].ok


@pytest.mark.parametrize("case", ACTION_CASES, ids=[c[0] for c in ACTION_CASES])
def test_bad_actions(backbone, data, case):
    _, tenant, mutate, mask, field = case
    obs, actions = data[tenant]
    req = ForwardBackward(tenant, obs, mutate(actions), None if mask is None else mask(actions))
    err = run_alongside(make_runner(backbone), req, data, tenant)
    assert isinstance(err, InvalidInputError) and field in str(err), repr(err)
    if field == "actions":
        assert "action_mask" not in str(err)


def test_valid_action_mask_accepted(backbone, data):
    obs, actions = data["acme"]
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 5:] = False
    runner = make_runner(backbone)
    assert runner.execute([ForwardBackward("acme", obs, actions, mask)])[0].ok


def test_unknown_tenant(backbone, data):
    obs, actions = data["acme"]
    runner = make_runner(backbone)
    for req in (Sample("mallory", obs), ForwardBackward("mallory", obs, actions)):
        err = run_alongside(runner, req, data, "mallory")
        assert isinstance(err, UnknownTenantError) and "'mallory'" in str(err)
    res = runner.optim_step("mallory")
    assert isinstance(res.error, UnknownTenantError) and "mallory" in str(res.error)
    with pytest.raises(UnknownTenantError, match="mallory"):
        runner.slot("mallory")


class NotARequest:
    tenant = "acme"


@pytest.mark.parametrize("thing", [NotARequest(), None, "acme", {"tenant": "acme"}, 42],
                         ids=["object-with-tenant", "None", "str", "dict", "int"])
def test_non_request(backbone, data, thing):
    runner = make_runner(backbone)
    obs, _ = data["acme"]
    res = runner.execute([Sample("acme", obs, True), thing])
    assert res[0].ok
    assert isinstance(res[1].error, InvalidInputError) and "request 1" in str(res[1].error)
    assert "ForwardBackward or Sample" in str(res[1].error)


@pytest.mark.parametrize("size", [(17, 93), (1, 1), (32, 32), (300, 200)])
def test_any_image_size_is_resized(backbone, data, size):
    obs, actions = data["acme"]
    g = torch.Generator().manual_seed(0)
    img = torch.randint(0, 256, (2, 3, *size), dtype=torch.uint8, generator=g)
    odd = with_obs(obs, images={"top": img})
    batch = canonicalize(odd, backbone.schema, backbone.tokenizer)
    r = backbone.schema.image_size
    assert batch.pixels.shape == (2, 1, 3, r, r) and batch.pixels.dtype == torch.float32
    assert batch.pixels.min() >= -1 - 1e-5 and batch.pixels.max() <= 1 + 1e-5
    assert img.dtype == torch.uint8 and torch.equal(odd.images["top"], img)  # the caller's tensor is untouched
    runner = make_runner(backbone)
    res = runner.execute([Sample("acme", odd), ForwardBackward("acme", odd, actions)])
    assert all(x.ok for x in res), [x.error for x in res]
    assert res[0].output["actions"].shape == (2, 8, 4)


def test_native_size_image_is_only_scaled(backbone, data):
    r = backbone.schema.image_size
    img = torch.tensor([0, 255, 51], dtype=torch.uint8).view(1, 3, 1, 1).expand(2, 3, r, r).contiguous()
    obs = with_obs(data["acme"][0], images={"top": img})
    pixels = canonicalize(obs, backbone.schema, backbone.tokenizer).pixels
    assert torch.allclose(pixels[0, 0, :, 0, 0], torch.tensor([-1.0, 1.0, -0.6]), atol=1e-6)


# ---- non-tensor fields ------------------------------------------------

def test_camera_mask_as_list(backbone, data):
    obs, _ = data["acme"]
    err = make_runner(backbone).execute([Sample("acme", with_obs(obs, camera_mask={"top": [True, True]}))])[0].error
    assert isinstance(err, InvalidInputError) and "camera_mask['top']" in str(err), repr(err)


def test_action_mask_as_list(backbone, data):
    obs, actions = data["acme"]
    err = make_runner(backbone).execute([ForwardBackward("acme", obs, actions, [[True] * 8] * 2)])[0].error
    assert isinstance(err, InvalidInputError) and "action_mask" in str(err), repr(err)


def test_obs_not_an_observation(backbone, data):
    obs, actions = data["acme"]
    err = make_runner(backbone).execute([Sample("acme", {"images": obs.images})])[0].error
    assert isinstance(err, InvalidInputError) and "obs" in str(err), repr(err)
