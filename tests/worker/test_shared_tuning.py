"""max-autotune's matmul timings travel between workers through Redis (worker/tuning.py), for real: two CPU
workers with separate disks, Inductor's C++ GEMM templates benchmarked against ATen on the first, and none
benchmarked again on the second. The compile children are sandboxed and never reach Redis: each worker seeds its
child's timings file before the compile and publishes what the child measured after it."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from modelzoo import export, seeded
from procs import ROOT, Cluster, api, stop
from service.store import keys
from service.store.apikeys import DEFAULT_NAMESPACE
from worker.tuning import GemmTimingShare

pytestmark = pytest.mark.slow


class TwoLinear(torch.nn.Module):
    def __init__(self, act: str) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 128), torch.nn.Linear(128, 32)
        self.act = torch.nn.ReLU() if act == "relu" else torch.nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("tuning"), env={"AOTC_MAX_UPLOAD_MB": "8"})
    yield c
    c.close()


def _compile(cluster: Cluster, path: Path, work: Path) -> dict:
    """Compile with mode=max-autotune on a worker of its own, with an empty disk; returns the artifact record."""
    proc, _ = cluster.start_worker(AOTC_WORK_DIR=str(work))
    try:
        job = cluster.submit(cluster.upload(path), {"x": [16, 64]}, options={"mode": "max-autotune"})
        done = cluster.wait_end(job["id"], timeout=600)
        assert done["state"] == "succeeded", done
    finally:
        stop(proc)
    return dict(api.get(f"{cluster.url}/v1/artifacts/{done['artifact']}/meta", timeout=30).json())


def test_max_autotune_timings_measured_by_one_worker_spare_the_next_the_benchmarking(cluster, tmp_path):
    x = torch.randn(16, 64)
    first = _compile(cluster, export(seeded(TwoLinear, 1, act="relu"), (x,), tmp_path / "relu.pt2"), tmp_path / "w1")
    g1 = first["caches"]["gemm_timings"]
    # Two matmuls, each timed for at least two choices (ATen and a C++ template), all published, none shared yet.
    assert g1["measured"] >= 4 and g1["published"] == g1["measured"] and g1["shared"] == 0 and g1["refused"] == 0, g1
    # Inductor's own Redis caches are off in the sandboxed child, which has no route to Redis.
    assert first["caches"]["autotune_remote_cache"] is False
    assert first["caches"]["fx_graph_cache_used_by_aot_compiles"] is False
    # In the table of the namespace that asked (a loopback caller without a key: the default one).
    stored = [k for k in cluster.store.r.scan_iter(match=keys.gemm_tuning(DEFAULT_NAMESPACE, first["target"], "*"))]
    assert len(stored) == 1 and cluster.store.r.hlen(stored[0]) == g1["measured"]

    # Entries that are not timings are skipped on the way in (Redis is shared; a bad value must not break compiles).
    cluster.store.r.hset(stored[0], mapping={"not json": "1", json.dumps(["op", "in", "prec", "c"]): "nan",
                                             json.dumps(["op", "in", "prec"]): "1.0"})

    # Another model with the same matmul shapes, on another worker with nothing on its disk.
    second = _compile(cluster, export(seeded(TwoLinear, 2, act="gelu"), (x,), tmp_path / "gelu.pt2"), tmp_path / "w2")
    g2 = second["caches"]["gemm_timings"]
    assert g2 == {"shared": g1["measured"], "measured": 0, "published": 0, "refused": 0}, g2
    assert second["check"]["passed"], second["check"]

    # `aotc report` says where the timings came from.
    shown = subprocess.run([sys.executable, "-m", "client.cli", "--url", cluster.url, "report", second["key"]],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert f"max-autotune timings: {g1['measured']} from other workers, 0 measured here, 0 published" in shown.stdout


INPUTS = "[('cpu', 'torch.float32', 16, 64, 64, 1, 0), ('cpu', 'torch.float32', 64, 128, 1, 64, 0)]"


def test_a_namespace_seeds_only_what_its_own_compiles_published(store, tmp_path):
    """A compile can write made-up timings for any shapes (worker/tuning.py). Published for namespace A, they seed
    A's later compiles and never B's: B's compile starts with no timings file, and B's table stays empty."""
    from compiler.compat import caches

    target = f"cpu-share-{uuid.uuid4().hex[:6]}"
    made_up = {("mm", INPUTS, "highest", "cpp_gemm_slowest"): 1e-6, ("mm", INPUTS, "highest", "aten_mm"): 9.0}
    hostile = GemmTimingShare(store.r, "team-a", target)
    hostile.seed(tmp_path / "a1")
    assert hostile.stats["shared"] == 0 and hostile.files()
    caches.merge_gemm_timings(str(tmp_path / "a1" / hostile.files()[0]), made_up)  # what the child left
    hostile.collect(tmp_path / "a1")
    assert hostile.stats["published"] == 2, hostile.stats

    other = GemmTimingShare(store.r, "team-b", target)
    other.seed(tmp_path / "b1")
    assert other.stats["shared"] == 0 and not (tmp_path / "b1" / other.files()[0]).exists(), other.stats
    assert store.r.hlen(other.key) == 0 and other.key != hostile.key

    same = GemmTimingShare(store.r, "team-a", target)
    same.seed(tmp_path / "a2")
    assert same.stats["shared"] == 2
    assert caches.read_gemm_timings(str(tmp_path / "a2" / same.files()[0])) == made_up
