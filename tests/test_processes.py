"""Simulator processes fork from a fork server (vlamux/envs/processes.py): a worker sees its parent's
environment as it is when the worker starts (not as it was when the server started), and the server
preloads what a worker would otherwise import again for the parent's main module."""

import os
import sys
import types

from vlamux.envs.processes import _main_imports, apply_environ, environ, worker_context


def _report(q, env, names):
    apply_environ(env)
    q.put({n: os.environ.get(n) for n in names})


def test_a_worker_takes_its_parents_environment_as_it_starts(monkeypatch):
    ctx = worker_context()
    monkeypatch.setenv("VLAMUX_TEST_MARK", "before")
    q = ctx.Queue()
    first = ctx.Process(target=_report, args=(q, environ(), ["VLAMUX_TEST_MARK"]))
    first.start()  # the server exists from here on, with "before" in its own environment
    assert q.get(timeout=60) == {"VLAMUX_TEST_MARK": "before"}
    first.join(30)
    monkeypatch.setenv("VLAMUX_TEST_MARK", "after")
    monkeypatch.delenv("VLAMUX_TEST_GONE", raising=False)
    second = ctx.Process(target=_report, args=(q, environ(), ["VLAMUX_TEST_MARK", "VLAMUX_TEST_GONE"]))
    second.start()
    assert q.get(timeout=60) == {"VLAMUX_TEST_MARK": "after", "VLAMUX_TEST_GONE": None}
    second.join(30)
    assert first.exitcode == second.exitcode == 0


def _main(monkeypatch, name=None, file=None):
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name=name) if name else None
    if file:
        main.__file__ = file
    monkeypatch.setitem(sys.modules, "__main__", main)


def test_the_server_preloads_what_the_parents_main_would_import_again(monkeypatch):
    _main(monkeypatch, file="/somewhere/bench/multi_tenant.py")  # a script: run again by its path
    by_path = _main_imports()
    assert "torch" in by_path and "vlamux.envs.processes" in by_path
    assert all(m == "torch" or m.split(".")[0] == "vlamux" for m in by_path)
    _main(monkeypatch, name="vlamux.envs.processes")  # python -m: run again by name, so not preloaded itself
    assert "vlamux.envs.processes" not in _main_imports() and "torch" in _main_imports()
    for name in ("vlamux.cli.__main__", "__main__"):  # multiprocessing runs these mains again never
        _main(monkeypatch, name=name)
        assert _main_imports() == []
    _main(monkeypatch)  # python -c
    assert _main_imports() == []
