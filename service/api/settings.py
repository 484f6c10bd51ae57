"""API settings, read from AOTC_* environment variables."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from compiler.archive.limits import MB, Limits
from service.store.blobstore.settings import StorageSettings
from service.store.names import Limits as RegistryLimits
from service.store.namespaces import GB, Quota
from service.store.redis_url import with_password_file


class Settings(StorageSettings):
    model_config = SettingsConfigDict(env_prefix="AOTC_", extra="ignore")

    redis_url: str | None = Field(
        default=None, description="Redis to use. Unset: `aotc-server` starts an embedded redis-server."
    )
    redis_password_file: Path | None = Field(
        default=None, description="A file holding Redis's password (e.g. a Docker secret), for an AOTC_REDIS_URL "
        "without one; a password in the URL wins.")
    data_dir: Path = Field(default=Path(".aotc"), description="Embedded Redis data and scratch space.")
    # aotc-server's supervision of its embedded Redis (service/store/embedded.py, RedisSupervisor).
    redis_restart_backoff_s: float = Field(
        default=0.5, gt=0, description="aotc-server: wait this long before starting its embedded redis-server again "
        "after it died, doubled per failed try up to AOTC_REDIS_RESTART_BACKOFF_MAX_S.")
    redis_restart_backoff_max_s: float = Field(
        default=5.0, gt=0, description="aotc-server: the longest wait between two restarts of its embedded Redis.")
    redis_restart_giveup_s: float = Field(
        default=60.0, gt=0, description="aotc-server: when its embedded Redis has not answered this long after it "
        "died (or at start), aotc-server stops its API and workers and exits 1, naming why, for systemd, compose "
        "or Kubernetes to restart it.")
    redis_hang_s: float = Field(
        default=30.0, gt=0, description="aotc-server: its embedded redis-server, alive but answering no PING for "
        "this long (stopped, deadlocked), is killed and started again from its AOF as one that died is.")
    liveness_stall_s: float = Field(
        default=120.0, gt=0, description="/healthz fails when this API process has made no progress for this long: "
        "a background task (the reaper) has not finished a round, or every thread of its pool has been held by the "
        "same requests. Keep it above the longest a Redis call can take (about 45 s).")
    max_upload_mb: int = Field(default=4096, gt=0, description="Largest accepted .pt2 upload.")
    # Bounds on the work one upload may cost the API (compiler.archive.limits; each refusal names its setting).
    max_zip_entries: int = Field(default=20_000, gt=0, description="Most entries in an uploaded zip.")
    max_unpacked_mb: int = Field(default=8192, gt=0,
                                 description="Largest total uncompressed size of an upload's entries.")
    max_entry_mb: int = Field(default=4096, gt=0, description="Largest uncompressed size of one entry of an upload.")
    max_compression_ratio: int = Field(default=100, gt=0,
                                       description="Largest uncompressed/compressed ratio of an entry over 1 MiB, "
                                       "and of the whole archive over 1 MiB.")
    max_json_mb: int = Field(default=32, gt=0,
                             description="Largest models/model.json (or weights/constants config) inside an upload.")
    max_json_depth: int = Field(default=64, gt=0, description="Deepest nesting of arrays and objects in that JSON.")
    max_json_values: int = Field(default=2_000_000, gt=0, description="Most values (numbers, strings, arrays, "
                                 "objects) in one JSON file of an upload.")
    max_graph_string_chars: int = Field(default=256, gt=0, description="Longest string argument or name in an "
                                        "uploaded program's graph (codegen pastes them into source).")
    max_model_name_chars: int = Field(default=200, gt=0, description="Longest model name (?name= or the "
                                      "x-aotc-filename header).")
    max_input_mb: int = Field(default=4096, gt=0, description="Largest size of one input at the largest shape a "
                              "compile request allows (elements x dtype size).")
    worker_ttl_s: float = Field(default=15.0, gt=0, description="A worker without a heartbeat this long is gone.")
    job_max_attempts: int = Field(default=3, ge=1, description="Claims before a job fails for good.")
    job_ttl_days: float = Field(default=30.0, gt=0, description="How long finished job records are kept.")
    lease_s: float = Field(
        default=30.0, gt=0, description="A job whose worker has not renewed its lease this long is requeued; "
        "the same AOTC_LEASE_S the workers use.")
    reap_interval_s: float = Field(default=5.0, gt=0, description="How often the API looks for expired leases.")
    reaper: bool = Field(default=True, description="Run a reaper in this API process (any number may run).")
    admin_key: SecretStr | None = Field(
        default=None, min_length=16, description="The bootstrap admin API key. Set: every /v1 route needs a key "
        "(Authorization: Bearer). Unset: the API runs open, and answers only clients on loopback.")
    admin_key_file: Path | None = Field(
        default=None, description="A file holding the bootstrap admin key (a docker secret), instead of "
        "AOTC_ADMIN_KEY in the environment, which `docker inspect` shows.")
    insecure: bool = Field(default=False, description="Without AOTC_ADMIN_KEY, answer clients beyond loopback "
                           "too (`aotc-server --insecure`): whoever reaches the API is an admin.")
    auth_cache_s: float = Field(default=5.0, ge=0, le=60, description="How long an API process trusts a key it "
                                "has checked: a revoked key stops working within this.")
    ns_kept_jobs: int = Field(default=10_000, gt=0, description="Most jobs a namespace keeps a record of: past it, "
                              "each new job lets go of its oldest ended ones (a job no namespace holds any more is "
                              "deleted with its event stream), so submitting and cancelling cannot fill Redis.")
    ns_max_jobs: int = Field(default=64, gt=0, description="Default quota: queued plus running jobs of a namespace "
                             "(429 past it). An admin sets another per namespace.")
    ns_max_stored_gb: float = Field(default=100.0, gt=0, description="Default quota: bytes a namespace's models "
                                    "and their artifacts hold (507 past it).")
    # What one API key may hold open at once, counted across every API process through Redis (service/api/slots.py).
    max_streams_per_key: int = Field(default=64, gt=0, description="Most job event streams (GET /v1/jobs/{id}/"
                                     "events) one API key may hold open at once, over all API processes (429 past "
                                     "it).")
    max_uploads_per_key: int = Field(default=8, gt=0, description="Most model uploads (POST /v1/models) one API "
                                     "key may have in progress at once, over all API processes (429 past it).")
    slot_lease_s: float = Field(default=30.0, gt=0, le=3600, description="How long a stream or upload slot lasts "
                                "unless its API process renews it (every third of this): the slots of an API "
                                "process that died come back within this.")
    # Clients that send slowly hold a connection and a task: they are cut off (service/api/http.py).
    header_timeout_s: float = Field(default=10.0, gt=0, description="A connection whose request headers are not "
                                    "complete within this (from its start, or from the end of the previous answer "
                                    "on a kept-alive connection) is closed, with a 408 if it sent part of them. "
                                    "Applies where aotc-server runs the API.")
    max_header_kb: int = Field(default=64, gt=0, le=1024, description="The most bytes a request's line and headers "
                               "may hold, in KiB (431 past it, the connection closed). Applies where aotc-server "
                               "runs the API with httptools, which has no limit of its own (h11 refuses past 16 KiB).")
    # The HTTP parser and event loop aotc-server's API processes run on (bench/README.md "Lookups": httptools and
    # uvloop take the lookup past 2,000 req/s at 32 connections on 2 cores, where h11 and asyncio stop short).
    http: Literal["auto", "httptools", "h11"] = Field(
        default="auto", description="aotc-server's HTTP/1.1 parser: httptools (the faster), h11, or auto (httptools "
        "when installed, as `aotc[server]` installs it). Both keep AOTC_HEADER_TIMEOUT_S.")
    loop: Literal["auto", "uvloop", "asyncio"] = Field(
        default="auto", description="aotc-server's event loop: uvloop (the faster), asyncio, or auto (uvloop when "
        "installed, as `aotc[server]` installs it).")
    sendfile: bool = Field(default=True, description="Send packages and weights blobs kept on the API's disk (the "
                           "file blob store) with sendfile(2) under httptools: about a quarter of the API's CPU per "
                           "GB. false streams them as the other stores are (on 2 loopback cores a verified pull was "
                           "faster streamed: bench/README.md).")
    send_stall_s: float = Field(default=60.0, gt=0, description="A download sent with sendfile (httptools, a file "
                                "blob store) to a client that takes no bytes for this long is cut off: its "
                                "connection is closed, and the client may resume with a Range.")
    body_idle_timeout_s: float = Field(default=30.0, gt=0, description="A request body that sends no bytes for "
                                       "this long is answered 408 and its connection closed.")
    body_min_rate_kbps: float = Field(default=8.0, ge=0, description="The slowest a request body may arrive, in "
                                      "KiB/s, averaged over each AOTC_BODY_IDLE_TIMEOUT_S of waiting for it (408 "
                                      "below it); 0: no minimum.")
    max_body_kb: int = Field(default=1024, gt=0, description="The largest request body, in KiB, on every route but "
                             "the upload (POST /v1/models, AOTC_MAX_UPLOAD_MB): answered 413 as soon as its "
                             "Content-Length or its bytes pass it. FastAPI reads and parses a JSON body before the "
                             "key is checked, so without it a caller with no key could have the API hold any size.")

    # The registry (service/store/names.py): names, versions and tags are records a caller adds, so each is bounded.
    max_registry_name_chars: int = Field(default=64, gt=0, le=64, description="Longest registry name or tag "
                                         "(`aotc compile --name`, `aotc tag`); 64 at most, as the API's paths say.")
    max_registry_names: int = Field(default=10_000, gt=0, description="Most registry names one namespace holds.")
    max_registry_versions: int = Field(default=50_000, gt=0, description="Most versions one namespace holds over all "
                                       "its names (delete old ones to add more): about 1 KB of Redis each.")
    max_versions_per_name: int = Field(default=1_000, gt=0, description="Most versions one name holds at once "
                                       "(delete old ones to add more).")
    max_tags_per_name: int = Field(default=100, gt=0, description="Most tags on one name's versions.")
    tag_history_len: int = Field(default=1_000, gt=0, description="Tag moves kept per name (older ones drop off).")
    max_tag_history: int = Field(default=100_000, gt=0, description="Tag moves kept over all of one namespace's "
                                 "names (about 90 bytes of Redis each). Past it, the oldest deleted names are "
                                 "forgotten first, then a name whose tag moves keeps only its newest 10.")
    max_gone_names: int = Field(default=10_000, gt=0, description="Deleted names (no version left) whose tag "
                                "history and last version number one namespace keeps; past it the oldest is "
                                "forgotten, and that name made again starts at version 1.")
    max_targets_per_request: int = Field(default=16, gt=0, le=64, description="Most targets one compile request "
                                         "names (after `all` is expanded).")

    def registry_limits(self) -> RegistryLimits:
        return RegistryLimits(max_names=self.max_registry_names, max_versions=self.max_versions_per_name,
                              max_tags=self.max_tags_per_name, history=self.tag_history_len,
                              max_ns_versions=self.max_registry_versions, max_ns_history=self.max_tag_history,
                              max_gone=self.max_gone_names)

    def bootstrap_admin_key(self) -> str | None:
        """AOTC_ADMIN_KEY, else the contents of AOTC_ADMIN_KEY_FILE; None: no keys (open mode)."""
        if self.admin_key is not None:
            return self.admin_key.get_secret_value()
        if self.admin_key_file is None:
            return None
        try:
            key = self.admin_key_file.read_text().strip()
        except OSError as e:
            raise ValueError(f"AOTC_ADMIN_KEY_FILE {self.admin_key_file}: {e.strerror}") from None
        if len(key) < 16:
            raise ValueError(f"AOTC_ADMIN_KEY_FILE {self.admin_key_file} holds {len(key)} characters; an admin key "
                             "needs 16 or more")
        return key

    def default_quota(self) -> Quota:
        return Quota(max_jobs=self.ns_max_jobs, max_stored_bytes=int(self.ns_max_stored_gb * GB))

    def archive_limits(self) -> Limits:
        """The upload bounds as compiler.archive takes them."""
        return Limits(
            max_entries=self.max_zip_entries, max_unpacked_bytes=self.max_unpacked_mb * MB,
            max_entry_bytes=self.max_entry_mb * MB, max_compression_ratio=self.max_compression_ratio,
            max_json_bytes=self.max_json_mb * MB, max_json_depth=self.max_json_depth,
            max_json_values=self.max_json_values, max_graph_string_chars=self.max_graph_string_chars)

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str | None) -> str | None:
        if v and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("AOTC_REDIS_URL must start with redis://, rediss:// or unix://")
        return v or None

    @model_validator(mode="after")
    def _redis_password(self) -> Settings:
        if self.redis_url:
            self.redis_url = with_password_file(self.redis_url, self.redis_password_file)
        return self


@lru_cache
def get_settings() -> Settings:
    return Settings()
