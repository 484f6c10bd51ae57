"""The bounded artifact cache: least recently pulled first, never a pinned artifact, never a model or a job; an
evicted artifact leaves lookup in the same step as its record; and the start-up refusal of an evicting Redis."""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from service.store import StorageOptions, Store, keys
from service.store.embedded import EmbeddedRedis, free_port, redis_server_binary
from service.store.memory import RedisPolicyError

KB = 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(tmp_path_factory.mktemp("cache-redis"), appendonly=False) as s:
        yield s


@pytest.fixture(params=["redis", "file"])
def store(request: pytest.FixtureRequest, server: EmbeddedRedis, tmp_path: Path) -> Iterator[Store]:
    """A store whose artifacts may hold 10 KB, on an empty Redis."""
    redis.Redis.from_url(server.url).flushdb()
    url = "redis" if request.param == "redis" else f"file://{tmp_path}/blobs"
    s = Store(server.url, storage=StorageOptions(blob_store=url, chunk_bytes=4 * KB, max_artifact_bytes=10 * KB))
    yield s
    s.close()


def publish(store: Store, tmp_path: Path, key: str, size: int = 3 * KB, model: str = "m" * 64) -> dict[str, Any]:
    package, sources = tmp_path / f"{key}.pt2", tmp_path / f"{key}.zip"
    package.write_bytes(b"p" * (size - 100))
    sources.write_bytes(b"s" * 100)
    record = {"key": key, "factors": {"model": model}, "model_id": model, "target": "cpu", "spec": [], "options": {}}
    return store.artifacts.put(record, package, report={"key": key}, sources=sources)


def alive(store: Store, key: str) -> bool:
    """Whether everything of an artifact is there: record, report, index entries, package and sources."""
    art = store.artifacts.get(key)
    parts = [art is not None, store.artifacts.report(key) is not None,
             store.r.zscore(keys.ARTIFACTS_INDEX, key) is not None,
             key in {a["key"] for a in store.artifacts.for_model("m" * 64)}]
    if art is not None:
        blob = store.artifacts.blob_id(art)
        parts += [store.blobs.exists("artifact", blob), store.blobs.exists("sources", blob)]
    assert all(parts) or not any(parts), (key, parts)  # all of it, or none of it
    return all(parts)


def test_least_recently_pulled_go_first_and_models_and_jobs_stay(store: Store, tmp_path: Path) -> None:
    store.models.put({"id": "m" * 64, "created": time.time(), "inputs": []})
    store.r.hset(keys.job("j1"), mapping={"state": "succeeded", "key": "a"})
    for key in "abc":
        publish(store, tmp_path, key)
        time.sleep(0.01)
    assert store.artifacts.total_bytes() == 9 * KB
    store.artifacts.touch("a")  # pulled: a goes to the back of the line
    art_b = store.artifacts.get("b")
    assert art_b is not None
    publish(store, tmp_path, "d")  # 12 KB > 10 KB: b, the least recently pulled, goes
    assert [k for k in "abcd" if alive(store, k)] == ["a", "c", "d"]
    assert store.artifacts.total_bytes() == 9 * KB
    assert store.r.hget(keys.METRICS_COUNTERS, "evictions") == "1"  # aotc_artifact_evictions, the console's farm
    assert not store.blobs.exists("artifact", store.artifacts.blob_id(art_b))
    assert store.models.get("m" * 64) is not None and store.r.hget(keys.job("j1"), "state") == "succeeded"
    store.artifacts.touch("b")  # a pull of an evicted artifact does not bring it back into the books
    assert store.r.zscore(keys.ARTIFACTS_PULLED, "b") is None


def test_pinned_artifacts_are_never_evicted(store: Store, tmp_path: Path) -> None:
    for key in "abc":
        publish(store, tmp_path, key)
    assert store.artifacts.pin("a") and store.artifacts.pinned("a")
    assert not store.artifacts.pin("nope")
    publish(store, tmp_path, "d")
    publish(store, tmp_path, "e")
    assert [k for k in "abcde" if alive(store, k)] == ["a", "d", "e"]
    store.artifacts.pin("d")
    store.artifacts.pin("e")
    publish(store, tmp_path, "f")  # everything else is pinned: over the bound rather than evict a pinned one
    assert [k for k in "abcdef" if alive(store, k)] == ["a", "d", "e", "f"]
    assert store.artifacts.unpin("a") and not store.artifacts.unpin("nope")
    assert store.artifacts.make_room() == ["a"]
    assert store.artifacts.total_bytes() == 9 * KB


