"""A dataset reads only its own files (issue 24, "isolation holes").

meta/info.json's `data_path` / `video_path` templates, the episode metadata that fills them in, image
cells' paths and every fixed metadata file must name a file inside the dataset's own directory, once
symbolic links are resolved; the templates take only LeRobot's fields with an integer format (no
`str.format` attribute access, indexing or other names). A dataset that names anything else is
refused when it is opened (the upload check and a job's start both open it), with one message that
names the field and is the same whether or not anything exists where the path leads. Errors name
files relative to the dataset's root, never the machine's paths.

The first half reads datasets directly; the second runs `vlamux serve` as a subprocess: tenant B
uploads datasets (and has datasets placed on disk, bypassing the upload check) that name tenant A's
files.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from api_server import served

from vlamux.data import DatasetError, LeRobotDataset, RobomimicDataset

pytestmark = pytest.mark.timeout(600)

DATA = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
INSIDE = "must name a file inside the dataset"
HEAD = {"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8}
TRICKS = ("data/chunk-{chunk_index.__class__}/file-{file_index:03d}.parquet",
          "data/chunk-{chunk_index.__class__.__mro__}/file-{file_index:03d}.parquet",
          "data/chunk-{chunk_index[0]}/file-{file_index:03d}.parquet",
          "data/chunk-{0}/file-{1}.parquet",
          "data/chunk-{}/file-{}.parquet",
          "data/{foo}.parquet",
          "data/chunk-{chunk_index!r}/file-{file_index:03d}.parquet",
          "data/chunk-{chunk_index:>{file_index}}/file.parquet",
          "data/chunk-{chunk_index:s}/file-{file_index:03d}.parquet",
          "data/chunk-{episode_chunk:03d}/file-{file_index:03d}.parquet")  # a v2.x field in a v3.0 template


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    from demos import demo_dataset

    root = tmp_path_factory.mktemp("path-demos") / "demos"
    demo_dataset(root, 2)
    return root


def variant(src: Path, dest: Path, **info) -> Path:
    """A copy of the dataset `src` at `dest`, meta/info.json's fields replaced by `info`."""
    shutil.copytree(src, dest)
    path = dest / "meta" / "info.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **info}))
    return dest


def refusal(root: Path) -> str:
    with pytest.raises(DatasetError) as e:
        LeRobotDataset(root)
    return str(e.value)


def video_key(root: Path) -> str:
    return next(k for k, f in LeRobotDataset(root).features.items() if f.get("dtype") == "video")


# ---- the reader -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["data_path", "video_path"])
@pytest.mark.parametrize("kind", ["sibling", "absolute", "other tenant", "dot-dot inside", "absolute to itself"])
def test_a_template_leading_outside_is_refused_alike_whether_or_not_its_target_exists(demos, tmp_path, field, kind):
    svc = tmp_path / "svc"
    mine = svc / "tenants" / "me" / "datasets" / "mine"
    secret = {"sibling": mine.parent / "secret", "absolute": tmp_path / "elsewhere" / "secret",
              "other tenant": svc / "tenants" / "other" / "datasets" / "secret",
              "dot-dot inside": mine.parent / "secret", "absolute to itself": mine}[kind]
    tail = DATA if field == "data_path" else VIDEO
    template = {"sibling": "../secret/" + tail, "absolute": f"{secret}/{tail}",
                "other tenant": "../../../other/datasets/secret/" + tail,
                "dot-dot inside": "data/../../secret/" + tail, "absolute to itself": f"{mine}/{tail}"}[kind]
    mine.parent.mkdir(parents=True)
    variant(demos, mine, **{field: template})
    if kind == "absolute to itself":  # an absolute path is refused even where it would lead inside
        missing = existing = refusal(mine)
    else:
        missing = refusal(mine)
        assert not secret.exists()
        shutil.copytree(demos, secret)  # now the target is there, and readable
        assert (secret / DATA.format(chunk_index=0, file_index=0)).is_file()
        existing = refusal(mine)
    assert missing == existing, (missing, existing)
    m = re.fullmatch(rf"meta/info\.json: {field} '(.*)' {re.escape(INSIDE)} \(.*\)", missing)
    assert m and template.startswith(m.group(1).removesuffix("...")), missing  # names only the tenant's own text


@pytest.mark.parametrize("field", ["data_path", "video_path"])
@pytest.mark.parametrize("template", TRICKS)
def test_templates_take_only_the_documented_fields(demos, tmp_path, field, template):
    msg = refusal(variant(demos, tmp_path / "ds", **{field: template}))
    assert msg.startswith(f"meta/info.json: {field} ") and "is not allowed" in msg, msg
    assert "{chunk_index}, {file_index}, {video_key}" in msg and "<class" not in msg and "object>" not in msg, msg


