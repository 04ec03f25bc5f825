"""`python -m vlamux.cli serve ...` for tests, forked from one interpreter per test process that has
imported torch, FastAPI and vlamux's service once (a zygote), instead of a fresh interpreter that
spends about 6 of a server's 7.5 CPU-s of start on those imports (this 2-core machine).

The forked server is still a process of its own, in a session of its own, with the environment and
output it was given: tests that kill, restart or signal it meet a real process. Only its parent
differs (the zygote, which reaps it), so the handle here asks the zygote for its exit code.

    from zygote import popen
    proc = popen([sys.executable, "-m", "vlamux.cli", "serve", ...], stdout=log, env=env)

The zygote is a fresh interpreter, never a fork of the test process: a pytest worker has threads
(uvicorn, torch's pools, Ray's) whose locks a fork would copy held.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = ("torch", "fastapi", "uvicorn", "vlamux.api.app", "vlamux.api.host", "vlamux.services.runtime",
           "vlamux.cli")


class Forked:
    """What tests use of `subprocess.Popen`, for a child of the zygote."""

    def __init__(self, zygote: "Zygote", pid: int, args: list[str]):
        self._zygote, self.pid, self.args, self.returncode = zygote, pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.request({"poll": self.pid})["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The test process's side: one request at a time over a Unix socket (JSON, the child's output
    descriptor passed with SCM_RIGHTS)."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self._proc = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                      cwd=ROOT, env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self._sock, self._lock = ours, threading.Lock()
        self._reader = ours.makefile("r")
        self.request({"ping": True}, timeout_s=120)  # its imports done

    def request(self, message: dict, fds=(), timeout_s: float = 30) -> dict:
        with self._lock:
            self._sock.settimeout(timeout_s)
            socket.send_fds(self._sock, [json.dumps(message).encode() + b"\n"], list(fds))
            line = self._reader.readline()
        if not line:
            raise RuntimeError(f"the test zygote exited ({self._proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the test zygote: {reply['error']}")
        return reply

    def popen(self, argv: list[str], stdout=None, stderr=None, env=None, cwd=None) -> Forked:
        """`argv` as `subprocess.Popen` would start it (`[python, "-m", module, ...]` or `[python, script,
        ...]`), its stdout and stderr to `stdout` (a file), or nowhere."""
        out = stdout if hasattr(stdout, "fileno") else open(os.devnull, "w")  # noqa: SIM115
        try:
            reply = self.request({"argv": list(map(str, argv)), "cwd": str(cwd or os.getcwd()),
                                  "env": dict(os.environ if env is None else env)}, fds=[out.fileno()])
        finally:
            if out is not stdout:
                out.close()
        return Forked(self, reply["pid"], argv)


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def popen(argv, stdout=None, stderr=None, env=None, cwd=None) -> Forked:
    """A `subprocess.Popen` for `vlamux.cli` children, from this process's zygote (started on first use)."""
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote._proc.poll() is not None:
            _zygote = Zygote()
    return _zygote.popen(argv, stdout=stdout, stderr=stderr, env=env, cwd=cwd)


def _serve(sock: socket.socket) -> None:
    """The zygote: fork a child per request, reap them when asked; kill what is left when the test
    process goes."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from step_process import fork_python

    children: dict[int, int | None] = {}
    buffer = b""
    try:
        while True:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
            if not data:
                return
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                message = json.loads(line)
                try:
                    if "argv" in message:
                        pid = fork_python(message["argv"], Path(message["cwd"]), message["env"], fds[0])
                        children[pid] = None
                        reply = {"pid": pid}
                    elif "poll" in message:
                        pid = message["poll"]
                        if children.get(pid) is None:
                            done, status = os.waitpid(pid, os.WNOHANG)
                            if done:
                                children[pid] = os.waitstatus_to_exitcode(status)
                        reply = {"code": children[pid]}
                    else:
                        reply = {"ok": True}
                except Exception as e:  # noqa: BLE001 - said to the test, the zygote goes on
                    reply = {"error": f"{type(e).__name__}: {e}"}
                finally:
                    for fd in fds:
                        os.close(fd)
                    fds = []
                sock.sendall(json.dumps(reply).encode() + b"\n")
    finally:
        for pid, code in children.items():
            if code is None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


if __name__ == "__main__":
    sys.path.remove(str(Path(__file__).resolve().parent))  # the children's path is their own, not tests/
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    _serve(socket.socket(fileno=int(sys.argv[1])))
