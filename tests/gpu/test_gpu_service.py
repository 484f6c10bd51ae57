"""Upload -> compile on the GPU worker (Triton kernels) -> pull -> load -> run, compared with eager on the GPU."""

from __future__ import annotations

import pytest
import torch

from modelzoo import MLP, ConvNet, InvertedResidual, export, seeded


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.float32: (1e-3, 1e-3), torch.bfloat16: (5e-2, 5e-2)}[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=tol[0], atol=tol[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_conv_net_on_gpu(gpu_worker, gpu_compile, client, tmp_path, dtype):
    assert gpu_worker["target"].startswith("cuda-sm")
    assert gpu_worker["toolchain"]["triton"] and gpu_worker["toolchain"]["cuda"]
    # fp32 is exported on the CPU (the common case: export anywhere, compile for the GPU); bf16 on the GPU.
    model = seeded(ConvNet, 21).to(dtype=dtype)
    x = torch.randn(4, 3, 32, 32, dtype=dtype)
    if dtype == torch.bfloat16:
        model, x = model.cuda(), x.cuda()
    path = export(model, (x,), tmp_path / "conv.pt2")
    model, x = model.cuda(), x.cuda()
    art = gpu_compile(path, {"x": [4, 3, 32, 32]}, target="cuda")
    assert art.meta["factors"]["target"] == gpu_worker["target"]
    assert art.meta["check"]["passed"] and art.meta["check"]["device"].startswith("cuda")
    fn = client.load(art, device="cuda:0")
    with torch.no_grad():
        _close(fn(x), model(x), dtype)


def test_dynamic_batch_mlp_on_gpu(gpu_compile, client, tmp_path):
    model = seeded(MLP, 22).to("cuda")
    batch = torch.export.Dim("batch", min=1, max=512)
    path = export(model, (torch.randn(8, 32, device="cuda"),), tmp_path / "mlp.pt2", dynamic_shapes={"x": {0: batch}})
    art = gpu_compile(path, {"x": [{"min": 1, "max": 256}, 32]})
    assert art.meta["dynamic_dims"] == [{"input": "x", "dim": 0, "min": 1, "max": 256}]
    fn = client.load(art, device="cuda:0")
    with torch.no_grad():
        for b in (1, 37, 256):
            xb = torch.randn(b, 32, device="cuda")
            _close(fn(xb), model(xb), torch.float32)


def test_generated_depthwise_through_the_sandboxed_worker(gpu_compile, client, tmp_path):
    """options.convolutions="generated" through the GPU worker, whose compile and check children run sandboxed as
    every worker's do: the compile child builds compiler.dwconv's Triton kernel into the package (its source read
    from the worker's own tree, its Triton compile inside the sandbox), the check passes, and the client's load of
    the pulled package gives eager's result."""
    model = seeded(InvertedResidual, 24, stride=1, kernel=5).cuda().eval()
    x = torch.randn(4, 3, 24, 24, device="cuda")
    path = export(model, (x,), tmp_path / "ir.pt2")
    art = gpu_compile(path, {"x": [4, 3, 24, 24]}, convolutions="generated")
    assert art.meta["factors"]["options"]["convolutions"] == "generated"
    assert art.meta["check"]["passed"] and art.meta["check"]["device"].startswith("cuda")
    report = client.report(art.key)
    assert report["stages"]["capture"]["convolutions"] == {"generated": 1, "taps": 25, "left_to_library": 3}
    externs = report["stages"]["fusion"]["externs"]
    assert len([e for e in externs if "conv" in str(e["kernel"]).lower()]) == 1, externs  # the stem alone
    assert any("_depthwise_rows_kernel" in client.source(art.key, f["path"]) for f in client.sources(art.key)
               if f["kind"] != "graph"), [f["path"] for f in client.sources(art.key)]
    fn = client.load(art, device="cuda:0")
    with torch.no_grad():
        _close(fn(x), model(x), torch.float32)
