"""Small models shaped like the real ones users upload (HF-style attention with masks, rotary embeddings, string
keyword arguments, norms, embeddings, data-dependent shapes, grad-mode regions, torchvision's dashed block names),
for the tests that show the upload checks refuse none of them. `python tests/realistic.py DIR LAYERS` exports
bigger ones to measure model.json."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.export import Dim


class Attention(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        q = q * cos + torch.cat([-q[..., q.shape[-1] // 2:], q[..., : q.shape[-1] // 2]], -1) * sin  # rotary
        k = k * cos + torch.cat([-k[..., k.shape[-1] // 2:], k[..., : k.shape[-1] // 2]], -1) * sin
        keep = (mask[:, None, None, :] > 0) & torch.ones(t, t, dtype=torch.bool).tril()  # HF-style causal mask
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        y = F.softmax(scores, dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask, cos, sin)
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class TinyLM(torch.nn.Module):
    """Decoder with token and position handling, rotary attention, padding and causal masks, tied head."""

    def __init__(self, vocab: int = 100, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d)
        inv = 1.0 / (10000 ** (torch.arange(0, d // heads, 2).float() / (d // heads)))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        pos = torch.arange(t, dtype=torch.float32)
        ang = torch.outer(pos, self.inv_freq)
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        x = self.emb(input_ids)
        for blk in self.blocks:
            x = blk(x, attention_mask, cos, sin)
        return self.norm(x) @ self.emb.weight.T


class Kwargs(torch.nn.Module):
    """Ops that take string arguments and reductions that name their mode."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 4, 3, padding=1, padding_mode="reflect")
        self.gn = torch.nn.GroupNorm(2, 4)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.gn(self.conv(x))
        floor = torch.div(idx, 2, rounding_mode="floor")
        trunc = torch.div(x, 3.0, rounding_mode="trunc")
        g = F.gelu(y, approximate="tanh") + F.gelu(y)
        red = torch.zeros(4).scatter_reduce(0, idx.clamp(0, 3), x[0, 0, :4], reduce="mean", include_self=False)
        e = torch.einsum("bij,bjk->bik", x, x.transpose(1, 2))
        up = F.interpolate(x, scale_factor=2.0, mode="linear", align_corners=False)
        p = F.pad(x, (1, 1), mode="replicate")
        s = torch.searchsorted(torch.arange(8.0), x[0, 0], side="right")
        return g, floor, trunc, red, e, up, p, s


class DataDependent(torch.nn.Module):
    """nonzero and .item(): export adds _assert_scalar nodes with torch's own quoted messages."""

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = n.sum().item()
        torch._check(k >= 0)
        torch._check(k <= 16)
        return x.nonzero().float().sum() + torch.ones(k).sum(), x.to(torch.bfloat16).float()


class Assert(torch.nn.Module):
    def __init__(self, message: str = "all tokens must be in range") -> None:
        super().__init__()
        self.message = message

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._assert_async(x.sum() > -1e9, self.message)
        return x * 2


class Rotary(torch.nn.Module):
    """HF Llama's and Qwen2's rotary embedding: a `torch.no_grad()` region with autocast turned off, which export
    keeps as higher-order ops (wrap_with_set_grad_enabled, wrap_with_autocast) whose positional arguments have the
    name ''."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device).float()
        with torch.autocast(device_type=x.device.type, enabled=False):
            freqs = torch.outer(pos, self.inv_freq.float())
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype)


class Regions(torch.nn.Module):
    """Grad-mode regions and module paths with '-': torchvision's RegNet names its blocks 'block1-0'."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.rotary = Rotary(d)
        self.trunk = torch.nn.Sequential()
        for i in range(2):
            self.trunk.add_module(f"block1-{i}", torch.nn.Linear(d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trunk(x) * self.rotary(x)


def export_realistic(d: Path, layers: int = 2, d_model: int = 32) -> dict[str, Path]:
    torch.manual_seed(0)
    b, t = Dim("batch", min=1, max=16), Dim("seq", min=2, max=128)
    out = {}
    for name, model, args, dyn in [
        ("lm", TinyLM(d=d_model, layers=layers), (torch.randint(0, 100, (2, 8)), torch.ones(2, 8, dtype=torch.int64)),
         {"input_ids": {0: b, 1: t}, "attention_mask": {0: b, 1: t}}),
        ("kwargs", Kwargs(), (torch.randn(2, 4, 8), torch.tensor([1, 5, 2, 7])), None),
        ("data_dependent", DataDependent(), (torch.randn(4), torch.tensor([3])), None),
        ("assert", Assert(), (torch.randn(3),), None),
        ("regions", Regions(), (torch.randn(2, 8, 16),), None),
    ]:
        ep: Any = torch.export.export(model.eval(), args, dynamic_shapes=dyn)
        path = d / f"{name}.pt2"
        torch.export.save(ep, str(path))
        out[name] = path
    return out


if __name__ == "__main__":
    export_realistic(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 32)
