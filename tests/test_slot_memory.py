"""What a resident slot costs in memory (issue 28): a training slot its parameters, plus its optimizer
state once it has stepped (AdamW: two moments per parameter), plus its gradients while it holds them;
a serving copy (an inference replica's) its parameters and nothing else. Each within 10%.

Measured as this process's resident memory (RSS, after the allocator gave back what it could) over
100 slots made through the model runner as the services make them, against byte counts of the same
head built apart on the meta device (numel x element size: not the slot's own accounting). A fused
stack (vlamux.model.fused) is a group's working set, bounded by its cache, not a slot's: the runners
here do not fuse.
"""

from __future__ import annotations

import ctypes
import gc

import pytest
import torch

from conftest import TENANTS
from vlamux.model import ForwardBackward, ModelRunner, OptimizerSpec
from vlamux.model.heads import build_head
from vlamux.model.synthetic import make_batch

N = 100
SPEC, PROFILE = TENANTS["cobalt"]  # a Gaussian head of the default width and depth


def resident_bytes() -> int:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed blocks back to the system, so RSS is what is live
    except OSError:
        pytest.skip("RSS accounting here assumes glibc")
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def param_bytes(backbone) -> int:
    with torch.device("meta"):
        head = build_head(SPEC, backbone.meta.hidden_dim, False)
    return sum(p.numel() * p.element_size() for p in head.parameters())


def per_slot(before: int, after: int) -> float:
    return (after - before) / N


def test_a_training_slot_costs_its_parameters_optimizer_and_gradients_a_serving_copy_its_parameters(backbone):
    params = param_bytes(backbone)
    assert params > 1_000_000, params  # slots big enough that a page's rounding is noise
    obs, act = make_batch(PROFILE, 1, torch.Generator().manual_seed(0))
    train = ModelRunner(backbone, fuse_heads=False)
    serve = ModelRunner(backbone, fuse_heads=False)
    # one slot of each kind first: what the first one makes once (kernels' caches, the optimizer's
    # lazily imported code) is not a slot's cost
    train.create_slot("warm", SPEC, OptimizerSpec(), seed=0)
    train.execute([ForwardBackward("warm", obs, act)])[0].unwrap()
    train.optim_step("warm").unwrap()
    serve.apply_policy(train.slot("warm").export_policy())
    names = [f"t{i}" for i in range(N)]

    base = resident_bytes()
    for i, t in enumerate(names):
        train.create_slot(t, SPEC, OptimizerSpec(), seed=i + 1)
    created = resident_bytes()
    for t in names:  # one at a time: a group's activations are gone before the next is measured
        train.execute([ForwardBackward(t, obs, act)])[0].unwrap()
    with_grads = resident_bytes()
    for t in names:
        train.optim_step(t).unwrap()
    stepped = resident_bytes()
    for t in names:
        serve.apply_policy(train.slot(t).export_policy())
    served = resident_bytes()

    figures = {"created": per_slot(base, created) / params,  # no optimizer state before a step
               "holding gradients": per_slot(base, with_grads) / (2 * params),
               "stepped": per_slot(base, stepped) / (3 * params),  # moments in, gradients dropped
               "serving copy": per_slot(stepped, served) / params}
    print("per-slot bytes over the formula:", {k: round(v, 3) for k, v in figures.items()}, "params", params)
    for what, ratio in figures.items():
        assert 0.9 <= ratio <= 1.1, (what, figures, params)
    assert all(train.slot(t).optimizer.state for t in names)  # the moments exist: the test measured them
    assert all(serve.slot(t).optimizer is None for t in names)
