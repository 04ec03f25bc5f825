"""How the GPU check starts a step: a process (and process group) of its own, its output merged into
one pipe, killed with its group at its time limit.

On a GPU every step is a fresh interpreter: a step's CUDA context, its memory and a crash stay its
own, and forking a process that has touched CUDA is not safe. The dry run (CPU only, tiny sizes, in
the test suite) forks each step from the check's own process instead, with torch, transformers and
vlamux's service core imported once (`preload`): the dry run took 148 s with a fresh interpreter a
step and 79 s forked (alone, on this project's 2-core CPU). The fork runs the step's script or
module as `python` would, in a new session, with the step's environment, and leaves through the
interpreter's exit handlers.
"""

from __future__ import annotations

import atexit
import importlib
import os
import runpy
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Imported before the dry run's first step (no MuJoCo here: it takes its GL backend from the
# environment when imported, and the steps' GL choice comes after the probe)
PRELOAD = ("torch", "torch._dynamo", "transformers", "vlamux.services.runtime", "vlamux.workflows.rl",
           "vlamux.model.backbones.hf")


def preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)


class StepProcess:
    """A started step: `pid` leads its own process group; `fd` reads its stdout and stderr."""

    def __init__(self, argv: list[str], cwd: Path, env: dict, fork: bool):
        if fork:
            self.fd, write = os.pipe()
            try:
                self.pid, self._popen = fork_python(argv, cwd, env, write), None
            finally:
                os.close(write)
        else:
            self._popen = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, start_new_session=True)
            self.pid, self.fd = self._popen.pid, self._popen.stdout.fileno()

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def finish(self, timeout_s: float) -> tuple[int | None, str]:
        """(exit code, or None if it ran past `timeout_s` and was killed with its group; its output)."""
        deadline, chunks, timed_out = time.monotonic() + timeout_s, [], False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                timed_out = True
                left = 5.0  # what the killed group wrote; a grandchild outside the group may hold the pipe
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                if timed_out:
                    break
                continue
            data = os.read(self.fd, 1 << 16)
            if not data:
                break
            chunks.append(data)
        if self._popen is not None:
            self._popen.stdout.close()
            code = self._popen.wait()
        else:
            os.close(self.fd)
            code = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return (None if timed_out else code), b"".join(chunks).decode(errors="replace")


def fork_python(argv: list[str], cwd: Path, env: dict, out: int) -> int:
    """Fork `argv` (`[python, script, args...]` or `[python, "-m", module, args...]`) from this process,
    in a new session, its stdin from /dev/null and its stdout and stderr to the descriptor `out`; its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's own handler is not the child's
        signal.signal(signal.SIGINT, signal.default_int_handler)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        code = _run(argv[1:], cwd, env)
    except BaseException:  # noqa: BLE001 - the child reports and leaves; it never returns into the parent
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # as the interpreter's exit would: what the child registered (its pools)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _run(args: list[str], cwd: Path, env: dict) -> int:
    """The step as `python *args` would run it; its exit code."""
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    ours = {str(ROOT / "scripts"), str(ROOT / "bench")}  # the check's own additions to its path
    site = [p for p in sys.path if p and str(Path(p).resolve()) not in ours]
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[:] = [str(cwd), *extra, *site]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            script = (cwd / args[0]).resolve()
            sys.argv = [str(script), *args[1:]]
            sys.path[:] = [str(script.parent), *extra, *site]
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    return 0
