"""Small statistics the services and benchmarks report."""

from __future__ import annotations

from collections.abc import Iterable


def quantile(xs: Iterable[float], q: float, empty=None):
    """The q-quantile of `xs` by rank (the value at index int(q * n) of the sorted values); `empty`
    when there are none."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else empty
