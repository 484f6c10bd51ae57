"""`aotc-server` supervises its embedded Redis: `kill -9` of redis-server with jobs queued and one compiling, and
the service heals by itself, losing nothing; a Redis that cannot come back makes aotc-server exit 1, naming why.

Real processes throughout: `python -m service` (what the aotc-server script runs) with its own embedded
redis-server, two API processes and a worker running the real compiler, all driven over HTTP.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse

from procs import AUTH, AotcServer, alive, api, stop
from service.store import Store

LEASE_S = 6.0  # short, so that the outage below lasts several leases
# A heartbeat as slow as the lease allows (under half of it) against reapers every 0.5 s in both API processes: once
# Redis is back, a reaper that judged leases by their idle time alone would take the running job's lease before the
# worker renewed it.
HEARTBEAT_S = 2.5


class Events:
    """A job's event stream (SSE), read in a background thread: (event, id, data) frames until it ends."""

    def __init__(self, url: str, job_id: str, last_id: str | None = None) -> None:
        self.frames: list[tuple[str, str | None, Any]] = []
        self.ended = threading.Event()
        headers = {**AUTH, **({"Last-Event-ID": last_id} if last_id else {})}
        self.thread = threading.Thread(target=self._run, args=(f"{url}/v1/jobs/{job_id}/events", headers),
                                       daemon=True)
        self.thread.start()

    def _run(self, url: str, headers: dict[str, str]) -> None:
        try:
            with httpx.Client(timeout=60) as http, connect_sse(http, "GET", url, headers=headers) as events:
                for sse in events.iter_sse():
                    if sse.data:
                        self.frames.append((sse.event, sse.id or None, json.loads(sse.data)))
        finally:
            self.ended.set()

    def ids(self) -> list[str]:
        return [i for e, i, _ in self.frames if e == "state" and i]


def _model(tmp_path: Path, seed: int) -> bytes:
    import torch

    from modelzoo import MLP, export, seeded

    path = export(seeded(MLP, seed, d_in=4, hidden=8, d_out=4), (torch.randn(2, 4),), tmp_path / f"mlp-{seed}.pt2")
    return path.read_bytes()


def _upload(url: str, body: bytes) -> str:
    r = api.post(f"{url}/v1/models", content=body, timeout=60)
    assert r.status_code in (200, 201), r.text
    return str(r.json()["id"])


def _submit(url: str, model_id: str) -> str:
    r = api.post(f"{url}/v1/compilations", json={"model_id": model_id, "shapes": {"x": [2, 4]}, "target": "cpu"},
                 timeout=30)
    assert r.status_code == 202, r.text
    return str(r.json()["job"]["id"])


def _wait(what: str, pred: Any, timeout: float, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := pred():
            return got
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout} s")


def _answer(url: str) -> tuple[int, str]:
    try:
        r = api.get(url, timeout=5)
    except httpx.TransportError as e:
        return 0, repr(e)
    return r.status_code, r.text


@pytest.fixture
def servers() -> Iterator[list[AotcServer]]:
    started: list[AotcServer] = []
    yield started
    for s in started:
        stop(s.proc)


