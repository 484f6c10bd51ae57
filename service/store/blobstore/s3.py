"""The `s3://bucket/prefix` blob store: objects in an S3-protocol store (AWS S3, SeaweedFS, Garage, MinIO).

    {prefix}{kind}/{id}                 the bytes (one PUT, or a multipart upload for large ones)
    {prefix}{kind}/{id}.manifest.json   {size, sha256}, written after the bytes

An object appears whole or not at all, and the manifest comes last, so a writer killed midway leaves nothing a
reader can see (an unfinished multipart upload stays invisible; a bucket lifecycle rule aborts those). Downloads
do not pass through the API: it answers with a redirect to a presigned GET.

The endpoint, region and presigned-URL lifetime come from settings (AOTC_S3_*); credentials come the way boto3
finds them (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile, an instance role).

A store that refuses a write for lack of room (a 507 from the endpoint, or an error code that says so) raises
service.store.disk.NoSpace, an ENOSPC OSError: the API answers it with a 507 and a worker hands its job back, as for a
full local disk.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any, BinaryIO

from service.store.blobs import PIECE, BlobError, Manifest, Reads, check_id, clamp
from service.store.disk import NoSpace

_MANIFEST = ".manifest.json"
# Error codes S3-protocol stores give when they have no room: AWS's 507 InsufficientStorage, MinIO's drive and
# bucket-quota refusals, the generic quota code some stores use. EntityTooLarge: an object over what the store takes.
_NO_ROOM = frozenset({"InsufficientStorage", "XMinioStorageFull", "XMinioAdminBucketQuotaExceeded", "QuotaExceeded",
                      "EntityTooLarge"})


class _Hashing:
    """A read-only, non-seekable view of a stream that hashes what passes. Non-seekable, so boto3 reads it once,
    in order (and holds a few multipart chunks, not the file)."""

    def __init__(self, src: BinaryIO) -> None:
        self.src = src
        self.digest = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = self.src.read(n)
        self.digest.update(data)
        self.size += len(data)
        return data


def _missing(e: Exception) -> bool:
    err = getattr(e, "response", {}).get("Error", {})
    return str(err.get("Code")) in ("NoSuchKey", "404", "NotFound", "NoSuchBucket")


def _no_room(e: BaseException) -> str | None:
    """What a store's refusal for lack of room said ("InsufficientStorage: ..."), else None. boto3 hands a multipart
    failure over as S3UploadFailedError, whose text carries the code; the cause chain may hold the ClientError."""
    seen: BaseException | None = e
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            err = response.get("Error", {})
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = str(err.get("Code") or "")
            if status == 507 or code in _NO_ROOM:
                return f"{code or 'HTTP 507'}: {str(err.get('Message') or '')[:200]}".rstrip(": ")
        seen = seen.__cause__ or seen.__context__
    text = str(e)
    hit = next((c for c in sorted(_NO_ROOM) if f"({c})" in text), None)
    return f"{hit}: {text[:300]}" if hit else None


class S3Blobs(Reads):
    presigns = True

    def __init__(self, url: str, *, endpoint_url: str | None = None, public_url: str | None = None,
                 region: str | None = None, presign_s: int = 900, part_bytes: int = 16 * 2**20) -> None:
        import boto3  # type: ignore[import-untyped]  # only a store that uses S3 pays for importing boto3
        from boto3.s3.transfer import TransferConfig  # type: ignore[import-untyped]
        from botocore.config import Config  # type: ignore[import-untyped]

        rest = url.removeprefix("s3://")
        self.bucket, _, prefix = rest.partition("/")
        if not self.bucket:
            raise BlobError(f"AOTC_BLOB_STORE {url!r} names no bucket; write s3://bucket/prefix")
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{self.bucket}/{self.prefix}"
        self.presign_s = presign_s
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        # Path-style addressing for a store at its own endpoint (SeaweedFS, Garage, MinIO): no bucket DNS names.
        config = Config(signature_version="s3v4", s3={"addressing_style": "path"} if endpoint_url else {},
                        retries={"max_attempts": 3, "mode": "standard"}, max_pool_connections=32)
        session = boto3.session.Session()
        self.s3 = session.client("s3", endpoint_url=endpoint_url or None, region_name=region, config=config)
        # Presigned URLs name the host the clients reach, which inside a cluster may differ from the API's.
        self.public = (session.client("s3", endpoint_url=public_url, region_name=region, config=config)
                       if public_url else self.s3)
        # Uploads hold a few parts in memory, never the whole blob.
        self.transfer = TransferConfig(multipart_threshold=part_bytes, multipart_chunksize=part_bytes,
                                       max_concurrency=4)
        self._ensure_bucket(endpoint_url)

    def _ensure_bucket(self, endpoint_url: str | None) -> None:
        from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]

        where = f" at {endpoint_url}" if endpoint_url else ""
        try:
            self.s3.head_bucket(Bucket=self.bucket)
            return
        except ClientError as e:
            if not _missing(e):
                raise BlobError(f"cannot use bucket {self.bucket!r}{where}: {e}") from None
        except BotoCoreError as e:
            raise BlobError(f"cannot reach the S3 store{where} (AOTC_S3_ENDPOINT_URL): {e}") from None
        try:
            region = self.s3.meta.region_name
            extra: dict[str, Any] = ({} if region == "us-east-1" else
                                     {"CreateBucketConfiguration": {"LocationConstraint": region}})
            self.s3.create_bucket(Bucket=self.bucket, **extra)
        except (ClientError, BotoCoreError) as e:
            raise BlobError(f"bucket {self.bucket!r}{where} does not exist and cannot be created: {e}") from None

    def _key(self, kind: str, blob_id: str) -> str:
        check_id(kind, blob_id)
        return f"{self.prefix}{kind}/{blob_id}"

    def put(self, kind: str, blob_id: str, src: BinaryIO) -> Manifest:
        key = self._key(kind, blob_id)
        reader = _Hashing(src)
        try:
            self.s3.upload_fileobj(reader, self.bucket, key, Config=self.transfer)
            manifest: Manifest = {"size": reader.size, "sha256": reader.digest.hexdigest()}
            self.s3.put_object(Bucket=self.bucket, Key=key + _MANIFEST, Body=json.dumps(manifest).encode(),
                               ContentType="application/json")
        except Exception as e:
            if (said := _no_room(e)) is None:
                raise
            raise NoSpace(f"the S3 store {self.url}", f"it refused {kind} {blob_id[:12]} ({reader.size} bytes "
                          f"sent) with {said}") from e
        return manifest

    def manifest(self, kind: str, blob_id: str) -> Manifest | None:
        from botocore.exceptions import ClientError

        try:
            body = self.s3.get_object(Bucket=self.bucket, Key=self._key(kind, blob_id) + _MANIFEST)["Body"]
        except ClientError as e:
            if _missing(e):
                return None
            raise
        with body:
            m = json.loads(body.read())
        return {"size": int(m["size"]), "sha256": str(m["sha256"])}

    def iter_range(self, kind: str, blob_id: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        from botocore.exceptions import ClientError

        m = self.manifest(kind, blob_id)
        if m is None:
            raise KeyError(f"{kind}:{blob_id}")
        start, end = clamp(m["size"], start, end)
        if start >= end:
            return iter(())
        try:
            body = self.s3.get_object(Bucket=self.bucket, Key=self._key(kind, blob_id),
                                      Range=f"bytes={start}-{end - 1}")["Body"]
        except ClientError as e:
            if _missing(e):
                raise KeyError(f"{kind}:{blob_id}") from None
            raise
        return self._pieces(body)

    @staticmethod
    def _pieces(body: Any) -> Iterator[bytes]:
        with body:
            yield from body.iter_chunks(PIECE)

    def delete(self, kind: str, blob_id: str) -> None:
        key = self._key(kind, blob_id)
        self.s3.delete_object(Bucket=self.bucket, Key=key + _MANIFEST)
        self.s3.delete_object(Bucket=self.bucket, Key=key)

    def presign(self, kind: str, blob_id: str, *, filename: str) -> str | None:
        return str(self.public.generate_presigned_url(
            "get_object", ExpiresIn=self.presign_s,
            Params={"Bucket": self.bucket, "Key": self._key(kind, blob_id),
                    "ResponseContentDisposition": f'attachment; filename="{filename}"'}))

    def close(self) -> None:
        self.s3.close()
        if self.public is not self.s3:
            self.public.close()
