"""`aotc-worker` (and `python -m worker`, what `aotc worker` runs): one worker, one per GPU or one for the CPU.
Options left out come from the AOTC_* variables (worker/settings.py)."""

from __future__ import annotations

import logging
from typing import Annotated, Any

import typer


def run(
    device: Annotated[str | None, typer.Option(
        help="auto, cpu, cuda or cuda:N (default: $AOTC_DEVICE or auto).")] = None,
    redis_url: Annotated[str | None, typer.Option(help="The service's Redis (default: $AOTC_REDIS_URL).")] = None,
) -> None:
    """Run one compile worker until SIGTERM or SIGINT."""
    from worker.main import serve
    from worker.settings import WorkerSettings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    overrides: dict[str, Any] = {}
    if device:
        overrides["device"] = device
    if redis_url:
        overrides["redis_url"] = redis_url
    serve(WorkerSettings(**overrides))


# Plain tracebacks: this is a server's log, not a terminal session.
app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command()(run)


def main() -> None:
    app(prog_name="aotc-worker")


if __name__ == "__main__":
    main()
