"""A tenant's own LeRobot dataset, uploaded over the API: private, validated, quota-bound, and safe
against hostile archives (a refused upload leaves nothing behind)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import httpx
import pytest
from api_server import running_server

from vlamux.sdk import Client

HEAD = {"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from demos import demo_dataset

    root = tmp_path_factory.mktemp("uploads")
    demos = root / "demos"
    demo_dataset(demos, 3)
    with running_server(root / "svc") as (url, admin_key, host):
        admin = Client(url, admin_key)
        keys = {}
        for name in ("owner", "stranger", "small"):
            quotas = {"requests_per_s": 10000, **({"max_dataset_mb": 0.01} if name == "small" else {})}
            keys[name] = {"Authorization": f"Bearer {admin.admin.create_tenant(name, quotas)[1]}"}
        yield url, keys, demos, root / "svc"


def _tar(src: Path | None = None, extra=(), gz: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as t:
        if src is not None:
            t.add(src, arcname="ds")
        for info, data in extra:
            t.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _post(url, h, name, body, ctype="application/x-tar"):
    return httpx.post(f"{url}/v1/datasets", params={"name": name}, content=body,
                      headers={**h, "Content-Type": ctype}, timeout=120)


def test_an_uploaded_dataset_is_private_listed_trains_a_job_and_is_deleted_by_its_owner(served):
    url, keys, demos, _ = served
    r = _post(url, keys["owner"], "mine", _tar(demos, gz=True), "application/gzip")
    assert r.status_code == 201, r.text
    d = r.json()["dataset"]
    assert d["name"] == "mine" and d["public"] is False and d["episodes"] == 3 and d["bytes"] > 0
    listed = httpx.get(f"{url}/v1/datasets", headers=keys["owner"], timeout=30).json()["datasets"]
    assert [x["name"] for x in listed if not x["public"]] == ["mine"]
    theirs = httpx.get(f"{url}/v1/datasets", headers=keys["stranger"], timeout=30).json()["datasets"]
    assert "mine" not in [x["name"] for x in theirs]

    job = {"name": "sft-mine", "kind": "sft", "head": HEAD, "sft": {"dataset": "mine", "steps": 2, "batch_size": 4}}
    ok = httpx.post(f"{url}/v1/jobs", headers=keys["owner"], json=job, timeout=60)
    assert ok.status_code == 202, ok.text
    c = Client(url, keys["owner"]["Authorization"][7:])
    assert c.job(ok.json()["job"]["id"]).wait(timeout_s=120, progress=False).state == "succeeded"
    refused = httpx.post(f"{url}/v1/jobs", headers=keys["stranger"], json=job, timeout=60)
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "sft.dataset"
    assert "mine" in refused.json()["error"]["message"] and "tenants" not in refused.json()["error"]["message"]

    again = _post(url, keys["owner"], "mine", _tar(demos))
    assert again.status_code == 409
    assert httpx.delete(f"{url}/v1/datasets/mine", headers=keys["stranger"], timeout=30).status_code == 404
    assert httpx.delete(f"{url}/v1/datasets/mine", headers=keys["owner"], timeout=30).status_code == 204
    assert "mine" not in [x["name"] for x in httpx.get(f"{url}/v1/datasets", headers=keys["owner"]).json()["datasets"]]


def _member(name, kind=tarfile.REGTYPE, data=b"x", linkname=""):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, (data if kind == tarfile.REGTYPE else None)


@pytest.mark.parametrize("what, extra, field_text", [
    ("path traversal", [_member("../escape.txt")], "'..'"),
    ("absolute path", [_member("/etc/vlamux-owned")], "absolute"),
    ("symlink", [_member("ds/link", tarfile.SYMTYPE, linkname="/etc/passwd")], "links"),
    ("hard link", [_member("ds/hard", tarfile.LNKTYPE, linkname="ds/meta/info.json")], "links"),
    ("a zip bomb", [_member("ds/zeros", data=b"\0" * (8 << 20))], "x its size"),
    ("not a dataset", [_member("ds/readme.txt", data=b"hello")], "meta/info.json"),
])
def test_hostile_or_wrong_archives_are_refused_and_leave_nothing(served, what, extra, field_text):
    url, keys, demos, svc = served
    body = _tar(None, extra, gz=(what == "a zip bomb"))
    r = _post(url, keys["owner"], "bad", body, "application/gzip" if what == "a zip bomb" else "application/x-tar")
    assert r.status_code == 422 and field_text in r.json()["error"]["message"], (what, r.status_code, r.text)
    own = svc / "tenants"
    assert not list(own.rglob("bad")) and not list(own.rglob(".upload-*")) and not list(own.rglob("uploads/*.tar"))
    assert not (svc.parent / "escape.txt").exists() and not Path("/etc/vlamux-owned").exists()


def test_a_dataset_that_does_not_read_names_the_file(served, tmp_path):
    import shutil

    url, keys, demos, _ = served
    broken = tmp_path / "broken"
    shutil.copytree(demos, broken)
    next((broken / "data").rglob("*.parquet")).write_bytes(b"not parquet")
    r = _post(url, keys["owner"], "broken", _tar(broken))
    assert r.status_code == 422 and "parquet" in r.json()["error"]["message"], r.text


def test_a_dataset_missing_a_stat_is_refused_naming_it(served, tmp_path):
    import json
    import shutil

    url, keys, demos, svc = served
    broken = tmp_path / "nostat"
    shutil.copytree(demos, broken)
    stats = json.loads((broken / "meta" / "stats.json").read_text())
    del stats["action"]
    (broken / "meta" / "stats.json").write_text(json.dumps(stats))
    r = _post(url, keys["owner"], "nostat", _tar(broken))
    assert r.status_code == 422 and "stats.json" in r.text and "'action'" in r.text, r.text
    assert str(svc) not in r.text and not list((svc / "tenants").rglob("nostat"))


def test_a_truncated_or_oversized_upload_is_refused_and_leaves_nothing(served):
    url, keys, demos, svc = served
    whole = _tar(demos, gz=True)
    r = _post(url, keys["owner"], "cut", whole[: len(whole) // 2], "application/gzip")
    assert r.status_code == 422 and ("damaged" in r.text or "not a tar" in r.text or "truncated" in r.text.lower()), r.text
    limit = int(4096 * (1 << 20))  # max_upload_mb's default: a declared length over it is refused unread
    import socket
    from urllib.parse import urlparse

    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:  # a declared length, no body
        sock.sendall(f"POST /v1/datasets?name=big HTTP/1.1\r\nHost: x\r\nAuthorization: "
                     f"{keys['owner']['Authorization']}\r\nContent-Type: application/x-tar\r\n"
                     f"Content-Length: {limit + 1}\r\n\r\n".encode())
        answer = sock.recv(65536).decode()
        while str(limit) not in answer and (more := sock.recv(65536)):  # the body may come after the headers
            answer += more.decode()
    assert answer.startswith("HTTP/1.1 413") and str(limit) in answer, answer
    assert not list((svc / "tenants").rglob("cut")) and not list((svc / "tenants").rglob("incoming/*"))


def test_uploads_count_against_the_tenants_dataset_quota(served):
    url, keys, demos, _ = served
    r = _post(url, keys["small"], "toolarge", _tar(demos))
    assert r.status_code in (422, 429) and ("max_dataset_mb" in r.text or "more than" in r.text), r.text
    assert not [x for x in httpx.get(f"{url}/v1/datasets", headers=keys["small"]).json()["datasets"] if not x["public"]]


def test_the_sdk_and_the_cli_upload_a_directory(served):
    from click.testing import CliRunner

    from vlamux.cli import main

    url, keys, demos, _ = served
    c = Client(url, keys["stranger"]["Authorization"][7:])
    d = c.upload_dataset(str(demos), name="from-sdk")
    assert d["episodes"] == 3 and any(x["name"] == "from-sdk" and not x["public"] for x in c.datasets())
    c.delete_dataset("from-sdk")
    env = {"VLAMUX_URL": None, "VLAMUX_API_KEY": None}
    key = keys["stranger"]["Authorization"][7:]
    r = CliRunner(env=env).invoke(main, ["--url", url, "--key", key, "datasets", "upload", str(demos), "--name", "cli"])
    assert r.exit_code == 0 and "3 episodes" in r.output, r.output
    r = CliRunner(env=env).invoke(main, ["--url", url, "--key", key, "datasets"])
    assert "cli  yours" in r.output, r.output