def test_a_second_publish_of_the_same_key_stores_nothing(store: Store, tmp_path: Path) -> None:
    first = publish(store, tmp_path, "a")
    again = publish(store, tmp_path, "a")
    assert again == first and store.artifacts.total_bytes() == 3 * KB
    # Two deliveries racing past the first check: the loser's blobs are deleted.
    record = {"key": "a", "factors": {"model": "m" * 64}}
    store.artifacts.get = lambda key: None  # type: ignore[method-assign]  # as if the check came before the publish
    lost = store.artifacts.put(record, tmp_path / "a.pt2", sources=tmp_path / "a.zip")
    del store.artifacts.get
    current = store.artifacts.get("a")
    assert current is not None and current["blob"] == first["blob"] != lost["blob"]
    assert not store.blobs.exists("artifact", lost["blob"]) and not store.blobs.exists("sources", lost["blob"])
    assert store.artifacts.total_bytes() == 3 * KB
    assert store.r.zcard(keys.BLOBS_GARBAGE) == 0


def test_blobs_of_a_publish_that_died_are_collected(store: Store, tmp_path: Path) -> None:
    import io

    store.blobs.put("artifact", "dead.0001", io.BytesIO(b"orphan"))
    store.r.zadd(keys.BLOBS_GARBAGE, {"dead.0001": time.time() + 60})  # still within its grace: kept
    store.artifacts.collect_garbage()
    assert store.blobs.exists("artifact", "dead.0001")
    store.r.zadd(keys.BLOBS_GARBAGE, {"dead.0001": time.time() - 1})
    assert store.artifacts.collect_garbage() == 1
    assert not store.blobs.exists("artifact", "dead.0001") and store.r.zcard(keys.BLOBS_GARBAGE) == 0


def test_artifacts_from_before_the_bound_are_counted_and_evictable(store: Store, tmp_path: Path) -> None:
    import io

    for key in ("old1", "old2"):  # as the store wrote them before: blob id = key, no accounting
        store.blobs.put("artifact", key, io.BytesIO(b"x" * 4 * KB))
        record = {"key": key, "factors": {"model": "m" * 64}, "created": time.time(), "package": True}
        store.r.set(keys.artifact(key), __import__("json").dumps(record))
        store.r.zadd(keys.ARTIFACTS_INDEX, {key: record["created"]})
        store.r.sadd(keys.artifacts_by_model("m" * 64), key)
    assert store.artifacts.adopt() == 2 and store.artifacts.adopt() == 0
    assert store.artifacts.total_bytes() == 8 * KB
    publish(store, tmp_path, "new")
    assert store.artifacts.get("old1") is None and not store.blobs.exists("artifact", "old1")
    assert store.artifacts.get("old2") is not None


def test_lookup_never_sees_a_record_whose_bytes_are_gone(store: Store, tmp_path: Path) -> None:
    """A reader checks, over and over, that every artifact lookup can see still has its package; meanwhile
    publishes evict. Bytes are deleted only after record and index entries are gone, in one script."""
    stop, seen, bad = threading.Event(), [0], []

    def check() -> None:
        while not stop.is_set():
            for art in store.artifacts.for_model("m" * 64):
                ok = store.blobs.exists("artifact", store.artifacts.blob_id(art))
                if not ok and store.artifacts.get(art["key"]) is not None:  # still listed, bytes gone
                    bad.append(art["key"])
                seen[0] += 1

    t = threading.Thread(target=check)
    t.start()
    try:
        for i in range(30):
            publish(store, tmp_path, f"k{i}", size=2 * KB)
    finally:
        stop.set()
        t.join()
    assert not bad and seen[0] > 0
    assert store.artifacts.total_bytes() <= 10 * KB


def test_a_redis_that_evicts_by_itself_is_refused(server: EmbeddedRedis) -> None:
    store = Store(server.url)
    r = redis.Redis.from_url(server.url)
    try:
        r.config_set("maxmemory-policy", "allkeys-lru")
        with pytest.raises(RedisPolicyError, match="maxmemory-policy is 'allkeys-lru'.*noeviction"):
            store.check_redis()
    finally:
        r.config_set("maxmemory-policy", "noeviction")
    assert store.check_redis() == []
    store.close()