def test_documented_templates_with_plain_or_integer_formats_read(demos, tmp_path):
    root = variant(demos, tmp_path / "ds", data_path="data/c{{{chunk_index}}}/file-{file_index:3d}.parquet",
                   video_path="videos/{video_key}/chunk-{chunk_index:03}/f{file_index:d}.mp4")
    (root / "data" / "chunk-000").rename(root / "data" / "c{0}")
    (root / "data" / "c{0}" / "file-000.parquet").rename(root / "data" / "c{0}" / "file-  0.parquet")
    for d in (root / "videos").iterdir():
        (d / "chunk-000" / "file-000.mp4").rename(d / "chunk-000" / "f0.mp4")
    ds = LeRobotDataset(root)
    assert ds.episodes[1].data_path == "data/c{0}/file-  0.parquet"
    assert ds.episode(1).data["action"].shape[1] == 4
    key = video_key(root)
    assert ds.episodes[0].videos[key].path == f"videos/{key}/chunk-000/f0.mp4"
    assert ds.episode_images(0, key).shape[1:] == (32, 32, 3)


def _link(at: Path, to: Path) -> None:
    if at.is_dir() and not at.is_symlink():
        shutil.rmtree(at)
    else:
        at.unlink()
    at.symlink_to(to, target_is_directory=True)


@pytest.mark.parametrize("what", ["data dir", "data file", "video dir", "stats", "episodes dir", "info"])
def test_a_link_inside_the_dataset_leading_out_is_refused_alike_whether_or_not_its_target_exists(
        demos, tmp_path, what):
    mine = variant(demos, tmp_path / "datasets" / "mine")
    secret = tmp_path / "other" / "secret"
    key = video_key(mine)
    rel = {"data dir": "data/chunk-000", "data file": "data/chunk-000/file-000.parquet",
           "video dir": f"videos/{key}", "stats": "meta/stats.json", "episodes dir": "meta/episodes/chunk-000",
           "info": "meta/info.json"}[what]
    _link(mine / rel, secret / rel)
    missing = refusal(mine)
    shutil.copytree(demos, secret)
    existing = refusal(mine)
    assert missing == existing and INSIDE in missing, (missing, existing)
    assert str(tmp_path) not in missing and rel in missing, missing
    first = {"data dir": "meta/info.json: data_path ", "data file": "meta/info.json: data_path ",
             "video dir": "meta/info.json: video_path "}.get(what, f"'{rel}' ")
    assert missing.startswith(first), missing


def test_a_link_that_stays_inside_the_dataset_reads(demos, tmp_path):
    root = variant(demos, tmp_path / "ds")
    (root / "data" / "chunk-000").rename(root / "data" / "real")
    (root / "data" / "chunk-000").symlink_to("real", target_is_directory=True)
    assert LeRobotDataset(root).episode(0).data["action"].shape[1] == 4


@pytest.mark.parametrize("column, value", [("data/chunk_index", "../../secret"), ("data/file_index", -1),
                                           ("data/chunk_index", 1.5)])
def test_episode_metadata_fills_templates_with_non_negative_integers_only(demos, tmp_path, column, value):
    root = variant(demos, tmp_path / "ds")
    path = root / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    t = pq.read_table(path)
    i = t.column_names.index(column)
    t = t.set_column(i, column, pa.array([value] * t.num_rows))
    pq.write_table(t, path)
    msg = refusal(root)
    assert msg.startswith("meta/episodes/chunk-000/file-000.parquet (episode 0): ") and column in msg, msg
    assert str(tmp_path) not in msg


