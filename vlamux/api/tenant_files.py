"""A tenant's stored files: private datasets and policy files, uploaded whole or in resumable chunks,
read back before they are accepted, counted against the tenant's stored-bytes quota (max_dataset_mb).

Under the service's data directory:

    datasets/<name>/  or  datasets/<name>.hdf5            the service's public datasets
    tenants/<tenant>/datasets/<name>/  or  <name>.hdf5    the tenant's own (LeRobot, robomimic/LIBERO)
    tenants/<tenant>/policy-files/<name>.policy.safetensors   policies a tenant brought (a job's init_from)
    tenants/<tenant>/policy-files/<name>.lerobot/             ... and LeRobot checkpoints (SmolVLA, π0, π0.5)
    tenants/<tenant>/uploads/<id>/{data, session.json}    uploads in progress: a client resumes at `offset`

An upload is spooled to disk (never held whole in memory), its format told by its first bytes (tar,
gzip, HDF5, safetensors), checked, and only then moved into place at once; a refusal leaves nothing.
Another tenant's names do not exist for a tenant: every lookup starts in its own directory.

The quota (max_dataset_mb) counts stored files, the bytes each open resumable upload declared, and the
bytes each whole upload has reserved while it streams in (`Spool`): the declared Content-Length at
once (refused before a byte is written if it does not fit), else each chunk before it is written. So
a tenant's spools never hold more than its quota, and at most MAX_WHOLE_UPLOADS stream at once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from vlamux.api.faults import Conflict, NotFound, QuotaExceeded, TooLarge
from vlamux.api.uploads import (ArchiveLimits, ChunkWriter, Spool, check_hdf5, checkpoint_root, dataset_root, du,
                                scratch, sniff, unpack, validate, validate_hdf5)
from vlamux.errors import InvalidInputError

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
UPLOAD_ID = re.compile(r"[0-9a-f]{32}")
POLICY_SUFFIX = ".policy.safetensors"
CHECKPOINT_SUFFIX = ".lerobot"  # a LeRobot policy checkpoint a tenant brought, unpacked (a directory)
MAX_OPEN_UPLOADS = 4  # per tenant
MAX_WHOLE_UPLOADS = 2  # per tenant: whole uploads (POST /v1/datasets, /v1/policy-files) streaming at once
WHOLE_UPLOAD_RETRY_S = 5.0  # Retry-After of a whole upload refused for MAX_WHOLE_UPLOADS
QUOTA_RETRY_S = 60.0  # Retry-After of an upload refused for max_dataset_mb
UPLOAD_IDLE_S = 24 * 3600.0  # an upload nobody appended to for this long is dropped


class TenantFiles:
    def __init__(self, data_dir: Path, quotas: Callable[[str], dict],
                 backbone_hashes: Callable[[], dict[str, str]] | None = None):
        """quotas: a tenant's quotas (its max_dataset_mb); backbone_hashes: {content sha256: backbone id}
        of the backbones the service holds (a policy file must fit one)."""
        self.data_dir, self._quotas = Path(data_dir), quotas
        self._backbone_hashes = backbone_hashes or (lambda: {})
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        # the ledger, per tenant, under _ledger(tenant): bytes held back for uploads in flight ({token: bytes}:
        # a whole upload's spool, or an accepted file about to be moved in), the spools streaming, and a cache
        # of stored + declared-session bytes (dropped on every change this class makes)
        self._reserved: dict[str, dict[str, int]] = {}
        self._spools: dict[str, set[str]] = {}
        self._base: dict[str, int] = {}

    # ---- where things are -----------------------------------------------------------------------
    def _tenant(self, tenant_id: str) -> Path:
        return self.data_dir / "tenants" / tenant_id

    def _datasets(self, tenant_id: str) -> Path:
        return self._tenant(tenant_id) / "datasets"

    def _policies(self, tenant_id: str) -> Path:
        return self._tenant(tenant_id) / "policy-files"

    def _uploads(self, tenant_id: str) -> Path:
        return self._tenant(tenant_id) / "uploads"

    @staticmethod
    def _find(root: Path, name: str) -> Path | None:
        if (root / name / "meta" / "info.json").is_file():
            return root / name
        if (root / f"{name}.hdf5").is_file():
            return root / f"{name}.hdf5"
        return None

    def dataset_path(self, name, field_name: str, tenant_id: str | None = None) -> Path:
        """A dataset a job of `tenant_id` may read: its own (uploaded) one of that name, else the
        service's public one. Another tenant's datasets do not exist for it."""
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InvalidInputError(f"{field_name}: the name of a dataset (GET /v1/datasets), got {str(name)[:80]!r}")
        for root in ([self._datasets(tenant_id)] if tenant_id else []) + [self.data_dir / "datasets"]:
            found = self._find(root, name)
            if found is not None and found.resolve().is_relative_to(root.resolve()):
                return found.resolve()  # (a link out of its own directory, made on the disk, is not a dataset)
        raise InvalidInputError(f"{field_name}: no dataset {name!r} (GET /v1/datasets)")

    def datasets(self, tenant_id: str | None = None) -> list[dict]:
        """The service's public datasets, and the tenant's own (private) ones with their sizes."""
        out = [{**v, "public": True} for v in self._listed(self.data_dir / "datasets", sizes=False)]
        if tenant_id:
            out += [{**v, "public": False} for v in self._listed(self._datasets(tenant_id), sizes=True)]
        return out

    def _listed(self, root: Path, sizes: bool) -> list[dict]:
        if not root.is_dir():
            return []
        out = []
        for p in sorted(root.iterdir()):
            if p.name.startswith("."):
                continue
            if (p / "meta" / "info.json").is_file():
                out.append({"name": p.name, "format": "lerobot", **({"bytes": du(p)} if sizes else {})})
            elif p.suffix == ".hdf5" and p.is_file():
                out.append({"name": p.stem, "format": "hdf5", **({"bytes": du(p)} if sizes else {})})
        return out

    def policy_files(self, tenant_id: str) -> list[dict]:
        root = self._policies(tenant_id)
        if not root.is_dir():
            return []
        out = []
        for p in sorted(root.iterdir()):
            if p.name.endswith(POLICY_SUFFIX) and p.is_file():
                out.append({"name": p.name[:-len(POLICY_SUFFIX)], "format": "vlamux", "bytes": p.stat().st_size})
            elif p.name.endswith(CHECKPOINT_SUFFIX) and p.is_dir():
                out.append({"name": p.name[:-len(CHECKPOINT_SUFFIX)], "format": "lerobot", "bytes": du(p)})
        return out

    def _policy_entry(self, tenant_id: str, name) -> Path | None:
        """A stored policy of that name: a policy file, or an unpacked LeRobot checkpoint."""
        if not isinstance(name, str) or not NAME.fullmatch(name):
            return None
        root = self._policies(tenant_id)
        if (root / f"{name}{POLICY_SUFFIX}").is_file():
            return root / f"{name}{POLICY_SUFFIX}"
        if (root / f"{name}{CHECKPOINT_SUFFIX}").is_dir():
            return root / f"{name}{CHECKPOINT_SUFFIX}"
        return None

    def policy_file_path(self, tenant_id: str, name, field_name: str) -> Path:
        found = self._policy_entry(tenant_id, name)
        if found is None:
            raise InvalidInputError(f"{field_name}: no policy file {str(name)[:80]!r} of yours (POST /v1/policy-files; "
                                    f"GET /v1/policy-files lists them)")
        return found.resolve()

    def delete_dataset(self, tenant_id: str, name: str) -> None:
        found = self._find(self._datasets(tenant_id), name) if NAME.fullmatch(name) else None
        if found is None:
            raise NotFound(f"no dataset {name!r} of yours")
        with self._tenant_lock(tenant_id):
            shutil.rmtree(found) if found.is_dir() else found.unlink()
            self._changed(tenant_id)

    def delete_policy_file(self, tenant_id: str, name: str) -> None:
        path = self._policy_entry(tenant_id, name)
        if path is None:
            raise NotFound(f"no policy file {name!r} of yours")
        with self._tenant_lock(tenant_id):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            self._changed(tenant_id)

    # ---- the quota --------------------------------------------------------------------------------
    def limit(self, tenant_id: str) -> int:
        return int(float(self._quotas(tenant_id)["max_dataset_mb"]) * (1 << 20))

    def _stored(self, tenant_id: str, but: str | None = None) -> int:
        """Bytes on disk of datasets and policy files, and what open uploads (other than `but`) declared."""
        total = sum(du(p) for root in (self._datasets(tenant_id), self._policies(tenant_id)) if root.is_dir()
                    for p in root.iterdir() if not p.name.startswith("."))
        return total + sum(s["bytes"] for s in self._sessions(tenant_id) if s["id"] != but)

    def used(self, tenant_id: str, but: str | None = None) -> int:
        """Stored bytes: datasets, policy files, what open uploads declared and what whole uploads in
        flight reserved; `but`: an upload session or reservation not to count (the one being accepted)."""
        # a copy (atomic under the GIL): callers outside the ledger lock read it while uploads grow
        held = sum(n for k, n in list(self._reserved.get(tenant_id, {}).items()) if k != but)
        return self._stored(tenant_id, but) + held

    def _ledger(self, tenant_id: str) -> threading.Lock:
        """Held for each quota decision and the change it allows; never while waiting for the client."""
        return self._tenant_lock(f"ledger:{tenant_id}")

    def _changed(self, tenant_id: str) -> None:
        with self._ledger(tenant_id):
            self._base.pop(tenant_id, None)

    @staticmethod
    def _refusal(what: str, adding: int, used: int, limit: int) -> QuotaExceeded:
        return QuotaExceeded(f"quota: {what} of {adding} bytes beside the {used} you store or are uploading "
                             f"would exceed max_dataset_mb ({limit} bytes); delete a dataset or policy file first",
                             retry_after_s=QUOTA_RETRY_S)

    def _over(self, tenant_id: str, adding: int, what: str, but: str | None = None, hold: bool = False) -> None:
        """Refuse (429) unless `adding` bytes fit beside the rest. hold: keep them reserved under `but`
        until `_release(but)`, so that nothing else takes them before the file is in place (an
        archive can unpack to more than its upload reserved)."""
        with self._ledger(tenant_id):
            used, limit = self.used(tenant_id, but), self.limit(tenant_id)
            if used + adding > limit:
                raise self._refusal(what, adding, used, limit)
            if hold and but:
                held = self._reserved.setdefault(tenant_id, {})
                held[but] = max(held.get(but, 0), adding)

    def _release(self, tenant_id: str, token: str) -> None:
        with self._ledger(tenant_id):
            self._reserved.get(tenant_id, {}).pop(token, None)
            self._spools.get(tenant_id, set()).discard(token)
            self._base.pop(tenant_id, None)  # a file may have moved in under this reservation

    # ---- whole uploads, streamed in ---------------------------------------------------------------------
    def spool(self, tenant_id: str, declared: int | None) -> Spool:
        """Where a whole upload streams to, once it may: at most MAX_WHOLE_UPLOADS of a tenant's at once,
        and its declared size (Content-Length; None when chunked) within the quota, reserved at once.
        Refused (429) before anything is written. The caller must `discard()` it on every path."""
        token = uuid.uuid4().hex
        with self._ledger(tenant_id):
            if declared is not None:
                used, limit = self.used(tenant_id), self.limit(tenant_id)
                if used + declared > limit:
                    raise self._refusal("an upload", declared, used, limit)
            spools = self._spools.setdefault(tenant_id, set())
            if len(spools) >= MAX_WHOLE_UPLOADS:
                raise QuotaExceeded(f"quota: {MAX_WHOLE_UPLOADS} uploads of yours are streaming in at once, the "
                                    f"most at a time; send this one when one of them is done",
                                    retry_after_s=WHOLE_UPLOAD_RETRY_S)
            spools.add(token)
            self._reserved.setdefault(tenant_id, {})[token] = declared or 0
        try:
            where = self._tenant(tenant_id) / "incoming"
            where.mkdir(parents=True, exist_ok=True)
            return Spool(where / token, declared, token, grow=lambda total: self._grow(tenant_id, token, total),
                         release=lambda: self._release(tenant_id, token))
        except BaseException:
            self._release(tenant_id, token)
            raise

    def _grow(self, tenant_id: str, token: str, total: int) -> None:
        """Raise the reservation `token` to `total` bytes, or refuse (429) when that passes the quota."""
        with self._ledger(tenant_id):
            held = self._reserved.setdefault(tenant_id, {})
            if total <= held.get(token, 0):
                return
            others, limit = sum(n for k, n in held.items() if k != token), self.limit(tenant_id)
            if tenant_id not in self._base:
                self._base[tenant_id] = self._stored(tenant_id)
            if self._base[tenant_id] + others + total > limit:
                self._base[tenant_id] = self._stored(tenant_id)  # refuse on fresh numbers only
                if self._base[tenant_id] + others + total > limit:
                    used = self._base[tenant_id] + others
                    raise QuotaExceeded(f"quota: the upload reached {total} bytes; beside the {used} you store or "
                                        f"are uploading that exceeds max_dataset_mb ({limit} bytes); delete a "
                                        f"dataset or policy file first", retry_after_s=QUOTA_RETRY_S)
            held[token] = total

    def _tenant_lock(self, tenant_id: str) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(tenant_id, threading.Lock())

    # ---- accepting a spooled upload -----------------------------------------------------------------
    def accept(self, tenant_id: str, spooled: Path, kind: str, name: str, but: str | None = None) -> dict:
        """Take the file `spooled` (on this disk) as the tenant's dataset or policy file `name`: its
        format from its first bytes, read back, within the quota, then moved into place. `spooled` is
        the caller's to delete. but: an upload session whose reservation this replaces."""
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InvalidInputError(f"name: letters, digits, '-', '_' and '.', 1 to 64, got {str(name)[:80]!r}")
        fmt = sniff(spooled)
        with self._tenant_lock(tenant_id):  # one acceptance of a tenant at a time: its quota check holds
            try:
                if kind == "dataset":
                    return self._accept_dataset(tenant_id, spooled, fmt, name, but)
                if kind == "policy_file":
                    return self._accept_policy(tenant_id, spooled, fmt, name, but)
            finally:
                self._changed(tenant_id)  # the stored bytes changed (or not): counted afresh
        raise InvalidInputError(f"as: 'dataset' or 'policy_file', got {str(kind)[:40]!r}")

    def _accept_dataset(self, tenant_id: str, spooled: Path, fmt: str, name: str, but: str | None) -> dict:
        own = self._datasets(tenant_id)
        own.mkdir(parents=True, exist_ok=True)
        if self._find(own, name) is not None or self._find(self.data_dir / "datasets", name) is not None:
            raise Conflict(f"name: a dataset {name!r} exists already (delete yours first, or pick another name)")
        if fmt == "hdf5":
            size = spooled.stat().st_size
            self._over(tenant_id, size, "the dataset", but)
            check_hdf5(spooled)
            info = validate_hdf5(spooled, name)
            self._over(tenant_id, size, "the dataset", but, hold=True)
            os.replace(spooled, own / f"{name}.hdf5")
            return {"name": name, "public": False, "format": "hdf5", "bytes": size, **info}
        if fmt not in ("tar", "gzip"):
            raise InvalidInputError("body: not a tar archive (plain or gzip) of a LeRobot dataset, nor an HDF5 file "
                                    "(robomimic / LIBERO)")
        remaining = max(0, self.limit(tenant_id) - self.used(tenant_id, but))
        tmp = scratch(own)
        try:
            unpack(spooled, tmp, ArchiveLimits(max_bytes=remaining + 1))
            root = dataset_root(tmp)
            size = du(root)
            self._over(tenant_id, size, "the dataset", but)
            info = validate(root)
            self._over(tenant_id, size, "the dataset", but, hold=True)
            os.replace(root, own / name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return {"name": name, "public": False, "format": "lerobot", "bytes": size, **info}

    def _accept_policy(self, tenant_id: str, spooled: Path, fmt: str, name: str, but: str | None) -> dict:
        from vlamux.errors import CorruptCheckpointError, IncompatibleError
        from vlamux.model.heads.base import HeadSpec
        from vlamux.policy import read_policy

        own = self._policies(tenant_id)
        own.mkdir(parents=True, exist_ok=True)
        if self._policy_entry(tenant_id, name) is not None:
            raise Conflict(f"name: a policy file {name!r} exists already (delete it first, or pick another name)")
        if fmt in ("tar", "gzip"):
            return self._accept_checkpoint(tenant_id, spooled, name, but)
        if fmt != "safetensors":
            raise InvalidInputError("body: not a policy file (a safetensors file from GET /v1/policies/{id}/download) "
                                    "nor a tar archive of a LeRobot policy checkpoint directory")
        size = spooled.stat().st_size
        self._over(tenant_id, size, "the policy file", but)
        try:
            _, meta = read_policy(spooled)
        except (CorruptCheckpointError, IncompatibleError) as e:
            raise InvalidInputError(f"body: {str(e).replace(str(spooled), 'the policy file')}") from None
        held = self._backbone_hashes()
        if meta.get("backbone_sha256") not in held:
            raise InvalidInputError(f"body: the policy was trained on backbone {meta.get('backbone_id')!r}, which "
                                    f"this service does not hold (it holds {sorted(held.values())})")
        self._over(tenant_id, size, "the policy file", but, hold=True)
        os.replace(spooled, own / f"{name}{POLICY_SUFFIX}")
        return {"name": name, "bytes": size, "policy_version": int(meta["policy_version"]),
                "backbone": held[meta["backbone_sha256"]], "head": json.loads(HeadSpec.from_json(meta["head_spec"]).to_json())}

    def _accept_checkpoint(self, tenant_id: str, spooled: Path, name: str, but: str | None) -> dict:
        """A tar of a LeRobot checkpoint directory: unpacked within the quota, read back whole (its files,
        tensors and statistics), and kept only if its VLM is one this service holds."""
        from vlamux.model.vla.checkpoint import LeRobotCheckpoint

        own = self._policies(tenant_id)
        remaining = max(0, self.limit(tenant_id) - self.used(tenant_id, but))
        tmp = scratch(own)
        try:
            unpack(spooled, tmp, ArchiveLimits(max_bytes=remaining + 1))
            root = checkpoint_root(tmp)
            size = du(root)
            self._over(tenant_id, size, "the checkpoint", but)
            try:
                ckpt = LeRobotCheckpoint.read(root)
            except InvalidInputError as e:
                raise InvalidInputError(f"body: {e}") from None
            held, digest = self._backbone_hashes(), ckpt.vlm_sha256()
            if digest not in held:
                raise InvalidInputError(f"body: the checkpoint's VLM (sha256 {digest}) is none this service holds "
                                        f"(it holds {sorted(held.values())}); serve it with --add-backbone "
                                        f"NAME=lerobot:CKPT_DIR --vlm DIR")
            info = {"name": name, "format": "lerobot", "bytes": size, "family": ckpt.family, "backbone": held[digest],
                    "policy_version": 0, "cameras": ckpt.cameras(), "state_dim": ckpt.state_dim(),
                    "action_dim": ckpt.action_dim()}
            del ckpt
            self._over(tenant_id, size, "the checkpoint", but, hold=True)
            os.replace(root, own / f"{name}{CHECKPOINT_SUFFIX}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return info

    # ---- resumable uploads ----------------------------------------------------------------------------
    def _sessions(self, tenant_id: str) -> list[dict]:
        root = self._uploads(tenant_id)
        if not root.is_dir():
            return []
        out = []
        for d in root.iterdir():
            try:
                out.append(json.loads((d / "session.json").read_text()))
            except (OSError, ValueError):
                continue
        return out

    def _session_dir(self, tenant_id: str, upload_id: str) -> Path:
        d = self._uploads(tenant_id) / upload_id
        if not UPLOAD_ID.fullmatch(upload_id or "") or not (d / "session.json").is_file():
            raise NotFound(f"no upload {str(upload_id)[:40]!r} of yours")
        return d

    def _sweep(self, tenant_id: str) -> None:
        now = time.time()
        for s in self._sessions(tenant_id):
            d = self._uploads(tenant_id) / s["id"]
            touched = (d / "data").stat().st_mtime if (d / "data").exists() else s["created"]
            if now - touched > UPLOAD_IDLE_S:
                shutil.rmtree(d, ignore_errors=True)

    def start_upload(self, tenant_id: str, total: int, sha256: str | None = None) -> dict:
        """A new resumable upload of `total` bytes (reserved against the quota at once)."""
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise InvalidInputError(f"bytes: a positive integer, got {total!r}")
        if sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", str(sha256)):
            raise InvalidInputError("sha256: 64 lower-case hex digits")
        with self._ledger(tenant_id):  # the quota decision and the session it allows, at once
            self._sweep(tenant_id)
            self._base.pop(tenant_id, None)
            if len(self._sessions(tenant_id)) >= MAX_OPEN_UPLOADS:
                raise QuotaExceeded(f"quota: {MAX_OPEN_UPLOADS} uploads are open; finish or delete one first",
                                    retry_after_s=10.0)
            used, limit = self.used(tenant_id), self.limit(tenant_id)
            if used + total > limit:
                raise self._refusal("an upload", total, used, limit)
            upload_id = uuid.uuid4().hex
            d = self._uploads(tenant_id) / upload_id
            d.mkdir(parents=True)
            (d / "data").touch()
            session = {"id": upload_id, "bytes": total, "sha256": sha256, "created": time.time()}
            (d / "session.json").write_text(json.dumps(session))
        return self._view(d, session)

    def upload_status(self, tenant_id: str, upload_id: str) -> dict:
        d = self._session_dir(tenant_id, upload_id)
        return self._view(d, json.loads((d / "session.json").read_text()))

    @staticmethod
    def _view(d: Path, session: dict) -> dict:
        return {"id": session["id"], "bytes": session["bytes"], "offset": (d / "data").stat().st_size,
                "sha256": session["sha256"]}

    def writer(self, tenant_id: str, upload_id: str, offset: int, length: int | None = None) -> ChunkWriter:
        """Where a chunk starting at `offset` goes: it must start where the upload's bytes end, and a
        chunk whose declared `length` (Content-Length) runs past the upload's declared bytes is refused
        (413) before a byte of it is written."""
        d = self._session_dir(tenant_id, upload_id)
        session = json.loads((d / "session.json").read_text())
        if length is not None and offset + length > session["bytes"]:
            raise TooLarge(f"body: a chunk of {length} bytes at offset {offset} runs past the upload's declared "
                           f"{session['bytes']} bytes")
        lock = self._tenant_lock(f"upload:{upload_id}")
        if not lock.acquire(blocking=False):
            raise Conflict(f"upload {upload_id}: another chunk is being written; send one at a time")
        try:
            have = (d / "data").stat().st_size
            if offset != have:
                raise Conflict(f"offset: the upload holds {have} bytes; send the chunk that starts there "
                               f"(GET /v1/uploads/{upload_id})")
            return ChunkWriter(d / "data", have, session["bytes"], lock)
        except BaseException:
            lock.release()
            raise

    def finish_upload(self, tenant_id: str, upload_id: str, kind: str, name: str) -> dict:
        """The whole upload, checked against its declared size and digest, accepted as `kind` `name`;
        once whole, the session is gone afterwards, accepted or refused."""
        d = self._session_dir(tenant_id, upload_id)
        session = json.loads((d / "session.json").read_text())
        data = d / "data"
        have = data.stat().st_size
        if have != session["bytes"]:  # not yet whole: the session stays, to be completed
            raise Conflict(f"offset: the upload holds {have} of its {session['bytes']} bytes; send the rest first")
        try:
            if session["sha256"]:
                from vlamux.utils.io import file_sha256

                got = file_sha256(data)
                if got != session["sha256"]:
                    raise InvalidInputError(f"sha256: the upload's bytes hash to {got}, not {session['sha256']}; "
                                            f"start it again")
            return self.accept(tenant_id, data, kind, name, but=upload_id)
        finally:
            shutil.rmtree(d, ignore_errors=True)
            self._release(tenant_id, upload_id)

    def abort_upload(self, tenant_id: str, upload_id: str) -> None:
        shutil.rmtree(self._session_dir(tenant_id, upload_id), ignore_errors=True)
        self._changed(tenant_id)
