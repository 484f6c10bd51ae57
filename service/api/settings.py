"""API settings, read from AOTC_* environment variables."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AOTC_", extra="ignore")

    redis_url: str | None = Field(
        default=None, description="Redis to use. Unset: `aotc-server` starts an embedded redis-server."
    )
    data_dir: Path = Field(default=Path(".aotc"), description="Embedded Redis data and scratch space.")
    max_upload_mb: int = Field(default=4096, gt=0, description="Largest accepted .pt2 upload.")
    max_json_mb: int = Field(default=256, gt=0, description="Largest models/model.json inside an upload.")
    chunk_mb: int = Field(default=64, gt=0, le=512,
                          description="Blob chunk size in Redis (one string holds <= 512 MB).")
    worker_ttl_s: float = Field(default=15.0, gt=0, description="A worker without a heartbeat this long is gone.")
    job_max_attempts: int = Field(default=3, ge=1, description="Claims before a job fails for good.")
    job_ttl_days: float = Field(default=30.0, gt=0, description="How long finished job records are kept.")
    lease_s: float = Field(
        default=30.0, gt=0, description="A job whose worker has not renewed its lease this long is requeued; "
        "the same AOTC_LEASE_S the workers use.")
    reap_interval_s: float = Field(default=5.0, gt=0, description="How often the API looks for expired leases.")
    reaper: bool = Field(default=True, description="Run a reaper in this API process (any number may run).")

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str | None) -> str | None:
        if v and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("AOTC_REDIS_URL must start with redis://, rediss:// or unix://")
        return v or None


@lru_cache
def get_settings() -> Settings:
    return Settings()
