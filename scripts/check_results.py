"""Every number in docs/RESULTS.md's tables comes from a committed result file, and so does every
number in the README's tables whose section names one.

    python scripts/check_results.py           # lists the table rows with a number no result file holds

A number in a table cell ("81.0%", "0.92x", "194.5", "[55.9, 65.4]", "502 ms") is found when some
value in bench/results (JSON numbers, and numbers in CSV and text files) shows as it at the precision
it is written with: 0.81 or 81.0 for "81.0%", 0.4989 for "0.50" (seconds may be shown as ms). The
files searched are those the table's section names (`bench/results/...`, in its text or the row), so
each table says where its numbers come from. Small integers (a grid's N and b) and targets (after
"≥", "≤" or "target") are not looked up. Exit status 1 when a number is found in none of them.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "RESULTS.md"
README = ROOT / "README.md"  # its tables describe as well as measure: only those with a source are checked
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w])")


def values_in(path: Path) -> list[float]:
    """Every number a result file holds."""
    if path.suffix == ".json":
        out: list[float] = []

        def walk(x):
            if isinstance(x, bool):
                return
            if isinstance(x, (int, float)):
                out.append(float(x))
            elif isinstance(x, dict):
                for v in x.values():
                    walk(v)
            elif isinstance(x, list):
                for v in x:
                    walk(v)
            elif isinstance(x, str):
                out.extend(float(m) for m in NUMBER.findall(x))

        try:
            walk(json.loads(path.read_text()))
        except (ValueError, UnicodeDecodeError):
            return []
        return out
    try:
        return [float(m) for m in NUMBER.findall(path.read_text())]
    except UnicodeDecodeError:
        return []


def shown_as(value: float, text: str, percent: bool) -> bool:
    """Whether `value` rounds to the number written as `text` (a percentage: value or 100 x value)."""
    decimals = len(text.split(".", 1)[1]) if "." in text else 0
    want = float(text)
    candidates = [value, 100 * value] if percent else [value]
    if not percent:  # a rate shown in percent without its sign (an interval's ends), seconds shown in ms
        candidates += [1e3 * value, 100 * value]
    tol = 0.5 * 10 ** -decimals + 1e-9
    return any(math.isfinite(c) and abs(c - want) <= tol for c in candidates)


PATH = re.compile(r"bench/results/[\w./-]+\w")


def tables(doc: str):
    """(line number, the result files its section names, row cells) of every table body row: a
    table's sources are the files its section's text (anywhere under its heading) or the row names."""
    lines = doc.splitlines()
    section_of, named, section = [], {}, 0
    for line in lines:
        if line.startswith("#"):
            section += 1
        section_of.append(section)
        named.setdefault(section, [])
        if not line.startswith("|"):
            named[section] += PATH.findall(line)
    for i, line in enumerate(lines, 1):
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if all(re.fullmatch(r":?-+:?", c) for c in cells if c):
            continue
        if not (lines[i - 2] if i >= 2 else "").startswith("|"):  # the header row
            continue
        yield i, list(dict.fromkeys(named[section_of[i - 1]] + PATH.findall(line))), cells


def check(doc_path: Path = DOC, results: Path = RESULTS, require_source: bool = True) -> list[str]:
    """Problems with `doc_path`'s tables; require_source=False skips tables whose section names no
    result file (a README's tables of options and concepts)."""
    problems = []
    cache: dict[str, list[float]] = {}

    def pool(name: str) -> list[float] | None:
        path = ROOT / name
        if name not in cache:
            if path.is_dir():
                cache[name] = [v for p in sorted(path.rglob("*")) if p.is_file() for v in values_in(p)]
            elif path.is_file():
                cache[name] = values_in(path)
            else:
                cache[name] = None
        return cache[name]

    for line, sources, cells in tables(doc_path.read_text()):
        if not sources:
            if require_source:
                problems.append(f"line {line}: its section names no result file (bench/results/...)")
            continue
        missing = [s for s in sources if pool(s) is None]
        if missing:
            problems.append(f"line {line}: names {missing[0]}, which is not committed")
            continue
        values = [v for s in sources for v in pool(s)]
        for cell in cells:
            for m in NUMBER.finditer(cell):
                text = m.group(0)
                if PATH.search(cell) and text in "".join(PATH.findall(cell)):
                    continue  # a number inside a file name
                percent = cell[m.end():m.end() + 1] == "%"
                if re.search(r"(≥|≤|>=|<=|target)\s*$", cell[:m.start()]):
                    continue  # a target (the papers' figure, or ours), not a measurement
                if float(text).is_integer() and abs(float(text)) <= 16 and "." not in text:
                    continue  # small integers: grid sizes, ranks, counts of tasks
                if not any(shown_as(v, text, percent) for v in values):
                    problems.append(f"line {line}: {text}{'%' if percent else ''} in {cell!r} is not in "
                                    f"{', '.join(sources)}")
    return problems


def main() -> int:
    problems = [f"{DOC.name} {p}" for p in check()] + [f"{README.name} {p}" for p in check(README, require_source=False)]
    for p in problems:
        print(p)
    print(f"{len(problems)} numbers without a source" if problems else "every table number has a source")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
