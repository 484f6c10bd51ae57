"""Weights stored once on a GPU: the issue's Conv+BN+Linear model compiled weightless for cuda:0 (fp32 and bf16),
checked with its blob bound on the device (user-managed) and perturbed; two loads share one device copy; and the
0.50 trap (package_constants_in_so=False without always_keep_tensor_constants) caught by name."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from compiler import weights as weights_mod
from compiler import weightsfile
from compiler.check import check_artifact
from compiler.compat.aoti import aoti_compile_and_package, aoti_load_package, constant_fqns, weightless_configs
from compiler.errors import CheckFailed
from compiler.options import CompileOptions
from compiler.pipeline import compile_model
from modelzoo import ConvBnHead, export, seeded

SPEC = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 8}, 3, 8, 8]}]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("gpu-weights")
    batch = torch.export.Dim("batch", min=1, max=8)
    path = export(seeded(ConvBnHead, 0).eval(), (torch.randn(2, 3, 8, 8),), d / "m.pt2",
                  dynamic_shapes={"x": {0: batch}})
    return d, path


def test_this_torch_builds_weightless_packages():
    assert weightless_configs() is not None, f"torch {torch.__version__} lacks the weightless settings"


@pytest.mark.parametrize("precision", ["keep", "bf16"])
def test_a_weightless_cuda_package_binds_its_blob_on_the_device_and_follows_it(exported, precision):
    d, path = exported
    result = compile_model(str(path), SPEC, SPEC, CompileOptions(precision=precision), "cuda:0",
                           str(d / f"{precision}.pt2"))
    assert result["weights"] is not None
    check = check_artifact(str(path), result["package"], SPEC, "cuda:0", precision=precision, adversarial=False)
    assert check["weights"]["perturbed"]["ok"]
    blob = weights_mod.load(result["weights"], "cuda:0")
    assert all(t.is_cuda for t in blob.values())
    a, b = (aoti_load_package(result["package"], "cuda:0", weights=blob) for _ in range(2))
    x = torch.randn(3, 3, 8, 8, device="cuda")
    with torch.inference_mode():
        ya = a(x)
        blob["head.bias"].add_(1.0)  # one device copy: both packages see it
        torch.testing.assert_close(b(x), ya + 1.0, rtol=0, atol=2e-2)


def test_the_half_trap_is_caught_on_the_gpu(exported):
    d, path = exported
    ep = torch.export.load(str(path))
    ep = torch.export.export(ep.module().cuda(), (torch.randn(2, 3, 8, 8, device="cuda"),))
    package = str(d / "trap.pt2")
    aoti_compile_and_package(ep, package, {**CompileOptions().inductor_configs(),
                                           "aot_inductor.package_constants_in_so": False})
    weights_mod.save(weights_mod.program_weights(ep), weights_mod.sidecar(package))
    assert "head.bias" not in constant_fqns(aoti_load_package(package, "cuda:0"))
    static = [{"name": "x", "dtype": "float32", "shape": [2, 3, 8, 8]}]
    with pytest.raises(CheckFailed, match="does not read weight 'head.bias'"):
        check_artifact(str(path), package, static, "cuda:0", adversarial=False)


def test_a_self_contained_cuda_build_runs_under_torchs_own_loader(exported):
    """embed_weights (what `aotc pull --self-contained` asks the service for): a CUDA package with its weights
    inside, no blob written, that torch's own aoti_load_package runs with nothing bound, and the check passes."""
    d, path = exported
    result = compile_model(str(path), SPEC, SPEC, CompileOptions(embed_weights=True), "cuda:0",
                           str(d / "self-contained.pt2"))
    assert result["weights"] is None
    check = check_artifact(str(path), result["package"], SPEC, "cuda:0", adversarial=False)
    assert check["passed"], check
    from torch._inductor import aoti_load_package as torch_load

    model = seeded(ConvBnHead, 0).eval().cuda()
    x = torch.randn(3, 3, 8, 8, device="cuda")
    with torch.inference_mode():
        torch.testing.assert_close(torch_load(result["package"], device_index=0)(x), model(x), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(("lanes", "chunk"), [(4, 7), (2, 4096), (4, 16 << 20)])
def test_pinned_chunks_put_the_blob_on_the_device_bit_for_bit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               lanes, chunk):
    torch.manual_seed(2)
    w = {"a": torch.randn(3).bfloat16(), "t": torch.randn(64, 33).t(), "big": torch.randn(3 << 20),
         "n": torch.tensor(5), "e": torch.empty(0, 2)}
    path = tmp_path / "w.safetensors"
    weights_mod.save(w, path)
    header = weightsfile.read_header_file(path)
    got = weights_mod.copy_in(path, header, torch.device("cuda:0"), lanes=lanes, chunk=chunk)
    monkeypatch.setenv(weights_mod.COPY_SETTING, "tensors")
    old = weights_mod.load(path, "cuda:0")
    for k, v in w.items():
        assert got[k].is_cuda and got[k].stride() == v.stride() and torch.equal(got[k].cpu(), v), k
        assert torch.equal(old[k].cpu(), v), k
        assert not v.numel() or got[k].data_ptr() % 256 == 0, k  # each its own allocation: aligned for the kernels


def test_a_cold_load_puts_the_blob_on_the_gpu_as_it_arrives(gpu_compile, client, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture):
    """Client.load with an empty cache: the blob goes onto the device while it downloads (compiler.weights.Follower),
    its copy checked by its own digest; the package then runs as eager does."""
    model = seeded(ConvBnHead, 5).eval()
    path = export(model, (torch.randn(2, 3, 8, 8),), tmp_path / "m.pt2")
    art = gpu_compile(path, {"x": [2, 3, 8, 8]})
    assert art.meta.get("weights"), "a weightless artifact binds a blob"
    with caplog.at_level(logging.DEBUG, logger="aotc.client"):
        fn = client.load(art, device="cuda:0")
    assert "as it arrived" in caplog.text and "from the verified file" not in caplog.text, caplog.text
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(fn(x.cuda()).cpu(), model(x), rtol=1e-3, atol=1e-3)
