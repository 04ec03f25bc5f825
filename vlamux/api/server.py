"""`vlamux serve`: the services and the HTTP API in one process, until SIGINT/SIGTERM.

A stop, clean or not, loses nothing: jobs are in the store and checkpoint as they go, so the next
start resumes every job that was running from its last checkpoint.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from vlamux.api.host import ServiceConfig, ServiceHost

log = logging.getLogger(__name__)


def serve(host_addr: str = "127.0.0.1", port: int = 8321, config: ServiceConfig | None = None,
          admin_key: str | None = None, log_level: str = "info") -> None:
    import uvicorn

    from vlamux.api.app import create_app

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config or ServiceConfig()
    host = ServiceHost(config)
    new_admin = host.start(admin_key)
    key_file = Path(config.data_dir) / "admin.key"
    if new_admin:
        write_private(key_file, new_admin + "\n")
        # never printed: logs and terminals are read by more people than the key's file
        print(f"admin API key written to {key_file} (mode 600); the CLI reads it with "
              f"--admin-key-file {key_file}", flush=True)
    runtime = "ray at " + config.ray_address if config.ray_address else "embedded"
    print(f"vlamux serving on http://{host_addr}:{port} ({runtime} runtime, backbone {config.backbone}, "
          f"data in {config.data_dir}); dashboard: /dashboard, API docs: /docs", flush=True)
    try:
        uvicorn.run(create_app(host), host=host_addr, port=port, log_level=log_level.lower(),
                    timeout_graceful_shutdown=10, timeout_keep_alive=5)  # idle connections close after 5 s
    finally:
        host.stop()


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read, from its first byte (no window at the umask's mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode under O_CREAT: set it
        os.write(fd, text.encode())
    finally:
        os.close(fd)
