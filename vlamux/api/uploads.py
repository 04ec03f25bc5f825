"""A tenant's upload: streamed to disk (`Spool` for a whole one, `ChunkWriter` for a resumable one's
chunks), told apart by its first bytes (`sniff`); a dataset as a tar archive (optionally gzip'ed) is
unpacked with every safety check, read back by the LeRobot reader, and only then moved into place.

Archive safety: regular files and directories only (no links, devices or FIFOs), no absolute paths
and no `..`, at most `max_files` members and `max_bytes` unpacked, and a compression ratio of at most
`max_ratio` (a zip bomb is refused before it fills the disk). A refused upload leaves nothing behind.
"""

from __future__ import annotations

import gzip
import os
import shutil
import tarfile
import threading
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from vlamux.api.faults import TooLarge
from vlamux.errors import InvalidInputError


# what reading a cut or corrupted (gzip'ed) tar raises: tarfile's errors, gzip's EOF and zlib's
DAMAGED = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile)


@dataclass(frozen=True)
class ArchiveLimits:
    max_bytes: int = 4 << 30  # unpacked
    max_files: int = 100_000
    max_ratio: float = 200.0  # unpacked bytes per archive byte


def unpack(archive: Path, dest: Path, limits: ArchiveLimits) -> int:
    """Unpack `archive` into the new directory `dest`, checking every member first; the bytes unpacked.
    On any refusal `dest` does not exist afterwards."""
    try:
        tar = tarfile.open(archive, mode="r:*")
    except (tarfile.TarError, OSError) as e:
        raise InvalidInputError(f"body: not a tar archive (plain or gzip): {e}") from None
    with tar:
        members, total = [], 0
        try:
            for m in tar:
                name = PurePosixPath(m.name)
                where = f"body: archive member {m.name[:200]!r}"
                if m.name.startswith("/") or name.is_absolute() or ".." in name.parts:
                    raise InvalidInputError(f"{where}: absolute paths and '..' are not allowed")
                if not (m.isfile() or m.isdir()):
                    raise InvalidInputError(f"{where}: only files and directories are allowed (no links or devices)")
                members.append(m)
                total += m.size if m.isfile() else 0
                if len(members) > limits.max_files:
                    raise InvalidInputError(f"body: more than {limits.max_files} archive members")
                if total > limits.max_bytes:
                    raise InvalidInputError(f"body: unpacks to more than {limits.max_bytes} bytes")
        except DAMAGED as e:
            raise InvalidInputError(f"body: a damaged or truncated archive ({type(e).__name__}: {e})") from None
        size = max(1, archive.stat().st_size)
        if total / size > limits.max_ratio:
            raise InvalidInputError(f"body: unpacks to {total / size:.0f}x its size, more than {limits.max_ratio:g}x")
        dest.mkdir(parents=True)
        try:
            for m in members:
                target = dest / PurePosixPath(m.name)
                if m.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(m)
                with open(target, "xb") as out:  # "x": a duplicate member is an error, not an overwrite
                    shutil.copyfileobj(src, out, 1 << 20)
        except FileExistsError:
            shutil.rmtree(dest, ignore_errors=True)
            raise InvalidInputError("body: the archive names one file twice") from None
        except DAMAGED as e:  # members listed whole, then data cut short
            shutil.rmtree(dest, ignore_errors=True)
            raise InvalidInputError(f"body: a damaged or truncated archive ({type(e).__name__}: {e})") from None
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
    return total


def dataset_root(unpacked: Path) -> Path:
    """The LeRobot dataset in an unpacked archive: at its top, or in its one top-level directory."""
    if (unpacked / "meta" / "info.json").is_file():
        return unpacked
    entries = [p for p in unpacked.iterdir()]
    if len(entries) == 1 and entries[0].is_dir() and (entries[0] / "meta" / "info.json").is_file():
        return entries[0]
    raise InvalidInputError("body: no meta/info.json at the archive's top or in its one top-level directory; "
                            "not a LeRobot dataset")


def checkpoint_root(unpacked: Path) -> Path:
    """The LeRobot policy checkpoint in an unpacked archive: at its top, or in its one top-level directory."""
    from vlamux.model.vla.checkpoint import CONFIG

    if (unpacked / CONFIG).is_file():
        return unpacked
    entries = [p for p in unpacked.iterdir()]
    if len(entries) == 1 and entries[0].is_dir() and (entries[0] / CONFIG).is_file():
        return entries[0]
    raise InvalidInputError(f"body: no {CONFIG} at the archive's top or in its one top-level directory; not a "
                            f"LeRobot policy checkpoint")


def validate(root: Path) -> dict:
    """Read the dataset back as training will (its metadata, and a frame of its first and last
    episodes, cameras included): what it holds, or an error naming the file and the key.

    Opening it checks every path its files name (meta/info.json's data_path / video_path templates,
    filled in for each episode): one leading outside the dataset is refused with the reader's own
    message (the one a job on such a dataset fails with), the same whether or not anything is there."""
    from vlamux.data.errors import DatasetError
    from vlamux.data.lerobot import LeRobotDataset

    try:
        ds = LeRobotDataset(root)
        n = ds.num_episodes
        if n == 0:
            raise InvalidInputError("body: the dataset has no episodes")
        for i in sorted({0, n - 1}):
            ep = ds.episode(i)
            for cam in ds.camera_keys:
                ep.images(cam)
        for key, f in ds.features.items():  # what training normalises: its statistics must be there
            if f.get("dtype") in ("float32", "float64") and key != "timestamp":
                ds.norm_stats(key)
        return {"episodes": n, "frames": ds.num_frames, "cameras": list(ds.camera_keys),
                "codebase_version": ds.info.get("codebase_version")}
    except InvalidInputError:
        raise
    except (DatasetError, OSError, ValueError, KeyError, TypeError, IndexError) as e:
        msg = str(e)
        for r in dict.fromkeys((str(root), os.path.realpath(root))):  # errors name files relative to it
            msg = msg.replace(r + "/", "").replace(r, ".")
        raise InvalidInputError(f"body: the dataset does not read: {msg}") from None


