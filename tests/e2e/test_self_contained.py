"""A self-contained pull (issue 21): the artifact's build with its weights inside, asked for on request, built and
signed by a worker as an artifact of its own, that torch's own loader runs with nothing bound. One compile of its
own: the weightless artifact is the session's dynamic MLP (tests/e2e/conftest.py), compiled once for the tests
that read it."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch

from client.sdk import Artifact
from client.verify import check_file
from compiler.errors import BadSignature
from procs import ROOT, api

pytestmark = pytest.mark.slow


def test_a_self_contained_pull_loads_with_torch_alone_and_is_signed(api_url, worker, client, store, dynamic_mlp,
                                                                     tmp_path):
    model, art = dynamic_mlp.model, dynamic_mlp.art
    assert isinstance(art, Artifact) and art.meta["weights"]  # weightless: it binds the model's blob

    r = api.post(f"{api_url}/v1/artifacts/{art.key}/self-contained")
    assert r.status_code in (200, 202), r.text
    if r.status_code == 202:
        assert r.headers["location"] == f"/v1/jobs/{r.json()['job']['id']}"
    path = client.pull(art, tmp_path / "mlp-self.pt2", self_contained=True)

    built = client.self_contained(art)  # stored now: answered at once, the same artifact
    again = api.post(f"{api_url}/v1/artifacts/{art.key}/self-contained")
    assert again.status_code == 200 and again.json()["key"] == built.key != art.key
    assert built.meta["factors"]["weights"]["layout"] == "embedded"
    assert built.meta["factors"]["options"]["embed_weights"] is True and not built.meta.get("weights")
    assert built.meta["factors"]["spec"] == art.meta["factors"]["spec"]
    assert api.get(f"{api_url}/v1/artifacts/{built.key}/weights").status_code == 409  # nothing to bind
    # A lookup still answers the package that binds the shared blob, though the build is newer and as specialised.
    found = client.lookup(dynamic_mlp.record["id"], {"x": [8, 32]}, target="cpu")
    assert found is not None and found.key == art.key
    # A package that carries its weights is its own self-contained build.
    assert api.post(f"{api_url}/v1/artifacts/{built.key}/self-contained").json()["key"] == built.key

    # torch's own loader, no weights bound, no sidecar beside it: the same outputs as eager.
    assert not path.with_name("mlp-self.weights.safetensors").exists()
    from torch._inductor import aoti_load_package

    fn = aoti_load_package(str(path))
    x = torch.randn(8, 32)  # a batch inside the artifact's range (1..64)
    with torch.no_grad():
        torch.testing.assert_close(fn(x), model(x), rtol=1e-4, atol=1e-5)

    timings: dict[str, float] = {}
    loaded = client.load(built, timings=timings)  # aotc's loader too: nothing to pull or bind beside the package
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-4, atol=1e-5)
    assert "weights_pull_s" not in timings and set(timings) >= {"verify_s", "pull_s", "load_s", "first_call_s"}

    # `aotc pull KEY --self-contained`: the build (stored now) named on stderr, its path on stdout, nothing beside.
    out = tmp_path / "cli" / "self.pt2"
    done = subprocess.run([sys.executable, "-m", "client.cli", "--url", api_url, "pull", art.key, "--self-contained",
                           "-o", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(out)
    assert f"{art.key}: its self-contained build is {built.key}" in done.stderr
    assert out.read_bytes() == path.read_bytes() and [p.name for p in out.parent.iterdir()] == ["self.pt2"]

    # Its signature verifies like any artifact's, and a changed byte is refused.
    signed = client.verifier.manifest(built.key, built.meta)
    check_file(signed, path)
    tampered = tmp_path / "tampered.pt2"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    tampered.write_bytes(bytes(data))
    with pytest.raises(BadSignature, match="tampered with"):
        check_file(signed, tampered)
    # The stored bytes swapped for others: a fresh pull refuses them and writes nothing.
    store.blobs.put("artifact", store.artifacts.blob_id(built.meta), io.BytesIO(bytes(data)))
    from client import Client

    with Client(api_url, cache_dir=tmp_path / "fresh", timeout=120) as fresh:
        with pytest.raises(BadSignature, match="tampered with"):
            fresh.pull(art, tmp_path / "refused.pt2", self_contained=True)
    assert not (tmp_path / "refused.pt2").exists()

