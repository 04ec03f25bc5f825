"""scripts/layout.py: the import graph it reports, on the package and on a graph with known cycles."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import layout  # noqa: E402


def test_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}, "g": set()}
    assert sorted(layout.cycles(graph)) == [["a", "b", "c"], ["e", "f"]]
    assert layout.cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycle_and_its_report_prints():
    r = layout.report()
    assert r["cycles"] == [], r["cycles"]
    assert r["lines"]["vlamux.model.runner"] > 100 and "vlamux.api.host" in r["lines"]
    # an import the layer order forbids is reported as a back-edge
    assert layout.layer_of("vlamux.cli") < layout.layer_of("vlamux.api.host") < layout.layer_of("vlamux.model.slot")
    out = subprocess.run([sys.executable, "scripts/layout.py"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "back-edges" in out.stdout and "vlamux.model  (" in out.stdout


def test_the_layout_holds_its_rules():
    """No back-edge, no cycle, no module over the limit without a reason, and the API reaches the
    services through the runtime contract only (issue 27)."""
    r = layout.report()
    assert r["back_edges"] == [] and r["cycles"] == [] and r["unexplained_long"] == [], r
    assert r["api_internals"] == [], r["api_internals"]
    out = subprocess.run([sys.executable, "scripts/layout.py", "--check"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout[-2000:]