def scratch(parent: Path) -> Path:
    return parent / f".upload-{uuid.uuid4().hex}"


def check_hdf5(path: Path) -> None:
    """An HDF5 file that reads only itself: no external or soft links, no virtual datasets and no
    external storage (each could make the service read another file of its disk)."""
    import h5py

    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise InvalidInputError(f"body: not a readable HDF5 file ({e})") from None
    with f:
        bad: list[str] = []

        def visit(name: str, link) -> None:
            if isinstance(link, (h5py.ExternalLink, h5py.SoftLink)):
                bad.append(f"{name} is a {type(link).__name__}")
                return
            obj = f.get(name)
            if isinstance(obj, h5py.Dataset) and (obj.is_virtual or obj.external):
                bad.append(f"{name} is stored outside the file")

        f.visititems_links(visit)
        if bad:
            raise InvalidInputError(f"body: HDF5 key {bad[0]}; links and external storage are not allowed")


def validate_hdf5(path: Path, name: str) -> dict:
    """Read a robomimic / LIBERO file back as training will (its demos, a frame of the first and last
    demo's cameras and arrays): what it holds, or an error naming the key. A robomimic file has no
    instruction of its own (its jobs give one: sft.reader.instruction); a LIBERO file's is checked."""
    import h5py

    from vlamux.data import RobomimicDataset
    from vlamux.data.errors import DatasetError

    try:
        with h5py.File(path, "r") as f:
            own = "data" in f and "problem_info" in f["data"].attrs
        with RobomimicDataset(path, instruction=None if own else "-") as ds:
            n = ds.num_episodes
            cameras = [k for k, v in ds.features.items() if v["dtype"] == "image"]
            for i in sorted({0, n - 1}):
                for key, v in ds.features.items():
                    ds.episode_images(i, key) if v["dtype"] == "image" else ds.episode_array(i, key)
            return {"episodes": n, "frames": ds.num_frames, "cameras": cameras, "instruction": ds.instruction if own
                    else None, "keys": sorted(k for k, v in ds.features.items() if v["dtype"] != "image")}
    except (DatasetError, OSError, ValueError, KeyError, TypeError, IndexError) as e:
        msg = str(e).replace(str(path), name).replace(path.name, name)  # the reader names the file by its name
        raise InvalidInputError(f"body: the HDF5 dataset does not read: {msg}") from None


HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


def du(path: Path) -> int:
    """Bytes of the files at or under path."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def sniff(path: Path) -> str:
    """What a spooled upload is, from its first bytes: tar | gzip | hdf5 | safetensors | unknown."""
    with path.open("rb") as f:
        head = f.read(512)
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    if head.startswith(HDF5_MAGIC):
        return "hdf5"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    if len(head) >= 9 and head[8:9] == b"{":  # safetensors: u64 header length, then its JSON header
        return "safetensors"
    return "unknown"


class ChunkWriter:
    """Appends one chunk of a resumable upload; bytes past the declared size are refused (413) and the
    file cut back to where the chunk began. A chunk cut short by a dropped connection keeps what
    arrived: the client resumes from the new offset."""

    def __init__(self, path: Path, offset: int, total: int, lock: threading.Lock):
        self.path, self.start, self.total, self._lock = path, offset, total, lock
        self.f = path.open("ab")
        self.at = offset

    def write(self, chunk: bytes) -> None:
        if self.at + len(chunk) > self.total:
            self.f.truncate(self.start)
            raise TooLarge(f"body: the chunk runs past the upload's declared {self.total} bytes")
        self.f.write(chunk)
        self.at += len(chunk)

    def close(self) -> int:
        try:
            self.f.close()
        finally:
            self._lock.release()
        return self.at


class Spool:
    """A whole upload streaming to disk (TenantFiles.spool): each chunk is reserved against the quota
    before it is written (nothing to do when the declared size was reserved at once), so a refusal
    comes before the bytes over the quota reach the disk. `discard()` removes the file and gives the
    reservation back; call it on every path (after `accept`, whose file moves away)."""

    def __init__(self, path: Path, declared: int | None, token: str, grow: Callable[[int], None],
                 release: Callable[[], None]):
        """token: its reservation's name in the quota's ledger (what `accept` leaves out of the count);
        grow(total): reserve the upload's new size (raises when it does not fit); release(): give the
        reservation back."""
        self.path, self.declared, self.token, self._grow, self._release = path, declared, token, grow, release
        self.at = 0
        self.f = path.open("xb")

    def write(self, chunk: bytes) -> None:
        total = self.at + len(chunk)
        if self.declared is not None and total > self.declared:  # the server's HTTP parser stops it first
            raise TooLarge(f"body: more than its Content-Length of {self.declared} bytes")
        self._grow(total)
        self.f.write(chunk)
        self.at = total

    def close(self) -> None:
        self.f.close()

    def discard(self) -> None:
        try:
            self.f.close()
            self.path.unlink(missing_ok=True)
        finally:
            self._release()
