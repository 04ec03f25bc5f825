"""Both runtimes satisfy the runtime contract (vlamux/services/contract.py): every member it declares,
with every parameter it names, and the callers outside the services reach nothing else of a runtime."""

import inspect
import re
from pathlib import Path

import pytest

from vlamux.services.contract import Runtime
from vlamux.services.runtime import EmbeddedRuntime

ROOT = Path(__file__).resolve().parents[1]
MEMBERS = [n for n in dir(Runtime) if not n.startswith("_")]


def accepts(impl, declared) -> list[str]:
    """The declared parameters `impl` would not take, by name and kind."""
    got = inspect.signature(impl).parameters
    takes_args = any(p.kind is p.VAR_POSITIONAL for p in got.values())
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in got.values())
    missing = []
    for name, p in inspect.signature(declared).parameters.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in got:
            if (got[name].default is inspect.Parameter.empty) != (p.default is inspect.Parameter.empty):
                missing.append(f"{name} (default differs)")
        elif not (takes_kwargs or (takes_args and p.kind is p.POSITIONAL_OR_KEYWORD)):
            missing.append(name)
    return missing


def runtime_classes():
    classes = [EmbeddedRuntime]
    try:
        from vlamux.services.ray_runtime import RayRuntime
        classes.append(RayRuntime)
    except ImportError:  # ray is an extra; the suite installs it
        pass
    return classes


@pytest.mark.parametrize("cls", runtime_classes(), ids=lambda c: c.__name__)
def test_each_runtime_has_every_member_with_its_parameters(cls):
    for name in MEMBERS:
        assert hasattr(cls, name) or name == "environment", f"{cls.__name__} has no {name}"
        declared = getattr(Runtime, name)
        if callable(declared) and not isinstance(inspect.getattr_static(Runtime, name), property):
            assert accepts(getattr(cls, name), declared) == [], f"{cls.__name__}.{name}"


def test_an_embedded_runtime_is_a_runtime():
    from vlamux.model.backbones import BackboneSpec
    from vlamux.services.runtime import RuntimeConfig

    rt = EmbeddedRuntime(RuntimeConfig(backbone=BackboneSpec(preset="tiny"), inference_replicas=1))
    assert isinstance(rt, Runtime)


def test_callers_reach_no_runtime_internals():
    """The API host, the Master Service, the workflows and metering use the contract only: no service
    object of a runtime (.training, .replicas, .publisher), and no probing for what a runtime has."""
    pattern = re.compile(r"(runtime|services|svc)\.(training|replicas|publisher)\b|getattr\((self\.)?(runtime|services)")
    hits = []
    for pkg in ("api", "jobs", "workflows"):
        for path in (ROOT / "vlamux" / pkg).rglob("*.py"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert hits == [], "\n".join(hits)
