"""Every kind of bad input gets a 4xx that names the problem; nothing is queued and the service stays up."""

from __future__ import annotations

import hashlib
import io
import pickle
import subprocess
import sys
import zipfile

import pytest
import torch

from archives import AddBytes, excluded_op_call
from modelzoo import MLP, export, seeded
from procs import MAX_UPLOAD_MB, ROOT, api
from service.store import keys


@pytest.fixture(scope="module")
def two_input_model(api_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    class TwoInputs(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x.sum(-1) + y

    b = torch.export.Dim("b", min=2, max=64)
    path = export(TwoInputs(), (torch.randn(4, 8), torch.randn(4)), tmp_path_factory.mktemp("m") / "two.pt2",
                  dynamic_shapes={"x": {0: b}, "y": {0: b}})
    r = api.post(f"{api_url}/v1/models", content=path.read_bytes())
    assert r.status_code == 201, r.text
    return r.json()


def _queue_state(store) -> tuple[int, int]:
    streams = sum(store.r.xlen(k) for k in store.r.scan_iter(keys.queue("*", "*")))
    return streams, store.r.zcard(keys.JOBS_INDEX)


def test_importing_the_api_leaves_torch_out():
    code = ("import sys, service.api.app; service.api.app.create_app(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_upload_reports_inputs_with_dynamic_ranges(two_input_model):
    x, y = two_input_model["inputs"]
    assert x["name"] == "x" and x["dtype"] == "float32"
    assert x["shape"][0]["min"] == 2 and x["shape"][0]["max"] == 64 and x["shape"][1] == 8
    assert y["shape"][0]["symbol"] == x["shape"][0]["symbol"]  # one shared batch dim


def test_same_upload_twice_is_the_same_model(api_url, two_input_model, tmp_path):
    r = api.get(f"{api_url}/v1/models/{two_input_model['id']}")
    assert r.status_code == 200 and r.json()["id"] == two_input_model["id"]


@pytest.mark.parametrize(
    "body, status, needle",
    [
        (b"definitely not a zip", 415, "not a zip"),
        (b"", 400, "empty"),
    ],
)
def test_upload_refusals(api_url, body, status, needle):
    r = api.post(f"{api_url}/v1/models", content=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_zip_that_is_not_an_exported_program(api_url):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("hello/readme.txt", "hi")
    r = api.post(f"{api_url}/v1/models", content=buf.getvalue())
    assert r.status_code == 422
    assert "torch.export" in r.json()["error"]["message"]


def test_upload_over_the_size_limit(api_url):
    r = api.post(f"{api_url}/v1/models", content=b"PK" + b"\0" * (MAX_UPLOAD_MB * 2**20 + 10))
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_archive_with_a_malicious_pickle_is_refused_at_upload(api_url, tmp_path):
    path = export(seeded(MLP, 11), (torch.randn(2, 32),), tmp_path / "evil.pt2")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (__import__("os").system, (f"touch {marker}",))

    evil_zip = io.BytesIO()
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(evil_zip, "w") as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename.endswith("sample_inputs/model.pt"):
                inner = io.BytesIO()
                with zipfile.ZipFile(inner, "w") as z:
                    z.writestr("archive/data.pkl", pickle.dumps(Evil(), protocol=2))
                data = inner.getvalue()
            dst.writestr(item, data)
    r = api.post(f"{api_url}/v1/models", content=evil_zip.getvalue())
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "unsafe_archive"
    assert "system" in r.json()["error"]["message"]
    assert not marker.exists()


def test_archive_calling_an_excluded_operator_is_refused_naming_it(api_url, tmp_path):
    """aten.from_file is a real ATen operator that reads a file of whatever machine runs the program; it is left
    off the operator list (compiler/archive/ops.py EXCLUDED), and the 422 says which node calls it and why."""
    src = export(AddBytes(), (torch.zeros(16, dtype=torch.uint8),), tmp_path / "add.pt2")
    r = api.post(f"{api_url}/v1/models", content=excluded_op_call(src, tmp_path / "ff.pt2", "from_file",
                                                                  "/etc/hostname").read_bytes())
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "unsafe_archive", error
    assert "node 'zeros' calls torch.ops.aten.from_file.default, which reads the file its string argument names" \
        in error["message"], error
    assert "compiler/archive/ops.py EXCLUDED" in error["message"], error
    assert error["path"] == "graph_module.graph.nodes[0].target", error


@pytest.mark.parametrize(
    "shapes, needle",
    [
        ({"x": [4, 8]}, "no shape given for input(s) ['y']"),
        ({"x": [4, 8], "y": [4], "z": [1]}, "unknown input(s) ['z']"),
        ({"x": [4, 8, 1], "y": [4]}, "input 'x' has rank 2"),
        ({"x": [4, 9], "y": [4]}, "input 'x' dim 1 is static (8)"),
        ({"x": [128, 8], "y": [128]}, "input 'x' dim 0 is 128; the exported program allows 2..64"),
        ({"x": [{"min": 1, "max": 8}, 8], "y": [{"min": 1, "max": 8}]}, "input 'x' dim 0 is 1..8"),
        ({"x": [4, {"min": 1, "max": 8}], "y": [4]}, "input 'x' dim 1 is static (8)"),
        ({"x": [4, 8], "y": [5]}, "input 'y' dim 0 shares its size with input 'x' dim 0"),
        ({"x": [{"min": 9, "max": 3}, 8], "y": [4]}, "range 9..3 is empty"),
        ({"x": "4xbanana", "y": [4]}, "cannot read shape '4xbanana'"),
    ],
)
def test_specs_that_contradict_the_program_are_422_and_queue_nothing(api_url, store, two_input_model, shapes, needle):
    before = _queue_state(store)
    r = api.post(f"{api_url}/v1/compilations", json={"model_id": two_input_model["id"], "shapes": shapes})
    assert r.status_code == 422, r.text
    assert needle in r.json()["error"]["message"]
    assert _queue_state(store) == before


@pytest.mark.parametrize(
    "patch, needle",
    [
        ({"target": "tpu"}, "unknown target 'tpu'"),
        ({"options": {"mode": "fastest"}}, "options.mode"),
        ({"options": {"triton.cudagraphs": True}}, "options.triton.cudagraphs"),
    ],
)
def test_bad_target_or_option_is_422(api_url, two_input_model, patch, needle):
    body = {"model_id": two_input_model["id"], "shapes": {"x": [4, 8], "y": [4]}, **patch}
    r = api.post(f"{api_url}/v1/compilations", json=body)
    assert r.status_code == 422 and needle in r.json()["error"]["message"], r.text


def test_unknown_things_are_404(api_url):
    assert api.post(f"{api_url}/v1/compilations", json={"model_id": "0" * 64, "shapes": {"x": [1]}}).status_code == 404
    for path in ("/v1/models/nope", "/v1/jobs/nope", "/v1/artifacts/nope", "/v1/artifacts/nope/meta"):
        r = api.get(api_url + path)
        assert r.status_code == 404 and "nope" in r.json()["error"]["message"], path
    assert api.head(f"{api_url}/v1/artifacts/nope").status_code == 404
    assert api.delete(f"{api_url}/v1/jobs/nope").status_code == 404
    r = api.get(f"{api_url}/v1/artifacts/lookup", params={"model_id": "nope", "shape": "x=1"})
    assert r.status_code == 404


def test_service_is_still_up(api_url):
    assert api.get(f"{api_url}/healthz").json() == {"ok": True}
    assert api.get(f"{api_url}/readyz").status_code == 200


def test_the_sdk_reads_an_upload_once_and_a_too_large_one_is_refused_up_front(api_url, tmp_path, monkeypatch):
    """Client.upload of a path hashes the bytes as it sends them (it read the file twice: hash, then send) and still
    announces their length, so the service refuses one over AOTC_MAX_UPLOAD_MB by it."""
    from client import Client, ClientError, sdk

    path = export(MLP(), (torch.randn(2, 32),), tmp_path / "mlp.pt2")
    read: list[int] = []

    class Counted(io.FileIO):  # every byte the SDK reads from the file, whichever way it reads
        def readinto(self, b):  # type: ignore[no-untyped-def]
            n = super().readinto(b)
            read.append(n or 0)
            return n

    monkeypatch.setattr(sdk, "open", lambda p, mode="rb": io.BufferedReader(Counted(p, "rb")), raising=False)
    with Client(api_url) as c:
        record = c.upload(path)
        assert record["id"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert sum(read) == path.stat().st_size  # once: hashed while it was sent

        big = tmp_path / "big.pt2"
        with open(big, "wb") as f:
            f.truncate(MAX_UPLOAD_MB * 2**20 + 10)  # sparse: its length is what matters
        with pytest.raises(ClientError) as got:
            c.upload(big)
        # Refused by the length announced in its headers (the message names it), not once the limit was crossed.
        assert got.value.status == 413 and f"the upload is {MAX_UPLOAD_MB * 2**20 + 10} bytes" in got.value.message
