"""The whole path with real parts: upload over HTTP, a real worker compiles on the CPU, pull, load, compare."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
from pathlib import Path

import pytest
import torch

from compiler.compat.aoti import aoti_load_package
from compiler.weightsfile import sidecar
from modelzoo import MLP, ConvNet, export, seeded
from procs import api, wait_job
from realistic import Regions

pytestmark = pytest.mark.slow


def _upload(api_url: str, path: Path) -> dict:
    r = api.post(f"{api_url}/v1/models", content=path.read_bytes(), timeout=60)
    assert r.status_code in (200, 201), r.text
    return r.json()


def test_conv_net_compiles_checks_and_matches_eager(api_url, worker, client, store, tmp_path):
    model = seeded(ConvNet, 1)
    x = torch.randn(2, 3, 32, 32)
    path = export(model, (x,), tmp_path / "conv.pt2")
    rec = _upload(api_url, path)
    assert rec["id"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert rec["inputs"] == [{"name": "x", "dtype": "float32", "shape": [2, 3, 32, 32]}]

    r = api.post(f"{api_url}/v1/compilations", json={"model_id": rec["id"], "shapes": {"x": [2, 3, 32, 32]}})
    assert r.status_code == 202, r.text
    job = wait_job(api_url, r.json()["job"]["id"])
    assert job["state"] == "succeeded", job.get("error")
    assert job["attempts"] == 1
    assert set(job["timings"]) >= {"load", "capture", "compile", "check"}

    meta = api.get(f"{api_url}/v1/artifacts/{job['artifact']}/meta").json()
    assert meta["factors"]["model"] == rec["id"]
    assert meta["factors"]["target"] == worker["target"]
    assert meta["factors"]["toolchain"]["torch"] == torch.__version__
    assert meta["check"]["passed"] is True and meta["check"]["max_rel_err"] < 1e-4

    head = api.head(f"{api_url}/v1/artifacts/{job['artifact']}")
    assert head.status_code == 200 and head.headers["etag"] == f'"{meta["sha256"]}"'
    assert int(head.headers["content-length"]) == meta["size"]

    path = client.pull(job["artifact"], tmp_path / "conv-aoti.pt2")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == meta["sha256"]
    # The package is weightless: its weights blob goes beside it, where aotc's loader binds it.
    weights = client.pull_weights(job["artifact"], sidecar(path))
    assert weights is not None and hashlib.sha256(weights.read_bytes()).hexdigest() == meta["weights"]["sha256"]
    compiled = aoti_load_package(str(path))
    xs = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(xs), model(xs), rtol=1e-4, atol=1e-5)


def test_mlp_dynamic_batch_one_artifact_serves_the_range(api_url, worker, client, dynamic_mlp):
    """The session's dynamic MLP (tests/e2e/conftest.py: exported for batches 1..1024, compiled for 1..64)."""
    model, rec, art = dynamic_mlp.model, dynamic_mlp.record, dynamic_mlp.art
    dim0 = rec["inputs"][0]["shape"][0]
    assert dim0["min"] == 1 and dim0["max"] == 1024

    assert art.meta["dynamic_dims"] == [{"input": "x", "dim": 0, "min": 1, "max": 64}]
    assert [p["point"] for p in art.meta["check"]["points"]] == ["min", "max"]
    fn = client.load(art)
    with torch.no_grad():
        for b in (1, 7, 64):
            xb = torch.randn(b, 32)
            torch.testing.assert_close(fn(xb), model(xb), rtol=1e-4, atol=1e-5)

    # Deploy-time lookup finds it without the key, for any batch in range; none outside it.
    found = client.lookup(rec["id"], {"x": [17, 32]}, target="cpu")
    assert found is not None and found.key == art.key
    assert client.lookup(rec["id"], {"x": [65, 32]}, target="cpu") is None
    r = api.get(f"{client.url}/v1/artifacts/lookup", params={"model_id": rec["id"], "shape": "x=65x32"})
    assert r.status_code == 404 and "x=65x32" in r.json()["error"]["message"]

    # The package is weightless: Client.load bound the process's one copy of its signed blob, which any other
    # bucket or version naming the same digest gets too (tests/compiler/test_weights.py: buckets write one blob).
    signed = client.verifier.manifest(art.key, art.meta)
    assert art.meta["weights"]["sha256"] == signed.weights["sha256"]
    assert fn._aotc_weights is client._device_weights(art, signed, "cpu")  # type: ignore[attr-defined]


def test_grad_mode_regions_and_dashed_module_names_compile(api_url, worker, client, tmp_path):
    """What HF Llama/Qwen2 (a no_grad, autocast-off rotary embedding) and torchvision's RegNet ('block1-0') hold, once
    refused at upload by the graph-string grammars, goes through upload, compile, check and load."""
    torch.manual_seed(0)
    model = Regions().eval()
    x = torch.randn(2, 8, 16)
    path = export(model, (x,), tmp_path / "regions.pt2")
    art = client.compile(path, {"x": [2, 8, 16]}, target="cpu")
    assert art.meta["check"]["passed"] is True
    fn = client.load(art)
    xs = torch.randn(2, 8, 16)
    with torch.no_grad():
        torch.testing.assert_close(fn(xs), model(xs), rtol=1e-4, atol=1e-5)


def test_identical_requests_hit_the_cache_and_share_one_job(api_url, worker, store, tmp_path):
    model = seeded(MLP, 3, d_in=16)
    path = export(model, (torch.randn(8, 16),), tmp_path / "mlp3.pt2")
    rec = _upload(api_url, path)
    body = {"model_id": rec["id"], "shapes": {"x": [8, 16]}, "target": "cpu"}
    compiles_before = store.caches.compiles()

    with cf.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: api.post(f"{api_url}/v1/compilations", json=body, timeout=30), range(8)))
    assert all(a.status_code == 202 for a in answers), [a.text for a in answers]
    job_ids = {a.json()["job"]["id"] for a in answers}
    assert len(job_ids) == 1
    assert sorted(a.json()["status"] for a in answers).count("queued") == 1
    job = wait_job(api_url, job_ids.pop())
    assert job["state"] == "succeeded", job.get("error")
    assert store.caches.compiles() == compiles_before + 1

    again = api.post(f"{api_url}/v1/compilations", json=body)
    assert again.status_code == 200 and again.json()["status"] == "cached"
    assert again.json()["key"] == job["artifact"]
    assert store.caches.compiles() == compiles_before + 1  # the hit compiled nothing

    # Another shape is another key, hence another compile.
    other = api.post(f"{api_url}/v1/compilations",
                       json={**body, "shapes": {"x": [8, 16]}, "options": {"mode": "default"}})
    assert other.status_code == 200  # spelling the default option out changes nothing


def test_no_live_worker_for_target_is_a_clear_503(api_url, worker, tmp_path):
    path = export(seeded(MLP, 4), (torch.randn(2, 32),), tmp_path / "m.pt2")
    rec = _upload(api_url, path)
    r = api.post(f"{api_url}/v1/compilations",
                   json={"model_id": rec["id"], "shapes": {"x": [2, 32]}, "target": "cuda"})
    assert r.status_code == 503
    err = r.json()["error"]
    assert "no live worker serves target 'cuda'" in err["message"]
    assert err["live_targets"] == sorted(worker["targets"])