def test_an_image_cell_naming_a_file_outside_is_refused(demos, tmp_path):
    """Inline images may name a file (HF Image {bytes: null, path}): it too must be inside."""
    from vlamux.data.demos import generate

    root = tmp_path / "img"
    generate(["goal/touch-red-cube"], 1, root, image_size=32, workers=1, progress=None, camera_dtype="image")
    path = root / DATA.format(chunk_index=0, file_index=0)
    t = pq.read_table(path)
    cam = next(c for c in t.column_names if c.startswith("observation.images."))
    outside = tmp_path / "secret.png"
    cells = pa.array([{"bytes": None, "path": str(outside)}] * t.num_rows,
                     pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    pq.write_table(t.set_column(t.column_names.index(cam), cam, cells), path)
    ds = LeRobotDataset(root)
    with pytest.raises(DatasetError) as missing:
        ds.episode_images(0, cam)
    from PIL import Image

    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(outside)
    with pytest.raises(DatasetError) as existing:
        LeRobotDataset(root).episode_images(0, cam)
    assert str(missing.value) == str(existing.value) and INSIDE in str(missing.value)
    assert str(missing.value).startswith(f"data/chunk-000/file-000.parquet: column '{cam}': image path ")


def legacy(root: Path, **info) -> Path:
    """A small v2.1 dataset (one parquet per episode, JSON-lines metadata), no cameras."""
    rng = np.random.default_rng(0)
    for e, n in enumerate((4, 3)):
        path = root / f"data/chunk-000/episode_{e:06d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"action": pa.array(rng.normal(size=(n, 2)).astype(np.float32).tolist(),
                                                    pa.list_(pa.float32())),
                                 "timestamp": pa.array(np.arange(n, dtype=np.float32) / 10),
                                 "frame_index": pa.array(np.arange(n)), "episode_index": pa.array(np.full(n, e)),
                                 "task_index": pa.array(np.zeros(n, np.int64))}), path)
    base = {"codebase_version": "v2.1", "fps": 10, "total_episodes": 2, "chunks_size": 1000,
            "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
            "video_path": None, "features": {"action": {"dtype": "float32", "shape": [2]}}}
    (root / "meta").mkdir(parents=True)
    (root / "meta/info.json").write_text(json.dumps({**base, **info}))
    (root / "meta/tasks.jsonl").write_text(json.dumps({"task_index": 0, "task": "push"}) + "\n")
    (root / "meta/episodes.jsonl").write_text("".join(json.dumps({"episode_index": e, "tasks": ["push"], "length": n})
                                                      + "\n" for e, n in enumerate((4, 3))))
    return root


def test_legacy_layout_templates_are_confined_and_checked_too(tmp_path):
    ds = LeRobotDataset(legacy(tmp_path / "ok"))
    assert ds.version == "v2.1" and ds.episode(1).data["action"].shape == (3, 2)
    assert LeRobotDataset(legacy(tmp_path / "plain", data_path="data/chunk-{episode_chunk:03d}/"
                                 "episode_{episode_index:06}.parquet")).num_episodes == 2
    tail = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
    for field in ("data_path", "video_path"):
        for n, template in enumerate(("../secret/" + tail, f"{tmp_path}/secret/{tail}")):
            root = legacy(tmp_path / f"{field}-{n}", **{field: template})
            missing = refusal(root)
            if not (tmp_path / "secret").exists():
                legacy(tmp_path / "secret")
            assert refusal(root) == missing and missing.startswith(f"meta/info.json: {field} ") and INSIDE in missing
        for n, template in enumerate(("data/{episode_index.__class__}.parquet", "data/{chunk_index:03d}.parquet",
                                      "data/{episode_index[0]}.parquet", "{0}", "data/{episode_chunk!s}")):
            msg = refusal(legacy(tmp_path / f"{field}-trick-{n}", **{field: template}))
            assert msg.startswith(f"meta/info.json: {field} ") and "is not allowed" in msg, msg
            assert "{episode_chunk}, {episode_index}, {video_key}" in msg
    link = legacy(tmp_path / "link")
    _link(link / "meta" / "episodes.jsonl", tmp_path / "secret" / "meta" / "episodes.jsonl")
    msg = refusal(link)
    assert msg.startswith("'meta/episodes.jsonl' ") and INSIDE in msg, msg


def test_errors_name_files_relative_to_the_dataset(demos, tmp_path):
    root = variant(demos, tmp_path / "ds")
    data = root / DATA.format(chunk_index=0, file_index=0)
    t = pq.read_table(data)
    pq.write_table(t.drop(["action"]), data)
    ds = LeRobotDataset(root)
    with pytest.raises(DatasetError, match=r"^data/chunk-000/file-000\.parquet: no column 'action'$"):
        ds.episode_array(0, "action")
    data.write_bytes(b"not parquet")
    with pytest.raises(DatasetError) as e:
        LeRobotDataset(root).episode(0)
    assert str(e.value).startswith("data/chunk-000/file-000.parquet: cannot read") and str(tmp_path) not in str(e.value)
    other = variant(demos, tmp_path / "badvideo")
    key = video_key(other)
    (other / VIDEO.format(video_key=key, chunk_index=0, file_index=0)).write_bytes(b"not a video")
    with pytest.raises(DatasetError) as e:
        LeRobotDataset(other).episode_images(0, key)
    assert str(e.value).startswith(f"videos/{key}/chunk-000/file-000.mp4: ") and str(tmp_path) not in str(e.value)
    (root / "meta" / "stats.json").unlink()
    with pytest.raises(DatasetError, match="^meta/stats.json missing$"):
        LeRobotDataset(root).stat("action")
    with pytest.raises(DatasetError) as e:
        LeRobotDataset(tmp_path / "nothing-here")
    assert str(tmp_path) not in str(e.value) and "meta/info.json" in str(e.value)
    with pytest.raises(DatasetError, match="^meta/info.json: no feature 'nope'"):
        LeRobotDataset(root).feature("nope")


