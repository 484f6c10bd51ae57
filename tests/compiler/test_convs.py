"""options.convolutions="generated" (compiler/convs.py): depthwise convolutions lowered to pointwise ops, so that a
package builds no cuDNN plan for them at its first call. The rewrite is exact where it applies, leaves every other
convolution alone, keeps a dynamic batch dynamic, and a real compile with it passes the check against the upload."""

from __future__ import annotations

import json

import pytest
import torch

from client.render import report_notes
from compiler import convs
from compiler.check import check_artifact
from compiler.options import CompileOptions
from compiler.pipeline import compile_model
from modelzoo import InvertedResidual, MixedConvs, export, seeded


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_depthwise_convolutions_become_pointwise_and_give_what_eager_gives(dtype, atol):
    model = seeded(MixedConvs, 0).to(dtype)
    x = torch.randn(2, 8, 13, 11, dtype=dtype)
    ep = torch.export.export(model, (x,))
    lowered, n, taps, note = convs.lower_depthwise(ep)
    assert n == 4 and taps == 9 + 25 + 9 + 7 and note is None
    assert convs.count(lowered) == 5  # the four depthwise ones, and only they
    with torch.no_grad():
        want, got = model(x), lowered.module()(x)
    for w, g in zip(want, got):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g.float(), w.float(), atol=atol, rtol=atol)


def test_a_dynamic_batch_stays_dynamic():
    model = seeded(InvertedResidual, 1, stride=2, bias=True)
    batch = torch.export.Dim("batch", min=1, max=16)
    ep = torch.export.export(model, (torch.randn(2, 3, 16, 16),), dynamic_shapes={"x": {0: batch}})
    lowered, n, _, _ = convs.lower_depthwise(ep)
    assert n == 1 and convs.count(lowered) == 3  # the stem and the two 1x1s stay (Inductor's conv_1x1_as_mm)
    for b in (1, 5):
        x = torch.randn(b, 3, 16, 16)
        with torch.no_grad():
            torch.testing.assert_close(lowered.module()(x), model(x), atol=1e-5, rtol=1e-5)


def test_options_spell_it_only_when_asked_and_keep_it_to_inference():
    assert "convolutions" not in CompileOptions().canonical()  # old keys unchanged
    assert "conv_1x1_as_mm" not in CompileOptions().inductor_configs()
    generated = CompileOptions(convolutions="generated")
    assert generated.canonical()["convolutions"] == "generated"
    assert generated.inductor_configs()["conv_1x1_as_mm"] is True
    with pytest.raises(ValueError, match="convolutions=generated is for inference packages"):
        CompileOptions(mode="training", convolutions="generated")
    with pytest.raises(ValueError):
        CompileOptions(convolutions="cudnn")


@pytest.mark.slow
def test_a_generated_convolutions_package_runs_no_library_depthwise_and_passes_the_check(tmp_path):
    """A real compile on the CPU: the capture stage says what it lowered, the generated code calls the library for
    the stem alone (the 1x1s are matmuls), and the check against the upload passes at both ends of the batch's
    range, the package following its bound weights."""
    spec = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 4}, 3, 16, 16]}]
    batch = torch.export.Dim("batch", min=1, max=4)
    path = export(seeded(InvertedResidual, 2), (torch.randn(2, 3, 16, 16),), tmp_path / "m.pt2",
                  dynamic_shapes={"x": {0: batch}})
    result = compile_model(str(path), spec, spec, CompileOptions(convolutions="generated"), "cpu",
                           str(tmp_path / "a.pt2"))
    report = json.loads(open(result["report"]).read())
    assert report["stages"]["capture"]["convolutions"] == {"generated": 1, "taps": 9, "left_to_library": 3}
    assert "convolutions: 1 depthwise lowered to generated kernels (9 taps), 3 left to the library" in \
        report_notes("k", report)  # what `aotc report` prints
    assert report["options"]["convolutions"] == "generated"
    externs = report["stages"]["fusion"]["externs"]
    library = [e["kernel"] for e in externs if "conv" in str(e["kernel"]).lower()]
    assert len(library) == 1, externs  # the stem
    check = check_artifact(str(path), result["package"], spec, "cpu")
    assert check["passed"] and check["weights"]["perturbed"]["ok"], check  # it reads the depthwise weights it binds
    assert {p["shapes"]["x"][0] for p in check["points"]} >= {1, 4} and check["max_abs_err"] < 1e-4


