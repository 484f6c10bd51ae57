"""Worker settings, read from AOTC_* environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AOTC_", extra="ignore")

    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="The service's Redis.")
    device: str = Field(default="auto", description="auto, cpu, cuda or cuda:N. One worker process per GPU.")
    work_dir: Path = Field(default=Path(".aotc/work"), description="Scratch space for compiles.")
    compile_timeout_s: float = Field(default=1800.0, gt=0, description="A compile running longer is killed.")
    check_timeout_s: float = Field(default=600.0, gt=0, description="An artifact check running longer is killed.")
    heartbeat_s: float = Field(default=5.0, gt=0, description="Registry and lease renewal period.")
    lease_s: float = Field(
        default=30.0, gt=0, description="A claimed job whose lease is not renewed this long is reclaimed."
    )
    reap_interval_s: float = Field(default=5.0, gt=0, description="How often this worker looks for expired leases.")
    worker_ttl_s: float = Field(default=15.0, gt=0, description="Registry entry lifetime without a heartbeat.")
    batch_max_wait_s: float = Field(
        default=600.0, gt=0, description="A batch job queued longer than this is served before interactive ones."
    )
    poll_ms: int = Field(default=2000, gt=0, description="How long one queue read blocks.")
    chunk_mb: int = Field(default=64, gt=0, le=512)
    child_ld_preload: str = Field(
        default="", description="LD_PRELOAD for compile/check children (some images need their system libstdc++)."
    )
    inductor_remote_cache: bool = Field(
        default=True, description="Point Inductor's Redis remote caches (Triton autotune results) at redis_url."
    )
    share_gemm_timings: bool = Field(
        default=True, description="Share max-autotune's matmul/conv timings with other workers through redis_url."
    )
    keep_work: bool = Field(default=False, description="Keep each job's scratch folder (logs, package) for debugging.")

    @model_validator(mode="after")
    def _lease_outlives_heartbeat(self) -> WorkerSettings:
        if self.lease_s <= 2 * self.heartbeat_s:
            raise ValueError(f"AOTC_LEASE_S ({self.lease_s}) must exceed twice AOTC_HEARTBEAT_S ({self.heartbeat_s})")
        return self
