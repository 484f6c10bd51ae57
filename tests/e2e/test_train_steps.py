"""mode=training end to end with real parts: upload over HTTP, a real worker builds and checks a train-step
package, the SDK pulls it verified and binds it to a live module; 3 SGD steps match eager's (issue 23)."""

from __future__ import annotations

import base64
import copy
import json
import shutil
import subprocess

import pytest
import torch

from client.sdk import ClientError
from compiler.weightsfile import sidecar
from cppbuild import CXX, build_aotc_run, save_verification
from modelzoo import TrainMLP, export_train, seeded
from procs import api, wait_job

pytestmark = pytest.mark.slow

X, Y = (6, 8), (6, 4)


def _upload(api_url: str, path) -> dict:  # type: ignore[no-untyped-def]
    r = api.post(f"{api_url}/v1/models", content=path.read_bytes(), timeout=60)
    assert r.status_code in (200, 201), r.text
    return r.json()


@pytest.fixture(scope="module")
def uploaded(api_url, tmp_path_factory) -> dict:  # type: ignore[no-untyped-def]
    path = export_train(seeded(TrainMLP, 3), (torch.randn(*X), torch.randn(*Y)),
                        tmp_path_factory.mktemp("train") / "train.pt2")
    return _upload(api_url, path)


def test_dynamic_dims_are_refused_for_training_naming_the_dim(api_url, tmp_path):
    """Static shapes first: a program exported with a dynamic batch still compiles for training, at one size."""
    batch = torch.export.Dim("batch", min=2, max=16)
    path = export_train(seeded(TrainMLP, 4), (torch.randn(*X), torch.randn(*Y)), tmp_path / "dyn.pt2",
                        dynamic_shapes={"x": {0: batch}, "y": {0: batch}})
    dynamic = _upload(api_url, path)
    r = api.post(f"{api_url}/v1/compilations", json={
        "model_id": dynamic["id"], "shapes": {"x": [{"min": 2, "max": 16}, 8], "y": [{"min": 2, "max": 16}, 4]},
        "options": {"mode": "training"}})
    assert r.status_code == 422, r.text
    assert "input 'x' dim 0 is a range 2..16" in r.json()["error"]["message"]


def test_loss_output_needs_training_mode(api_url, uploaded):
    r = api.post(f"{api_url}/v1/compilations", json={
        "model_id": uploaded["id"], "shapes": {"x": list(X), "y": list(Y)}, "options": {"loss_output": 1}})
    assert r.status_code == 422, r.text
    assert "loss_output" in r.text and "mode=training" in r.text


@pytest.fixture(scope="module")
def trained(api_url, worker, uploaded) -> str:  # type: ignore[no-untyped-def]
    """The uploaded step compiled for training by the session's worker: its artifact key."""
    r = api.post(f"{api_url}/v1/compilations", json={
        "model_id": uploaded["id"], "shapes": {"x": list(X), "y": list(Y)}, "options": {"mode": "training"}})
    assert r.status_code in (200, 202), r.text
    if r.status_code == 200:
        return str(r.json()["key"])
    job = wait_job(api_url, r.json()["job"]["id"], timeout=600)
    assert job["state"] == "succeeded", job.get("error")
    return str(job["artifact"])


def test_train_step_package_signed_and_steps_match_eager(api_url, client, uploaded, trained):
    key = trained
    meta = api.get(f"{api_url}/v1/artifacts/{key}/meta").json()
    assert meta["package"] is True and meta["options"]["mode"] == "training"
    train = meta["check"]["training"]
    roles = [o["role"] for o in train["outputs"]]
    assert roles[:2] == ["loss", "output:0"]
    assert sorted(roles[2:]) == sorted(f"grad:{n}" for n, _ in TrainMLP().named_parameters())
    assert train["mutated_buffers"] == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    assert len(train["steps"]) == 3
    # The report: the joint graph and its partition (the autograd stage), the roles it built, and a real package.
    rep = api.get(f"{api_url}/v1/artifacts/{key}/report").json()
    tr = rep["stages"]["autograd"]["training"]
    assert tr["joint"]["nodes"] > 0 and tr["saved_for_backward"] > 0 and tr["tangents"] >= 1
    assert rep["stages"]["autograd"]["train_step"]["outputs"] == train["outputs"]
    assert [rep["stages"][s]["status"] for s in ("fusion", "codegen", "package")] == ["ok"] * 3
    assert api.get(f"{api_url}/v1/artifacts/{key}/source/graphs/joint.py").status_code == 200
    # The same request again is a cache hit: the key covers the mode and the loss index.
    again = api.post(f"{api_url}/v1/compilations", json={
        "model_id": uploaded["id"], "shapes": {"x": list(X), "y": list(Y)}, "options": {"mode": "training"}})
    assert again.json()["status"] == "cached" and again.json()["key"] == key

    # The caller's module, and an eager twin of it: the step fills .grad, any optimizer steps both.
    model = seeded(TrainMLP, 3).train()
    twin = copy.deepcopy(model)
    step = client.load_training(key, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_eager = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(7)
    for i in range(3):
        x, y = torch.randn(*X, generator=gen), torch.randn(*Y, generator=gen)
        opt.zero_grad()
        opt_eager.zero_grad()
        loss, (out,) = step(x, y)
        loss_e, out_e = twin(x, y)
        loss_e.backward()
        torch.testing.assert_close(loss, loss_e.detach(), rtol=1e-4, atol=1e-6, msg=f"loss at step {i}")
        torch.testing.assert_close(out, out_e, rtol=1e-4, atol=1e-6)
        for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"grad of {n} at step {i}")
        opt.step()
        opt_eager.step()
    # Buffers were updated in place in the caller's module (not returned).
    assert int(model.bn.num_batches_tracked) == 3
    torch.testing.assert_close(model.bn.running_mean, twin.bn.running_mean)
    torch.testing.assert_close(model.bn.running_var, twin.bn.running_var)

    # .grad accumulates as backward() does: two steps without zero_grad give the sum.
    opt.zero_grad()
    x, y = torch.randn(*X, generator=gen), torch.randn(*Y, generator=gen)
    step(x, y)
    once = model.l1.weight.grad.clone()
    step(x, y)
    torch.testing.assert_close(model.l1.weight.grad, 2 * once)

    # By name: the pick serves the train step to load_training, and never to load (an inference server).
    named = api.post(f"{api_url}/v1/compilations", json={
        "model_id": uploaded["id"], "shapes": {"x": list(X), "y": list(Y)}, "options": {"mode": "training"},
        "name": "train-mlp"})
    assert named.status_code < 300 and named.json()["key"] == key, named.text
    by_name = client.load_training("train-mlp", seeded(TrainMLP, 3).train())
    assert by_name.manifest["outputs"] == train["outputs"]
    with pytest.raises(ClientError, match=r"a train step \(mode=training\): load it with Client.load_training"):
        client.load("train-mlp")

    # A module of another shape is refused, naming the tensor.
    with pytest.raises(ValueError, match="'l1.weight' is float32 \\[16, 9\\]"):
        client.load_training(key, TrainMLP(d_in=9))


