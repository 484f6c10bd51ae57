"""No compiled memory access without a bound, on a CUDA worker (pytest -m gpu): Triton kernels keep their index
asserts (compiled with `debug`, so tl.device_assert fires), the adversarial check runs its refused cases in probes
that each lose their CUDA context, the scan reads every Triton kernel, and a pulled package refuses out-of-range
indices. An out-of-range index in a Triton kernel is a device-side assert, which leaves the CUDA context unusable,
so every call that should fail runs in a fresh process of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from compiler.weightsfile import sidecar
from modelzoo import export
from procs import ROOT


class UnsafeIndex(torch.nn.Module):
    def forward(self, x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._unsafe_index.Tensor(x, [i])


class Divergent(torch.nn.Module):
    """masked_scatter decomposes on CUDA to _unsafe_masked_index over a cumsum index (an out-of-bounds read of a
    short source); scatter_add of bf16 and max_unpool2d decompose to unchecked index puts."""

    def forward(self, x: torch.Tensor, ind: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, src: torch.Tensor,
                idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (torch.nn.functional.max_unpool2d(x, ind, 2),
                torch.scatter_add(y.bfloat16(), 0, idx, torch.ones(idx.shape, dtype=torch.bfloat16, device=y.device)),
                y.masked_scatter(mask, src))


def _from_float(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 1000, x, torch.zeros_like(x)).long()


class Bags(torch.nn.Module):
    """embedding_bag over offsets a float input can move: zero at every value the check draws, so the check's own
    cases never move them (as in tests/compiler/test_trusted_values.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(10, 3))
        self.register_buffer("ids", torch.tensor([1, 2, 3, 4]))
        self.register_buffer("offsets", torch.tensor([0, 2, 3]))
        self.register_buffer("second", torch.tensor([0, 1, 0]))

    def forward(self, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        offsets = self.offsets - _from_float(b) * self.second + _from_float(c) * self.second
        return torch.nn.functional.embedding_bag(self.ids, self.w, offsets, mode="sum")


def _pull(client, key: str, package: Path) -> Path:
    """The artifact and, beside it, the weights blob its weightless package binds at load (none bound: it refuses
    to run)."""
    path = client.pull(key, package)
    assert client.pull_weights(key, sidecar(path)) is not None
    return path


def _run(package: Path, code: str) -> subprocess.CompletedProcess[str]:
    """Load the package on cuda:0 in a fresh process and run `code` (which calls `fn`); prints RETURNED if it
    returned."""
    script = textwrap.dedent(f"""
        import torch
        from compiler.compat.aoti import aoti_load_package
        fn = aoti_load_package({str(package)!r}, "cuda:0")
        {code}
        torch.cuda.synchronize()
        print("RETURNED")
    """)
    return subprocess.run([sys.executable, "-P", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _refuses(package: Path, code: str) -> None:
    done = _run(package, code)
    assert "RETURNED" not in done.stdout, f"the package returned for: {code}"
    assert done.returncode != 0 and ("device-side assert" in done.stderr or "out of bounds" in done.stderr
                                     or "RuntimeError" in done.stderr), done.stderr[-2000:]


def test_an_unsafe_index_package_for_cuda_refuses_out_of_range_indices(gpu_compile, client, tmp_path):
    path = export(UnsafeIndex(), (torch.randn(16, 4), torch.zeros(8, dtype=torch.long)), tmp_path / "ui.pt2")
    art = gpu_compile(path, {"x": [16, 4], "i": [8]}, timeout=1200)
    adv = art.meta["check"]["adversarial"]
    assert adv["failures"] == [] and adv["oracle"] == "eager on a CPU copy of the program"
    assert adv["outcomes"] == {"refused": 12, "agreed": 14}
    assert adv["probes"] == 13  # the agreeing cases in one probe, then one probe per refused case (any free lane)
    report = client.report(art.key)
    assert report["stages"]["capture"]["bounds"]["ops"] == {"aten._unsafe_index.Tensor": 1}
    scan = report["stages"]["package"]["scan"]
    assert scan["findings"] == []
    kernels = [f for f in scan["scanned"] if f["language"] == "kernel"]
    assert kernels and all(f["file"].startswith("<triton kernel triton_") for f in kernels), scan["scanned"]

    package = _pull(client, art.key, tmp_path / "ui-cuda.pt2")
    ok = _run(package, "x = torch.randn(16, 4, device='cuda'); i = torch.tensor([0, 15, -1, -16, 3, 2, 1, 0], "
                       "device='cuda'); assert torch.equal(fn(x, i), x[i])")
    assert "RETURNED" in ok.stdout, ok.stderr[-2000:]
    for bad in ("[0, 1, 2, 3, 4, 5, 6, 16]", "[-400000, 0, 0, 0, 0, 0, 0, 400000]", "[-17] * 8"):
        _refuses(package, f"fn(torch.randn(16, 4, device='cuda'), torch.tensor({bad}, device='cuda'))")


def test_masked_scatter_scatter_add_and_max_unpool_on_cuda_refuse_what_eager_refuses(gpu_compile, client, tmp_path):
    torch.manual_seed(3)
    _, ind = torch.nn.functional.max_pool2d(torch.randn(1, 2, 8, 8), 2, return_indices=True)
    mask = torch.zeros(16, dtype=torch.bool)
    mask[:4] = True
    # 12 sources: the check's random mask (seed 0, as in tests/compiler/test_check.py) has 10 ones, which fit.
    # Exported on the GPU: its bf16 cast asserts the device it was traced on.
    args = tuple(a.cuda() for a in (torch.randn(1, 2, 4, 4), ind, torch.randn(16), mask, torch.randn(12),
                                    torch.zeros(4, dtype=torch.long)))
    path = export(Divergent(), args, tmp_path / "div.pt2")
    shapes = {"x": [1, 2, 4, 4], "ind": [1, 2, 4, 4], "y": [16], "mask": [16], "src": [12], "idx": [4]}
    art = gpu_compile(path, shapes, timeout=1200)
    assert art.meta["check"]["adversarial"]["failures"] == []
    package = _pull(client, art.key, tmp_path / "div-cuda.pt2")
    setup = ("torch.manual_seed(3); ind = torch.nn.functional.max_pool2d(torch.randn(1, 2, 8, 8), 2, "
             "return_indices=True)[1].cuda(); x = torch.randn(1, 2, 4, 4, device='cuda'); "
             "y = torch.randn(16, device='cuda'); m = torch.zeros(16, dtype=torch.bool, device='cuda'); "
             "m[:4] = True; src = torch.randn(12, device='cuda'); idx = torch.zeros(4, dtype=torch.long, "
             "device='cuda'); ")
    ok = _run(package, setup + "fn(x, ind, y, m, src, idx)")
    assert "RETURNED" in ok.stdout, ok.stderr[-2000:]
    # -1 and 64 (an 8x8 plane) fall in the other plane of the batch's buffer; a mask of 16 ones finds 12 sources.
    for poison in ("ind[0, 0, 0, 0] = -1", "ind[0, 1, 0, 0] = 64", "idx[1] = 16", "idx[1] = -400000", "m[:] = True"):
        _refuses(package, setup + poison + "; fn(x, ind, y, m, src, idx)")


def test_embedding_bag_offsets_on_cuda_meet_a_device_assert_before_the_kernel(gpu_compile, client, tmp_path):
    """ATen bounds neither the ids' bags nor the offsets between the first and the last, and no kernel assert
    does on CUDA: the offsets are checked on the device (compiler.ranges, Span.on_cuda) before the kernel reads."""
    path = export(Bags().cuda(), (torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")), tmp_path / "bag.pt2")
    art = gpu_compile(path, {"b": [1], "c": [1]}, timeout=1200)
    assert art.meta["check"]["adversarial"]["failures"] == []
    checked = client.report(art.key)["stages"]["capture"]["bounds"]["range_checked"]
    assert checked["ops"] == {"aten.embedding_bag.padding_idx": 1}, checked
    package = _pull(client, art.key, tmp_path / "bag-cuda.pt2")
    z = "z = torch.zeros(1, device='cuda'); big = torch.tensor([5e6], device='cuda'); "
    ok = _run(package, z + "out = fn(z, z); print(out.shape)")
    assert "RETURNED" in ok.stdout and "torch.Size([3, 3])" in ok.stdout, ok.stderr[-2000:]
    for hostile in ("fn(big, z)", "fn(z, big)"):  # a middle offset below 0, then one past the ids and the last
        done = _run(package, z + hostile)
        assert "RETURNED" not in done.stdout, f"the package returned for {hostile}"
        assert "device-side assert" in done.stderr and "offsets of aten.embedding_bag" in done.stderr, \
            done.stderr[-3000:]
