"""`aotc-server` (and `python -m service`): the API, an embedded Redis unless AOTC_REDIS_URL is set, and local
workers in subprocesses. One command for a laptop or a single box; a fleet runs `aotc-server --workers 0` beside
`aotc-worker`s and an external Redis.

Its children die with it, `kill -9` included (service/procs.py): redis-server and the API processes get SIGTERM
(Redis flushes its append-only file), workers SIGKILL (their compile child follows; a job one was running is
requeued by a reaper once its lease expires). A lock on the data dir keeps a second aotc-server (and so a second
redis-server on the same append-only file) off it. At start it removes what a killed one left behind
(service/cleanup.py) before its API and workers run.

The embedded Redis is supervised (service/store/embedded.py, RedisSupervisor): one that dies is started again from
its AOF, on the same port with the same password, and the API processes and workers reconnect by themselves; one
that answers nothing for AOTC_REDIS_HANG_S (stopped, deadlocked) is killed and started again the same way. If it
cannot come back within AOTC_REDIS_RESTART_GIVEUP_S, aotc-server stops its API and workers and exits 1, naming
why, so that systemd, compose or Kubernetes restart the whole service.

This process never imports torch (a worker needs it; the API does not): workers run as `python -m worker`, and
`--device cuda:all` counts GPUs with `nvidia-smi -L`.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from service import datadir
from service.procs import DirLock, LockHeld, dying_with_this_process, set_parent_death_signal

if TYPE_CHECKING:
    from fastapi import FastAPI

    from service.api.settings import Settings

log = logging.getLogger("aotc.server")
SERVER_PID = "AOTC_SERVER_PID"  # tells API processes (uvicorn's children) whose death they die with


def serve(
    host: Annotated[str, typer.Option(help="Address the API listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port the API listens on.")] = 8000,
    redis_port: Annotated[int | None, typer.Option(
        help="Port of the embedded Redis (default: a free one). Unused with AOTC_REDIS_URL.")] = None,
    device: Annotated[str, typer.Option(
        help="Device of the local workers: auto, cpu, cuda:N, or cuda:all (one worker per visible GPU).")] = "auto",
    workers: Annotated[int, typer.Option(
        min=0, help="Local workers to start (0 runs the API alone). Ignored with --device cuda:all.")] = 1,
    api_workers: Annotated[int, typer.Option(
        min=1, help="API processes (uvicorn workers) sharing the port.")] = 2,
    log_level: Annotated[str, typer.Option(help="uvicorn's log level.")] = "info",
    insecure: Annotated[bool, typer.Option(
        "--insecure", help="Serve an address other than loopback without API keys: whoever reaches it is an "
        "admin. Without AOTC_ADMIN_KEY, aotc-server refuses to unless this is given.")] = False,
) -> None:
    """Run the API, an embedded Redis (unless AOTC_REDIS_URL is set) and workers for this machine's devices."""
    from service.api.settings import Settings
    from service.store.embedded import EmbeddedRedis, RedisSupervisor
    from service.store.redis_url import masked

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.umask(datadir.UMASK)  # what this process tree writes is private (service/datadir.py)
    settings = Settings()
    _check_auth(settings, host, insecure)
    devices = _worker_devices(device, workers)
    try:
        lock = DirLock(settings.data_dir / "server.lock").acquire(wait_s=5.0)
    except LockHeld:
        holder = DirLock(settings.data_dir / "server.lock").holder()
        _exit(f"another aotc-server (pid {holder}) is using the data dir {settings.data_dir.resolve()}; stop it "
              "first, or give this one its own AOTC_DATA_DIR")
    datadir.tighten(settings.data_dir)  # and what an older version left
    supervisor: RedisSupervisor | None = None
    local: LocalWorkers | None = None
    try:
        if not settings.redis_url:
            redis_proc = EmbeddedRedis(settings.data_dir / "redis", port=redis_port)
            supervisor = RedisSupervisor(
                redis_proc, backoff_s=settings.redis_restart_backoff_s,
                backoff_max_s=settings.redis_restart_backoff_max_s, giveup_s=settings.redis_restart_giveup_s,
                hang_s=settings.redis_hang_s, on_give_up=_stop_serving)
            try:
                supervisor.start()
            except RuntimeError as e:
                _exit(str(e))
            settings = settings.model_copy(update={"redis_url": redis_proc.url})
            print(f"aotc: embedded redis-server pid {redis_proc.proc.pid if redis_proc.proc else '?'} on "
                  f"{masked(redis_proc.url)} (data in {redis_proc.data_dir}, AOF on, password in "
                  f"{redis_proc.password_file}; restarted if it dies)", file=sys.stderr)
        work_dirs = [settings.data_dir / ("work" if i == 0 else f"work-{i}") for i in range(len(devices))]
        _clean_up(settings, work_dirs, own_redis=supervisor is not None)
        if devices and importlib.util.find_spec("torch") is None:
            print("aotc: torch is not installed, so no worker starts (install aotc[worker])", file=sys.stderr)
        elif devices:
            local = LocalWorkers(settings.redis_url or "", list(zip(devices, work_dirs, strict=True)))
        try:
            _run_api(settings, host, port, api_workers, log_level)
        except SystemExit:  # the SIGTERM that _stop_serving sent, with one API process: exit 1 below instead
            if not (supervisor and supervisor.gave_up):
                raise
    finally:
        if local:
            # Given up on Redis: a worker told to stop would wait for it to hand its job back. Killed, its lease
            # is reaped once a restarted aotc-server's Redis is up (service/store/reaper.py).
            local.stop(kill=bool(supervisor and supervisor.gave_up))
        if supervisor:
            supervisor.stop()
        lock.release()
    if supervisor and supervisor.gave_up:
        _exit(f"exiting, so that whatever supervises aotc-server (systemd, compose, Kubernetes) starts it again: "
              f"{supervisor.gave_up}")


