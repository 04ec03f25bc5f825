"""A real vlamux HTTP server for tests: the app on uvicorn, on a free localhost port, in a thread;
or `vlamux serve` as a child process (`served`), for tests that must meet the server as a client
does (or kill it).

    from api_server import running_server

    with running_server(tmp_path) as (url, admin_key, host):
        c = vlamux.Client(url, api_key=admin_key)
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

from vlamux.api.host import ServiceConfig, ServiceHost


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(data_dir, port: int, **kw):
    """`vlamux.sdk.process.spawn`, forked from this test process's preloaded zygote (tests/zygote.py):
    a real server process without a fresh interpreter's imports."""
    from vlamux.sdk.process import spawn
    from zygote import popen

    return spawn(data_dir, port, popen=popen, **kw)


@contextlib.contextmanager
def served(data_dir: Path, log: Path | None = None, extra_args=()):
    """`vlamux serve` on `data_dir` as a child process (one torch thread, its output in `log`), stopped
    on the way out. Yields ``(url, admin_key, proc)``."""
    import os

    from vlamux.sdk.process import stop

    port = free_port()
    log = log or Path(data_dir).parent / f"{Path(data_dir).name}.log"
    proc = spawn(data_dir, port, log=log.open("a"), extra_args=extra_args, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        yield f"http://127.0.0.1:{port}", (Path(data_dir) / "admin.key").read_text().strip(), proc
    finally:
        stop(proc)


@contextlib.contextmanager
def running_server(tmp_path: Path, **config):
    """Yields ``(url, admin_key, host)``; `config` overrides `ServiceConfig` fields (data_dir is tmp_path)."""
    import uvicorn

    from vlamux.api.app import create_app

    config.setdefault("group_cap", None)  # as tests/conftest.py makes `vlamux serve`'s default: no timing at start
    host = ServiceHost(ServiceConfig(data_dir=Path(tmp_path), **config))
    admin_key = host.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # bound before uvicorn starts: no race for the port
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(host), log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}", admin_key, host
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
        host.stop()
