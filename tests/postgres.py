"""A throwaway PostgreSQL server for the tests: Debian's binaries (scripts/setup-system.sh installs
them), a fresh cluster in a temporary directory, on a free loopback port, stopped at the end.

PostgreSQL refuses to run as root; as root (CI containers) the cluster runs as the `postgres` user.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def _bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or ([shutil.which(name)] if shutil.which(name) else [])
    if not found:
        raise RuntimeError(f"PostgreSQL's {name} is not installed: run scripts/setup-system.sh (apt-get install "
                           f"postgresql), as `make test` does")
    return found[-1]


def _as_owner(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def postgres_server():
    """Yields a SQLAlchemy URL of a new, empty database `vlamux` (user `postgres`, trust auth on
    loopback only)."""
    root = Path(tempfile.mkdtemp(prefix="vlamux-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        shutil.chown(sock, "postgres")
    port = _port()
    run = lambda cmd: subprocess.run(_as_owner(cmd), check=True, capture_output=True, text=True, timeout=120)  # noqa: E731
    try:
        run([_bin("initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"])
        run([_bin("pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "-t", "60", "start", "-o",
             f"-h 127.0.0.1 -p {port} -k {sock} -c fsync=off -c max_connections=200"])
    except subprocess.CalledProcessError as e:
        log = (root / "log").read_text() if (root / "log").exists() else ""
        raise RuntimeError(f"could not start PostgreSQL: {e.stderr or e.stdout}{log[-2000:]}") from None
    try:
        url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
        import sqlalchemy

        engine = sqlalchemy.create_engine(url, isolation_level="AUTOCOMMIT")
        for _ in range(50):
            try:
                with engine.connect() as c:
                    c.execute(sqlalchemy.text("CREATE DATABASE vlamux"))
                break
            except sqlalchemy.exc.OperationalError:
                time.sleep(0.2)
        engine.dispose()
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/vlamux"
    finally:
        subprocess.run(_as_owner([_bin("pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]),
                       capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


def fresh_database(url: str, name: str) -> str:
    """A new empty database beside the one `url` names: each test gets its own."""
    import sqlalchemy

    server = url.rsplit("/", 1)[0]
    engine = sqlalchemy.create_engine(f"{server}/postgres", isolation_level="AUTOCOMMIT")
    with engine.connect() as c:
        c.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return f"{server}/{name}"
