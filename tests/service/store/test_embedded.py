"""The embedded redis-server: one per data dir (a lock), and it dies with the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import ROOT
from service.store.embedded import EmbeddedRedis


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
