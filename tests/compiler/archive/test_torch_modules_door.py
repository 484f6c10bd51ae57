"""PyTorch's own building blocks through the door: each exported as a user would, then checked as an upload
(inspect_archive) and loaded by the worker's loader (load_program), where it must give what the exported program
gives. A sweep of these on 2026-11-30 found the door refusing nn.TransformerEncoder with a padding mask (its -inf,
written as the string "-Infinity"); the zoo of 84 models has none of them in that form."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from compiler.archive.inspect import inspect_archive
from compiler.loading import load_program

B, T, D = 2, 8, 16
PAD = torch.tensor([[False] * 6 + [True] * 2] * B)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.m = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, 2, 32, batch_first=True), 2)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.m(x, src_key_padding_mask=pad)


class Causal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.m = nn.Transformer(D, 2, 1, 1, 32, batch_first=True)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(b.shape[1])
        return self.m(a, b, tgt_mask=mask, tgt_is_causal=True)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.m = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.m(x, x, x, key_padding_mask=pad)[0] + F.scaled_dot_product_attention(x, x, x, is_causal=True)


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(D, D, 2, batch_first=True, bidirectional=True)
        self.gru = nn.GRU(2 * D, D, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(self.lstm(x)[0])[0]


class Bags(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(100, D, mode="max")
        self.emb = nn.Embedding(100, D, padding_idx=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.bag(ids) + self.emb(ids).sum(1)


class Vision(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(4, 4, 3, stride=2)
        self.norm = nn.GroupNorm(2, 4)
        self.shuffle = nn.PixelShuffle(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.interpolate(x, scale_factor=2.0, mode="bilinear").amax(dim=(2, 3))
        y = y + F.grid_sample(x, torch.zeros(x.shape[0], 4, 4, 2), align_corners=False).mean()
        return y + self.shuffle(self.norm(self.up(x))).mean() + F.max_pool2d(x, 2, ceil_mode=True).mean()


class Losses(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(x, y, label_smoothing=0.1) + F.nll_loss(F.log_softmax(x, -1), y)


class NonFinite(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nan_to_num(x.log(), nan=0.0, neginf=-1e4) + x.clamp(min=float("-inf"), max=float("inf"))


MODULES: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Any, ...]]]] = {
    "transformer_encoder_padded": (Encoder, lambda: (torch.randn(B, T, D), PAD)),
    "transformer_causal": (Causal, lambda: (torch.randn(B, T, D), torch.randn(B, T, D))),
    "attention_padded_and_causal": (Attention, lambda: (torch.randn(B, T, D), PAD)),
    "lstm_gru": (Recurrent, lambda: (torch.randn(B, T, D),)),
    "embedding_bags": (Bags, lambda: (torch.randint(0, 100, (B, 5)),)),
    "vision_ops": (Vision, lambda: (torch.randn(B, 4, 8, 8),)),
    "losses_with_ignore_index": (Losses, lambda: (torch.randn(4, 10), torch.tensor([1, -100, 3, 9]))),
    "non_finite_arguments": (NonFinite, lambda: (torch.rand(4, 4),)),
}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_pytorchs_own_modules_pass_the_door_and_load(name: str, tmp_path: Path) -> None:
    make, example = MODULES[name]
    torch.manual_seed(0)
    module, args = make().eval(), example()
    with torch.no_grad():
        ep = torch.export.export(module, args)
    path = tmp_path / f"{name}.pt2"
    torch.export.save(ep, str(path))
    info = inspect_archive(str(path))
    assert len(info["inputs"]) == len(args), info["inputs"]
    loaded = load_program(str(path))
    # Against the exported program, not the module: eager's nn.TransformerEncoder takes a fast path export does not.
    with torch.no_grad():
        torch.testing.assert_close(loaded.module()(*args), ep.module()(*args), equal_nan=True)
