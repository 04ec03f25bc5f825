"""The example job specs the README points at are valid specs."""

from pathlib import Path

import pytest
import yaml

from vlamux.jobs.spec import load_spec

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_spec_loads(path):
    data = yaml.safe_load(path.read_text())
    data["tenant"] = "acme"  # the service fills it in
    spec = load_spec(data)
    assert spec.name and spec.kind in ("sft", "rl")
    assert spec.sft is not None and spec.sft.dataset == "goal-touch-red-cube"  # what `vlamux demos` names it


def test_there_are_examples():
    assert len(EXAMPLES) >= 2
