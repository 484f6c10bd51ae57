"""Why the training check starts each step from eager's weights (compiler/traincheck.py, issue 23).

Two correct implementations of one train step in bf16 (eager's kernels and a package's) differ by rounding. When
each updates its own weights with its own gradients, a deep network amplifies that difference step after step, and
the check then compares two models, not two implementations of one step. This script shows it without a compiler:
"eager" is a ResNet-18 (written here: no torchvision) under bf16 autocast; the "package" is the same network in
float32, whose gradients are MORE accurate than eager's. Per step: each side's distance from a float64 run of
eager's weights, in the largest element of the logits and of the worst gradient (relative to the largest element),
for the package on its own trajectory (the check before) and started from eager's weights (the check now), and
compiler.fp64.judge's verdict on each.

    python bench/train_drift.py --out bench/results/train-drift-cpu.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compiler import fp64  # noqa: E402


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.short: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.short(x))


class ResNet18(nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, c = [], 64
        for cout, stride in [(64, 1), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1)]:
            blocks.append(Block(c, cout, stride))
            c = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.fc(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1)).float()
        return F.cross_entropy(z, y), z


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, amp: bool) -> tuple[torch.Tensor, dict[str, Any]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss, z = model(x, y)
    loss.backward()
    return z.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def verdict(pkg: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    scale = max(float(ref.abs().max()), 1e-30)
    j = fp64.judge(pkg, eager, ref, scale, 0.05)  # bf16's tolerance
    return {"package": round(j["package"], 5), "eager": round(j["eager"], 5), "ok": j["ok"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--res", type=int, default=112)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.05, help="the training check's (compiler.traincheck.LR)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    eager = ResNet18()
    own = copy.deepcopy(eager)  # the package on its own trajectory
    rows = []
    t0 = time.perf_counter()
    for k in range(a.steps):
        g = torch.Generator().manual_seed(k)
        x, y = torch.randn(a.batch, 3, a.res, a.res, generator=g), torch.randint(0, 1000, (a.batch,), generator=g)
        ref = copy.deepcopy(eager).double()
        ref_z, ref_g = step(ref, x.double(), y, False)
        z_e, g_e = step(eager, x, y, True)
        z_own, g_own = step(own, x, y, False)
        z_sync, g_sync = step(copy.deepcopy(eager), x, y, False)  # from eager's weights: the check now

        def worst(grads: dict[str, torch.Tensor]) -> dict[str, Any]:
            judged = {n: verdict(grads[n], g_e[n], ref_g[n]) for n in ref_g}
            name = max(judged, key=lambda n: judged[n]["package"] / max(judged[n]["eager"], 1e-12))
            return {"param": name, **judged[name], "all_ok": all(j["ok"] for j in judged.values())}

        rows.append({"step": k + 1,
                     "logits": {"own": verdict(z_own, z_e, ref_z), "synced": verdict(z_sync, z_e, ref_z)},
                     "grads": {"own": worst(g_own), "synced": worst(g_sync)}})
        with torch.no_grad():
            for n, p in eager.named_parameters():
                p.sub_(a.lr * g_e[n])
            for n, p in own.named_parameters():
                p.sub_(a.lr * g_own[n])
    print("logits' distance from float64 (of eager's weights): eager in bf16; the float32 package on its own weights")
    print("(own) and from eager's (synced); the gradient the package on its own weights is worst at, eager / package")
    print(f"{'step':>4}  {'eager':>8}  {'own':>8} {'':4}  {'synced':>8} {'':4}  worst gradient")
    for r in rows:
        lo, ls, go = r["logits"]["own"], r["logits"]["synced"], r["grads"]["own"]
        print(f"{r['step']:>4}  {lo['eager']:>8.4f}  {lo['package']:>8.4f} {'ok' if lo['ok'] else 'FAIL':4}  "
              f"{ls['package']:>8.4f} {'ok' if ls['ok'] else 'FAIL':4}  {go['param']}: {go['eager']:.4f} / "
              f"{go['package']:.4f} {'ok' if go['all_ok'] else 'FAIL'}; synced: "
              f"{'ok' if r['grads']['synced']['all_ok'] else 'FAIL'}")
    result = {"torch": torch.__version__, "batch": a.batch, "res": a.res, "lr": a.lr,
              "threads": torch.get_num_threads(),
              "seconds": round(time.perf_counter() - t0, 1), "rows": rows}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