@pytest.mark.slow
def test_kill_9_of_the_embedded_redis_heals_by_itself_and_loses_nothing(tmp_path, servers):
    server = AotcServer(tmp_path / "data", "--workers", "1", "--device", "cpu", "--api-workers", "2", env={
        "AOTC_LEASE_S": str(LEASE_S), "AOTC_HEARTBEAT_S": str(HEARTBEAT_S), "AOTC_REAP_INTERVAL_S": "0.5",
        "AOTC_POLL_MS": "500",
        "AOTC_REDIS_RESTART_BACKOFF_S": "1", "AOTC_REDIS_RESTART_BACKOFF_MAX_S": "1",
        "AOTC_REDIS_RESTART_GIVEUP_S": "600"})
    servers.append(server)
    server.wait_ready(targets=1)
    url = server.url
    running, *queued = jobs = [_submit(url, _upload(url, _model(tmp_path, seed))) for seed in (21, 22, 23)]
    _wait("the first job compiling", lambda: api.get(f"{url}/v1/jobs/{running}").json()["stage"]
          not in ("queued", "fetch", "load"), 300)
    assert [api.get(f"{url}/v1/jobs/{j}").json()["state"] for j in queued] == ["queued", "queued"]
    stream = Events(url, running)
    _wait("the event stream", lambda: stream.frames, 10, 0.05)
    worker = api.get(f"{url}/v1/workers").json()["workers"][0]
    others = {p: cmd for p, cmd in server.children().items() if "redis-server" not in cmd}  # API processes, worker
    late = _upload(url, _model(tmp_path, 24))  # acknowledged just before the kill: the AOF must have it
    before = {"models": len(api.get(f"{url}/v1/models").json()["models"]),
              "jobs": len(api.get(f"{url}/v1/jobs").json()["jobs"])}

    # kill -9, and keep Redis from starting again until the compile and the check are over, so that the worker has
    # to publish through the outage, which lasts several leases: its log file is a directory meanwhile (its open
    # one was moved aside, and goes back after).
    redis_log = server.data_dir / "redis" / "redis.log"
    redis_log.rename(redis_log.with_suffix(".aside"))
    redis_log.mkdir()
    old_redis = server.redis_pid()
    os.kill(old_redis, signal.SIGKILL)
    t_kill = time.monotonic()
    try:
        down = _wait("a 503 while Redis is down", lambda: (a := _answer(f"{url}/readyz"))[0] == 503 and a, 10)
        assert json.loads(down[1])["error"]["code"] == "redis_unavailable", down
        assert _answer(f"{url}/healthz")[0] == 200  # liveness does not depend on Redis
        assert stream.ended.wait(15), stream.frames
        assert stream.frames[-1][0] == "unavailable", stream.frames
        # The compile and the check are over: the worker waits to publish (or, as it did before, to hand the job
        # back and redo it; the counts below tell the two apart).
        waiting = (f"cannot reach Redis to publish job {running}", f"lost Redis during job {running}")
        _wait("the worker done with the compile", lambda: any(w in server.output() for w in waiting), 300, 0.5)
        assert api.get(f"{url}/v1/jobs/{running}", timeout=10).status_code == 503
    finally:
        redis_log.rmdir()
        redis_log.with_suffix(".aside").rename(redis_log)
    t_free = time.monotonic()
    _wait("/readyz 200 again", lambda: _answer(f"{url}/readyz")[0] == 200, 30, 0.1)
    back_s, outage_s = time.monotonic() - t_free, time.monotonic() - t_kill
    # The API may see Redis answer a moment before the supervisor, past its start(), has logged it back.
    _wait("the supervisor's word that Redis is back", lambda: "the embedded redis-server is back" in server.output(),
          10, 0.1)
    out = server.output()
    assert f"the embedded redis-server (pid {old_redis}, port {server.redis_port}) exited with SIGKILL (signal 9)" \
        in out, out[-4000:]
    assert "Can't open the log file: Is a directory" in out, out[-4000:]

    done = [_wait(f"job {j} ended", lambda j=j: (r := api.get(f"{url}/v1/jobs/{j}").json())["state"] in
                  ("succeeded", "failed", "cancelled") and r, 400, 0.5) for j in jobs]
    assert [j["state"] for j in done] == ["succeeded"] * 3, [j.get("error") for j in done]
    # No attempt spent on the outage, no lease reaped as a lost worker's (WorkerLost), no compile redone.
    assert [j["attempts"] for j in done] == [1, 1, 1], [j.get("failures") for j in done]
    assert all(not j.get("failures") for j in done), [j.get("failures") for j in done]
    store = Store(server.redis_url)
    try:
        assert store.caches.compiles() == 3
        events = [i for i, _ in store.jobs.events(running)]
    finally:
        store.close()
    assert len({j["artifact"] for j in done}) == 3

    # The stream that ended with `unavailable`, resumed from its Last-Event-ID, misses nothing and repeats nothing.
    resumed = Events(url, running, last_id=stream.ids()[-1])
    assert resumed.ended.wait(30) and resumed.frames[-1][0] == "end", resumed.frames
    assert stream.ids() + resumed.ids() == events

    # Nothing lost, nothing restarted but Redis: the same API processes and worker, healthy and serving again.
    after = {"models": len(api.get(f"{url}/v1/models").json()["models"]),
             "jobs": len(api.get(f"{url}/v1/jobs").json()["jobs"])}
    assert after == before, (before, after)
    assert api.get(f"{url}/v1/models/{late}").status_code == 200
    now = {p: cmd for p, cmd in server.children().items() if "redis-server" not in cmd}
    assert now == others, (others, now)
    assert server.redis_pid() != old_redis
    ready = server.wait_ready(targets=1)
    assert ready["targets"] == sorted(worker["targets"]) and not ready["degraded"], ready
    again = api.get(f"{url}/v1/workers").json()["workers"]
    assert [(w["id"], w["healthy"]) for w in again] == [(worker["id"], True)], again
    print(f"\nkill -9 of the embedded Redis, kept from starting for {t_free - t_kill:.1f} s: /readyz 200 again "
          f"{back_s:.2f} s after it could ({outage_s:.1f} s outage, {outage_s / LEASE_S:.1f} leases); 3 of 3 jobs "
          "succeeded on their first attempt, 3 compiles")


