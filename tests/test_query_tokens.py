"""Tenants' learned query tokens appended to a VLM backbone's prompt (vlamux.model.queries): the
vectors land exactly where a token would, grouping with other tenants (with and without adapters or
query tokens) changes nobody's outputs, they train, and they travel with the slot and its policy file.
Random-weight model directories, in the hub's layout (`write_random_model`)."""

import pytest
import torch

from vlamux.errors import InvalidInputError
from vlamux.model import BackboneSpec, ForwardBackward, HeadSpec, ModelRunner, OptimizerSpec, Sample, Slot, build_backbone
from vlamux.model.backbones.hf.random_init import write_random_model
from vlamux.model.feature import TokenType
from vlamux.model.synthetic import TaskProfile, make_batch

pytest.importorskip("transformers")
TOL = 1e-5
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
TENANTS = {
    "acme": (HeadSpec("gaussian", 4, 8, 4, width=64, query_tokens=4),
             TaskProfile({"top": (64, 64)}, 4, 8, 4, "reach the {color} block")),
    "bolt": (HeadSpec("l1_chunk", 3, 6, 0, width=64, query_tokens=2, adapter=LORA),
             TaskProfile({"top": (48, 48), "wrist": (32, 32)}, 3, 6, 0, "please push the {color} cube to the left")),
    "cobalt": (HeadSpec("bins", 5, 4, 2, width=64, options={"n_bins": 16}),
               TaskProfile({"top": (32, 48), "wrist": (64, 64), "side": (32, 32)}, 5, 4, 2, "{color}")),
}


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "smolvlm", "paligemma"])
def hf(request, tmp_path_factory):
    path = write_random_model(request.param, "tiny", tmp_path_factory.mktemp(request.param) / "model")
    return build_backbone(BackboneSpec(kind="hf", path=str(path), image_size=56))


def batches(seed=0, rows=2):
    g = torch.Generator().manual_seed(seed)
    return {t: make_batch(p, rows, g) for t, (_, p) in TENANTS.items()}


def runner(backbone, tenants=TENANTS):
    r = ModelRunner(backbone)
    for t in tenants:  # a tenant's seed is its own, whoever else is there
        r.create_slot(t, TENANTS[t][0], OptimizerSpec(lr=1e-2), seed=list(TENANTS).index(t))
    return r


def test_query_vectors_sit_where_a_token_would(hf):
    """Query vectors equal to a token's own embedding give the transformers model's features for a
    prompt that ends in that token: they are placed at the row's last positions, nowhere else, under
    each family's padding (two rows of different lengths share the call)."""
    data = batches()
    token = int(hf.tokenizer("a", add_special_tokens=False)["input_ids"][0])
    with torch.no_grad():  # the embedding module's output (Gemma's scales its table)
        vector = hf.model.get_input_embeddings()(torch.tensor([token]))[0]
    reqs = [hf.prepare(data["cobalt"][0], n_query=3), hf.prepare(data["acme"][0])]
    queries = [vector.expand(3, -1).clone(), None]
    mine = hf.forward_group(reqs, queries=queries)
    kwargs = hf.encode(reqs)
    ids = kwargs["input_ids"].clone()
    placeholder = torch.zeros_like(ids, dtype=torch.bool)
    for i, row in enumerate(reqs[0].rows):  # the rows with query tokens: their last 3 tokens
        n, length = len(row.input_ids), ids.shape[1]
        end = n if hf.family.padding_side == "right" else length
        placeholder[i, end - 3:end] = True
    ids[placeholder] = token
    with torch.no_grad():
        direct = hf.model(**{**kwargs, "input_ids": ids}).last_hidden_state
    for f, (start, b) in zip(mine, ((0, reqs[0]), (2, reqs[1]))):
        own = max(len(r.input_ids) for r in b.rows)
        at = slice(0, own) if hf.family.padding_side == "right" else slice(ids.shape[1] - own, ids.shape[1])
        assert (f.hidden - direct[start:start + b.batch_size, at]).abs().max() <= TOL
    types = mine[0].token_type
    assert ((types == TokenType.QUERY) & mine[0].mask).sum(-1).tolist() == [3, 3]
    assert not (mine[1].token_type == TokenType.QUERY).any()