def _stop_serving(reason: str) -> None:
    """What the Redis supervisor does when it gives up: stop the API as SIGTERM would (open requests finish), and
    serve() then exits 1 with the reason."""
    print("aotc: giving up on the embedded Redis: stopping the API and the workers", file=sys.stderr)
    os.kill(os.getpid(), signal.SIGTERM)


class LocalWorkers:
    """aotc-server's own workers: each dies with aotc-server, and one that fails (a crash, an exception, the OOM
    killer) is started again, after 1 s, doubling up to a minute while it keeps failing young. One that exits 0
    was told to stop (a signal: Ctrl-C reaches it too) and stays stopped."""

    def __init__(self, redis_url: str, slots: list[tuple[str, Path]]) -> None:
        self.redis_url = redis_url
        self.slots = slots  # (device, work dir) per worker
        self.procs: list[subprocess.Popen[bytes]] = []
        self.no_restarts = threading.Event()
        self._done = threading.Event()
        # The kernel signals a child when the *thread* that started it ends, so one thread starts them all and
        # lives until they have stopped.
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name="local-workers", daemon=True)
        self._thread.start()
        self._started.wait()

    def _spawn(self, n: int) -> subprocess.Popen[bytes]:
        device, work = self.slots[n]
        env = {**os.environ, "AOTC_REDIS_URL": self.redis_url, "AOTC_DEVICE": device, "AOTC_WORK_DIR": str(work)}
        # SIGKILL: a worker told to stop would wait for a Redis that is going down with us to hand its job back;
        # killed, its lease expires and the next start's reaper requeues the job. Its compile child follows it.
        p = subprocess.Popen(dying_with_this_process([sys.executable, "-m", "worker"], signal.SIGKILL), env=env)
        print(f"aotc: worker pid {p.pid} for device {device} (work dir {work})", file=sys.stderr)
        return p

    def _supervise(self) -> None:
        self.procs = [self._spawn(n) for n in range(len(self.slots))]
        started = [time.monotonic()] * len(self.procs)
        delay = [1.0] * len(self.procs)
        self._started.set()
        while not self._done.wait(0.5):
            for n, p in enumerate(self.procs):
                if p.poll() in (None, 0) or self.no_restarts.is_set():
                    continue
                if time.monotonic() - started[n] > 300:
                    delay[n] = 1.0  # it ran a good while: a fresh crash, not a loop
                log.warning("worker pid %d exited with %s; starting another in %.0f s", p.pid, p.returncode, delay[n])
                if self.no_restarts.wait(delay[n]):
                    continue
                self.procs[n], started[n], delay[n] = self._spawn(n), time.monotonic(), min(delay[n] * 2, 60.0)

    def stop(self, *, kill: bool = False) -> None:
        """SIGTERM each (a running job is handed back), or SIGKILL with `kill`; wait, then let the supervising
        thread end."""
        self.no_restarts.set()
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._done.set()
        self._thread.join(5)


def _run_api(settings: Settings, host: str, port: int, api_workers: int, log_level: str) -> None:
    import uvicorn

    from service.api.http import protocol

    if api_workers == 1:
        from service.api.app import create_app

        # uvicorn re-raises the SIGTERM it caught once it has drained; turn it into SystemExit so the workers and
        # Redis are stopped too.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
        uvicorn.run(create_app(settings), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30,
                    http=protocol(settings.http), loop=settings.loop)  # a deadline on request headers
        return
    # Several processes accept on one socket, each with its own event loop and Redis connections. They read their
    # settings from the environment, so the embedded Redis' URL goes there. uvicorn supervises them (restarts one
    # that dies, stops them all on SIGTERM); each dies with this process too (api_app).
    from uvicorn.supervisors import Multiprocess

    os.environ["AOTC_REDIS_URL"] = settings.redis_url or ""
    os.environ[SERVER_PID] = str(os.getpid())
    config = uvicorn.Config("service.__main__:api_app", factory=True, workers=api_workers, host=host, port=port,
                            log_level=log_level, timeout_graceful_shutdown=30, http=protocol(settings.http),
                            loop=settings.loop)
    Multiprocess(config, sockets=[_tcp_nodelay(config.bind_socket())]).run()  # what uvicorn.run does, but this


