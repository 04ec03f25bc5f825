"""Issue 24: uploads reach the disk only within the tenant's dataset quota (max_dataset_mb), against
`vlamux serve` as a subprocess.

A whole upload (POST /v1/datasets, /v1/policy-files) whose Content-Length passes the tenant's remaining
quota is refused (429, the numbers named) before a byte is written; one without a Content-Length
(chunked) is reserved chunk by chunk before each is written and cut off as it passes the quota; at most
MAX_WHOLE_UPLOADS of a tenant's stream at once (429 with Retry-After). A sampler thread sums the bytes
of every file under the tenant's directory every ~2 ms while 4 uploads of 50 to 250 MB run at once.

The bound asserted is the quota itself: the server reserves each received chunk before writing it (a
chunk is what uvicorn's h11 hands the app per receive: at most its 64 KiB high-water mark plus one
socket read of 256 KiB; the client sends 1 MiB blocks), so "quota plus one chunk" holds with room.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from api_server import served as serve_subprocess

from vlamux.api.tenant_files import MAX_WHOLE_UPLOADS

pytestmark = pytest.mark.timeout(300)
MIB = 1 << 20
QUOTA = 1 * MIB  # max_dataset_mb: 1
BLOCK = b"\0" * MIB  # the client's chunk (junk: were it ever accepted it would be refused as "not a tar")
SIZES_MB = (50, 100, 150, 250)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from vlamux.sdk import Client

    root = tmp_path_factory.mktemp("upload-quota")
    svc = root / "svc"
    with serve_subprocess(svc, root / "server.log") as (url, admin_key, _):
        admin = Client(url, admin_key)
        keys, dirs = {}, {}
        for name, quotas in (("flood", {"max_dataset_mb": 1}), ("capped", {}), ("resume", {"max_dataset_mb": 1}),
                             ("drop", {"max_dataset_mb": 1})):
            tenant, keys[name] = admin.admin.create_tenant(name, {"requests_per_s": 10000, **quotas})
            dirs[name] = svc / "tenants" / tenant["id"]  # all that tenant's files, the sampler's subject
        yield url, keys, dirs, svc


def h(key: str, **more) -> dict:
    return {"Authorization": f"Bearer {key}", **more}


def files_under(path: Path) -> list[tuple[Path, int]]:
    out = []
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                out.append((Path(dirpath) / n, os.stat(os.path.join(dirpath, n)).st_size))
            except FileNotFoundError:  # removed while we looked
                pass
    return out


class Sampler(threading.Thread):
    """The bytes of every file under `path`, every ~2 ms: the peak, and how many samples were taken."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.peak, self.samples, self.files_seen = path, 0, 0, 0
        self._done = threading.Event()

    def run(self):
        while not self._done.is_set():
            found = files_under(self.path)
            self.peak = max(self.peak, sum(n for _, n in found))
            self.files_seen = max(self.files_seen, len(found))
            self.samples += 1
            time.sleep(0.002)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self.join(10)


def blocks(mb: int):
    for _ in range(mb):
        yield BLOCK


def refused_for_quota(r: httpx.Response, svc: Path) -> dict:
    """A 429 in the API's error shape, naming the quota (or the cap on uploads at once), no server path."""
    assert r.status_code == 429, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["type"] == "quota_exceeded" and r.headers.get("retry-after"), r.text
    assert "max_dataset_mb" in err["message"] or f"{MAX_WHOLE_UPLOADS} uploads" in err["message"], r.text
    assert str(svc) not in r.text and "/tenants/" not in r.text and "incoming" not in r.text, r.text
    return err


def post(client: httpx.Client, route: str, key: str, content, length: int | None = None, name: str = "big"):
    headers = h(key, **{"Content-Type": "application/octet-stream"})
    if length is not None:  # a generator body with a declared length: sent as is, not chunked
        headers["Content-Length"] = str(length)
    return client.post(route, params={"name": name}, content=content, headers=headers)


def tiny_hdf5(path: Path) -> Path:
    """A valid robomimic-layout HDF5 dataset of a few KB: the follow-up upload that must succeed."""
    import h5py
    import numpy as np

    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        g = f.create_group("data").create_group("demo_0")
        g.create_dataset("actions", data=rng.uniform(-1, 1, (6, 4)).astype(np.float32))
        g.create_dataset("obs/agentview_rgb", data=rng.integers(0, 255, (6, 16, 16, 3), dtype=np.uint8))
        g.create_dataset("obs/state", data=rng.normal(size=(6, 8)).astype(np.float32))
        g.attrs["num_samples"] = 6
    return path