def test_a_tuned_train_step_has_a_key_of_its_own_is_checked_and_steps_as_eager(api_url, client, worker, uploaded,
                                                                              trained):
    """options.autotune: the same step built with max-autotune, its matmuls among ATen and Triton (on a CPU, ATen's
    alone), under its own key; checked as every train step is, its matmul timings shared as max-autotune's are."""
    shapes = {"x": list(X), "y": list(Y)}
    refused = api.post(f"{api_url}/v1/compilations", json={
        "model_id": uploaded["id"], "shapes": shapes, "options": {"autotune": True}})
    assert refused.status_code == 422 and "autotune tunes a train step (mode=training)" in refused.text
    r = api.post(f"{api_url}/v1/compilations", json={
        "model_id": uploaded["id"], "shapes": shapes, "options": {"mode": "training", "autotune": True}})
    assert r.status_code in (200, 202), r.text
    if r.status_code == 202:
        job = wait_job(api_url, r.json()["job"]["id"], timeout=600)
        assert job["state"] == "succeeded", job.get("error")
        key = str(job["artifact"])
    else:
        key = str(r.json()["key"])
    assert key != trained  # the untuned step's key is not this one
    meta = api.get(f"{api_url}/v1/artifacts/{key}/meta").json()
    assert meta["options"]["autotune"] is True and len(meta["check"]["training"]["steps"]) == 3
    assert meta["caches"]["gemm_timings"] is not None  # what a max-autotune compile shares, shared
    model = seeded(TrainMLP, 3).train()
    twin = copy.deepcopy(model)
    x, y = torch.randn(*X), torch.randn(*Y)
    loss, (out,) = client.load_training(key, model)(x, y)
    loss_e, out_e = twin(x, y)
    loss_e.backward()
    torch.testing.assert_close(loss, loss_e.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out, out_e, rtol=1e-4, atol=1e-6)
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"grad of {n}")


@pytest.mark.skipif(shutil.which(CXX) is None or shutil.which("make") is None,
                    reason=f"no C++ compiler ({CXX}) or make: the C++ example cannot be built")
def test_the_cpp_example_runs_train_steps_as_python_does(api_url, client, trained, tmp_path):
    """examples/cpp's aotc_run with --train-steps: verified as any package, roles from the signed check, the weights
    blob bound user-managed as the starting state, SGD between steps. Its losses and final parameters and buffers
    are eager's after the same steps."""
    exe = build_aotc_run()
    package = client.pull(trained, tmp_path / "train.pt2")
    blob = client.pull_weights(trained, sidecar(package))
    assert blob is not None
    manifest, signing_keys, trusted_key, kid = save_verification(api_url, trained, tmp_path)
    x, y = torch.randn(*X, generator=torch.Generator().manual_seed(11)), torch.randn(*Y)
    torch.save([x, y], tmp_path / "in.pt")
    argv = [str(exe), "--package", str(package), "--weights", str(blob), "--artifact-key", trained,
            "--manifest", str(manifest), "--trusted-key", str(trusted_key), "--signing-keys", str(signing_keys),
            "--inputs", str(tmp_path / "in.pt"), "--outputs", str(tmp_path / "out.pt")]
    plain = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 1 and "is a train step (mode=training): run it with --train-steps N" in plain.stderr
    done = subprocess.run(argv + ["--train-steps", "3", "--lr", "0.1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"signed by key {kid}" in done.stdout and "3 train steps (SGD lr=0.1 on 7 parameters)" in done.stdout

    model = seeded(TrainMLP, 3).train()  # what was uploaded: the blob's starting state
    losses = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        loss, _ = model(x, y)
        loss.backward()
        losses.append(float(loss.detach()))
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    torch.testing.assert_close(out[0], torch.tensor(losses, dtype=torch.float64), rtol=1e-4, atol=1e-6)
    statement = json.loads(base64.b64decode(json.loads(manifest.read_text())["payload"]))
    fqns = [c["fqn"] for c in statement["predicate"]["weights"]["constants"]]
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert len(out) == 1 + len(fqns) and {"bn.running_mean", "l1.weight"} <= set(fqns)
    for fqn, got in zip(fqns, out[1:], strict=True):
        torch.testing.assert_close(got, state[fqn].detach(), rtol=1e-4, atol=1e-5, msg=f"{fqn} after 3 steps")
