"""Uploads of datasets and policy files: whole for small files, else in resumable chunks.

A chunked upload declares its size and sha256 first (the service reserves the quota), sends chunks
at offsets, and on a dropped or refused chunk asks the service where its bytes end and goes on from
there; the service checks size and digest before it reads the file back and accepts it.
"""

from __future__ import annotations

import contextlib
import os
import tarfile
import tempfile
from collections.abc import Callable, Iterator

from vlamux.sdk.errors import ConflictError, ServiceUnavailableError
from vlamux.utils.io import file_sha256

CHUNK_BYTES = 8 << 20
WHOLE_BYTES = 16 << 20  # files up to this size go in one request


@contextlib.contextmanager
def packed(source: str) -> Iterator[str]:
    """`source` as one file: a directory packed as .tar.gz into a temporary file, a file as it is."""
    if os.path.isdir(source):
        fd, tmp = tempfile.mkstemp(suffix=".tar.gz")
        os.close(fd)
        try:
            with tarfile.open(tmp, "w:gz") as t:
                t.add(source, arcname=os.path.basename(os.path.normpath(source)))
            yield tmp
        finally:
            os.unlink(tmp)
    elif os.path.isfile(source):
        yield source
    else:
        raise FileNotFoundError(f"{source}: no such directory or file")


def content_type(path: str) -> str:
    if path.endswith((".gz", ".tgz")):
        return "application/gzip"
    if path.endswith(".tar"):
        return "application/x-tar"
    if path.endswith((".hdf5", ".h5")):
        return "application/x-hdf5"
    return "application/octet-stream"


def upload(http, source: str, kind: str, name: str, chunk_bytes: int = CHUNK_BYTES, whole_bytes: int = WHOLE_BYTES,
           timeout_s: float = 3600.0, max_failures: int = 20, progress: Callable[[int, int], None] | None = None
           ) -> dict:
    """Upload `source` (a directory, an archive, an HDF5 file or a policy file) as `kind` ("dataset" or
    "policy_file") `name`; what the service accepted."""
    route = {"dataset": "/v1/datasets", "policy_file": "/v1/policy-files"}[kind]
    with packed(source) as path:
        size = os.path.getsize(path)
        if size <= whole_bytes:
            with open(path, "rb") as f:
                return http.send("POST", route, f, content_type(path), params={"name": name},
                                 timeout_s=timeout_s)[kind]
        up = http.post("/v1/uploads", json={"bytes": size, "sha256": file_sha256(path)})["upload"]
        where, offset, failures = f"/v1/uploads/{up['id']}", 0, 0
        try:
            with open(path, "rb") as f:
                while offset < size:
                    f.seek(offset)
                    chunk = f.read(chunk_bytes)
                    try:
                        offset = http.send("PUT", where, chunk, "application/octet-stream",
                                           params={"offset": offset})["upload"]["offset"]
                    except (ServiceUnavailableError, ConflictError):
                        # dropped mid-chunk (part of it may have landed), or a retry of a chunk that did:
                        # the service says where its bytes end
                        failures += 1
                        if failures > max_failures:
                            raise
                        offset = http.get(where)["upload"]["offset"]
                    if progress is not None:
                        progress(offset, size)
            return http.post(f"{where}/finish", json={"as": kind, "name": name}, timeout_s=timeout_s)[kind]
        except BaseException:
            with contextlib.suppress(Exception):
                http.delete(where)
            raise