def test_hdf5_reads_only_its_own_file_and_names_no_directory(tmp_path):
    import h5py

    def write(path: Path, external: Path | None = None) -> Path:
        with h5py.File(path, "w") as f:
            g = f.create_group("data/demo_0")
            g["actions"] = np.zeros((5, 2), np.float32)
            g["obs/state"] = np.zeros((5, 3), np.float32)
            if external is not None:
                f["data/demo_1"] = h5py.ExternalLink(str(external), "/data/demo_0")
        return path

    with pytest.raises(DatasetError) as e:
        RobomimicDataset(tmp_path / "absent.hdf5", instruction="x")
    assert str(e.value) == "absent.hdf5: file missing"
    with RobomimicDataset(write(tmp_path / "ok.hdf5"), instruction="x") as ds:
        with pytest.raises(DatasetError) as e:
            ds.episode_array(0, "nope")
        assert str(tmp_path) not in str(e.value)
    other = tmp_path / "other.hdf5"
    linked = write(tmp_path / "linked.hdf5", external=other)
    with pytest.raises(DatasetError) as missing:
        RobomimicDataset(linked, instruction="x")
    write(other)
    with pytest.raises(DatasetError) as existing:
        RobomimicDataset(linked, instruction="x")
    assert str(missing.value) == str(existing.value) == (
        "linked.hdf5:/data/demo_1: an external link (to another file); links to other files are not read")


# ---- through `vlamux serve` -------------------------------------------------------------------------------

