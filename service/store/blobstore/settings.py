"""The storage settings the API and the workers share (AOTC_BLOB_STORE, AOTC_CHUNK_MB, AOTC_STORE_MAX_GB,
AOTC_WEIGHTS_GRACE_S, AOTC_S3_*, AOTC_DISK_LOW_WATER_MB): both settings classes derive from this one, so each
setting is declared once."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class StorageSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AOTC_", extra="ignore")

    chunk_mb: int = Field(default=4, gt=0, le=512, description="Chunk size of blobs in Redis (AOTC_BLOB_STORE=redis).")
    blob_store: str = Field(
        default="", description="Where models and packages are stored: redis, file:///DIR or s3://bucket/prefix. "
        "Empty: the API uses file://AOTC_DATA_DIR/blobs and announces it in Redis; a worker uses what the API "
        "announced.")
    store_max_gb: float = Field(
        default=20.0, gt=0, description="Bytes artifacts (packages and sources) may hold in the blob store; beyond it "
        "the least recently pulled ones that are not pinned are evicted.")
    weights_grace_s: float = Field(
        default=600.0, ge=0, le=7 * 86400, description="How long a weights blob whose last artifact was evicted waits "
        "before it is deleted: a publish that found it stored a moment before takes it back meanwhile. Its bytes "
        "leave AOTC_STORE_MAX_GB's count at once.")
    s3_endpoint_url: str = Field(default="", description="S3 endpoint (SeaweedFS, Garage, MinIO); empty: AWS.")
    s3_public_url: str = Field(
        default="", description="S3 endpoint in the presigned URLs clients are sent to; empty: AOTC_S3_ENDPOINT_URL.")
    s3_region: str = Field(default="", description="S3 region; empty: AWS_REGION, else us-east-1.")
    s3_presign_s: int = Field(default=900, gt=0, description="How long a presigned download URL works.")
    disk_low_water_mb: int = Field(
        default=512, ge=0, description="Free space kept in reserve on the local disks aotc writes to. The API refuses "
        "an upload (507) that would leave less free where it spools uploads (AOTC_DATA_DIR/uploads) or, with a file "
        "blob store, where blobs go; a worker claims no job while its work dir or its file blob store has less "
        "free, and says so (unhealthy), until there is room again. 0: only a write that fails for want of room.")
