"""The package's layout, as a newcomer reads it: each package's modules with their line counts, the
modules over the size limit, and the import graph's back-edges (an import against the layer order)
and cycles.

    python scripts/layout.py            # the report
    python scripts/layout.py --check    # exit 1 on a cycle, a back-edge, an unexplained long module, or an
                                        # import of a service's internals in the API layer

The layer order (docs/ARCHITECTURE.md's "data flows one way"): a module may import from its own layer
and the layers below it. Imports inside a function (made when it runs, often to keep a heavy extra
optional) count like any other: a cycle through one still ties the modules together.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "vlamux"
LIMIT = 500  # lines a module may have

# top layer first; the entries of one tuple are one layer (they do not import each other's internals
# in a circle, which the cycle report shows)
LAYERS: list[tuple[str, ...]] = [
    ("cli", "backbone_cli", "main_job", "demo", "pretrain"),
    ("experiments",),
    ("sdk",),
    ("api",),
    ("jobs",),
    ("workflows",),
    ("services",),
    ("policy",),
    ("store",),
    ("envs", "data"),
    ("model",),
    ("utils", "specs", "errors", "wire", "assets"),
]

# What the API layer may import of the services: the runtime contract, and the two runtimes where the
# host builds one (the composition root). Anything else would be a service's internals.
API_MAY_IMPORT = {"vlamux.services.contract", "vlamux.services.runtime", "vlamux.services.ray_runtime"}

# modules allowed past LIMIT, and why (empty: none)
LONG_OK: dict[str, str] = {}


def layer_of(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else module
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    return len(LAYERS)  # the package's __init__, or a module not placed: below every layer


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for each vlamux import of `path`; `from x import y`
    resolves to x.y where that is a module."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            targets = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    stem = ".".join(base[:len(base) - child.level + 1] + ([child.module] if child.module else []))
                else:
                    stem = child.module or ""
                targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in child.names]
            for t in targets:
                if t == PACKAGE or t.startswith(PACKAGE + "."):
                    while t not in known and "." in t:
                        t = t.rsplit(".", 1)[0]
                    if t in known and t != name:
                        found.append((t, child.lineno, in_function))
            visit(child, inner)

    visit(tree, False)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def report(root: Path = ROOT) -> dict:
    mods = modules(root)
    known = set(mods)
    lines = {m: sum(1 for _ in p.open()) for m, p in mods.items()}
    edges = {m: imports(m, p, known) for m, p in mods.items()}
    graph = {m: {t for t, _, _ in e} for m, e in edges.items()}
    back = [(m, t, line, lazy) for m, e in edges.items() for t, line, lazy in e
            if layer_of(t) < layer_of(m) and not t.startswith(m + ".")]
    long = {m: n for m, n in lines.items() if n > LIMIT}
    internals = sorted((m, t, line) for m, e in edges.items() if m.startswith(f"{PACKAGE}.api.")
                       for t, line, _ in e if t.startswith(f"{PACKAGE}.services") and t not in API_MAY_IMPORT)
    return {"lines": lines, "paths": mods, "back_edges": back, "cycles": cycles(graph),
            "long": long, "unexplained_long": sorted(set(long) - set(LONG_OK)), "api_internals": internals}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 on a cycle, a back-edge or an unexplained long module")
    args = ap.parse_args(argv)
    r = report()
    by_pkg: dict[str, list[str]] = defaultdict(list)
    for m in r["lines"]:
        pkg = m.rsplit(".", 1)[0] if r["paths"][m].name != "__init__.py" else m
        by_pkg[pkg].append(m)
    for pkg in sorted(by_pkg):
        total = sum(r["lines"][m] for m in by_pkg[pkg])
        print(f"{pkg}  ({len(by_pkg[pkg])} modules, {total} lines)")
        for m in sorted(by_pkg[pkg]):
            flag = f"  > {LIMIT}" + (f": {LONG_OK[m]}" if m in LONG_OK else "") if m in r["long"] else ""
            print(f"  {r['lines'][m]:5d}  {m}{flag}")
    print(f"\nback-edges (an import against the layer order {' > '.join('/'.join(x) for x in LAYERS)}):")
    for m, t, line, lazy in sorted(r["back_edges"]):
        print(f"  {m}:{line} imports {t}{'  (inside a function)' if lazy else ''}")
    if not r["back_edges"]:
        print("  none")
    print("\ncycles (modules that import each other, directly or round about):")
    for comp in r["cycles"]:
        print("  " + " <-> ".join(comp))
    if not r["cycles"]:
        print("  none")
    print(f"\nthe API's imports of services' internals (beyond {', '.join(sorted(API_MAY_IMPORT))}):")
    for m, t, line in r["api_internals"]:
        print(f"  {m}:{line} imports {t}")
    if not r["api_internals"]:
        print("  none")
    print(f"\nmodules over {LIMIT} lines: {len(r['long'])} ({len(r['unexplained_long'])} without a stated reason)")
    bad = bool(r["cycles"] or r["back_edges"] or r["unexplained_long"] or r["api_internals"])
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
