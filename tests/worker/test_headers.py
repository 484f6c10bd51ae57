"""Precompiled headers off a fresh worker's critical path (worker/headers.py, AOTC_HEADERS_WARMUP=background).

A worker with an empty headers dir starts its warm-up in the background and claims jobs at once: a job submitted
as it registers compiles without precompiled headers (it builds none and binds none) while the warm-up builds the
trusted set, which is adopted read-only afterwards. One real worker, one small compile beside the warm-up's.
"""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import torch

from modelzoo import MLP, export, seeded
from procs import Cluster


def test_a_fresh_worker_takes_its_first_job_while_its_headers_build(tmp_path: Path) -> None:
    headers = tmp_path / "headers"
    cluster = Cluster(tmp_path / "svc", worker_env={"AOTC_HEADERS_DIR": str(headers),
                                                    "AOTC_HEADERS_WARMUP": "background"})
    try:
        model = export(seeded(MLP, 24), (torch.randn(2, 32),), tmp_path / "mlp.pt2")
        model_id = cluster.upload(model)
        # A worker registers before it looks for its headers; the warm-up's compile takes far longer than this.
        cluster.start_worker()
        job = cluster.submit(model_id, {"x": [2, 32]})
        done = cluster.wait_end(job["id"], timeout=600)
        assert done["state"] == "succeeded", done.get("error")
        deadline = time.monotonic() + 300  # the warm-up, which shared the cores with that job, ends after it
        stamps: list[Path] = []
        while time.monotonic() < deadline and not stamps:
            stamps = list(headers.glob("*/stamp.json"))
            time.sleep(0.5)
        assert len(stamps) == 1, list(headers.rglob("*"))
        # The job was claimed before the set existed: on a worker that builds first, it would have waited.
        assert float(done["started"]) < stamps[0].stat().st_mtime, (done["started"], stamps[0].stat().st_mtime)
        artifact = cluster.store.artifacts.get(done["artifact"])
        assert artifact is not None
        # It compiled without the set, building none of its own (a job's header is never adopted either way).
        assert artifact["caches"].get("precompiled_headers") == "none", artifact["caches"]
        built = json.loads(stamps[0].read_text())["files"]
        assert any(n.endswith(".gch") for n in built), built
        for name in built:  # adopted as the worker's, read-only
            mode = (stamps[0].parent / name).stat().st_mode
            assert stat.S_IMODE(mode) == 0o444, (name, oct(mode))
    finally:
        cluster.close()
