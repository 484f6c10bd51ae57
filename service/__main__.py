"""`aotc-server` (and `python -m service`): the API, an embedded Redis unless AOTC_REDIS_URL is set, and one local
worker in a subprocess. One command for a laptop or a single box; a fleet runs `aotc-server --workers 0` beside
`aotc-worker`s and an external Redis.

This process never imports torch (a worker needs it; the API does not): the worker runs as `python -m worker`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import subprocess
import sys
from typing import Annotated

import typer


def serve(
    host: Annotated[str, typer.Option(help="Address the API listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port the API listens on.")] = 8000,
    redis_port: Annotated[int | None, typer.Option(
        help="Port of the embedded Redis (default: a free one). Unused with AOTC_REDIS_URL.")] = None,
    device: Annotated[str, typer.Option(help="Device of the local worker: auto, cpu, cuda:N.")] = "auto",
    workers: Annotated[int, typer.Option(min=0, max=1, help="1 starts a local worker; 0 runs the API alone.")] = 1,
    log_level: Annotated[str, typer.Option(help="uvicorn's log level.")] = "info",
) -> None:
    """Run the API, an embedded Redis (unless AOTC_REDIS_URL is set) and a worker for this machine's device."""
    import uvicorn

    from service.api.app import create_app
    from service.api.settings import Settings
    from service.store.embedded import EmbeddedRedis

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = Settings()
    redis_proc = None
    if not settings.redis_url:
        redis_proc = EmbeddedRedis(settings.data_dir / "redis", port=redis_port).start()
        settings = settings.model_copy(update={"redis_url": redis_proc.url})
        print(f"aotc: embedded redis-server on {redis_proc.url} (data in {redis_proc.data_dir}, AOF on)",
              file=sys.stderr)
    worker = None
    if workers:
        if importlib.util.find_spec("torch") is None:
            print("aotc: torch is not installed, so no worker starts (install aotc[worker])", file=sys.stderr)
        else:
            env = {**os.environ, "AOTC_REDIS_URL": settings.redis_url or "", "AOTC_DEVICE": device,
                   "AOTC_WORK_DIR": str(settings.data_dir / "work")}
            worker = subprocess.Popen([sys.executable, "-m", "worker"], env=env)
            print(f"aotc: worker pid {worker.pid} for device {device}", file=sys.stderr)
    # uvicorn re-raises the SIGTERM it caught once it has drained; turn it into SystemExit so the worker and Redis
    # below are stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    try:
        uvicorn.run(create_app(settings), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30)
    finally:
        if worker and worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
        if redis_proc:
            redis_proc.stop()


# Plain tracebacks: this is a server's log, not a terminal session.
app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command()(serve)


def main() -> None:
    app(prog_name="aotc-server")


if __name__ == "__main__":
    main()