def test_a_redis_without_config_is_used_with_a_warning(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--dir", str(tmp_path), "--rename-command", "CONFIG", ""],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        store = Store(url)
        [warning] = store.check_redis()
        assert "CONFIG GET is disabled" in warning and "noeviction" in warning
        store.close()
    finally:
        proc.terminate()
        proc.wait()


def test_keys_of_one_artifact_are_named_in_keys_py() -> None:
    # The eviction script builds record, report and by-model keys from the prefix: keep them in step with keys.py.
    k = uuid.uuid4().hex
    assert keys.artifact(k) == f"{keys.PREFIX}artifact:{k}"
    assert keys.report(k) == f"{keys.PREFIX}report:{k}"
    assert keys.artifacts_by_model(k) == f"{keys.PREFIX}artifacts:by-model:{k}"


def publish_weightless(store: Store, tmp_path: Path, key: str, weights: Path, size: int = 2 * KB) -> dict[str, Any]:
    """An artifact whose package binds the weights blob `weights` (named by its sha256 in the record)."""
    import hashlib

    package, sources = tmp_path / f"{key}.pt2", tmp_path / f"{key}.zip"
    package.write_bytes(b"p" * (size - 100))
    sources.write_bytes(b"s" * 100)
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    record = {"key": key, "factors": {"model": "m" * 64}, "model_id": "m" * 64, "target": "cpu", "spec": [],
              "options": {}, "weights": {"sha256": digest, "size": weights.stat().st_size, "constants": 1}}
    return store.artifacts.put(record, package, report={"key": key}, sources=sources, weights=weights)


def test_weights_are_stored_once_counted_once_and_go_with_their_last_artifact(store: Store, tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"w" * 3 * KB)
    a = publish_weightless(store, tmp_path, "a", weights)
    publish_weightless(store, tmp_path, "b", weights)  # another bucket of the same model: no second copy
    digest = a["weights"]["sha256"]
    assert store.blobs.exists("weights", digest)
    assert store.r.smembers(keys.weights_users(digest)) == {"a", "b"}
    assert store.artifacts.total_bytes() == 2 * 2 * KB + 3 * KB  # two packages, one weights blob
    store.models.put({"id": "m" * 64, "created": time.time(), "inputs": [], "size": 0})
    store.namespaces.add_model("team", "m" * 64, "m")
    assert store.namespaces.stored_bytes("team") == 2 * 2 * KB + 3 * KB  # the quota counts the weights once too

    store.artifacts.pin("b")
    publish(store, tmp_path, "c", size=4 * KB, model="n" * 64)  # 11 KB: a goes; b (pinned) keeps the weights
    assert store.artifacts.get("a") is None and store.artifacts.get("b") is not None
    assert store.blobs.exists("weights", digest) and store.r.smembers(keys.weights_users(digest)) == {"b"}

    monkeypatch.setattr(store.artifacts, "weights_grace_s", 0.0)  # AOTC_WEIGHTS_GRACE_S=0
    store.artifacts.unpin("b")
    publish(store, tmp_path, "d", size=6 * KB, model="n" * 64)  # b goes, and with it the last user of the weights
    assert store.artifacts.get("b") is None and store.artifacts.get("c") is not None
    assert not store.r.exists(keys.weights_users(digest)) and store.r.hget(keys.WEIGHTS_BYTES, digest) is None
    store.artifacts.collect_garbage()
    assert not store.blobs.exists("weights", digest)
    assert store.artifacts.total_bytes() == 10 * KB  # c and d: the weights left the books with their last user


def test_the_weights_grace_is_a_setting(server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    """AOTC_WEIGHTS_GRACE_S reaches the store from the API's and the workers' settings (was a constant)."""
    from pydantic import ValidationError

    from service.store.blobstore.settings import StorageSettings

    monkeypatch.setenv("AOTC_WEIGHTS_GRACE_S", "5")
    options = StorageOptions.from_settings(StorageSettings())
    assert options.weights_grace_s == 5.0
    s = Store(server.url, storage=options)
    try:
        assert s.artifacts.weights_grace_s == 5.0  # what EVICT schedules a last user's weights blob's deletion by
    finally:
        s.close()
    monkeypatch.setenv("AOTC_WEIGHTS_GRACE_S", "-1")
    with pytest.raises(ValidationError, match="weights_grace_s"):
        StorageSettings()
