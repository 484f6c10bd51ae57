"""The embedded redis-server: one per data dir (a lock), it dies with the process that started it, and it requires
the password it keeps in its data dir."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from procs import ADMIN_KEY, ROOT, api, start_api, start_worker, stop, wait_workers
from service.store import Store
from service.store.embedded import EmbeddedRedis, RedisSupervisor


def _gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (OSError, IndexError):
            return True
        time.sleep(0.1)
    return False


def test_a_second_redis_on_the_same_data_dir_is_refused(tmp_path):
    with EmbeddedRedis(tmp_path / "redis"):
        second = EmbeddedRedis(tmp_path / "redis")
        with pytest.raises(RuntimeError, match="another redis-server is using the data dir"):
            second.start(lock_wait_s=0.5)
        assert second.proc is None
    with EmbeddedRedis(tmp_path / "redis") as again:  # released with the first one
        assert again.proc is not None


def test_redis_dies_with_the_process_that_started_it(tmp_path):
    script = ("import sys, time; from service.store.embedded import EmbeddedRedis; "
              f"r = EmbeddedRedis({str(tmp_path / 'redis')!r}).start(); print(r.proc.pid, flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert parent.stdout is not None
        redis_pid = int(parent.stdout.readline())
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _gone(redis_pid), "redis-server outlived the process that started it"
        with EmbeddedRedis(tmp_path / "redis") as again:  # its lock went with it
            assert again.proc is not None
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_redis_busy_in_a_long_script_answers_busy_and_is_not_taken_for_hung(tmp_path):
    """Redis answers nothing while a script runs, then BUSY to every client once it has run for lua-time-limit
    (5 s): that is an answer. A supervisor whose hang bound (8 s) is shorter than the script (10 s) leaves it be."""
    given_up: list[str] = []
    supervisor = RedisSupervisor(EmbeddedRedis(tmp_path / "redis", die_with_parent=False), backoff_s=0.5,
                                 backoff_max_s=1, giveup_s=30, hang_s=8, on_give_up=given_up.append).start()
    try:
        proc = supervisor.redis.proc
        assert proc is not None
        client = redis.Redis.from_url(supervisor.redis.url, socket_timeout=60)
        busy = ("local t0 = tonumber(redis.call('TIME')[1]) "
                "while tonumber(redis.call('TIME')[1]) - t0 < tonumber(ARGV[1]) do end return 1")
        t0 = time.monotonic()
        assert client.eval(busy, 0, 10) == 1
        took = time.monotonic() - t0
        assert took >= 9, took
        assert supervisor.killed_hung == 0 and proc.poll() is None and supervisor.redis.proc is proc
        assert client.ping()
        # and the same redis-server, stopped, is killed within the bound and started again
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while supervisor.redis.proc is proc and time.monotonic() < deadline:
            time.sleep(0.1)
        assert supervisor.killed_hung == 1 and proc.returncode == -signal.SIGKILL
        client = redis.Redis.from_url(supervisor.redis.url)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        assert client.ping() and not given_up
    finally:
        supervisor.stop()


# -- the password ------------------------------------------------------------------------------------------------


def test_embedded_redis_requires_its_password_kept_0600_in_the_data_dir_and_reused_on_restart(tmp_path):
    data = tmp_path / "redis"
    server = EmbeddedRedis(data).start()
    try:
        password_file = data / "password"
        assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
        password = password_file.read_text().strip()
        assert len(password) >= 32 and server.password == password
        assert server.url == f"redis://:{password}@127.0.0.1:{server.port}/0"
        assert password not in Path(f"/proc/{server.proc.pid}/cmdline").read_text()  # `ps` does not show it

        anonymous = redis.Redis(host="127.0.0.1", port=server.port)
        with pytest.raises(redis.AuthenticationError):
            anonymous.set("aotc:test", "1")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=server.port, password="wrong-password").ping()
        assert redis.Redis.from_url(server.url).set("aotc:test", "kept")

        server.stop()
        server.start()  # the same folder: the same password, and the data is still there
        assert (data / "password").read_text().strip() == password
        assert redis.Redis.from_url(server.url).get("aotc:test") == b"kept"
    finally:
        server.stop()
    with EmbeddedRedis(data) as again:  # another object on the same folder: the same password again
        assert again.password == password and redis.Redis.from_url(again.url).get("aotc:test") == b"kept"


def test_a_password_file_others_can_read_is_tightened_and_one_that_is_empty_is_refused(tmp_path):
    data = tmp_path / "redis"
    data.mkdir()
    (data / "password").write_text("an-operator-chose-this\n")
    os.chmod(data / "password", 0o644)
    with EmbeddedRedis(data) as server:
        assert server.password == "an-operator-chose-this"
        assert stat.S_IMODE((data / "password").stat().st_mode) == 0o600
    (data / "password").write_text("")
    refused = EmbeddedRedis(data)
    with pytest.raises(RuntimeError, match=r"password file .*/redis/password: the file is empty"):
        refused.start()
    assert refused.proc is None
    (data / "password").write_text("another\n")
    with EmbeddedRedis(data) as server:  # the refusal released the lock
        assert redis.Redis.from_url(server.url).ping()


def test_the_api_and_a_worker_connect_with_a_password_file_and_a_url_without_it(tmp_path):
    data = tmp_path / "data"
    with EmbeddedRedis(data / "redis") as server:
        bare = f"redis://127.0.0.1:{server.port}/0"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "AOTC_REDIS_URL": bare, "AOTC_DATA_DIR": str(data),
               "AOTC_REDIS_PASSWORD_FILE": str(server.password_file), "AOTC_ADMIN_KEY": ADMIN_KEY,
               "AOTC_DEVICE": "cpu", "AOTC_WORK_DIR": str(data / "work")}
        url, api_proc = start_api(env, tmp_path / "api.log")
        worker = start_worker(env, tmp_path / "worker.log")
        store = Store(server.url)
        try:
            ready = api.get(f"{url}/readyz", timeout=10)
            assert ready.status_code == 200, ready.text  # the API's Redis answered
            assert len(wait_workers(store, 1, timeout=120)) == 1  # the worker registered through Redis
            assert api.get(f"{url}/v1/workers", timeout=10).json()["workers"][0]["pid"] == worker.pid
        finally:
            stop(worker)
            stop(api_proc)
            store.close()
        logs = (tmp_path / "api.log").read_text() + (tmp_path / "worker.log").read_text()
        assert server.password not in logs

        # Without the file, the same URL gets nowhere: the API answers, but says it cannot reach its Redis.
        env.pop("AOTC_REDIS_PASSWORD_FILE")
        url, api_proc = start_api(env, tmp_path / "api-no-password.log")
        try:
            refused = api.get(f"{url}/readyz", timeout=10)
            assert refused.status_code == 503 and "authenticated" in refused.json()["error"]["message"], refused.text
        finally:
            stop(api_proc)
