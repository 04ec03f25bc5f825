"""Specs state their bounds once, on their fields (vlamux.specs), and every way of making one holds
to them: direct construction, `build` from plain data (a job spec, an API body), and the messages
name the field's whole path."""

import dataclasses
import math

import pytest

from vlamux.envs import EnvSpec
from vlamux.jobs.spec import EvalSpec, JobSpec, JobSpecError, load_spec
from vlamux.model import HeadSpec, OptimizerSpec
from vlamux.specs import SpecError, build
from vlamux.workflows.rl import RLConfig
from vlamux.workflows.sft import SFTConfig

HEAD = {"kind": "gaussian", "action_dim": 4, "horizon": 4}
REQUIRED = {HeadSpec: HEAD, OptimizerSpec: {}, EnvSpec: {}, RLConfig: {}, SFTConfig: {}, EvalSpec: {},
            JobSpec: {"name": "j", "tenant": "t", "kind": "sft", "head": HeadSpec(**HEAD), "sft": SFTConfig()}}


def _bounded(cls):
    return [(f.name, f.metadata["bound"]) for f in dataclasses.fields(cls) if "bound" in f.metadata]


def _outside(bound):
    """Values just outside a numeric bound (NaN too), or not among its choices."""
    if bound.choices is not None:
        return ["not-a-choice"]
    out = [math.nan]
    if bound.lo is not None:
        out.append(bound.lo if bound.lo_open else (bound.lo - 1 if bound.lo >= 1 else bound.lo - 0.5))
    if bound.hi is not None:
        out.append(bound.hi if bound.hi_open else bound.hi * 2 + 1)
    return out


@pytest.mark.parametrize("cls", list(REQUIRED), ids=lambda c: c.__name__)
def test_every_bounded_field_refuses_what_is_outside_its_bounds_naming_the_field(cls):
    fields = [(n, b) for n, b in _bounded(cls) if b.length is None and b.each is None]
    assert fields, cls  # every spec states bounds
    for name, bound in fields:
        for bad in _outside(bound):
            if isinstance(bad, float) and math.isnan(bad) and bound.choices is None and _is_int(cls, name):
                bad = 1.5  # an integer field: a fraction is as wrong as NaN
            with pytest.raises(SpecError, match=rf"^{name}: "):
                cls(**{**REQUIRED[cls], name: bad})
    cls(**REQUIRED[cls])  # the defaults are inside


def _is_int(cls, name) -> bool:
    import typing

    return typing.get_type_hints(cls)[name] in (int, int | None)


def test_build_names_the_whole_path_and_the_type():
    with pytest.raises(JobSpecError, match=r"^rl\.env\.image_size: must be an integer in \[1, 1024\], got 0$"):
        load_spec({"name": "j", "tenant": "t", "kind": "rl", "head": HEAD, "rl": {"env": {"image_size": 0}}})
    with pytest.raises(SpecError, match=r"^head\.width: expected an integer, got 'wide'$"):
        build(HeadSpec, {**HEAD, "width": "wide"}, "head")
    with pytest.raises(SpecError, match=r"^optimizer\.betas: item 1: must be a number in \[0, 1\), got 1\.0$"):
        build(OptimizerSpec, {"betas": [0.9, 1.0]}, "optimizer")
    with pytest.raises(SpecError, match=r"^head\.options\.n_bins: must be an integer in \[2, 4096\], got 1$"):
        build(HeadSpec, {**HEAD, "kind": "bins", "options": {"n_bins": 1}}, "head")
    with pytest.raises(SpecError, match=r"^spec\.nope: unknown field; allowed: "):
        build(EnvSpec, {"nope": 1}, "spec")
    with pytest.raises(SpecError, match=r"^head\.horizon: required$"):
        build(HeadSpec, {"kind": "flow", "action_dim": 2}, "head")


def test_cross_field_rules_live_on_the_spec_too():
    with pytest.raises(SpecError, match=r"^width: 10 is not a multiple of n_heads 4$"):
        HeadSpec(**HEAD, width=10)
    with pytest.raises(SpecError, match=r"^kind: unknown kind 'nope'"):
        HeadSpec(**{**HEAD, "kind": "nope"})
    with pytest.raises(SpecError, match=r"^task: unknown tabletop task"):
        EnvSpec(task="goal/nope")
    with pytest.raises(SpecError, match=r"^backend: unknown backend"):
        EnvSpec(backend="nope")
    assert EnvSpec(cameras=["a"]).cameras == ("a",)  # JSON's list, the spec's tuple
