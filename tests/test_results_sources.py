"""Every number in docs/RESULTS.md's tables is found in a committed result file its section names
(scripts/check_results.py); the check itself catches a number no file holds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from check_results import check, shown_as  # noqa: E402


def test_every_table_number_in_the_results_doc_has_a_source():
    assert check() == []


def test_the_readme_tables_that_name_a_result_file_hold_its_numbers():
    from check_results import README

    assert check(README, require_source=False) == []


def test_the_check_finds_a_number_no_result_file_holds(tmp_path, monkeypatch):
    import check_results

    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    (results / "run.json").write_text(json.dumps({"speedup": 1.3634, "success": 0.8098, "p99_s": 0.5023,
                                                  "ci95": [0.769, 0.845]}))
    doc = tmp_path / "RESULTS.md"
    doc.write_text("## A section\n\nFrom `bench/results/run.json`.\n\n| cell | speedup | success | p99 | CI |\n"
                   "|---|---|---|---|---|\n| 8 x 1 | **1.36×** | 81.0% | 502 ms | 76.9–84.5 |\n"
                   "| made up | 1.42× | 81.0% | 502 ms | ≥ 0.9 |\n\n## No source\n\n| a | b |\n|---|---|\n| x | 3.7 |\n")
    monkeypatch.setattr(check_results, "ROOT", tmp_path)
    problems = check(doc, results)
    assert len(problems) == 2, problems
    assert "1.42" in problems[0] and "names no result file" in problems[1]


def test_numbers_match_at_their_shown_precision():
    assert shown_as(0.8098, "81.0", percent=True) and not shown_as(0.8098, "81.1", percent=True)
    assert shown_as(0.5023, "502", percent=False)  # seconds shown in ms
    assert shown_as(1.3634, "1.36", percent=False) and not shown_as(1.3634, "1.37", percent=False)