def test_mixed_groups_equal_serial_with_query_tokens(hf):
    """A query-token tenant, a query-token + LoRA tenant and a plain one, sampling and training in one
    group: each gets what it gets alone (fp32, 1e-5), over steps that move the query tokens."""
    grouped, serial = runner(hf), runner(hf)
    for step in range(3):
        data = batches(step)
        reqs = [Sample(t, obs) for t, (obs, _) in data.items()] + \
            [ForwardBackward(t, obs, act) for t, (obs, act) in data.items()]
        a, b = grouped.execute(reqs, grouped=True), serial.execute(reqs, grouped=False)
        for x, y in zip(a, b):
            assert x.ok and y.ok, (x.error, y.error)
            for k, v in x.output.items():
                if isinstance(v, torch.Tensor):
                    assert (v - y.output[k]).abs().max() <= TOL, (x.tenant, k)
                elif isinstance(v, float):
                    assert abs(v - y.output[k]) <= TOL * max(1.0, abs(v)), (x.tenant, k)
        for t in TENANTS:
            grouped.optim_step(t), serial.optim_step(t)
    for t in ("acme", "bolt"):
        q = grouped.slot(t).queries.weight
        assert (q - serial.slot(t).queries.weight).abs().max() <= TOL
        assert not torch.equal(q, runner(hf, [t]).slot(t).queries.weight)  # they trained


def test_a_neighbours_query_tokens_change_nothing_of_mine(hf):
    data = batches(3)
    alone, beside = runner(hf, ["cobalt"]), runner(hf)
    for s in beside.slots.values():  # the neighbours' tokens far from their start
        if s.queries is not None:
            s.queries.weight.data.mul_(100)
    a = alone.execute([Sample("cobalt", data["cobalt"][0], deterministic=True)])[0].unwrap()
    b = beside.execute([Sample(t, obs, deterministic=True) for t, (obs, _) in data.items()])[2].unwrap()
    assert (a["actions"] - b["actions"]).abs().max() <= TOL


def test_query_tokens_lower_the_loss_and_get_gradients(hf):
    """Training a tenant with query tokens alone (no adapter) moves its tokens and lowers its loss."""
    r = ModelRunner(hf)
    r.create_slot("q", HeadSpec("l1_chunk", 4, 8, 4, width=64, query_tokens=4), OptimizerSpec(lr=3e-3))
    obs, act = make_batch(TENANTS["acme"][1], 8, torch.Generator().manual_seed(0))
    start = r.slot("q").queries.weight.detach().clone()
    losses = []
    for _ in range(15):
        losses.append(r.execute([ForwardBackward("q", obs, act)])[0].unwrap()["loss"])
        r.optim_step("q")
    assert losses[-1] < 0.7 * losses[0], losses
    assert not torch.equal(start, r.slot("q").queries.weight)


def test_query_tokens_save_resume_and_export(hf, tmp_path):
    import vlamux.policy

    r = runner(hf, ["acme"])
    obs, act = batches(5)["acme"]
    for _ in range(2):
        r.execute([ForwardBackward("acme", obs, act)])
        r.optim_step("acme")
    r.slot("acme").save(tmp_path / "acme.safetensors")
    back = Slot.from_file(tmp_path / "acme.safetensors", hf.meta, **r.adapter_targets(hf.backbone_id))
    assert torch.equal(back.queries.weight, r.slot("acme").queries.weight)
    other = ModelRunner(hf)
    other.add_slot(back)
    a = r.execute([Sample("acme", obs, deterministic=True)])[0].unwrap()
    b = other.execute([Sample("acme", obs, deterministic=True)])[0].unwrap()
    assert torch.equal(a["actions"], b["actions"])
    path = vlamux.policy.write_policy(r.slot("acme").export_policy(), hf, tmp_path / "acme.policy.safetensors")
    policy = vlamux.policy.load(path, backbone=hf)
    assert torch.equal(torch.as_tensor(policy.act(obs, deterministic=True)), a["actions"].float())


def test_query_tokens_are_refused_where_they_cannot_go():
    with pytest.raises(ValueError, match="query_tokens"):
        HeadSpec("gaussian", 4, 8, 4, query_tokens=-1)
    with pytest.raises(ValueError, match="query_tokens"):
        HeadSpec("gaussian", 4, 8, 4, query_tokens=10_000)
    builtin = build_backbone(BackboneSpec(preset="tiny"))
    with pytest.raises(InvalidInputError, match="head.query_tokens.*takes no query tokens"):
        ModelRunner(builtin).create_slot("t", HeadSpec("gaussian", 4, 8, 4, query_tokens=2))
    assert "query_tokens" not in HeadSpec("gaussian", 4, 8, 4).to_json()  # older files read the same
