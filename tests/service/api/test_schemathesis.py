"""The API keeps its contract: schemathesis generates requests from the OpenAPI that the real server publishes and
sends them over HTTP with the admin key: its coverage phase (each parameter at its bounds and just past them, each
required part missing), then random valid and invalid requests. Every answer is checked: no 5xx, a status code the
operation declares, the content type it declares, a body that validates against the declared schema (error bodies
included), and an invalid request refused with a 4xx.

It runs schemathesis' own command line (`schemathesis run`) in a subprocess: its pytest plugin's lazy schemas do
not run under pytest 9. The service is a Cluster of its own (its own redis-server and API, no worker), since the
fuzzer clears the shared compile caches (DELETE /v1/caches), creates keys and sets quotas. It holds one real model,
one job and one artifact, so the list routes answer records and their schemas are checked too, and the operations
on one model or artifact reach it. The run is deterministic (schemathesis' deterministic generation): the same tree
sends the same requests. AOTC_FUZZ_EXAMPLES raises the random requests per operation for a longer run; the default
keeps the test under a minute on two cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from modelzoo import MLP, export, seeded
from procs import ADMIN_KEY, ROOT, Cluster, api

SEED = 1105  # issue 11, item 5
EXAMPLES = int(os.environ.get("AOTC_FUZZ_EXAMPLES", "10"))
CHECKS = ["not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance", "negative_data_rejection"]


@pytest.fixture(scope="module")
def contract_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, dict[str, str]]]:
    base = tmp_path_factory.mktemp("contract")
    cluster = Cluster(base)
    try:
        yield cluster, _records(cluster, base)
    finally:
        cluster.close()


def _records(cluster: Cluster, base: Path) -> dict[str, str]:
    """One model (uploaded over HTTP), one queued job and one artifact (written through the store); returns the
    model's id and the artifact's key."""
    path = export(seeded(MLP, SEED), (torch.randn(2, 32),), base / "mlp.pt2")
    r = api.post(f"{cluster.url}/v1/models", content=path.read_bytes(), params={"name": "contract"}, timeout=60)
    assert r.status_code == 201, r.text
    model_id = r.json()["id"]
    spec = [{"name": "x", "dtype": "float32", "shape": [2, 32]}]
    factors = {"format": 1, "model": model_id, "options": {}, "spec": spec, "target": "cpu-x86_64-avx2",
               "toolchain": {"torch": torch.__version__}}
    cluster.store.jobs.submit("e" * 32, factors["target"], {"model_id": model_id, "spec": spec, "options": {},
                                                            "factors": factors})
    (base / "package.pt2").write_bytes(b"PK\x05\x06" + b"\0" * 18)
    cluster.store.artifacts.put({"key": "a" * 32, "factors": factors, "model_id": model_id,
                                 "target": factors["target"], "spec": spec, "options": {}}, base / "package.pt2")
    return {"model_id": model_id, "key": "a" * 32}


def test_every_answer_keeps_the_contract(contract_cluster: tuple[Cluster, dict[str, str]], tmp_path: Path) -> None:
    cluster, ids = contract_cluster
    # The model and the artifact fill every `model_id` and `key` (valid cases), so the operations on them reach
    # the records, not only a 404. Job ids stay random: the event stream of a queued job would never end.
    config = tmp_path / "schemathesis.toml"
    config.write_text("[parameters]\n" + "".join(f'"{where}.{name}" = "{value}"\n' for name, value in ids.items()
                                                  for where in ("path", "query")))
    har = tmp_path / "run.har"
    cmd = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run", f"{cluster.url}/openapi.json",
        "--header", f"Authorization: Bearer {ADMIN_KEY}",
        "--checks", ",".join(CHECKS),
        "--phases", "examples,coverage,fuzzing",  # stateful: the API declares no links to follow
        "--max-examples", str(EXAMPLES), "--generation-deterministic",  # the same requests every run
        "--generation-with-security-parameters", "false",
        "--suppress-health-check", "all", "--workers", "1",
        "--request-timeout", "10",  # an event stream of a job that exists would never end by itself
        "--report", "har", "--report-har-path", str(har), "--no-color",
    ]
    run = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                         text=True, timeout=600)
    out = run.stdout + run.stderr
    (tmp_path / "schemathesis.out").write_text(out)
    assert run.returncode == 0, out[-12000:]

    # The run reached the service as the admin (no 401 or 403), and past validation: most operations answered
    # something other than an error at least once, so the success schemas were checked, not only the errors'.
    statuses = Counter(entry["response"]["status"] for entry in json.loads(har.read_text())["log"]["entries"])
    print(f"schemathesis: {sum(statuses.values())} requests, by status {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) > 500, statuses
    assert not statuses.keys() & {401, 403, 500, 502, 503, 504}, statuses
    assert sum(n for status, n in statuses.items() if status < 400) > 50, statuses
