"""A depthwise 2-D convolution as one Triton kernel, for CUDA packages built with `options.convolutions="generated"`.

cuDNN builds an execution plan the first time a thread meets each convolution shape. For the channels-last bf16
depthwise convolutions of MobileNetV3, EfficientNet and ConvNeXt, cuDNN 9.19 compiles that plan at run time
(libnvrtc is loaded), 160-1,550 ms a shape on an H200, 2.2-2.6 s of a model's first call (bench/depthwise.py,
bench/first_call.py). compiler.convs first lowered them to sums of shifted slices that Inductor fused into
pointwise kernels: no plan, a 0.2-0.3 s first call, but steady calls up to 2.2x slower, because Inductor realises
the padded, widened input once per convolution and reads it back per tap.

This kernel is still slower than cuDNN's compiled ones: 707 against 234 us over EfficientNet-B0's twelve at batch
32 (device time, CUDA graphs); other block shapes gained 5 % at most. A whole package with its first form
(extents and strides as arguments) ran 1.18-1.33x slower than with cuDNN; this form (extents as constants, no
copy of its output) was not yet measured in a package. So `generated` stays a choice, not the default.

`depthwise_conv2d` is a `torch.library.triton_op`: Inductor and AOTInductor see through it, so the package holds
the kernel itself, compiled for the target with the rest of its Triton kernels, and no reference to this module or
to an `aotc` operator. A package built with it runs in a process that never imported aotc.

The kernel reads each input element of a tile once per tap it falls under, straight from the unpadded input
(masked loads stand for the padding, so no padded copy is made), accumulates in float32 and writes the output in
the input's memory format. A program covers BLOCK_P output pixels of one image by BLOCK_C channels; its loads are
contiguous along the channels for a channels-last input and along the pixels for a contiguous one. Offsets that
can pass 2**31 (the batch's, for a large dynamic batch) are 64-bit. Every load and store is masked to the tensors'
extents: the kernel reads and writes nothing outside them whatever the shapes.

Imported only where a CUDA program is lowered (it imports triton, which a CPU install lacks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from compiler.convs import out_size


@triton.jit
def _depthwise_kernel(x_ptr, w_ptr, b_ptr, y_ptr,  # type: ignore[no-untyped-def]  # Triton reads annotations
                      C: tl.constexpr, H: tl.constexpr, W: tl.constexpr, OH: tl.constexpr, OW: tl.constexpr,
                      KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                      PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                      CHANNELS_LAST: tl.constexpr, HAS_BIAS: tl.constexpr, W_TAPS_MAJOR: tl.constexpr,
                      BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    # Every extent but the batch's is a constant of the kernel (a program's are static), so the index arithmetic
    # folds and the loads along the contiguous axis vectorise. Input and output are dense in their layout;
    # the weight is [C, 1, KH, KW], contiguous, or with W_TAPS_MAJOR [KH, KW, C] (a tap's channels contiguous).
    tiles = (OH * OW + BLOCK_P - 1) // BLOCK_P
    pid = tl.program_id(0)
    n = (pid // tiles).to(tl.int64)  # the batch folds into axis 0 (2**31 - 1 programs, against axis 2's 65535)
    pid_p = pid % tiles
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    p_ok = p < OH * OW
    c_ok = c < C
    oh = p // OW
    ow = p % OW
    x_img = x_ptr + n * (C * H * W)
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for i in tl.static_range(KH):
        ih = oh * SH - PH + i * DH
        h_ok = p_ok & (ih >= 0) & (ih < H)
        for j in tl.static_range(KW):
            iw = ow * SW - PW + j * DW
            ok = h_ok & (iw >= 0) & (iw < W)
            if CHANNELS_LAST:
                offs = ((ih * W + iw) * C)[:, None] + c[None, :]
            else:
                offs = (ih * W + iw)[:, None] + (c * (H * W))[None, :]
            xv = tl.load(x_img + offs, mask=ok[:, None] & c_ok[None, :], other=0.0)
            if W_TAPS_MAJOR:
                wv = tl.load(w_ptr + (i * KW + j) * C + c, mask=c_ok, other=0.0)
            else:
                wv = tl.load(w_ptr + c * (KH * KW) + (i * KW + j), mask=c_ok, other=0.0)
            acc += xv.to(tl.float32) * wv.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    y_img = y_ptr + n * (C * OH * OW)
    if CHANNELS_LAST:
        y_offs = (p * C)[:, None] + c[None, :]
    else:
        y_offs = p[:, None] + (c * (OH * OW))[None, :]
    tl.store(y_img + y_offs, acc.to(y_ptr.dtype.element_ty), mask=p_ok[:, None] & c_ok[None, :])


def _blocks(channels_last: bool, c: int) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_C, num_warps): wide along the contiguous axis. Fixed per shape: no autotuning in the
    compile."""
    if channels_last:
        bc = 64 if c >= 64 else max(16, triton.next_power_of_2(c))
        return 2048 // bc, bc, 4
    return 256, 8, 4


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Sequence[int],
           padding: Sequence[int], dilation: Sequence[int],
           blocks: tuple[int, int, int] | None = None, taps_major: bool = False) -> torch.Tensor:
    """The kernel's launch, `blocks` (BLOCK_P, BLOCK_C, num_warps) chosen by `_blocks` unless given.
    `taps_major` copies the weight to [KH, KW, C] first, so that each tap's load of a channel block is contiguous
    (one kernel more a call, in a package without constant folding). Both are for bench/depthwise.py to try; the
    operator below uses neither."""
    n, c, h, w = x.shape
    kh, kw = weight.shape[2], weight.shape[3]
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    oh, ow = out_size(h, w, kh, kw, stride, padding, dilation)
    channels_last = c > 1 and x.is_contiguous(memory_format=torch.channels_last)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = x.contiguous(memory_format=fmt)  # dense in its layout (a no-op for what compiler.convs passes)
    y = torch.empty((n, c, oh, ow), dtype=x.dtype, device=x.device, memory_format=fmt)  # no copy of it
    bp, bc, warps = blocks or _blocks(channels_last, c)
    grid = (triton.cdiv(oh * ow, bp) * n, triton.cdiv(c, bc))
    wt = weight.permute(2, 3, 0, 1).contiguous() if taps_major else weight.contiguous()
    wrap_triton(_depthwise_kernel)[grid](
        x, wt, bias if bias is not None else wt, y,
        C=c, H=h, W=w, OH=oh, OW=ow, KH=kh, KW=kw, SH=sh, SW=sw, PH=ph, PW=pw, DH=dh, DW=dw,
        CHANNELS_LAST=channels_last, HAS_BIAS=bias is not None, W_TAPS_MAJOR=taps_major, BLOCK_P=bp, BLOCK_C=bc,
        num_warps=warps)
    return y


@triton_op("aotc::depthwise_conv2d", mutates_args={})
def depthwise_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Sequence[int],
                     padding: Sequence[int], dilation: Sequence[int]) -> torch.Tensor:
    """y[n, c] = sum over (i, j) of x[n, c, oh*sh - ph + i*dh, ow*sw - pw + j*dw] * weight[c, 0, i, j] (+ bias[c]),
    zero outside x: aten.convolution with groups == channels and one filter per channel."""
    return launch(x, weight, bias, stride, padding, dilation)