def test_a_redis_that_cannot_come_back_makes_aotc_server_exit_1_naming_why(tmp_path, servers):
    server = AotcServer(tmp_path / "data", "--workers", "0", "--api-workers", "1",
                    env={"AOTC_REDIS_RESTART_BACKOFF_S": "0.5", "AOTC_REDIS_RESTART_GIVEUP_S": "8"})
    servers.append(server)
    server.wait_ready()
    kids = server.children()
    # A corrupt append-only file: garbage in the middle, which redis-server refuses to load (a truncated tail it
    # would repair by itself).
    aof = server.data_dir / "redis" / "appendonly.aof"
    with open(aof, "ab") as f:
        f.write(b"not the redis protocol\r\n")
    store = Store(server.redis_url)
    try:
        store.r.set("aotc:test:after-the-garbage", "1")
    finally:
        store.close()
    os.kill(server.redis_pid(), signal.SIGKILL)
    t0 = time.monotonic()
    assert server.proc.wait(60) == 1, server.output()[-4000:]
    took = time.monotonic() - t0
    out = server.output()
    assert "did not come back within AOTC_REDIS_RESTART_GIVEUP_S=8 s of dying" in out, out[-4000:]
    assert "Bad file format reading the append only file" in out, out[-4000:]
    assert "aotc: exiting, so that whatever supervises aotc-server" in out, out[-4000:]
    assert 8 <= took < 40, took
    _wait("its children gone", lambda: not any(alive(p) for p in kids), 20)
    print(f"\naotc-server exited 1 {took:.1f} s after its Redis died with a corrupt AOF (give-up 8 s)")


def test_a_hung_embedded_redis_is_killed_and_started_again_losing_nothing(tmp_path, servers):
    """SIGSTOP leaves redis-server alive and silent: no exit for the supervisor to see. It is killed once it has
    answered nothing for AOTC_REDIS_HANG_S, started again from its AOF, and the API serves again by itself."""
    # Redis stays down for AOTC_REDIS_RESTART_BACKOFF_S after the kill: long enough that /readyz's ping, which
    # retries a broken connection for about half a second, answers 503 in that window. With 0.5 s the restarted
    # Redis could answer a retry first, and no 503 was seen (a clean-clone CI run, 2026-11-29).
    server = AotcServer(tmp_path / "data", "--workers", "0", "--api-workers", "1",
                        env={"AOTC_REDIS_HANG_S": "3", "AOTC_REDIS_RESTART_BACKOFF_S": "3"})
    servers.append(server)
    server.wait_ready()
    store = Store(server.redis_url)
    try:
        store.r.set("aotc:test:before-the-hang", "1")
    finally:
        store.close()
    time.sleep(1.5)  # appendfsync everysec: on disk before the hang
    hung = server.redis_pid()
    os.kill(hung, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        down = _wait("a 503 while Redis is hung", lambda: (a := _answer(f"{server.url}/readyz"))[0] == 503 and a,
                     30)
        assert json.loads(down[1])["error"]["code"] == "redis_unavailable", down
        _wait("/readyz 200 again", lambda: _answer(f"{server.url}/readyz")[0] == 200, 60, 0.2)
        healed_s = time.monotonic() - t0
    finally:
        if alive(hung):
            os.kill(hung, signal.SIGCONT)
    _wait("the hung redis-server gone", lambda: not alive(hung), 10)
    # As in the kill -9 test: the API may see Redis answer a moment before the supervisor, past its start(), has
    # logged it back.
    _wait("the supervisor's word that Redis is back", lambda: "the embedded redis-server is back" in server.output(),
          10, 0.1)
    out = server.output()
    assert (f"the embedded redis-server (pid {hung}, port {server.redis_port}) is alive but has answered nothing "
            "for") in out, out[-4000:]
    assert f"(pid {hung}, port {server.redis_port}) was killed after answering nothing for" in out, out[-4000:]
    assert "the embedded redis-server is back" in out, out[-4000:]
    assert server.redis_pid() != hung and server.proc.poll() is None
    store = Store(server.redis_url)
    try:
        assert store.r.get("aotc:test:before-the-hang") in ("1", b"1")
    finally:
        store.close()
    assert 3 <= healed_s < 40, healed_s
    print(f"\na SIGSTOPped embedded Redis (AOTC_REDIS_HANG_S=3): /readyz 200 again {healed_s:.1f} s after the stop")

