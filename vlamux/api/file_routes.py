"""The routes of a tenant's stored files (vlamux.api.tenant_files): datasets, policy files, and
resumable uploads of either.

    POST   /v1/datasets?name=N          a whole dataset: tar / tar.gz of a LeRobot dataset, or an HDF5 file
    POST   /v1/policy-files?name=N      a whole policy file (a job's init_from: N)
    POST   /v1/uploads  {bytes, sha256?}            a resumable upload: 201 {id, offset: 0}
    PUT    /v1/uploads/{id}?offset=K    the next chunk (it must start at the upload's offset)
    GET    /v1/uploads/{id}             where to resume: {offset, bytes}
    POST   /v1/uploads/{id}/finish {as: dataset | policy_file, name}   checked and accepted, or refused
    DELETE /v1/uploads/{id}

Bodies stream to disk chunk by chunk; nothing is parsed on the event loop. A whole upload is held to
the tenant's quota before its bytes reach the disk (TenantFiles.spool): its Content-Length is reserved
(or refused, 429) before the first byte is written, a body without one is reserved chunk by chunk and
cut off as it passes the quota, and at most MAX_WHOLE_UPLOADS of a tenant's stream at once (429,
Retry-After). A refusal, a dropped client or an accepted file leaves no spool and no reservation.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from vlamux.api.errors import UPLOAD_TYPES, ApiError

log = logging.getLogger(__name__)
NAME_QUERY = dict(min_length=1, max_length=64)


def declared_length(request: Request) -> int | None:
    """The body's Content-Length (BodyLimit has refused a malformed or oversized one), or None (chunked)."""
    value = request.headers.get("content-length")
    try:
        return max(0, int(value)) if value is not None else None
    except ValueError:
        return None


def add_file_routes(app: FastAPI, host, tenant) -> None:
    files = host.files

    async def spooled(request: Request, t: str, kind: str, name: str) -> dict:
        """The body, streamed to a spool file, then accepted as `kind` `name` (on a worker thread)."""
        ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower().encode()
        if ctype not in UPLOAD_TYPES:
            raise ApiError(415, "invalid_input", "content-type: expected application/x-tar, application/gzip, "
                           "application/x-hdf5 or application/octet-stream", "content-type")
        # the quota and the cap on uploads at once, decided before the body is read: nothing written yet
        spool = await run_in_threadpool(files.spool, t, declared_length(request))
        try:
            async for chunk in request.stream():  # never the whole body in memory
                if chunk:
                    await run_in_threadpool(spool.write, chunk)  # reserved before written, else 429
            await run_in_threadpool(spool.close)
            return await run_in_threadpool(files.accept, t, spool.path, kind, name, spool.token)
        except ClientDisconnect:  # nobody to answer; not a server error
            log.info("a whole upload of %s: the client went away at byte %d", t, spool.at)
            raise ApiError(499, "client_closed_request", "body: the client went away before it was whole") from None
        finally:  # the spool file removed and its reservation given back, on every path
            try:
                await run_in_threadpool(spool.discard)
            except BaseException:  # cancelled: here, then (it is idempotent)
                spool.discard()
                raise

    @app.get("/v1/datasets")
    def datasets(t: str = Depends(tenant)):
        return {"datasets": files.datasets(t)}

    @app.post("/v1/datasets", status_code=201)
    async def upload_dataset(request: Request, name: str = Query(**NAME_QUERY), t: str = Depends(tenant)):
        """A private dataset: a tar archive (plain or gzip) of a LeRobot dataset, or a robomimic /
        LIBERO HDF5 file; read back before it is the tenant's (`sft.dataset: NAME`). 201 with what it holds."""
        return {"dataset": await spooled(request, t, "dataset", name)}

    @app.delete("/v1/datasets/{name}", status_code=204)
    def delete_dataset(name: str, t: str = Depends(tenant)):
        files.delete_dataset(t, name)
        return Response(status_code=204)

    @app.get("/v1/policy-files")
    def policy_files(t: str = Depends(tenant)):
        return {"policy_files": files.policy_files(t)}

    @app.post("/v1/policy-files", status_code=201)
    async def upload_policy_file(request: Request, name: str = Query(**NAME_QUERY), t: str = Depends(tenant)):
        """A policy file (GET /v1/policies/{id}/download's), verified and fitted to a backbone this service
        holds: a job's `init_from: NAME` starts from it."""
        return {"policy_file": await spooled(request, t, "policy_file", name)}

    @app.delete("/v1/policy-files/{name}", status_code=204)
    def delete_policy_file(name: str, t: str = Depends(tenant)):
        files.delete_policy_file(t, name)
        return Response(status_code=204)

    @app.post("/v1/uploads", status_code=201)
    def start_upload(body: dict[str, Any], t: str = Depends(tenant)):
        unknown = set(body) - {"bytes", "sha256"}
        if unknown:
            raise ApiError(422, "invalid_input", f"{sorted(unknown)[0]}: unknown field; allowed: bytes, sha256",
                           sorted(unknown)[0])
        return {"upload": files.start_upload(t, body.get("bytes"), body.get("sha256"))}

    @app.get("/v1/uploads/{upload_id}")
    def upload_status(upload_id: str, t: str = Depends(tenant)):
        return {"upload": files.upload_status(t, upload_id)}

    @app.put("/v1/uploads/{upload_id}")
    async def upload_chunk(upload_id: str, request: Request, offset: int = Query(ge=0, le=1 << 50),
                           t: str = Depends(tenant)):
        """Bytes [offset, offset + len) of the upload. A chunk cut off by a dropped connection keeps
        what arrived: GET the upload for the offset to go on from."""
        writer = await run_in_threadpool(files.writer, t, upload_id, offset, declared_length(request))
        try:
            async for chunk in request.stream():
                if chunk:
                    await run_in_threadpool(writer.write, chunk)
        except ClientDisconnect:  # nobody to answer; what arrived is kept for the resume
            log.info("upload %s: the client went away at byte %d", upload_id, writer.at)
            return Response(status_code=499)
        finally:
            at = await run_in_threadpool(writer.close)
        return {"upload": {**files.upload_status(t, upload_id), "offset": at}}

    @app.post("/v1/uploads/{upload_id}/finish", status_code=201)
    def finish_upload(upload_id: str, body: dict[str, Any], t: str = Depends(tenant)):
        kind, name = body.get("as"), body.get("name")
        if kind not in ("dataset", "policy_file"):
            raise ApiError(422, "invalid_input", f"as: 'dataset' or 'policy_file', got {str(kind)[:40]!r}", "as")
        out = files.finish_upload(t, upload_id, kind, name)
        return {kind: out}

    @app.delete("/v1/uploads/{upload_id}", status_code=204)
    def abort_upload(upload_id: str, t: str = Depends(tenant)):
        files.abort_upload(t, upload_id)
        return Response(status_code=204)
