"""Where simulator processes (VectorEnv's workers, the demonstration writer's) come from: a fork
server, started once per process that needs one, instead of a fresh interpreter per worker.

With "spawn" every worker re-imports the parent's main module (a benchmark or `python -m
vlamux.main_job` imports torch and the whole service: 3 s a worker, 40% of a short multi-tenant run
on two cores). The fork server imports what the main module and the worker code need once; each
worker is a fork of it, so starting one costs a fraction of a second. The server forks from a clean
process (no threads of the parent's), which is why this is safe where a plain fork of a threaded
service is not.

The server's environment is the parent's when the server started; a worker gets the parent's
environment as it is when the worker starts (`environ()` / `apply_environ`), as a spawned one would:
the GL choice, MUJOCO_EGL_DEVICE_ID and test-time settings reach it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys

# Imported once in the server, so workers fork with them loaded: the worker loop and the built-in
# tabletop simulator (MuJoCo and its GL bindings: 0.4 s a worker otherwise). MuJoCo takes its GL
# backend when it is imported: the env module runs `configure_gl()` first, and the server starts from a
# process that has chosen already (VectorEnv and the demo writer choose before they ask for workers),
# so the server's choice is its parent's; a worker's own environment comes with it (`apply_environ`).
PRELOAD = ("vlamux.envs.workers", "vlamux.envs.tabletop.env")


def worker_context() -> mp.context.BaseContext:
    """The multiprocessing context for helper processes: a fork server preloaded with `PRELOAD` and
    what a worker would otherwise import again and again (see `_main_imports`)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*_main_imports(), *PRELOAD])  # takes effect when the server starts
    return ctx


def _main_imports() -> list[str]:
    """A worker runs the parent's main module again (multiprocessing's rule, so that what it pickles by
    `__main__.name` resolves): a script by its path, `python -m pkg.mod` by name. Python 3.11's fork
    server cannot preload a main given by path (it never receives the path), and one preloaded by name
    would be run over an imported copy (runpy warns in every worker), so the server preloads what such a
    main costs instead: torch and the vlamux modules this process has loaded, the main itself excepted.
    In a worker the main then runs on imports already made."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None and (name == "__main__" or name.endswith(".__main__")):
        return []  # multiprocessing does not run such a main again
    if name is None and getattr(main, "__file__", None) is None:  # python -c, an interactive session
        return []
    return sorted(m for m in list(sys.modules)
                  if m != name and (m == "torch" or m == "vlamux" or m.startswith("vlamux.")))


def environ() -> dict[str, str]:
    """This process's environment, for a worker to take on as it starts."""
    return dict(os.environ)


def apply_environ(env: dict[str, str] | None) -> None:
    """In a worker: make its environment the one its parent had when it asked for the worker."""
    if env is None:
        return
    os.environ.clear()
    os.environ.update(env)
