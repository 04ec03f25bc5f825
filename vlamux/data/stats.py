"""Dataset statistics as LeRobot computes and stores them (meta/stats.json and each episode's): per
feature min, max, mean, std, count and quantiles; image statistics per channel over sampled frames."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from vlamux.data.lerobot_format import DEFAULT_QUANTILES

def feature_stats(x: np.ndarray) -> dict[str, np.ndarray]:
    """min/max/mean/std/count and quantiles over the first axis of x [N, ...]; scalars get shape (1,)."""
    x = np.asarray(x)
    if x.ndim == 1:
        x = x[:, None]
    out = {"min": x.min(0), "max": x.max(0)}  # in the feature's dtype, as LeRobot stores them
    x = x.astype(np.float64)
    out.update(mean=x.mean(0), std=x.std(0), count=np.array([x.shape[0]], dtype=np.int64))
    qs = np.quantile(x, DEFAULT_QUANTILES, axis=0)
    for q, v in zip(DEFAULT_QUANTILES, qs):
        out[f"q{int(round(q * 100)):02d}"] = v
    return out


def sample_indices(n: int) -> np.ndarray:
    """LeRobot's frame sampling for image statistics (100 frames up to ~500, then n**0.75, max 10k)."""
    num = max(min(100, n), min(int(n ** 0.75), 10_000))
    return np.round(np.linspace(0, n - 1, num)).astype(int)


def image_stats(frames: np.ndarray) -> dict[str, np.ndarray]:
    """Per-channel statistics of uint8 frames [T, H, W, 3], scaled to [0, 1], each of shape (3, 1, 1)."""
    sample = frames[sample_indices(len(frames))]
    h, w = sample.shape[1:3]
    if max(h, w) >= 300:  # LeRobot downsamples large images before computing statistics
        step = int(max(h, w) / 150)
        sample = sample[:, ::step, ::step]
    flat = sample.reshape(-1, sample.shape[-1]) / 255.0
    out = feature_stats(flat)
    out = {k: (v if k == "count" else v.reshape(-1, 1, 1)) for k, v in out.items()}
    out["count"] = np.array([len(sample)], dtype=np.int64)
    return out


def aggregate_stats(per_episode: Sequence[Mapping[str, Mapping[str, np.ndarray]]]) -> dict:
    """LeRobot's aggregation: count-weighted mean, pooled variance, min of mins, count-weighted quantiles."""
    keys = sorted({k for s in per_episode for k in s})
    out = {}
    for key in keys:
        items = [s[key] for s in per_episode if key in s]
        counts = np.stack([np.asarray(s["count"], dtype=np.float64).reshape(-1)[:1] for s in items])  # [E, 1]
        means = np.stack([np.asarray(s["mean"], dtype=np.float64) for s in items])
        total = counts.sum()
        w = counts.reshape((-1,) + (1,) * (means.ndim - 1))
        mean = (means * w).sum(0) / total
        var = ((np.stack([np.asarray(s["std"], dtype=np.float64) ** 2 for s in items]) + (means - mean) ** 2)
               * w).sum(0) / total
        agg = {"min": np.min(np.stack([np.asarray(s["min"]) for s in items]), 0),
               "max": np.max(np.stack([np.asarray(s["max"]) for s in items]), 0),
               "mean": mean, "std": np.sqrt(var), "count": np.array([int(total)], dtype=np.int64)}
        for q in [k for k in items[0] if k.startswith("q") and k[1:].isdigit()]:
            if all(q in s for s in items):
                agg[q] = (np.stack([np.asarray(s[q], dtype=np.float64) for s in items]) * w).sum(0) / total
        out[key] = agg
    return out


def _jsonable(stats: Mapping[str, Mapping[str, np.ndarray]]) -> dict:
    return {k: {s: np.asarray(v).tolist() for s, v in d.items()} for k, d in stats.items()}


def _as_arrays(stats: Mapping[str, Any]) -> dict[str, dict[str, np.ndarray]]:
    return {k: {s: np.asarray(v) for s, v in d.items()} for k, d in stats.items() if isinstance(d, Mapping)}
