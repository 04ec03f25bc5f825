"""Both runtimes satisfy the runtime contract (vlamux/services/contract.py): every member it declares,
with every parameter it names, and the callers outside the services reach nothing else of a runtime."""

import importlib
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


def with_ray(local, module: str, name: str) -> list:
    """`local` and, where ray is installed (an extra; the suite installs it), its Ray counterpart."""
    try:
        return [local, getattr(importlib.import_module(module), name)]
    except ImportError:
        return [local]


def runtime_classes():
    return with_ray(EmbeddedRuntime, "vlamux.services.ray_runtime", "RayRuntime")


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
    pattern = re.compile(r"(runtime|services|svc|rt)\.(training|replicas|publisher)\b|getattr\((self\.)?(runtime|services)")
    hits = []
    for pkg in ("api", "jobs", "workflows", "experiments"):
        for path in (ROOT / "vlamux" / pkg).rglob("*.py"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert hits == [], "\n".join(hits)


# the Ray face's own: its replicas (add, drain, ...), and reset/step leaving their answers in the object store
RAY_ONLY = {"add", "drain", "clear", "actor_of", "replica_metrics", "shipped", "reset_refs", "step_refs"}


def environment_faces():
    from vlamux.services.environment import EnvironmentService

    return with_ray(EnvironmentService, "vlamux.services.ray_environments", "RayEnvironments")


def _params(fn) -> list[tuple]:
    # Ray adds `_ray_trace_ctx` to the signatures of a class's methods, in place, once the class has been
    # made an actor in this process (the Ray tests may have run before, in this worker)
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()
            if p.name != "_ray_trace_ctx"]


@pytest.mark.parametrize("cls", environment_faces(), ids=lambda c: c.__name__)
def test_each_environment_face_has_the_contracts_methods_with_the_services_signatures(cls):
    """The contract declares the service's own signatures (defaults included), and the Ray face repeats
    them: a default changed in one place and not the other would change what a job gets on Ray."""
    from vlamux.services.contract import Environments
    from vlamux.services.environment import EnvironmentService

    declared = [n for n in dir(Environments) if not n.startswith("_")]
    for name in declared:
        assert _params(getattr(cls, name)) == _params(getattr(Environments, name)), f"{cls.__name__}.{name}"
    for name in (n for n in vars(cls) if not n.startswith("_") and callable(getattr(cls, n))):
        if name in RAY_ONLY:
            continue
        assert hasattr(EnvironmentService, name), f"{cls.__name__}.{name}: the service has no such method"
        assert _params(getattr(cls, name)) == _params(getattr(EnvironmentService, name)), f"{cls.__name__}.{name}"


def test_the_environment_actor_has_the_services_methods_and_no_string_dispatch():
    """Each call the driver makes of an environment replica is a method with the service's own
    signature: nothing reaches the service by a name in a string."""
    pytest.importorskip("ray")
    from vlamux.services.environment import EnvironmentService
    from vlamux.services.ray_actors import ENVIRONMENT_METHODS, EnvironmentActor

    for name in ENVIRONMENT_METHODS:
        assert _params(getattr(EnvironmentActor, name)) == _params(getattr(EnvironmentService, name)), name
    assert not hasattr(EnvironmentActor, "call")
