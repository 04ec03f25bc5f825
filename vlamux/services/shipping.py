"""Files that cross nodes: on a Ray cluster no directory is assumed shared. A path the driver holds
(a checkpoint, a dataset, an adapter directory) travels to the actor that needs it as bytes in
Ray's object store, and what an actor writes comes back the same way; each node keeps its copies in
its own temporary directory.

`Shipment` is a file or a directory as bytes (a directory as an uncompressed tar), named by a digest
of what it holds, so a node unpacks a dataset once however often it is opened.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import tarfile
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shipment:
    name: str  # the file's or directory's own name
    digest: str  # of the relative paths, sizes and modification times (the driver's identity of it)
    is_dir: bool
    data: bytes


def identity(path: Path) -> str:
    """A digest of what `path` holds, cheap to take for a large dataset: names, sizes, mtimes."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(path) if f != path else f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def pack(path: str | Path) -> Shipment:
    """A file's or directory's bytes, ready for `ray.put`."""
    path = Path(path)
    if path.is_file():
        return Shipment(path.name, identity(path), False, path.read_bytes())
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such file or directory to send to the cluster")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        t.add(path, arcname=path.name)
    return Shipment(path.name, identity(path), True, buf.getvalue())


def node_dir() -> Path:
    """This node's own directory for shipped copies (in its temporary directory, never shared)."""
    d = Path(tempfile.gettempdir()) / "vlamux-shipped"
    d.mkdir(parents=True, exist_ok=True)
    return d


def unpack(shipment: Shipment, cache: bool = True) -> Path:
    """The shipment as a path on this node: cached by digest (a dataset opened again is not unpacked
    again), or, `cache=False`, in a fresh directory the caller removes (`discard`)."""
    root = node_dir() / (shipment.digest if cache else f"once-{uuid.uuid4().hex}")
    target = root / shipment.name
    if cache and target.exists():
        return target
    tmp = node_dir() / f".{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        if shipment.is_dir:
            with tarfile.open(fileobj=io.BytesIO(shipment.data), mode="r") as t:
                t.extractall(tmp, filter="data")  # our own tar, but no links or absolute paths regardless
        else:
            (tmp / shipment.name).write_bytes(shipment.data)
        root.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp / shipment.name, target)
        except OSError:  # another call unpacked it first
            if not target.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def discard(path: Path) -> None:
    """Remove a `cache=False` copy (its own directory too)."""
    shutil.rmtree(path.parent, ignore_errors=True)


@contextlib.contextmanager
def received(shipment: Shipment):
    """A shipment as a path on this node for the length of a block, removed afterwards."""
    path = unpack(shipment, cache=False)
    try:
        yield path
    finally:
        discard(path)


def write_back(shipment: Shipment, dest: str | Path) -> Path:
    """What an actor sent back, written at `dest` on the driver: a file atomically, a directory's
    contents into `dest`."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not shipment.is_dir:
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}")
        tmp.write_bytes(shipment.data)
        os.replace(tmp, dest)
        return dest
    with tempfile.TemporaryDirectory(dir=dest.parent) as d:
        with tarfile.open(fileobj=io.BytesIO(shipment.data), mode="r") as t:
            t.extractall(d, filter="data")
        dest.mkdir(exist_ok=True)
        for p in (Path(d) / shipment.name).iterdir():
            os.replace(p, dest / p.name)
    return dest
