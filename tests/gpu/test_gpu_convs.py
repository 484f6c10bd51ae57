"""options.convolutions="generated" on a GPU: the depthwise convolutions become compiler.dwconv's Triton kernel,
which gives what cuDNN gives for every kind the rewrite takes, in both layouts, and ends up inside the package: a
process that never imported the op's module runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import pytest
import torch

from compiler import convs
from compiler.check import check_artifact
from compiler.options import CompileOptions
from compiler.pipeline import compile_model
from modelzoo import InvertedResidual, MixedConvs, export, seeded


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_the_kernel_gives_what_cudnn_gives(dtype, tol, channels_last):
    model = seeded(MixedConvs, 0).to("cuda", dtype)
    x = torch.randn(3, 8, 13, 11, device="cuda", dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    lowering = convs.lower_depthwise(torch.export.export(model, (x,)))
    assert lowering.lowered == 4 and convs.count(lowering.program) == 5  # the depthwise ones, and only they
    calls = [n for n in lowering.program.graph.nodes if n.target is torch.ops.aotc.depthwise_conv2d.default]
    assert len(calls) == 4
    with torch.no_grad():
        want, got = model(x), lowering.program.module()(x)
    for w, g in zip(want, got):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g.float(), w.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_every_tiling_gives_what_cudnn_gives_at_awkward_shapes(dtype, tol):
    """Each tiling bench/depthwise.py tries (rows of 1-4 output rows, the flat kernel, the weight taps-major or
    not) at shapes whose edges fall inside a tile: odd sizes, strides 1-3, dilations, padding wider than the
    filter's reach, channels beyond a channel block, with a bias and without."""
    from compiler.convs import Config
    from compiler.dwconv import launch

    # a few of each kind: every tiling is a Triton compile for each shape and dtype
    configs = [Config(1, 8, 16, 4), Config(2, 16, 16, 4, True), Config(3, 8, 16, 4), Config(4, 8, 16, 4, True),
               Config(4, 16, 32, 4), Config(0, 64, 16, 4), None]
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [  # (N, C, H, W), (KH, KW), stride, padding, dilation
        ((2, 17, 13, 11), (3, 3), (1, 1), (1, 1), (1, 1)), ((1, 40, 9, 15), (5, 5), (2, 2), (2, 2), (1, 1)),
        ((3, 24, 10, 7), (7, 7), (1, 1), (3, 3), (1, 1)), ((2, 33, 12, 12), (3, 5), (3, 2), (4, 0), (2, 1)),
        ((1, 16, 5, 6), (3, 3), (1, 2), (0, 3), (1, 3)), ((2, 8, 1, 1), (1, 1), (1, 1), (0, 0), (1, 1))]
    for (n, c, h, w), (kh, kw), stride, padding, dilation in shapes:
        x = torch.randn(n, c, h, w, device="cuda", dtype=dtype, generator=g)
        x = x.contiguous(memory_format=torch.channels_last)
        weight = torch.randn(c, 1, kh, kw, device="cuda", dtype=dtype, generator=g)
        bias = torch.randn(c, device="cuda", dtype=dtype, generator=g) if n % 2 else None  # odd batches have one
        want = torch.nn.functional.conv2d(x.float(), weight.float(), None if bias is None else bias.float(), stride,
                                          padding, dilation, c)
        for cfg in configs:
            got = launch(x, weight, bias, stride, padding, dilation, cfg)
            assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last), cfg
            torch.testing.assert_close(got.float(), want, atol=tol * 4, rtol=tol, msg=lambda m, cfg=cfg: f"{cfg}: {m}")


