"""A grid benchmark's cells as its command line names them (no torch: the GPU check's plan reads them)."""

from __future__ import annotations


def cell_key(mode: str, n: int, b: int) -> str:
    """A grid cell's name in a result file's "planned" and "done" lists: "inference 8x1"."""
    return f"{mode} {n}x{b}"


def parse_grid(text: str) -> list[tuple[int, int]]:
    """"1:1,8:1" -> [(1, 1), (8, 1)]: the (tenants, local batch) cells to run."""
    cells = []
    for part in text.split(","):
        try:
            n, b = (int(x) for x in part.split(":"))
        except ValueError:
            raise SystemExit(f"--grid: expected N:b pairs separated by commas, got {part!r}") from None
        if n < 1 or b < 1:
            raise SystemExit(f"--grid: N and b must be >= 1, got {part!r}")
        cells.append((n, b))
    return cells


def parse_models(text: str, grid: list[tuple[int, int]]) -> dict[tuple[str, str], list[tuple[int, int]]]:
    """"smolvla:tiny,pi0:small=4:1+8:1" -> each (family, shape) with its cells: its own after "=" (N:b
    joined by "+"), else `grid`."""
    models = {}
    for part in text.split(","):
        name, _, own = part.partition("=")
        family, sep, shape = name.partition(":")
        if not sep or not family or not shape:
            raise SystemExit(f"--models: expected family:shape[=N:b+N:b], got {part!r}")
        models[(family, shape)] = parse_grid(own.replace("+", ",")) if own else list(grid)
    return models