def _tcp_nodelay(sock: socket.socket) -> socket.socket:
    """The shared listening socket, as one whose connections send small answers at once.

    uvicorn binds it without naming the protocol, so asyncio in the API processes does not set TCP_NODELAY on the
    connections it accepts from it, and every answer written in two parts (headers, then body) waits for the
    client's delayed ACK: 40 ms a request (measured: 23 req/s on one connection, against 500 with one process).
    Naming the protocol lets asyncio set it; Linux also copies it from the listener to accepted connections."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    tcp = socket.socket(sock.family, sock.type, socket.IPPROTO_TCP, fileno=sock.detach())
    tcp.set_inheritable(True)
    return tcp


def api_app() -> FastAPI:
    """The app factory uvicorn calls in each API process that `--api-workers` starts."""
    from service.api.app import create_app

    parent = os.environ.get(SERVER_PID)
    set_parent_death_signal(signal.SIGTERM, int(parent) if parent else None)
    return create_app()


def _clean_up(settings: Settings, work_dirs: list[Path], *, own_redis: bool) -> None:
    """Remove what a killed aotc-server left behind (service/cleanup.py): nothing of ours runs yet."""
    from service.cleanup import remove_incomplete_blobs, remove_stale_work_dirs, remove_temp_uploads
    from service.store import Store

    freed = remove_temp_uploads(settings.data_dir)
    if freed:
        print(f"aotc: removed {freed} bytes of unfinished uploads", file=sys.stderr)
    assert settings.redis_url
    store = Store(settings.redis_url)  # the blob store the API announced, else Redis
    try:
        for work in work_dirs:
            if gone := remove_stale_work_dirs(store, work):
                print(f"aotc: removed {len(gone)} work dir(s) of jobs no longer running from {work}", file=sys.stderr)
        # Only our own Redis is sure to have no blob write under way; others' unfinished writes expire by themselves.
        if own_redis and (n := remove_incomplete_blobs(store)):
            print(f"aotc: removed {n} blob chunk(s) of unfinished writes", file=sys.stderr)
    except Exception as e:  # never a reason not to start
        log.warning("clean-up at start failed: %s", e)
    finally:
        store.close()


def _worker_devices(device: str, workers: int) -> list[str]:
    """The AOTC_DEVICE of each local worker: `workers` times `device`, or with cuda:all one per visible GPU."""
    if device != "cuda:all":
        return [device] * workers
    if workers == 0:
        return []
    n = gpu_count()
    if n == 0:
        _exit("--device cuda:all found no GPU (nvidia-smi -L lists none, or CUDA_VISIBLE_DEVICES hides them all)")
    return [f"cuda:{i}" for i in range(n)]


def gpu_count() -> int:
    """GPUs a worker would see, without importing torch: CUDA_VISIBLE_DEVICES when set, else `nvidia-smi -L`, else
    the driver's /proc/driver/nvidia/gpus."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if smi := shutil.which("nvidia-smi"):
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
            return sum(1 for line in out.splitlines() if line.startswith("GPU "))
        except (subprocess.SubprocessError, OSError):
            pass
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


def _check_auth(settings: Settings, host: str, insecure: bool) -> None:
    """Keys are on with AOTC_ADMIN_KEY. Without it, serve loopback only, unless told --insecure."""
    try:
        keyed = settings.bootstrap_admin_key() is not None
    except ValueError as e:
        _exit(str(e))
    if keyed:
        print("aotc: API keys are on (AOTC_ADMIN_KEY): every /v1 request needs `Authorization: Bearer <key>`",
              file=sys.stderr)
        return
    if _is_loopback(host):
        print("aotc: AOTC_ADMIN_KEY is unset: the API runs open, without keys, for local use on this machine only "
              "(it answers loopback clients; every caller is an admin)", file=sys.stderr)
        return
    if not insecure:
        _exit(f"refusing to serve {host} without API keys: anyone who reaches it could download every model and "
              "compile without limit. Set AOTC_ADMIN_KEY (a bootstrap admin key of 16+ characters; create the "
              "others with `aotc keys create`), or listen on 127.0.0.1, or pass --insecure to serve it open anyway")
    print(f"aotc: WARNING: --insecure: serving {host} without API keys; whoever reaches it is an admin",
          file=sys.stderr)
    os.environ["AOTC_INSECURE"] = "1"  # the API processes read their settings from the environment


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _exit(message: str) -> NoReturn:
    print(f"aotc: {message}", file=sys.stderr)
    raise SystemExit(1)


# Plain tracebacks: this is a server's log, not a terminal session.
app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command()(serve)


def main() -> None:
    app(prog_name="aotc-server")


if __name__ == "__main__":
    main()