def test_the_taps_one_program_may_lower_are_bounded():
    """A hostile upload of many depthwise convolutions cannot multiply the graph Inductor compiles without bound: a
    program whose depthwise taps together pass the bound is left as uploaded (each convolution a few nodes), and
    says why."""
    model = torch.nn.Sequential(*[torch.nn.Conv2d(4, 4, 7, padding=3, groups=4) for _ in range(3)]).eval()
    ep = torch.export.export(model, (torch.randn(1, 4, 9, 9),))
    kept = convs.lower_depthwise(ep, max_taps=146)  # three 7x7s: 147 taps
    assert kept.program is ep and kept.lowered == 0 and convs.count(kept.program) == 3
    assert kept.note == "none lowered: the depthwise convolutions have 147 taps together, more than the 146 one " \
                        "program may lower"
    assert convs.lower_depthwise(ep, max_taps=147).lowered == 3
    assert convs.MAX_PROGRAM_TAPS >= 882  # ConvNeXt-T's, the most of the zoo's models


def test_only_a_cuda_image_under_2_31_elements_takes_the_kernel():
    """compiler.dwconv's offsets within one image are 32-bit: a larger image, in or out, keeps the pointwise form
    (whose ops index in 64 bits), and a CPU program never imports the kernel's module (it needs triton)."""
    cuda, cpu = torch.device("cuda:0"), torch.device("cpu")
    assert convs.uses_kernel(cuda, 96, 56 * 56, 56 * 56)  # ConvNeXt-T's first
    assert not convs.uses_kernel(cpu, 96, 56 * 56, 56 * 56)
    assert convs.uses_kernel(cuda, 4, 2**29 - 1, 2**29 - 1)
    assert not convs.uses_kernel(cuda, 4, 2**29, 1)  # 2**31 elements in
    assert not convs.uses_kernel(cuda, 4, 1, 2**29)  # ... or out (a padded, dilated one grows)


def test_the_kernels_unrolled_loads_stay_bounded_whatever_the_stride_and_dilation():
    """compiler.dwconv's loops unroll at compile time. The rows kernel walks (TH - 1) * stride + (KH - 1) * dilation + 1
    input rows: a depthwise convolution with a stride or dilation of 10**6 is valid (with padding to match), and
    would unroll millions of loads, a compile as long as the upload likes. `pick` keeps the rows kernel to strides
    of at most 2 and no dilation along the height; anywhere else it takes the flat kernel (KH*KW loads)."""
    zoo = [(3, 3, 1, 1), (3, 3, 2, 1), (5, 5, 1, 1), (5, 5, 2, 1), (7, 7, 1, 1)]  # EfficientNet's, ConvNeXt's
    for kh, kw, s, d in zoo:
        cfg = convs.pick(True, 96, kh, kw, s, d)
        assert cfg.rows == 4 and cfg.taps_major == (kh * kw > 9), (kh, kw, s, d)
    filters = [(kh, kw) for kh in range(1, convs.MAX_TAPS + 1) for kw in range(1, convs.MAX_TAPS + 1)
               if kh * kw <= convs.MAX_TAPS]
    for kh, kw in filters:
        for s in (1, 2, 3, 64, 10**6, 2**40):
            for d in (1, 2, 10**6, 2**40):
                for channels_last in (True, False):
                    cfg = convs.pick(channels_last, 96, kh, kw, s, d)
                    loads = convs.unrolled_loads(cfg, kh, kw, s, d)
                    assert loads <= convs.MAX_UNROLLED_LOADS, (kh, kw, s, d, cfg, loads)
                    assert cfg.rows == 0 or (channels_last and s <= 2 and d == 1)
    assert convs.pick(True, 16, 3, 3, 1, 1) == convs.Config(4, 16, 16, 4)  # under 64 channels, 16 pixels a row
    assert not convs.pick(False, 96, 3, 3, 1, 1).rows  # NCHW is the flat kernel's
    hostile = convs.Config(4, 8, 64, 4)  # a tiling given from outside is checked by the launch against the bound
    assert convs.unrolled_loads(hostile, 3, 3, 10**6, 1) > convs.MAX_UNROLLED_LOADS
    assert convs.unrolled_loads(hostile, 3, 3, 1, 10**6) > convs.MAX_UNROLLED_LOADS
