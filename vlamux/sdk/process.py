"""`vlamux serve` as a child process, from the client's side: started, waited for until it answers,
stopped. For tests and benchmarks that need the server in a process of its own (to kill it, or to
load it from outside)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vlamux.sdk.http import wait_ready


def spawn(data_dir: str | Path, port: int, log=None, extra_args=(), timeout_s: float = 180.0, env=None,
          popen=subprocess.Popen):
    """`vlamux serve` as a child process, returned once it answers: for tests and benchmarks that
    need the server in a process of its own (to kill it, or to load it from outside). `popen` starts
    it (the test suite's forks a preloaded interpreter, tests/zygote.py)."""
    proc = popen([sys.executable, "-m", "vlamux.cli", "serve", "--port", str(port), "--data-dir",
                  str(data_dir), *extra_args], stdout=log or subprocess.DEVNULL,
                 stderr=subprocess.STDOUT, env=env)
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout_s=timeout_s, proc=proc)
    except BaseException:
        stop(proc)
        raise
    return proc


def stop(proc, timeout_s: float = 60.0) -> None:
    """SIGTERM (a clean shutdown), then SIGKILL if it has not exited within `timeout_s`."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
