"""Small real models for the tests, and helpers to export them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, stride=2)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.fc(x.mean(dim=(2, 3)))


class MLP(torch.nn.Module):
    def __init__(self, d_in: int = 32, hidden: int = 64, d_out: int = 8) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(d_in, hidden), torch.nn.GELU(), torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, d_out)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.net(x), dim=-1)


def export(model: torch.nn.Module, args: tuple[Any, ...], path: Path, dynamic_shapes: Any = None) -> Path:
    ep = torch.export.export(model.eval(), args, dynamic_shapes=dynamic_shapes)
    torch.export.save(ep, str(path))
    return path


def exported(fn: Any, *args: Any) -> torch.export.ExportedProgram:
    """`fn(*args)` as an exported program (its one module's forward calls `fn`)."""

    class M(torch.nn.Module):
        def forward(self, *a: Any) -> Any:
            return fn(*a)

    return torch.export.export(M(), args)


def seeded(cls: type[torch.nn.Module], seed: int, **kw: Any) -> torch.nn.Module:
    """A model with weights fixed by `seed`: a different seed gives a different model id."""
    torch.manual_seed(seed)
    return cls(**kw).eval()


class ConvBnHead(torch.nn.Module):
    """Issue 21's model: the head's bias has 4 elements, which Inductor inlines as a literal unless told not to
    (tests/compiler/test_weights.py, tests/gpu/test_gpu_weights.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 16, 3)
        self.bn = torch.nn.BatchNorm2d(16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.conv(x)).mean((2, 3)))


class InplaceReduce(torch.nn.Module):
    """Stage-report model: an in-place op (functionalisation removes it), a reduction followed by pointwise ops
    (Inductor fuses them into fewer kernels than graph nodes), and rows that never mix, so its batch dim can be
    dynamic and padded into shape buckets."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        y.add_(1.0)  # in place on an intermediate whose grad does not need it: trainable too
        y = torch.relu(y)
        s = y.sum(dim=-1, keepdim=True)
        return torch.nn.functional.gelu(y / (s + 1.0)) * 2.0


class TrainMLP(torch.nn.Module):
    """A training step's upload: 2 layers, BatchNorm (running stats and a batch count, mutated in place) and a
    1-element parameter (Inductor inlines tensors this small unless told not to). Returns (loss, logits detached)."""

    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(d_in, hidden)
        self.bn = torch.nn.BatchNorm1d(hidden)
        self.l2 = torch.nn.Linear(hidden, d_out)
        self.scale = torch.nn.Parameter(torch.tensor([0.5]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.l2(torch.relu(self.bn(self.l1(x)))) * self.scale
        return torch.nn.functional.mse_loss(out, y), out.detach()


class ShiftedMask(torch.nn.Module):
    """Swin's shifted-window mask in little: slices of a fresh tensor set to Python ints, which export lifts as 0-d
    tensor constants (`lifted_tensor_N`), beside a 0-d parameter and a 0-d buffer, which are weights whatever their
    shape. forward(x) is a model; forward(x, y) a train step's upload, (loss, output detached)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(8, 4)
        self.gain = torch.nn.Parameter(torch.tensor(1.5))
        self.register_buffer("offset", torch.tensor(0.25))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        mask = x.new_zeros(x.shape[0], 4)
        count = 0
        for rows in ((0, 2), (2, None)):
            for cols in ((0, 1), (1, None)):
                mask[rows[0]:rows[1], cols[0]:cols[1]] = count
                count += 1
        out = self.l(x) * self.gain + mask + self.offset
        if y is None:
            return out
        return torch.nn.functional.mse_loss(out, y), out.detach()


class ZeroBiasResidual(torch.nn.Module):
    """GPT-2's residual stream in little: 24 pre-norm MLP blocks, weights N(0, 0.02) and biases zero as HF initialises
    them, a final LayerNorm. Positive moves of every weight build a common offset in the stream that the norms
    subtract again, which in bf16 put eager 5.8 % from float64 (1.2 % unperturbed): the 'does not follow its weights'
    false refusals of GPT-2 and ViT on an H200 (tests/compiler/test_weights.py)."""

    def __init__(self, d: int = 64, n: int = 24) -> None:
        super().__init__()
        self.fc = torch.nn.ModuleList([torch.nn.Linear(d, 4 * d) for _ in range(n)])
        self.proj = torch.nn.ModuleList([torch.nn.Linear(4 * d, d) for _ in range(n)])
        self.norms = torch.nn.ModuleList([torch.nn.LayerNorm(d) for _ in range(n + 1)])
        for lin in [*self.fc, *self.proj]:
            torch.nn.init.normal_(lin.weight, 0.0, 0.02)
            torch.nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc, proj, norm in zip(self.fc, self.proj, self.norms):
            x = x + proj(torch.nn.functional.gelu(fc(norm(x))))
        return self.norms[-1](x)


class DeadPooler(torch.nn.Module):
    """An HF encoder's pooler in little: computed and dropped (only the hidden states are returned), so export keeps
    its ops and weights but Inductor removes them, and no package reads `pool.*`."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.pool = torch.nn.Linear(8, 8)

    def _both(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.body(x)
        return hidden, torch.tanh(self.pool(hidden[:, 0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._both(x)[0]


def export_train(model: torch.nn.Module, args: tuple[Any, ...], path: Path, dynamic_shapes: Any = None) -> Path:
    """Export in training mode (BatchNorm uses the batch's statistics and updates its running ones)."""
    torch.export.save(torch.export.export(model.train(), args, dynamic_shapes=dynamic_shapes), str(path))
    return path


class InvertedResidual(torch.nn.Module):
    """MobileNet's block in little: a 1x1 expansion, a depthwise 3x3 (stride 1 or 2, with a bias or not), a 1x1
    projection, and a residual, with a plain 3x3 stem in front; what options.convolutions="generated" rewrites
    (compiler/convs.py) and what it leaves to the library."""

    def __init__(self, stride: int = 1, bias: bool = False, kernel: int = 3) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.expand = torch.nn.Conv2d(8, 16, 1)
        self.depthwise = torch.nn.Conv2d(16, 16, kernel, stride=stride, padding=kernel // 2, groups=16, bias=bias)
        self.project = torch.nn.Conv2d(16, 8, 1)
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        y = self.project(torch.nn.functional.hardswish(self.depthwise(torch.relu(self.expand(h)))))
        return y + h if self.stride == 1 else y


class MixedConvs(torch.nn.Module):
    """Depthwise convolutions of every kind the rewrite takes, beside ones it must leave: grouped (not depthwise),
    a channel multiplier of 2, a kernel above MAX_TAPS, a plain one and a 1x1."""

    def __init__(self) -> None:
        super().__init__()
        self.taken = torch.nn.ModuleList([
            torch.nn.Conv2d(8, 8, 3, padding=1, groups=8),
            torch.nn.Conv2d(8, 8, 5, stride=2, padding=2, groups=8, bias=False),
            torch.nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=8),
            torch.nn.Conv2d(8, 8, (1, 7), padding=(0, 3), groups=8),
        ])
        self.left = torch.nn.ModuleList([
            torch.nn.Conv2d(8, 8, 3, padding=1, groups=2),
            torch.nn.Conv2d(8, 16, 3, padding=1, groups=8),
            torch.nn.Conv2d(8, 8, 9, padding=4, groups=8),
            torch.nn.Conv2d(8, 8, 3, padding=1),
            torch.nn.Conv2d(8, 8, 1),
        ])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [m(x) for m in self.taken] + [m(x) for m in self.left]


class FloatInputIndex(torch.nn.Module):
    """An index that a float input becomes (`.long()`): the check varied only integer inputs until 2026-11-30, so
    this program compiled as main did (reading wherever the float points) passed it."""

    def forward(self, x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._unsafe_index.Tensor(x, [f.abs().long()])


FLOAT_SPEC = [{"name": "x", "dtype": "float32", "shape": [16, 4]}, {"name": "f", "dtype": "float32", "shape": [8]}]


class MaskedGather(torch.nn.Module):
    """Rows of a table of 12 picked by a running count of the mask the caller sends (what CUDA lowers masked_scatter
    to): until 2026-11-30 the check kept the uploader's random mask (10 set), so a package that reads past the
    table at a mask of 16 set passed it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(12.0))

    def forward(self, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rows = (torch.cumsum(mask.long(), 0) - 1).clamp(min=0)
        return y + torch.ops.aten._unsafe_index.Tensor(self.table, [rows])


MASK_SPEC = [{"name": "y", "dtype": "float32", "shape": [16]}, {"name": "mask", "dtype": "bool", "shape": [16]}]
