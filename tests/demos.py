"""Demonstrations of the built-in suite for tests: each shape (task, episodes, image size) generated
once per test process and copied where a test wants it (a copy: tests may add to or damage theirs).

    from demos import demo_dataset

    demo_dataset(data_dir / "datasets" / "tiny", episodes=4)
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from pathlib import Path

_made: dict[tuple, Path] = {}
_lock = threading.Lock()


def demo_dataset(dest: str | Path, episodes: int, image_size: int = 32, task: str = "goal/touch-red-cube") -> Path:
    """A LeRobot dataset of `episodes` scripted episodes of `task` at `dest` (which must not exist)."""
    from vlamux.data.demos import generate

    key = (task, episodes, image_size)
    with _lock:
        if key not in _made:
            root = Path(tempfile.mkdtemp(prefix="vlamux-test-demos-"))
            atexit.register(shutil.rmtree, root, True)
            generate([task], episodes, root / "d", image_size=image_size, workers=1, progress=None)
            _made[key] = root / "d"
    shutil.copytree(_made[key], dest)
    return Path(dest)
