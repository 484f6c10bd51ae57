"""The console's settings, read from AOTC_UI_* environment variables (the API process reads them once)."""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ConsoleSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AOTC_UI_", extra="ignore")

    session_hours: float = Field(default=12.0, gt=0, le=24 * 30, description="How long the console's sign-in "
                                 "cookie lasts; the key it holds is checked on every request all the same.")
    secure_cookie: bool = Field(default=False, description="Mark the sign-in cookie Secure even when the request "
                                "came over plain HTTP (a proxy in front terminates TLS). HTTPS requests get it "
                                "anyway.")
    code_view_max_kb: int = Field(default=2048, gt=0, description="Largest generated file the console's code view "
                                  "highlights; larger ones are linked as plain text (GET /v1/artifacts/{key}/source).")
    history_jobs: int = Field(default=1000, gt=0, le=1000, description="Most recent jobs the farm page reads to "
                              "draw queue depth and throughput over time.")
    form_max_bytes: int = Field(default=8192, gt=0, description="Largest form the console accepts (sign-in, "
                                "cancel, retry: a key and a token; 413 past it).")
    page_kernels: int = Field(default=2000, gt=0, description="Most kernels and extern calls an artifact page "
                              "lists (the rest are counted; the report has them all).")


@lru_cache
def get_console_settings() -> ConsoleSettings:
    return ConsoleSettings()
