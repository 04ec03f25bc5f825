"""A tenant's files beyond a LeRobot archive: robomimic / LIBERO HDF5 datasets, resumable chunked
uploads (dropped chunks, wrong offsets, oversize, digests, quotas), and policy files as a job's
init_from. Each refusal names what was wrong and leaves nothing behind; another tenant sees none of it."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import h5py
import httpx
import numpy as np
import pytest
from api_server import running_server

from vlamux.sdk import Client
from vlamux.sdk.uploads import upload

HEAD = {"kind": "l1_chunk", "action_dim": 4, "horizon": 4, "state_dim": 8, "width": 64, "depth": 1}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from demos import demo_dataset

    root = tmp_path_factory.mktemp("files")
    demos = root / "demos"
    demo_dataset(demos, 3)
    with running_server(root / "svc") as (url, admin_key, host):
        admin = Client(url, admin_key)
        keys = {}
        for name, quotas in (("owner", {}), ("stranger", {}), ("small", {"max_dataset_mb": 0.05})):
            keys[name] = admin.admin.create_tenant(name, {"requests_per_s": 10000, **quotas})[1]
        yield url, keys, demos, root / "svc"


def h(key: str, **more) -> dict:
    return {"Authorization": f"Bearer {key}", **more}


def libero_file(path, demos=3, frames=12, external: str | None = None, drop: str | None = None, libero=True):
    """A LIBERO-layout HDF5 file: agentview + wrist cameras (uint8), 4-d actions, an 8-d state
    (libero=False: robomimic's, which names no instruction)."""
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        data = f.create_group("data")
        if libero:
            data.attrs["problem_info"] = json.dumps({"language_instruction": "touch the red cube"})
        data.attrs["env_args"] = json.dumps({"env_name": "tabletop", "env_kwargs": {"control_freq": 20}})
        for i in range(demos):
            g = data.create_group(f"demo_{i}")
            arrays = {"actions": rng.uniform(-1, 1, (frames, 4)).astype(np.float32),
                      "obs/agentview_rgb": rng.integers(0, 255, (frames, 32, 32, 3), dtype=np.uint8),
                      "obs/eye_in_hand_rgb": rng.integers(0, 255, (frames, 32, 32, 3), dtype=np.uint8),
                      "obs/state": rng.normal(size=(frames, 8)).astype(np.float32)}
            for k, v in arrays.items():
                if k != drop:
                    g.create_dataset(k, data=v)
            g.attrs["num_samples"] = frames
        if external:
            data["demo_0"]["obs/secret"] = h5py.ExternalLink(external, "/x")
    return path


def listed(url, key, route="datasets"):
    return httpx.get(f"{url}/v1/{route}", headers=h(key), timeout=30).json()[route.replace("-", "_")]


def leftovers(svc) -> list:
    """Anything an upload left beside the accepted files: spools, scratch dirs, sessions."""
    tenants = svc / "tenants"
    return [p for p in tenants.rglob("*") if p.parent.name in ("incoming", "uploads") or p.name.startswith(".upload-")]


# ---- robomimic / LIBERO HDF5 --------------------------------------------------------------------------------
def test_an_hdf5_dataset_uploads_lists_trains_a_job_and_stays_private(served, tmp_path):
    url, keys, _, svc = served
    c = Client(url, keys["owner"])
    d = c.upload_dataset(str(libero_file(tmp_path / "libero_touch.hdf5")))
    assert d["name"] == "libero_touch" and d["format"] == "hdf5" and d["episodes"] == 3 and d["frames"] == 36
    assert sorted(d["cameras"]) == ["obs/agentview_rgb", "obs/eye_in_hand_rgb"]
    assert {"name": "libero_touch", "format": "hdf5", "public": False, "bytes": d["bytes"]} in c.datasets()
    assert "libero_touch" not in [x["name"] for x in listed(url, keys["stranger"])]
    spec = {"name": "sft-h5", "kind": "sft", "head": HEAD, "eval": None,
            "sft": {"dataset": "libero_touch", "steps": 3, "batch_size": 4, "action_key": "actions",
                    "state_key": "obs/state", "camera_map": {"obs/agentview_rgb": "agentview",
                                                              "obs/eye_in_hand_rgb": "wrist"}}}
    job = c.submit(spec)
    assert job.wait(timeout_s=180, progress=False).state == "succeeded", job.error
    refused = httpx.post(f"{url}/v1/jobs", json=spec, headers=h(keys["stranger"]), timeout=30)
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "sft.dataset", refused.text
    bad_option = {**spec, "sft": {**spec["sft"], "reader": {"cache_mb": 10**6}}}
    r = httpx.post(f"{url}/v1/jobs", json=bad_option, headers=h(keys["owner"]), timeout=30)
    assert r.status_code == 422 and "reader.cache_mb" in r.text, r.text
    c.delete_dataset("libero_touch")
    assert "libero_touch" not in [x["name"] for x in c.datasets()]


def test_a_robomimic_file_without_an_instruction_is_accepted_and_its_job_names_one(served, tmp_path):
    url, keys, _, _ = served
    c = Client(url, keys["owner"])
    d = c.upload_dataset(str(libero_file(tmp_path / "robomimic_lift.hdf5", libero=False)))
    assert d["format"] == "hdf5" and d["instruction"] is None and "actions" in d["keys"]
    spec = {"name": "sft-rm", "kind": "sft", "head": HEAD, "eval": None,
            "sft": {"dataset": "robomimic_lift", "steps": 2, "batch_size": 4, "action_key": "actions",
                    "state_key": "obs/state", "reader": {"instruction": "lift the cube"},
                    "camera_map": {"obs/agentview_rgb": "agentview", "obs/eye_in_hand_rgb": "wrist"}}}
    job = c.submit(spec)
    assert job.wait(timeout_s=180, progress=False).state == "succeeded", job.error
    c.delete_dataset("robomimic_lift")


@pytest.mark.parametrize("what, make, text", [
    ("an external link", lambda p: libero_file(p, external="/etc/passwd"), "ExternalLink"),
    ("no actions", lambda p: libero_file(p, drop="actions"), "actions"),
    ("no data group", lambda p: h5py.File(p, "w").close() or p, "'data'"),
    ("a truncated file", lambda p: p.write_bytes(libero_file(p).read_bytes()[:3000]) and p, "HDF5"),
])
def test_bad_hdf5_files_are_refused_naming_the_key_and_leave_nothing(served, tmp_path, what, make, text):
    url, keys, _, svc = served
    path = make(tmp_path / "bad.hdf5")
    r = httpx.post(f"{url}/v1/datasets", params={"name": "bad-h5"}, content=path.read_bytes(),
                   headers=h(keys["owner"], **{"Content-Type": "application/x-hdf5"}), timeout=60)
    assert r.status_code == 422 and text in r.json()["error"]["message"], (what, r.text)
    assert str(svc) not in r.text and str(path) not in r.text  # no server paths in the answer
    assert "bad-h5" not in [x["name"] for x in listed(url, keys["owner"])] and not leftovers(svc)


# ---- resumable uploads -------------------------------------------------------------------------------------
def _archive(demos) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        t.add(demos, arcname="ds")
    return buf.getvalue()


def test_a_chunked_upload_survives_a_dropped_chunk_and_bad_offsets(served):
    url, keys, demos, svc = served
    body, A = _archive(demos), h(keys["owner"])
    up = httpx.post(f"{url}/v1/uploads", json={"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()},
                    headers=A, timeout=30)
    assert up.status_code == 201, up.text
    uid, where = up.json()["upload"]["id"], f"{url}/v1/uploads/{up.json()['upload']['id']}"

    def put(offset, chunk):
        return httpx.put(where, params={"offset": offset}, content=chunk,
                         headers={**A, "Content-Type": "application/octet-stream"}, timeout=30)

    third = len(body) // 3
    assert put(0, body[:third]).json()["upload"]["offset"] == third
    wrong = put(0, body[:third])  # a retry of a chunk that had landed
    assert wrong.status_code == 409 and f"holds {third} bytes" in wrong.json()["error"]["message"]

    def dropped():  # the connection dies half-way through a chunk: what arrived stays
        yield body[third:2 * third]
        raise ConnectionResetError("cable pulled")

    with pytest.raises(Exception):
        httpx.put(where, params={"offset": third}, content=dropped(),
                  headers={**A, "Content-Type": "application/octet-stream"}, timeout=30)
    at = httpx.get(where, headers=A, timeout=30).json()["upload"]["offset"]
    assert third <= at <= 2 * third
    early = httpx.post(f"{where}/finish", json={"as": "dataset", "name": "chunky"}, headers=A, timeout=30)
    assert early.status_code == 409 and "send the rest" in early.text
    over = put(at, body[at:] + b"extra")
    assert over.status_code == 413 and httpx.get(where, headers=A).json()["upload"]["offset"] == at
    stranger = httpx.get(where, headers=h(keys["stranger"]), timeout=30)
    assert stranger.status_code == 404 and uid in stranger.text
    assert put(at, body[at:]).json()["upload"]["offset"] == len(body)
    done = httpx.post(f"{where}/finish", json={"as": "dataset", "name": "chunky"}, headers=A, timeout=120)
    assert done.status_code == 201 and done.json()["dataset"]["episodes"] == 3, done.text
    assert httpx.get(where, headers=A).status_code == 404 and not leftovers(svc)  # the session is gone
    httpx.delete(f"{url}/v1/datasets/chunky", headers=A)


def test_the_sdk_uploads_in_chunks_and_resumes(served, monkeypatch):
    """The SDK's chunked path, with the service dropping every third chunk half-way: it asks for the
    offset and goes on; the dataset arrives whole (the service checks the declared sha256)."""
    url, keys, demos, svc = served
    c = Client(url, keys["owner"])
    http, real, calls = c._http, c._http.send, {"n": 0}

    def flaky(method, path, content, ctype, **kw):
        if method == "PUT":
            calls["n"] += 1
            if calls["n"] % 3 == 0:  # half the chunk lands, then the connection breaks
                real(method, path, content[:len(content) // 2], ctype, **kw)
                from vlamux.sdk.errors import ServiceUnavailableError

                raise ServiceUnavailableError(None, "unavailable", "connection reset")
        return real(method, path, content, ctype, **kw)

    monkeypatch.setattr(http, "send", flaky)
    seen = []
    d = upload(http, str(demos), "dataset", "resumed", chunk_bytes=2 << 10, whole_bytes=0,
               progress=lambda sent, total: seen.append((sent, total)))
    assert d["episodes"] == 3 and calls["n"] >= 6 and seen[-1][0] == seen[-1][1]
    assert not leftovers(svc)
    c.delete_dataset("resumed")


def test_upload_sessions_are_bounded_by_the_quota_and_checked(served):
    url, keys, demos, svc = served
    small, A = h(keys["small"]), h(keys["owner"])
    r = httpx.post(f"{url}/v1/uploads", json={"bytes": 10 << 20}, headers=small, timeout=30)
    assert r.status_code == 429 and "max_dataset_mb" in r.text and str(10 << 20) in r.text, r.text
    for bad, field in (({"bytes": -1}, "bytes"), ({"bytes": 5, "sha256": "xyz"}, "sha256"), ({"size": 5}, "size")):
        r = httpx.post(f"{url}/v1/uploads", json=bad, headers=A, timeout=30)
        assert r.status_code == 422 and r.json()["error"]["message"].startswith(field), r.text
    opened = [httpx.post(f"{url}/v1/uploads", json={"bytes": 100}, headers=A).json()["upload"]["id"] for _ in range(4)]
    fifth = httpx.post(f"{url}/v1/uploads", json={"bytes": 100}, headers=A, timeout=30)
    assert fifth.status_code == 429 and "uploads are open" in fifth.text
    # a wrong digest: refused at finish, and the session is gone
    body = b"x" * 100
    up = httpx.post(f"{url}/v1/uploads", json={"bytes": 100, "sha256": "0" * 64}, headers=small).json()["upload"]
    httpx.put(f"{url}/v1/uploads/{up['id']}", params={"offset": 0}, content=body,
              headers={**small, "Content-Type": "application/octet-stream"})
    fin = httpx.post(f"{url}/v1/uploads/{up['id']}/finish", json={"as": "dataset", "name": "x"}, headers=small)
    assert fin.status_code == 422 and "sha256" in fin.text
    assert httpx.get(f"{url}/v1/uploads/{up['id']}", headers=small).status_code == 404
    for uid in opened:
        assert httpx.delete(f"{url}/v1/uploads/{uid}", headers=A).status_code == 204
    assert not leftovers(svc)


# ---- policy files ------------------------------------------------------------------------------------------
def test_a_policy_file_is_a_jobs_init_from(served, tmp_path):
    """Download a job's policy, upload it as a policy file, start a new job from it: the new job's
    policy begins as the file's (the SFT step below moves it by lr 1e-12 only)."""
    from safetensors.torch import load_file

    url, keys, demos, svc = served
    c = Client(url, keys["owner"])
    c.upload_dataset(str(demos), name="pf-demos")
    sft = {"dataset": "pf-demos", "steps": 4, "batch_size": 4}
    first = c.submit({"name": "pf-first", "kind": "sft", "head": HEAD, "eval": None, "sft": sft})
    assert first.wait(timeout_s=180, progress=False).state == "succeeded"
    original = c.policy(first.id).download(str(tmp_path / "first.policy.safetensors"))
    f = c.upload_policy_file(original)
    assert f["name"] == "first" and f["backbone"] == "tiny" and [x["name"] for x in c.policy_files()] == ["first"]
    assert Client(url, keys["stranger"]).policy_files() == []

    second = c.submit({"name": "pf-second", "kind": "sft", "head": HEAD, "eval": None, "init_from": "first",
                       "sft": {**sft, "steps": 1, "lr": 1e-12}})
    assert second.wait(timeout_s=180, progress=False).state == "succeeded", second.error
    after = load_file(c.policy(second.id).download(str(tmp_path / "second.policy.safetensors")))
    before = load_file(original)
    heads = [k for k in before if k.startswith("head.")]
    assert heads and all(np.allclose(before[k].numpy(), after[k].numpy(), atol=1e-6) for k in heads)

    stranger = httpx.post(f"{url}/v1/jobs", json={"name": "x", "kind": "sft", "head": HEAD, "init_from": "first",
                                                  "sft": sft}, headers=h(keys["stranger"]), timeout=30)
    assert stranger.status_code == 422 and stranger.json()["error"]["field"] == "init_from", stranger.text
    other_head = c.submit({"name": "pf-head", "kind": "sft", "head": {**HEAD, "width": 32}, "eval": None,
                           "init_from": "first", "sft": sft})
    assert other_head.wait(timeout_s=120, progress=False).state == "failed"
    assert "init_from" in other_head.error and '"width": 32' in other_head.error, other_head.error

    damaged = bytearray((tmp_path / "first.policy.safetensors").read_bytes())
    damaged[-8:] = b"\xff" * 8
    r = httpx.post(f"{url}/v1/policy-files", params={"name": "damaged"}, content=bytes(damaged),
                   headers=h(keys["owner"], **{"Content-Type": "application/octet-stream"}), timeout=30)
    assert r.status_code == 422 and "sha256" in r.text and str(svc) not in r.text, r.text
    c.delete_policy_file("first")
    assert c.policy_files() == [] and not leftovers(svc)


# ---- the quota ledger, without a server (issue 24) ---------------------------------------------------------
def test_the_ledger_reserves_whole_uploads_before_their_bytes_are_written_and_gives_every_byte_back(tmp_path):
    from vlamux.api.faults import QuotaExceeded, TooLarge
    from vlamux.api.tenant_files import MAX_WHOLE_UPLOADS, TenantFiles

    quota = 1 << 20
    files = TenantFiles(tmp_path, lambda t: {"max_dataset_mb": 1})

    def on_disk() -> int:
        return sum(p.stat().st_size for p in (tmp_path / "tenants").rglob("*") if p.is_file())

    # a chunked body: each chunk reserved before it is written; the one that passes the quota is refused unwritten
    s = files.spool("t", None)
    with pytest.raises(QuotaExceeded, match=f"max_dataset_mb \\({quota} bytes\\)"):
        for _ in range(20):
            s.write(b"\0" * (100 << 10))
            s.f.flush()
            assert on_disk() <= quota
    assert s.at == 10 * (100 << 10) and files.used("t") == s.at
    s.discard()
    s.discard()  # idempotent: the route's fallback may call it twice
    assert on_disk() == 0 and files.used("t") == 0

    # a declared length is reserved at once, or refused before any file exists
    with pytest.raises(QuotaExceeded, match=str(quota + 1)):
        files.spool("t", quota + 1)
    assert on_disk() == 0 and files.used("t") == 0
    held = [files.spool("t", 300 << 10) for _ in range(MAX_WHOLE_UPLOADS)]
    assert files.used("t") == MAX_WHOLE_UPLOADS * (300 << 10)
    with pytest.raises(QuotaExceeded, match="at once") as e:  # the cap, before the quota is even near
        files.spool("t", 1)
    assert e.value.retry_after_s > 0
    with pytest.raises(QuotaExceeded, match=str(MAX_WHOLE_UPLOADS * (300 << 10))):  # a resumable upload sees them
        files.start_upload("t", quota - MAX_WHOLE_UPLOADS * (300 << 10) + 1)
    for s in held:
        s.discard()
    assert files.used("t") == 0

    # a resumable upload's declared bytes are seen by a whole one; a chunk cannot run past them
    up = files.start_upload("t", 700 << 10)
    with pytest.raises(QuotaExceeded, match=str(700 << 10)):
        files.spool("t", 400 << 10)
    s = files.spool("t", None)
    with pytest.raises(QuotaExceeded):
        s.write(b"\0" * (400 << 10))
    assert s.at == 0
    s.discard()
    with pytest.raises(TooLarge, match=str(700 << 10)):
        files.writer("t", up["id"], 0, (700 << 10) + 1)
    w = files.writer("t", up["id"], 0)  # the lock was not left held by the refusal
    w.close()
    files.abort_upload("t", up["id"])
    assert files.used("t") == 0 and files._reserved["t"] == {} and files._spools["t"] == set()
