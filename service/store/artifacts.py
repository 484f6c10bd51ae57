"""Artifacts: published compile results. A record (JSON) per cache key, its package, stage report and sources.

Publishing writes the blobs and the report first and the record last, so a reader never sees a record without
its bytes, and it is idempotent: a job delivered twice finds its own result.

Artifacts are a bounded cache that aotc evicts itself (AOTC_STORE_MAX_GB: the bytes artifacts hold in the blob
store, package and sources). Before a publish adds bytes, the least recently pulled artifacts that are not pinned
go, each in one script with its record and index entries (the EVICT script), so a lookup never returns what cannot
be pulled. Models, job records and the index are never evicted. Each publish writes blobs of its own
(`{key}.{generation}`, named in the record's `blob`), so deleting an evicted artifact's bytes can never touch those
of a later publish of the same key; blob ids to delete wait in `blobs:garbage` until they are gone.

Weights are stored once (compiler/weights.py): a weightless artifact's record names its weights blob by sha256
(`weights`), a blob of kind `weights` shared by every artifact of that model and precision. Its bytes count once
in AOTC_STORE_MAX_GB; the artifacts that use it are a set (`weights:users:{sha256}`), and when eviction takes the
last of them the blob is deleted after AOTC_WEIGHTS_GRACE_S. A pinned artifact keeps its weights, as it keeps itself.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any, cast

import redis

from compiler.cachekey import canonical_json
from service.store import keys, scripts
from service.store.blobs import BlobStore
from service.store.memory import is_out_of_memory

log = logging.getLogger("aotc.store")
PUBLISH_GRACE_S = 6 * 3600  # the blobs of a publish that has not finished by then are garbage


class Artifacts:
    def __init__(self, r: redis.Redis, blobs: BlobStore, max_bytes: int | None = None, *,
                 weights_grace_s: float = 600.0) -> None:
        self.r = r
        self.blobs = blobs
        self.max_bytes = max_bytes  # None: unbounded
        # A weights blob whose last artifact was evicted waits this long (AOTC_WEIGHTS_GRACE_S) before it is
        # deleted: a publish that found it stored a moment before takes it back meanwhile (PUBLISH calls it off).
        self.weights_grace_s = weights_grace_s
        self._publish = r.register_script(scripts.PUBLISH)
        self._evict = r.register_script(scripts.EVICT)
        self._adopt = r.register_script(scripts.ADOPT)
        self._pin = r.register_script(scripts.PIN)

    # -- publish ------------------------------------------------------------------------------------------------

    def put(self, record: dict[str, Any], package: Path | None, *, report: dict[str, Any] | None = None,
            sources: Path | None = None, weights: Path | None = None) -> dict[str, Any]:
        """Publish an artifact: blobs first, record last, so a reader never sees a record without its bytes.

        `report` (the stage report) and `sources` (a zip of the graphs and generated code) are stored before the
        record too. `package=None` publishes a report-only record (mode=training): "package" is false and there
        are no bytes to pull. Idempotent: a job that ran twice finds its own result and stores nothing again.
        Makes room first, evicting the least recently pulled artifacts beyond AOTC_STORE_MAX_GB.

        `weights` is the file of the weights blob `record["weights"]["sha256"]` names: stored unless a blob of that
        digest is already there (another bucket, target or version of the model stored it).
        """
        key = record["key"]
        existing = self.get(key)
        if existing:
            return existing
        digest = str(record["weights"]["sha256"]) if weights is not None else ""
        incoming = sum(os.path.getsize(p) for p in (package, sources) if p is not None)
        if digest and not self.r.hexists(keys.WEIGHTS_BYTES, digest):
            incoming += os.path.getsize(weights)  # type: ignore[arg-type]
        self.make_room(incoming, spare=key)
        if weights is not None:
            self._store_weights(digest, weights)
        blob = f"{key}.{secrets.token_hex(4)}"
        # Until the record names them, these blobs are garbage if this process dies: collected after the grace.
        self.r.zadd(keys.BLOBS_GARBAGE, {blob: time.time() + PUBLISH_GRACE_S})
        if report is not None:
            self.r.set(keys.report(key), canonical_json(report))
        stored = 0
        if sources is not None:
            with open(sources, "rb") as f:
                stored += self.blobs.put("sources", blob, f)["size"]
        if package is None:
            record = {**record, "package": False, "size": 0, "sha256": None}
        else:
            with open(package, "rb") as f:
                manifest = self.blobs.put("artifact", blob, f)
            stored += manifest["size"]
            record = {**record, "package": True, "size": manifest["size"], "sha256": manifest["sha256"]}
        record = {**record, "blob": blob, "created": time.time()}
        weights_size = int(record["weights"]["size"]) if digest else 0
        published = self._publish(
            keys=[keys.artifact(key), keys.ARTIFACTS_INDEX, keys.artifacts_by_model(record["factors"]["model"]),
                  keys.ARTIFACTS_PULLED, keys.ARTIFACTS_BYTES, keys.ARTIFACTS_TOTAL, keys.BLOBS_GARBAGE,
                  keys.WEIGHTS_BYTES, keys.weights_users(digest or "-")],
            args=[canonical_json(record), record["created"], key, stored, blob, digest, weights_size])
        if not published:  # another delivery of the job published first: these blobs are surplus
            self._delete_blobs(blob)
            self.r.zrem(keys.BLOBS_GARBAGE, blob)
        elif weights is not None:
            # A collection that claimed this digest just before PUBLISH called it off may have deleted it since:
            # the record names it now, so it is stored again.
            self._store_weights(digest, weights)
        return self.get(key) or record

    def _store_weights(self, digest: str, weights: Path) -> None:
        if self.blobs.exists("weights", digest):
            return
        with open(weights, "rb") as f:
            manifest = self.blobs.put("weights", digest, f)
        if manifest["sha256"] != digest:
            self.blobs.delete("weights", digest)
            raise ValueError(f"weights file {weights} has sha256 {manifest['sha256']}, not the {digest} it was "
                             "published as")

    # -- the bounded cache --------------------------------------------------------------------------------------

    def make_room(self, incoming: int = 0, *, spare: str = "") -> list[str]:
        """Evict the least recently pulled artifacts that are not pinned (nor `spare`) until `incoming` more bytes
        fit under the bound; then delete the bytes of what was evicted. Returns the evicted keys."""
        evicted: list[str] = []
        if self.max_bytes is not None:
            evicted = cast(list[str], self._evict(
                keys=[keys.ARTIFACTS_PULLED, keys.ARTIFACTS_BYTES, keys.ARTIFACTS_TOTAL, keys.ARTIFACTS_PINNED,
                      keys.ARTIFACTS_INDEX, keys.BLOBS_GARBAGE],
                args=[self.max_bytes, incoming, spare, keys.PREFIX, time.time() + self.weights_grace_s]))
            if evicted:
                log.info("evicted %d artifact(s) to stay under %d bytes: %s", len(evicted), self.max_bytes,
                         " ".join(evicted))
                self.r.hincrby(keys.METRICS_COUNTERS, "evictions", len(evicted))  # /metrics and the console
            total = self.total_bytes()
            if total + incoming > self.max_bytes:
                log.warning("artifacts hold %d bytes (+%d coming), over AOTC_STORE_MAX_GB (%d bytes): the rest are "
                            "pinned or being published", total, incoming, self.max_bytes)
        self.collect_garbage()
        return evicted

    def collect_garbage(self) -> int:
        """Delete the blobs of evicted artifacts, and of publishes that never finished. Returns how many."""
        due = cast(list[str], self.r.zrangebyscore(keys.BLOBS_GARBAGE, "-inf", time.time(), start=0, num=256))
        for blob in due:
            if blob.startswith(keys.WEIGHTS_GARBAGE):
                self._collect_weights(blob)
                continue
            try:
                self._delete_blobs(blob)
            except Exception as e:  # left in the set: the next collection tries again
                log.warning("could not delete the blobs of %s: %s", blob, e)
                continue
            self.r.zrem(keys.BLOBS_GARBAGE, blob)
        return len(due)

    def _collect_weights(self, member: str) -> None:
        """Delete a weights blob that has had no user for AOTC_WEIGHTS_GRACE_S, unless one came back (claimed by
        ZREM first: of two collections, one deletes)."""
        digest = member[len(keys.WEIGHTS_GARBAGE):]
        if not self.r.zrem(keys.BLOBS_GARBAGE, member) or self.r.scard(keys.weights_users(digest)):
            return
        try:
            self.blobs.delete("weights", digest)
        except Exception as e:  # back in the set: the next collection tries again
            log.warning("could not delete weights blob %s: %s", digest, e)
            self.r.zadd(keys.BLOBS_GARBAGE, {member: time.time()})

    def weights_of(self, art: dict[str, Any]) -> dict[str, Any] | None:
        """The weights blob an artifact binds ({sha256, size}), or None: its package carries its weights."""
        w = art.get("weights")
        return w if isinstance(w, dict) and isinstance(w.get("sha256"), str) else None

    def _delete_blobs(self, blob: str) -> None:
        self.blobs.delete("artifact", blob)
        self.blobs.delete("sources", blob)

    def adopt(self) -> int:
        """Count artifacts published before the cache was bounded, so they can be evicted too. Returns how many."""
        ks = cast(list[str], self.r.zrange(keys.ARTIFACTS_INDEX, 0, -1))
        counted = cast(list[str | None], self.r.hmget(keys.ARTIFACTS_BYTES, ks)) if ks else []
        n = 0
        for key, known in zip(ks, counted):
            if known is not None:
                continue
            art = self.get(key)
            if art is None:
                continue
            blob = self.blob_id(art)
            stored = sum((m or {"size": 0})["size"] for m in (self.blobs.manifest("artifact", blob),
                                                               self.blobs.manifest("sources", blob)))
            n += int(cast(int, self._adopt(
                keys=[keys.artifact(key), keys.ARTIFACTS_PULLED, keys.ARTIFACTS_BYTES, keys.ARTIFACTS_TOTAL],
                args=[key, art.get("created", time.time()), stored])))
        return n

    def total_bytes(self) -> int:
        return int(cast(str | None, self.r.get(keys.ARTIFACTS_TOTAL)) or 0)

    def touch(self, key: str) -> None:
        """A pull: the artifact moves to the back of the eviction order (never resurrects an evicted one). Best
        effort: a Redis out of memory refuses the write, and the pull goes on."""
        try:
            self.r.zadd(keys.ARTIFACTS_PULLED, {key: time.time()}, xx=True)
        except redis.ResponseError as e:
            if not is_out_of_memory(e):
                raise

    def pin(self, key: str) -> bool:
        """Never evict this artifact. False when there is no such artifact."""
        return bool(self._pin(keys=[keys.artifact(key), keys.ARTIFACTS_PINNED], args=[key]))

    def unpin(self, key: str) -> bool:
        """Let it be evicted again. False when there is no such artifact."""
        self.r.srem(keys.ARTIFACTS_PINNED, key)
        return bool(self.r.exists(keys.artifact(key)))

    def pinned(self, key: str) -> bool:
        return bool(self.r.sismember(keys.ARTIFACTS_PINNED, key))

    # -- on target (compiler/ontarget.py) ------------------------------------------------------------------------

    def set_on_target(self, key: str, mark: dict[str, Any],
                      countersignature: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Rewrite an artifact's `on_target` mark, adding `countersignature` (a DSSE envelope) to its
        `countersignatures`, in one transaction with any other writer of the record. None when the artifact is gone
        (evicted or deleted meanwhile: nothing to vouch for)."""
        name = keys.artifact(key)

        def update(pipe: Any) -> dict[str, Any] | None:
            raw = pipe.get(name)
            if not raw:
                return None
            record = json.loads(raw)
            record["on_target"] = mark
            if countersignature is not None:
                record["countersignatures"] = [*(record.get("countersignatures") or []), countersignature]
            pipe.multi()
            pipe.set(name, canonical_json(record))
            return cast(dict[str, Any], record)

        return cast(dict[str, Any] | None, self.r.transaction(update, name,  # type: ignore[arg-type]
                                                              value_from_callable=True))

    # -- reads --------------------------------------------------------------------------------------------------

    @staticmethod
    def blob_id(art: dict[str, Any]) -> str:
        """The id of an artifact's package and sources blobs (the key itself for artifacts from before)."""
        return str(art.get("blob") or art["key"])

    def get(self, key: str) -> dict[str, Any] | None:
        raw = self.r.get(keys.artifact(key))
        return json.loads(raw) if raw else None

    def report(self, key: str) -> dict[str, Any] | None:
        """The artifact's stage report (compiler.report schema)."""
        raw = self.r.get(keys.report(key))
        return json.loads(raw) if raw else None

    def for_model(self, model_id: str) -> list[dict[str, Any]]:
        """Every artifact built from one model (deploy-time lookup)."""
        ks = sorted(cast(set[str], self.r.smembers(keys.artifacts_by_model(model_id))))
        if not ks:
            return []
        return [json.loads(v) for v in self.r.mget([keys.artifact(k) for k in ks]) if v]

    def recent(self, limit: int = 100) -> list[dict[str, Any]]:
        """The latest artifacts first."""
        ks = cast(list[str], self.r.zrevrange(keys.ARTIFACTS_INDEX, 0, limit - 1))
        return [a for a in (self.get(k) for k in ks) if a]
