"""A depthwise 2-D convolution as one Triton kernel, for CUDA packages built with `options.convolutions="generated"`.

cuDNN builds an execution plan the first time a thread meets each convolution shape. For the channels-last bf16
depthwise convolutions of MobileNetV3, EfficientNet and ConvNeXt, cuDNN 9.19 compiles that plan at run time
(libnvrtc is loaded), 160-1,550 ms a shape on an H200, 2.2-2.6 s of a model's first call (bench/depthwise.py,
bench/first_call.py). compiler.convs first lowered them to sums of shifted slices that Inductor fused into
pointwise kernels: no plan, a 0.2-0.3 s first call, but steady calls up to 2.2x slower, because Inductor realises
the padded, widened input once per convolution and reads it back per tap.

The first kernel here (`_depthwise_kernel`, the "flat" one: a run of pixels in row-major order per program) was
1.4-2.1x slower than cuDNN's compiled kernels: each thread loaded each tap's weights as 8 strided scalars against 2
vector loads of input, and loaded every input row once per filter row. The channels-last kernel now is
`_depthwise_rows_kernel`: four output rows a program, each input row loaded once for all the outputs it feeds,
the weight taps-major past 3x3, at a stride of at most 2 and no dilation along the height (compiler.convs.pick:
its walk over input rows unrolls at compile time, so a larger stride or dilation, which an upload chooses, takes the
flat kernel). Over the depthwise convolutions of EfficientNet-B0, MobileNetV3-L and ConvNeXt-T at batch 32 its
tilings ran 0.90x, 0.88x and 0.72x cuDNN's time on an H200 (device time, CUDA graphs; bench/depthwise.py --sweep,
2026-12-01), and whole packages built with it (8 pixels a row at every channel count then) ran their steady calls
at 0.97x (EfficientNet-B0) and 0.93x (MobileNetV3-L) the library's, first calls 0.21-0.32 s against 2.5-5.1 s
(bench/first_call.py, two rounds). The flat kernel stays for NCHW inputs (which no package passes) and for those
strides and dilations.

`depthwise_conv2d` is a `torch.library.triton_op`: Inductor and AOTInductor see through it, so the package holds
the kernel itself, compiled for the target with the rest of its Triton kernels, and no reference to this module or
to an `aotc` operator. A package built with it runs in a process that never imported aotc.

Both kernels read straight from the unpadded input (masked loads stand for the padding, so no padded copy is
made), accumulate in float32 and write the output in the input's memory format, with loads contiguous along the
channels for a channels-last input and along the pixels for a contiguous one. Offsets that
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

from compiler.convs import MAX_UNROLLED_LOADS, Config, out_size, pick, unrolled_loads


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


@triton.jit
def _depthwise_rows_kernel(x_ptr, w_ptr, b_ptr, y_ptr,  # type: ignore[no-untyped-def]  # Triton reads annotations
                           C: tl.constexpr, H: tl.constexpr, W: tl.constexpr, OH: tl.constexpr, OW: tl.constexpr,
                           KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                           PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                           HAS_BIAS: tl.constexpr, W_TAPS_MAJOR: tl.constexpr,
                           TH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
    # Channels-last only. A program computes TH output rows (TH <= 4) of BLOCK_W pixels by BLOCK_C channels of one
    # image. It walks the input rows those outputs need, loading each (row, horizontal tap) block once and adding it
    # to every output row it falls under: a stride-1 KxK convolution loads K * (TH + K - 1) blocks for TH rows,
    # against K * K * TH one output row at a time. The walk is unrolled at compile time (every extent is a
    # constant), so the row's tests below cost nothing at run time; the four accumulators are named, not indexed,
    # for Triton keeps no arrays of tensors.
    ROW_TILES: tl.constexpr = (OH + TH - 1) // TH
    COL_TILES: tl.constexpr = (OW + BLOCK_W - 1) // BLOCK_W
    ROWS: tl.constexpr = (TH - 1) * SH + (KH - 1) * DH + 1
    pid = tl.program_id(0)
    n = (pid // (ROW_TILES * COL_TILES)).to(tl.int64)  # the batch folds into axis 0, as in the kernel above
    tile = pid % (ROW_TILES * COL_TILES)
    oh0 = (tile // COL_TILES) * TH
    ow = (tile % COL_TILES) * BLOCK_W + tl.arange(0, BLOCK_W)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ow_ok = ow < OW
    c_ok = c < C
    x_img = x_ptr + n * (C * H * W)
    acc0 = tl.zeros((BLOCK_W, BLOCK_C), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_W, BLOCK_C), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_W, BLOCK_C), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_W, BLOCK_C), dtype=tl.float32)
    for r in tl.static_range(ROWS):
        ih = oh0 * SH - PH + r
        row_ok = (ih >= 0) & (ih < H)
        for j in tl.static_range(KW):
            iw = ow * SW - PW + j * DW
            ok = ow_ok & row_ok & (iw >= 0) & (iw < W)
            offs = ((ih * W + iw) * C)[:, None] + c[None, :]
            xv = tl.load(x_img + offs, mask=ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
            for t in tl.static_range(TH):
                # input row r serves output row t through the filter's row (r - t*SH) / DH, where that is one
                if r - t * SH >= 0:
                    if (r - t * SH) % DH == 0:
                        if (r - t * SH) // DH < KH:
                            if W_TAPS_MAJOR:
                                wv = tl.load(w_ptr + (((r - t * SH) // DH) * KW + j) * C + c, mask=c_ok, other=0.0)
                            else:
                                wv = tl.load(w_ptr + c * (KH * KW) + (((r - t * SH) // DH) * KW + j), mask=c_ok,
                                             other=0.0)
                            prod = xv * wv.to(tl.float32)[None, :]
                            if t == 0:
                                acc0 += prod
                            elif t == 1:
                                acc1 += prod
                            elif t == 2:
                                acc2 += prod
                            else:
                                acc3 += prod
    if HAS_BIAS:
        bv = tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        acc0 += bv
        acc1 += bv
        acc2 += bv
        acc3 += bv
    y_img = y_ptr + n * (C * OH * OW)
    y_offs = (oh0 * OW + ow) * C
    y_offs = y_offs[:, None] + c[None, :]
    y_ok = ow_ok[:, None] & c_ok[None, :]
    ty = y_ptr.dtype.element_ty
    tl.store(y_img + y_offs, acc0.to(ty), mask=y_ok)  # oh0 < OH: a tile starts inside the output
    if TH > 1:
        tl.store(y_img + y_offs + OW * C, acc1.to(ty), mask=y_ok & (oh0 + 1 < OH))
    if TH > 2:
        tl.store(y_img + y_offs + 2 * OW * C, acc2.to(ty), mask=y_ok & (oh0 + 2 < OH))
    if TH > 3:
        tl.store(y_img + y_offs + 3 * OW * C, acc3.to(ty), mask=y_ok & (oh0 + 3 < OH))


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Sequence[int],
           padding: Sequence[int], dilation: Sequence[int], config: Config | None = None) -> torch.Tensor:
    """The kernel's launch, tiled as `config` says or as `pick` chooses (bench/depthwise.py tries others)."""
    n, c, h, w = x.shape
    kh, kw = weight.shape[2], weight.shape[3]
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    oh, ow = out_size(h, w, kh, kw, stride, padding, dilation)
    channels_last = c > 1 and x.is_contiguous(memory_format=torch.channels_last)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = x.contiguous(memory_format=fmt)  # dense in its layout (a no-op for what compiler.convs passes)
    y = torch.empty((n, c, oh, ow), dtype=x.dtype, device=x.device, memory_format=fmt)  # no copy of it
    cfg = config or pick(channels_last, c, kh, kw, sh, dh)
    if cfg.rows and not channels_last:
        raise ValueError("the rows kernel takes a channels-last input")
    if not 0 <= cfg.rows <= 4:
        raise ValueError(f"rows must be 0 (flat) to 4, not {cfg.rows}")
    if unrolled_loads(cfg, kh, kw, sh, dh) > MAX_UNROLLED_LOADS:  # what `pick` never gives: a Config from outside
        raise ValueError(f"{cfg} unrolls past {MAX_UNROLLED_LOADS} loads at a {kh}x{kw} filter, stride {sh}, "
                         f"dilation {dh}")
    wt = weight.permute(2, 3, 0, 1).contiguous() if cfg.taps_major else weight.contiguous()
    b = bias if bias is not None else wt
    extents = dict(C=c, H=h, W=w, OH=oh, OW=ow, KH=kh, KW=kw, SH=sh, SW=sw, PH=ph, PW=pw, DH=dh, DW=dw,
                   HAS_BIAS=bias is not None, W_TAPS_MAJOR=cfg.taps_major, BLOCK_C=cfg.block_c)
    if cfg.rows:
        grid = (triton.cdiv(oh, cfg.rows) * triton.cdiv(ow, cfg.block_p) * n, triton.cdiv(c, cfg.block_c))
        wrap_triton(_depthwise_rows_kernel)[grid](x, wt, b, y, **extents, TH=cfg.rows, BLOCK_W=cfg.block_p,
                                                  num_warps=cfg.num_warps)
    else:
        grid = (triton.cdiv(oh * ow, cfg.block_p) * n, triton.cdiv(c, cfg.block_c))
        wrap_triton(_depthwise_kernel)[grid](x, wt, b, y, **extents, CHANNELS_LAST=channels_last,
                                             BLOCK_P=cfg.block_p, num_warps=cfg.num_warps)
    return y


@triton_op("aotc::depthwise_conv2d", mutates_args={})
def depthwise_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Sequence[int],
                     padding: Sequence[int], dilation: Sequence[int]) -> torch.Tensor:
    """y[n, c] = sum over (i, j) of x[n, c, oh*sh - ph + i*dh, ow*sw - pw + j*dw] * weight[c, 0, i, j] (+ bias[c]),
    zero outside x: aten.convolution with groups == channels and one filter per channel."""
    return launch(x, weight, bias, stride, padding, dilation)
