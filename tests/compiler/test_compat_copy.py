"""compiler.compat.copy_all, what a CUDA graph's replay copies with: every pair copied, whatever the dtypes and
layouts, on the CPU build (the GPU suite runs it under replays: tests/gpu/test_gpu_graphs.py)."""

from __future__ import annotations

import torch

from compiler.compat import copy_all


def test_copy_all_copies_every_pair_across_dtypes_and_layouts():
    torch.manual_seed(0)
    srcs = [torch.randn(4, 5), torch.randint(0, 100, (7,)), torch.randn(3, 6).bfloat16(), torch.randn(5, 4).t()]
    dsts = [torch.zeros(4, 5), torch.zeros(7, dtype=torch.int64), torch.zeros(3, 6, dtype=torch.bfloat16),
            torch.zeros(5, 4).t()]
    copy_all(dsts, srcs)
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d, s) and d.data_ptr() != s.data_ptr()
    copy_all([], [])  # nothing to copy: no call