def test_a_hostile_stride_or_dilation_compiles_the_flat_kernel_and_is_right():
    """A stride or dilation of 10**6 (a valid depthwise convolution, padded to match) would unroll the rows kernel's
    walk over input rows a million times; the launch's own pick takes the flat kernel, whose loops are the filter's
    taps, and a tiling given from outside is refused."""
    from compiler.convs import Config
    from compiler.dwconv import launch

    x = torch.randn(2, 20, 9, 10, device="cuda").contiguous(memory_format=torch.channels_last)
    w = torch.randn(20, 1, 3, 3, device="cuda")
    for stride, padding, dilation in (((1, 1), (1000, 1000), (1000, 1000)), ((10**6, 1), (1, 1), (1, 1))):
        want = torch.nn.functional.conv2d(x, w, None, stride, padding, dilation, 20)
        torch.testing.assert_close(launch(x, w, None, stride, padding, dilation), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="unrolls past"):
        launch(x, w, None, (10**6, 1), (1, 1), (1, 1), Config(4, 8, 32, 4))


def test_a_large_batch_folds_into_the_grid():
    """The batch is folded into the grid's first axis (2**31 - 1 programs), not its third (65535)."""
    from compiler.dwconv import depthwise_conv2d

    x = torch.randn(70_000, 4, 3, 3, device="cuda").contiguous(memory_format=torch.channels_last)
    w = torch.randn(4, 1, 3, 3, device="cuda")
    got = depthwise_conv2d(x, w, None, (1, 1), (1, 1), (1, 1))
    torch.testing.assert_close(got, torch.nn.functional.conv2d(x, w, None, 1, 1, 1, 4), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_a_generated_package_holds_the_kernel_and_runs_without_aotc(tmp_path):
    """A real compile for cuda:0 with a dynamic batch: no library call for the depthwise convolution, the kernel in
    the package, the check passed at both ends of the batch's range, and a process that never imported the op's
    module loads the package and gets what eager gets."""
    spec = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 8}, 3, 16, 16]}]
    batch = torch.export.Dim("batch", min=1, max=8)
    model = seeded(InvertedResidual, 2, stride=2, bias=True).cuda().eval()
    path = export(model, (torch.randn(2, 3, 16, 16, device="cuda"),), tmp_path / "m.pt2",
                  dynamic_shapes={"x": {0: batch}})
    result = compile_model(str(path), spec, spec, CompileOptions(convolutions="generated"), "cuda:0",
                           str(tmp_path / "a.pt2"))
    report = json.loads(open(result["report"]).read())
    assert report["stages"]["capture"]["convolutions"] == {"generated": 1, "taps": 9, "left_to_library": 3}
    externs = report["stages"]["fusion"]["externs"]
    assert len([e for e in externs if "conv" in str(e["kernel"]).lower()]) == 1, externs  # the stem alone
    with zipfile.ZipFile(result["package"]) as z:
        assert any(b"_depthwise_rows_kernel" in z.read(n) for n in z.namelist() if n.endswith((".cpp", ".py", ".json")))
    check = check_artifact(str(path), result["package"], spec, "cuda:0")
    assert check["passed"], check
    assert {p["shapes"]["x"][0] for p in check["points"]} >= {1, 8}

    x = torch.randn(5, 3, 16, 16, device="cuda")
    with torch.no_grad():
        want = model(x)
    torch.save({"x": x.cpu(), "want": want.cpu()}, tmp_path / "io.pt")
    # aotc's loader (it binds the weights sidecar the worker's packages have), but not the module of the op
    code = (
        "import sys, torch\n"
        "from compiler.compat.aoti import aoti_load_package\n"
        f"io = torch.load({str(tmp_path / 'io.pt')!r})\n"
        f"fn = aoti_load_package({result['package']!r}, 'cuda:0')\n"
        "with torch.no_grad():\n"
        "    got = fn(io['x'].cuda())\n"
        "got = got[0] if isinstance(got, (list, tuple)) else got\n"
        "torch.testing.assert_close(got.cpu(), io['want'], atol=1e-4, rtol=1e-4)\n"
        "assert 'compiler.dwconv' not in sys.modules\n"
        "print('ok')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]