def wait_empty(path: Path, timeout_s: float = 10.0) -> list:
    deadline = time.monotonic() + timeout_s
    while (left := files_under(path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


# ---- 1. four large uploads at once against a 1 MB quota ---------------------------------------------------
@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_parallel_large_uploads_never_put_more_than_the_quota_on_disk(served, tmp_path, declared):
    url, keys, dirs, svc = served
    key, tenant_dir = keys["flood"], dirs["flood"]
    clients = [httpx.Client(base_url=url, timeout=120) for _ in SIZES_MB]

    def one(i: int):
        mb = SIZES_MB[i]
        route = "/v1/policy-files" if i == 3 else "/v1/datasets"
        t0 = time.monotonic()
        r = post(clients[i], route, key, blocks(mb), mb * MIB if declared else None, name=f"big{i}")
        return r, time.monotonic() - t0

    try:
        with Sampler(tenant_dir) as sampler, ThreadPoolExecutor(len(SIZES_MB)) as pool:
            answers = list(pool.map(one, range(len(SIZES_MB))))
        assert sampler.samples > 10
        # the bound: never more than the quota on disk (reserved before written), however many at once
        assert sampler.peak <= QUOTA, (sampler.peak, QUOTA)
        if declared:  # refused on the declared length alone: no spool file was ever created
            assert sampler.peak == 0 and sampler.files_seen == 0, (sampler.peak, sampler.files_seen)
        for (r, _), mb in zip(answers, SIZES_MB):
            err = refused_for_quota(r, svc)
            if "max_dataset_mb" in err["message"]:
                assert str(QUOTA) in err["message"], err  # the limit, in bytes
                if declared:
                    assert str(mb * MIB) in err["message"], err  # the declared size
        assert any("max_dataset_mb" in r.json()["error"]["message"] for r, _ in answers)
        assert wait_empty(tenant_dir) == []  # nothing left: no spool, no partial file

        # each connection and the server stay usable; every reservation was given back
        for c in clients:
            assert c.get("/v1/datasets", headers=h(key)).status_code == 200
        junk = post(clients[0], "/v1/datasets", key, b"\1" * (QUOTA - 4096), name="junk")
        assert junk.status_code == 422 and "not a tar" in junk.text, junk.text  # inside the quota: read, refused
        ok = post(clients[1], "/v1/datasets", key, tiny_hdf5(tmp_path / "tiny.hdf5").read_bytes(), name="tiny")
        assert ok.status_code == 201 and ok.json()["dataset"]["format"] == "hdf5", ok.text
        assert clients[1].delete("/v1/datasets/tiny", headers=h(key)).status_code == 204
        assert files_under(tenant_dir) == [] and tenant_dir.is_dir()  # (the sampler watched the right place)
    finally:
        for c in clients:
            c.close()


def test_a_declared_length_over_the_quota_is_answered_before_the_body(served):
    """Headers alone, no body sent: the 429 comes at once (the server reads nothing of the body)."""
    url, keys, dirs, svc = served
    u = urlparse(url)
    for route in ("/v1/datasets", "/v1/policy-files"):
        with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
            t0 = time.monotonic()
            sock.sendall(f"POST {route}?name=huge HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {keys['flood']}\r\n"
                         f"Content-Type: application/x-tar\r\nContent-Length: {250 * MIB}\r\n\r\n".encode())
            answer = b""
            while b"}}" not in answer and (more := sock.recv(65536)):
                answer += more
            assert time.monotonic() - t0 < 5
        text = answer.decode()
        assert text.startswith("HTTP/1.1 429") and "max_dataset_mb" in text and str(250 * MIB) in text, text
        assert "retry-after" in text.lower() and str(svc) not in text
    assert files_under(dirs["flood"]) == []


def test_a_client_that_goes_away_mid_body_leaves_nothing_and_its_reservation_back(served):
    url, keys, dirs, svc = served
    key, tenant_dir = keys["drop"], dirs["drop"]

    def cut():
        yield b"\0" * (QUOTA // 2)
        time.sleep(0.3)  # the server has it (and reserved it)
        raise ConnectionResetError("cable pulled")

    with pytest.raises(Exception):
        httpx.post(f"{url}/v1/datasets", params={"name": "cut"}, content=cut(), timeout=30,
                   headers=h(key, **{"Content-Type": "application/x-tar"}))
    assert wait_empty(tenant_dir) == []
    # the half quota the dropped upload held is free again (polled: the server learns of the drop itself)
    deadline, r = time.monotonic() + 10, None
    while time.monotonic() < deadline:
        r = httpx.post(f"{url}/v1/datasets", params={"name": "after"}, content=b"\1" * (QUOTA - 4096), timeout=30,
                       headers=h(key, **{"Content-Type": "application/x-tar"}))
        if r.status_code != 429:
            break
        time.sleep(0.1)
    assert r.status_code == 422 and "not a tar" in r.text, r.text
    assert files_under(tenant_dir) == []


# ---- 2. the cap on whole uploads at once ---------------------------------------------------------------------
def test_more_whole_uploads_at_once_than_the_cap_get_429_with_retry_after(served):
    url, keys, dirs, svc = served
    key, incoming = keys["capped"], dirs["capped"] / "incoming"
    go = threading.Event()

    def slow():
        yield b"\0" * (64 << 10)
        go.wait(60)  # held open until the extra ones have been refused
        yield b"\0" * (64 << 10)

    def one(_):
        with httpx.Client(base_url=url, timeout=120) as c:
            return post(c, "/v1/datasets", key, slow(), name="slow")

    with ThreadPoolExecutor(MAX_WHOLE_UPLOADS) as pool:
        running = [pool.submit(one, i) for i in range(MAX_WHOLE_UPLOADS)]
        try:
            deadline = time.monotonic() + 30
            while len(files_under(incoming)) < MAX_WHOLE_UPLOADS and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(files_under(incoming)) == MAX_WHOLE_UPLOADS
            for route in ("/v1/datasets", "/v1/policy-files"):
                t0 = time.monotonic()
                extra = httpx.post(f"{url}{route}", params={"name": "extra"}, content=b"\0" * 4096, timeout=30,
                                   headers=h(key, **{"Content-Type": "application/octet-stream"}))
                assert time.monotonic() - t0 < 5
                err = refused_for_quota(extra, svc)
                assert f"{MAX_WHOLE_UPLOADS} uploads" in err["message"] and "at once" in err["message"], err
                assert int(extra.headers["retry-after"]) >= 1
            assert len(files_under(incoming)) == MAX_WHOLE_UPLOADS  # the refused ones wrote nothing
        finally:
            go.set()
        for f in running:  # junk bodies: read whole, then refused for what they are
            r = f.result()
            assert r.status_code == 422 and "not a tar" in r.text, r.text
    after = httpx.post(f"{url}/v1/datasets", params={"name": "after"}, content=b"\0" * 4096, timeout=30,
                       headers=h(key, **{"Content-Type": "application/octet-stream"}))
    assert after.status_code == 422, after.text  # the slots are free again
    assert wait_empty(dirs["capped"]) == []


# ---- 3. resumable uploads and whole ones share the quota -------------------------------------------------------
def test_a_resumable_upload_reserves_and_a_whole_upload_sees_the_reservation(served):
    url, keys, dirs, svc = served
    key, tenant_dir = keys["resume"], dirs["resume"]
    A = h(key)
    over = httpx.post(f"{url}/v1/uploads", json={"bytes": 2 * MIB}, headers=A, timeout=30)
    err = refused_for_quota(over, svc)
    assert str(2 * MIB) in err["message"] and str(QUOTA) in err["message"], err

    held = 700 << 10
    up = httpx.post(f"{url}/v1/uploads", json={"bytes": held}, headers=A, timeout=30)
    assert up.status_code == 201, up.text
    uid = up.json()["upload"]["id"]
    where = f"{url}/v1/uploads/{uid}"
    with httpx.Client(base_url=url, timeout=60) as c:
        declared = post(c, "/v1/datasets", key, b"\0" * (500 << 10), name="whole")  # 700 K + 500 K > 1 M
        err = refused_for_quota(declared, svc)
        assert str(held) in err["message"] and str(500 << 10) in err["message"], err
        with Sampler(tenant_dir) as sampler:
            chunked = post(c, "/v1/datasets", key, (b"\0" * (100 << 10) for _ in range(5)), name="whole")
        refused_for_quota(chunked, svc)
        assert sampler.peak <= QUOTA - held, sampler.peak  # the session's file is still empty
        assert c.get("/v1/datasets", headers=A).status_code == 200

    # a chunk cannot run past the upload's declared size: by its Content-Length (nothing written) or as it streams
    octet = {**A, "Content-Type": "application/octet-stream"}
    past = httpx.put(where, params={"offset": 0}, content=b"\0" * (held + 1), headers=octet, timeout=30)
    assert past.status_code == 413 and str(held) in past.json()["error"]["message"], past.text
    streamed = httpx.put(where, params={"offset": 0}, content=(b"\0" * (100 << 10) for _ in range(8)), headers=octet,
                         timeout=30)
    assert streamed.status_code == 413, streamed.text
    assert httpx.get(where, headers=A).json()["upload"]["offset"] == 0
    assert sum(n for _, n in files_under(tenant_dir)) <= QUOTA

    assert httpx.delete(where, headers=A).status_code == 204  # the reservation goes with the session
    with httpx.Client(base_url=url, timeout=60) as c:
        r = post(c, "/v1/datasets", key, b"\1" * (500 << 10), name="whole")
        assert r.status_code == 422 and "not a tar" in r.text, r.text
    assert wait_empty(tenant_dir) == []
