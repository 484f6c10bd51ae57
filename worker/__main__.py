"""`python -m worker` runs one worker with settings from AOTC_* variables (what `aotc worker` runs)."""

import logging

from worker.main import serve
from worker.settings import WorkerSettings

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(WorkerSettings())
