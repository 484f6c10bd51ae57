"""Depthwise convolutions lowered to pointwise ATen ops, so that a package calls no cuDNN for them
(`options.convolutions="generated"`).

An Inductor package runs its convolutions through cuDNN, and cuDNN builds an execution plan per channels-last
convolution shape on the process's first call, about 44 ms each: MobileNetV3-L's first call took 3.9 s that way on
an H200, most of it in its depthwise convolutions (bench/first_call.py). A depthwise convolution (one filter per
channel) is a sum of kh*kw shifted, strided slices of the padded input, each scaled by one weight column; Inductor
fuses that into one pointwise kernel (Triton on a GPU, C++ on a CPU), which needs no plan at first call. The 1x1
convolutions become matmuls (Inductor's `conv_1x1_as_mm`, compiler.options), whose cuBLAS handle is made once.

On a CUDA program each of them becomes one call of compiler.dwconv's Triton kernel instead (a
`torch.library.triton_op` that AOTInductor compiles into the package): Inductor realised the padded, widened input
of the pointwise form once per convolution and read it back per tap, which left steady calls 1.48x and 2.23x slower
than cuDNN's on EfficientNet-B0 and ConvNeXt-T. With the kernel, whole packages of EfficientNet-B0 and
MobileNetV3-L ran their steady calls at 0.97x and 0.93x the library's (bench/README.md, 2026-12-01). The kernel
takes its input channels-last, the layout Inductor's layout optimisation gives convolutions on a GPU.

`lower_depthwise(ep)` returns a new exported program with every 2-D depthwise convolution of static channels and
spatial size (the batch may be dynamic) rewritten that way, other convolutions untouched, and how many it rewrote.
bf16/fp16 inputs accumulate in float32 and are cast back at the end, so the numerics are at least as good as
cuDNN's. At most MAX_TAPS taps a convolution: the unrolled kernel's size is bounded whatever an upload holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

MAX_TAPS = 49  # kh*kw above this: a real convolution kernel wins, leave it to cuDNN
# The most taps one program's depthwise convolutions may have together to be lowered. Each tap is a few graph nodes,
# so without a bound an upload of many depthwise convolutions would multiply the graph Inductor compiles by up to
# ~300x (the sandbox's limits would end that compile, after its time). Real models are far below: ConvNeXt-T has
# 882 taps, MobileNetV3-L 231. A program above it is left as it is, and the capture stage's facts say why.
MAX_PROGRAM_TAPS = 10_000
_CONVS = (torch.ops.aten.convolution.default, torch.ops.aten.conv2d.default)


def _depthwise(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, stride: Sequence[int],
               padding: Sequence[int], dilation: Sequence[int], transposed: bool, output_padding: Sequence[int],
               groups: int) -> Any:
    """aten.convolution as a sum of strided slices when it is a static 2-D depthwise one; NotImplemented if not."""
    if not _taps(x, w, transposed, groups) or not all(isinstance(v, int) for v in (*stride, *padding, *dilation)):
        return NotImplemented
    _, c, h, wd = x.shape
    _, _, kh, kw = w.shape
    sh, sw = (stride[0], stride[-1])
    ph, pw = (padding[0], padding[-1])
    dh, dw = (dilation[0], dilation[-1])
    oh, ow = out_size(h, wd, kh, kw, (sh, sw), (ph, pw), (dh, dw))
    if uses_kernel(x.device, c, h * wd, oh * ow):
        from compiler import dwconv  # imports triton: only where a CUDA program is lowered

        # Channels-last picks the kernel's layout; launch makes the weight dense itself.
        return dwconv.depthwise_conv2d(x.contiguous(memory_format=torch.channels_last), w, bias, (sh, sw), (ph, pw),
                                       (dh, dw))
    low = x.dtype in (torch.bfloat16, torch.float16)
    acc_dtype = torch.float32 if low else x.dtype
    xp = torch.ops.aten.constant_pad_nd.default(x, [pw, pw, ph, ph], 0.0) if ph or pw else x
    xp = xp.to(acc_dtype)
    wf = w.to(acc_dtype)
    out: torch.Tensor | None = None
    for i in range(kh):
        for j in range(kw):
            tap = xp[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw]
            term = tap * wf[:, 0, i, j].view(1, c, 1, 1)
            out = term if out is None else out + term
    assert out is not None
    if bias is not None:
        out = out + bias.to(acc_dtype).view(1, c, 1, 1)
    return out.to(x.dtype)


def uses_kernel(device: torch.device, channels: int, pixels_in: int, pixels_out: int) -> bool:
    """Whether a depthwise convolution becomes compiler.dwconv's kernel rather than the pointwise form: on a CUDA
    device, where one image of its input and of its output each has fewer than 2**31 elements (the kernel's offsets
    within an image are 32-bit; the batch's are 64-bit)."""
    return device.type == "cuda" and channels * max(pixels_in, pixels_out) < 2**31


class Config(NamedTuple):
    """How compiler.dwconv's launch tiles its work (here, where no triton is imported, so that the choice is tested
    on any machine). rows: TH output rows of BLOCK_W pixels by BLOCK_C channels (the channels-last kernel); flat
    (rows == 0): BLOCK_P pixels in row-major order by BLOCK_C channels (the first kernel, which also takes NCHW).
    taps_major copies the weight to [KH, KW, C] first, so that each tap's channel block is one contiguous load (one
    small kernel more a call, in a package without constant folding)."""

    rows: int
    block_p: int  # BLOCK_W for rows, BLOCK_P for flat
    block_c: int
    num_warps: int
    taps_major: bool = False


# The most loads a kernel's unrolled loops may emit. Every extent is a constant of the kernel and its loops unroll
# at compile time, so an unbounded trip count is a compile an upload could make as long as it likes. The flat
# kernel emits KH*KW loads (at most MAX_TAPS); the rows kernel walks the input rows that its TH output rows span,
# (TH - 1) * stride + (KH - 1) * dilation + 1 of them, each with KW loads: a stride or dilation of 10**6 (a valid
# convolution, with padding to match) would unroll millions. So the rows kernel is only picked at a stride of at most 2
# and no dilation along the height, where (3 * 2 + KH) * KW <= 7 * MAX_TAPS, and a launch refuses any tiling above.
MAX_UNROLLED_LOADS = 7 * MAX_TAPS


def unrolled_loads(cfg: Config, kh: int, kw: int, stride_h: int, dilation_h: int) -> int:
    """How many input loads compiler.dwconv's kernel unrolls at this tiling and filter (its compile's size)."""
    if cfg.rows == 0:
        return kh * kw
    return ((cfg.rows - 1) * stride_h + (kh - 1) * dilation_h + 1) * kw


def flat_config(channels_last: bool, c: int) -> Config:
    """The flat kernel's tiling: channels-last, 2048 elements a program, wide along the channels (up to 64); NCHW,
    256 pixels by 8 channels. Its channel block is the rows kernel's too."""
    if not channels_last:
        return Config(0, 256, 8, 4)
    bc = 64 if c >= 64 else max(16, 1 << (c - 1).bit_length())
    return Config(0, 2048 // bc, bc, 4)


def pick(channels_last: bool, c: int, kh: int, kw: int, stride_h: int, dilation_h: int) -> Config:
    """The tiling compiler.dwconv's launch uses unless given one: fixed, no autotuning in the compile.
    Channels-last: four output rows of 8 pixels by up to 64 channels (16 pixels under 64 channels, so that a
    thread still loads 16 bytes), the weight taps-major past 3x3 (its copy costs less than the strided loads it
    saves only there). bench/depthwise.py's sweep on an H200 (2026-12-01) chose it: over the depthwise convolutions
    of EfficientNet-B0, MobileNetV3-L and ConvNeXt-T at batch 32 its tilings' times summed to 0.90x, 0.88x and 0.72x
    cuDNN's, against 1.56x, 1.41x and 2.10x for the flat kernel. A stride above 2 or a dilation above 1 along the
    height takes the flat kernel, whose loads do not grow with them (MAX_UNROLLED_LOADS)."""
    flat = flat_config(channels_last, c)
    if not channels_last or stride_h > 2 or dilation_h > 1:
        return flat
    bc = flat.block_c
    rows = Config(4, 8 if bc >= 64 else 16, bc, 4, taps_major=kh * kw > 9)
    return rows if unrolled_loads(rows, kh, kw, stride_h, dilation_h) <= MAX_UNROLLED_LOADS else flat


def out_size(h: int, w: int, kh: int, kw: int, stride: Sequence[int], padding: Sequence[int],
             dilation: Sequence[int]) -> tuple[int, int]:
    """A 2-D convolution's output height and width (compiler.dwconv's kernel uses it too)."""
    return ((h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1,
            (w + 2 * padding[-1] - dilation[-1] * (kw - 1) - 1) // stride[-1] + 1)


def _depthwise2d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 stride: Sequence[int] = (1, 1), padding: Sequence[int] = (0, 0), dilation: Sequence[int] = (1, 1),
                 groups: int = 1) -> Any:
    """aten.conv2d (which torch.export keeps, and run_decompositions keeps unless told) the same way."""
    return _depthwise(x, w, bias, stride, padding, dilation, False, (0, 0), groups)


def _taps(x: Any, w: Any, transposed: bool, groups: Any) -> int:
    """kh*kw of a convolution this module lowers (2-D, depthwise, static channels and spatial size, at most
    MAX_TAPS), else 0."""
    if transposed or not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.dim() != 4 \
            or w.dim() != 4:
        return 0
    if not all(isinstance(v, int) for v in (*x.shape[1:], *w.shape, groups)):
        return 0  # a symbolic channel or spatial size (a dynamic batch is fine: no tap depends on it)
    c, (out, one, kh, kw) = x.shape[1], w.shape
    return kh * kw if groups == c == out and one == 1 and kh * kw <= MAX_TAPS else 0


def _planned_taps(ep: torch.export.ExportedProgram) -> int:
    """The taps of all the convolutions `lower_depthwise` would lower, read off the graph's example values."""
    total = 0
    for n in ep.graph.nodes:
        if n.op != "call_function" or n.target not in _CONVS:
            continue
        args = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in n.args]
        if n.target is torch.ops.aten.conv2d.default:  # (input, weight, bias, stride, padding, dilation, groups)
            transposed, groups = False, args[6] if len(args) > 6 else n.kwargs.get("groups", 1)
        else:  # convolution: (input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
            transposed, groups = bool(args[6]), args[8]
        total += _taps(args[0], args[1], transposed, groups)
    return total


class Lowering(NamedTuple):
    program: torch.export.ExportedProgram
    lowered: int  # convolutions rewritten
    taps: int  # their taps together (what the graph grew by, in multiply-adds per output element)
    note: str | None = None  # why none was, where the program is above MAX_PROGRAM_TAPS


def count(ep: torch.export.ExportedProgram) -> int:
    """The program's convolutions (what cuDNN, or oneDNN on a CPU, runs)."""
    return sum(1 for n in ep.graph.nodes if n.op == "call_function" and n.target in _CONVS)


def lower_depthwise(ep: torch.export.ExportedProgram, max_taps: int = MAX_PROGRAM_TAPS) -> Lowering:
    """`ep` with its 2-D depthwise convolutions as pointwise ATen ops, unless their taps together are more than
    `max_taps` (then `ep` itself, and the note says so).

    Both aten.convolution and aten.conv2d (what torch.export leaves) are handled; for any other convolution the
    decomposition returns NotImplemented, so it stays in the graph as it was. Nothing else is decomposed.
    """
    taps = _planned_taps(ep)
    if taps == 0:  # nothing to lower: no second trace of the program
        return Lowering(ep, 0, 0)
    if taps > max_taps:
        return Lowering(ep, 0, 0, f"none lowered: the depthwise convolutions have {taps} taps together, more than "
                                  f"the {max_taps} one program may lower")
    before = count(ep)
    new = ep.run_decompositions({torch.ops.aten.convolution.default: _depthwise,
                                 torch.ops.aten.conv2d.default: _depthwise2d})
    return Lowering(new, before - count(new), taps)