def _targz(src: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        t.add(src, arcname="ds")
    return buf.getvalue()


@pytest.fixture(scope="module")
def world(tmp_path_factory, demos):
    from vlamux.sdk import Client

    root = tmp_path_factory.mktemp("path-serve")
    svc = root / "svc"
    with served(svc, root / "server.log") as (url, admin_key, _):
        admin = Client(url, admin_key)
        a, a_key = admin.admin.create_tenant("owner", {"requests_per_s": 10000})
        b, b_key = admin.admin.create_tenant("thief", {"requests_per_s": 10000})
        yield SimpleNamespace(url=url, svc=svc, root=root, demos=demos, a_id=a["id"], b_id=b["id"],
                              A=Client(url, a_key), B=Client(url, b_key), a_key=a_key, b_key=b_key)


def _leaks(w, text: str) -> bool:
    """Whether `text` names the server's directories (a template's own text may name "tenants/")."""
    return str(w.svc) in text or str(w.root) in text or str(w.root.parent) in text


def test_uploads_naming_another_tenants_files_are_refused_alike(world, tmp_path):
    import httpx

    from vlamux.sdk.errors import InvalidInputError
    from vlamux.sdk.uploads import upload

    w = world
    secret = w.svc / "tenants" / w.a_id / "datasets" / "a-secret"  # where A's upload lands
    cases = {  # from where B's dataset would be: tenants/<B>/datasets/<name>
        "relative data": {"data_path": f"../../../{w.a_id}/datasets/a-secret/{DATA}"},
        "absolute data": {"data_path": f"{secret}/{DATA}"},
        "relative video": {"video_path": f"../../../{w.a_id}/datasets/a-secret/{VIDEO}"},
        "absolute video": {"video_path": f"{secret}/{VIDEO}"},
    }
    bodies = {k: _targz(variant(w.demos, tmp_path / k.replace(" ", "-"), **info)) for k, info in cases.items()}
    with httpx.Client(base_url=w.url, headers={"Authorization": f"Bearer {w.b_key}"}, timeout=120) as http:
        def post(name: str, body: bytes) -> httpx.Response:
            r = http.post("/v1/datasets", params={"name": name}, content=body,
                          headers={"Content-Type": "application/gzip"})
            assert http.get("/v1/datasets").status_code == 200  # the same connection still answers
            return r

        before = {k: post("steal", body) for k, body in bodies.items()}
        with pytest.raises(InvalidInputError) as by_sdk_before:  # resumable upload: the same check
            upload(w.B._http, str(tmp_path / "relative-data"), "dataset", "steal", chunk_bytes=32 << 10, whole_bytes=0)
        d = upload(w.A._http, str(w.demos), "dataset", "a-secret", whole_bytes=1 << 30)
        assert d["episodes"] == 2 and (secret / DATA.format(chunk_index=0, file_index=0)).is_file()
        after = {k: post("steal", body) for k, body in bodies.items()}
        with pytest.raises(InvalidInputError) as by_sdk_after:
            upload(w.B._http, str(tmp_path / "relative-data"), "dataset", "steal", chunk_bytes=32 << 10, whole_bytes=0)

        for k in cases:
            field = next(iter(cases[k]))
            assert before[k].status_code == after[k].status_code == 422, (k, before[k].text, after[k].text)
            assert before[k].content == after[k].content, (k, before[k].text, after[k].text)
            msg = before[k].json()["error"]["message"]
            assert f"meta/info.json: {field} " in msg and INSIDE in msg and not _leaks(w, msg), (k, msg)
        whole = before["relative data"].json()["error"]["message"]
        assert by_sdk_before.value.message == by_sdk_after.value.message == whole

        for field in ("data_path", "video_path"):
            for n, template in enumerate(TRICKS):
                r = post("trick", _targz(variant(w.demos, tmp_path / f"{field}-trick-{n}", **{field: template})))
                msg = r.json()["error"]["message"]
                assert r.status_code == 422 and f"meta/info.json: {field} " in msg and "is not allowed" in msg, r.text
                assert "class 'int'" not in r.text and not _leaks(w, r.text), r.text
    own = w.svc / "tenants" / w.b_id
    assert not list(own.rglob("steal")) and not list(own.rglob("trick")) and not list(own.rglob(".upload-*"))
    assert [x["name"] for x in w.B.datasets() if not x["public"]] == []


def _job_error(w, client, name: str, dataset: str) -> str:
    """A job on `dataset` is refused at submit or fails; its error (and never a success)."""
    from vlamux.sdk.errors import InvalidInputError

    try:
        job = client.submit({"name": name, "kind": "sft", "head": HEAD, "eval": None,
                             "sft": {"dataset": dataset, "steps": 2, "batch_size": 4}})
    except InvalidInputError as e:
        return e.message
    done = job.wait(timeout_s=240, progress=False)
    assert done.state == "failed", (name, done.state, done.error)
    assert client.datasets() is not None  # the connection is still usable
    return done.error


def test_jobs_on_datasets_placed_on_disk_that_name_another_tenants_files_fail_alike(world, tmp_path):
    w = world
    secret = w.svc / "tenants" / w.a_id / "datasets" / "a-data"
    d = w.A.upload_dataset(str(w.demos), name="a-data")
    assert d["episodes"] == 2 and (secret / DATA.format(chunk_index=0, file_index=0)).is_file()
    public, own = w.svc / "datasets", w.svc / "tenants" / w.b_id / "datasets"
    own.mkdir(parents=True, exist_ok=True)
    variant(w.demos, public / "pub-rel", data_path=f"../../tenants/{w.a_id}/datasets/a-data/{DATA}")
    variant(w.demos, public / "pub-abs", video_path=f"{secret}/{VIDEO}")
    variant(w.demos, own / "b-rel", data_path=f"../../../{w.a_id}/datasets/a-data/{DATA}")
    _link(variant(w.demos, own / "b-link") / "data" / "chunk-000", secret / "data" / "chunk-000")
    variant(w.demos, own / "b-trick", data_path="data/chunk-{chunk_index.__class__.__mro__}/"
                                                 "file-{file_index:03d}.parquet")
    try:
        names = ("pub-rel", "pub-abs", "b-rel", "b-link")
        exists = {n: _job_error(w, w.B, f"steal-{n}", n) for n in names}
        trick = _job_error(w, w.B, "trick", "b-trick")
        assert "data_path" in trick and "is not allowed" in trick and "class 'int'" not in trick, trick
        w.A.delete_dataset("a-data")
        assert not secret.exists()
        missing = {n: _job_error(w, w.B, f"steal-{n}-again", n) for n in names}
        for n in names:
            assert exists[n] == missing[n], (n, exists[n], missing[n])
            assert INSIDE in exists[n] and not _leaks(w, exists[n]), (n, exists[n])
        assert "data_path" in exists["pub-rel"] and "video_path" in exists["pub-abs"] and "data_path" in exists["b-rel"]
        assert "data/chunk-000" in exists["b-link"]
    finally:
        for p in (public / "pub-rel", public / "pub-abs"):
            shutil.rmtree(p, ignore_errors=True)
