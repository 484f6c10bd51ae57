"""GET/DELETE /v1/caches and `aotc caches`: what workers share to compile faster, seen and cleared over HTTP."""

from __future__ import annotations

import json
import subprocess
import sys

from procs import ROOT, api
from service.store import keys


def test_shared_compile_caches_are_listed_and_cleared(api_url, store):
    table = keys.gemm_tuning("team-a", "cuda-sm90", "f" * 64)
    before = f"{keys.PREFIX}tuning:gemm:cuda-sm90:{'e' * 64}"  # of before namespaces: listed, never read, cleared
    store.r.hset(before, mapping={json.dumps(["mm", "in", "highest", "c"]): "0.5"})
    store.r.hset(table, mapping={json.dumps(["mm", f"in{i}", "highest", "c"]): "0.5" for i in range(3)})
    store.r.set("pt2:abc::k1:c1", "{}")
    store.r.set("pt2:abc::k2:c1", "{}")

    listed = api.get(f"{api_url}/v1/caches").json()
    assert {"namespace": "team-a", "target": "cuda-sm90", "system": "f" * 64, "entries": 3} in listed["gemm_timings"]
    assert {"namespace": None, "target": "cuda-sm90", "system": "e" * 64, "entries": 1} in listed["gemm_timings"]
    assert listed["inductor_entries"] >= 2

    shown = subprocess.run([sys.executable, "-m", "client.cli", "--url", api_url, "caches"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    rows = [line.split() for line in shown.stdout.splitlines()]
    assert ["team-a", "cuda-sm90", "f" * 16, "3"] in rows and ["-", "cuda-sm90", "e" * 16, "1"] in rows, shown.stdout

    removed = api.delete(f"{api_url}/v1/caches").json()["removed"]
    assert removed["gemm_timings"] >= 1 and removed["inductor_entries"] >= 2
    assert api.get(f"{api_url}/v1/caches").json() == {"gemm_timings": [], "inductor_entries": 0}
    assert not store.r.exists(table, before, "pt2:abc::k1:c1")
