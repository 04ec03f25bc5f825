"""Video frames of a LeRobot dataset: the frames of an mp4 segment nearest given timestamps (PyAV)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from vlamux.data.errors import DatasetFormatError

def decode_video_segment(path: Path, timestamps: Sequence[float], tolerance_s: float,
                         name: str | None = None) -> np.ndarray:
    """Frames of an mp4 nearest to each timestamp (seconds in the file), as uint8 [N, H, W, 3].

    Seeks to the keyframe before the first timestamp and decodes forward past the last one (as
    LeRobot's pyav backend does); every timestamp must have a frame within `tolerance_s`. Errors
    name the file as `name` (by default its path).
    """
    import av

    name = name if name is not None else str(path)
    ts = np.asarray(timestamps, dtype=np.float64)
    first, last = float(ts.min()), float(ts.max())
    frames, got = [], []
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            if first > 0:
                container.seek(max(0, int(first / stream.time_base) - 1), backward=True, any_frame=False,
                               stream=stream)
            for frame in container.decode(stream):
                if frame.pts is None:
                    continue
                t = float(frame.pts * frame.time_base)
                if t < first - tolerance_s:
                    continue
                frames.append(frame.to_ndarray(format="rgb24"))
                got.append(t)
                if t >= last - tolerance_s:
                    break
    except FileNotFoundError:
        raise DatasetFormatError(f"{name}: video file missing") from None
    except (av.error.FFmpegError, OSError, IndexError) as e:
        msg = str(e).replace(str(path), name)
        raise DatasetFormatError(f"{name}: cannot decode ({msg})") from None
    if not frames:
        raise DatasetFormatError(f"{name}: no frames decoded in [{first:.4f}, {last:.4f}] s")
    got = np.asarray(got)
    nearest = np.abs(ts[:, None] - got[None, :]).argmin(1)
    err = np.abs(got[nearest] - ts)
    if (err > tolerance_s).any():
        bad = int(err.argmax())
        raise DatasetFormatError(
            f"{name}: no frame within {tolerance_s} s of t={ts[bad]:.6f} s (nearest {got[nearest[bad]]:.6f} s)")
    return np.stack([frames[i] for i in nearest])
