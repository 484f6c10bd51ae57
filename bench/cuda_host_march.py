"""Can a CUDA package's host code (AOTInductor's C++ wrapper, built by g++) be pinned to an x86-64 level, the way
CPU packages are (compiler/compat/isa.py)? On a GPU machine: compile one small model for cuda twice with
AOTInductor, as Inductor builds it (-march=native) and pinned (`cpp.march` where this torch has it, else the
wrapped `_get_optimization_cflags`), then read each package (the -march of every g++ line it records, and
AVX-512 registers in its objdump) and run it against eager. Prints a table, writes JSON.

    python bench/cuda_host_march.py --out bench/results/cuda-host-march-h100.json     # needs a CUDA GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

AVX512_REGISTERS = re.compile(r"%zmm\d+|%k[0-7]\b")
COMPILE_LINE = re.compile(r"^// (g\+\+ .*)$", re.M)
PRODUCER = re.compile(rb"GNU C\+\+\d* [\d.]+ ([^\x00]+)")


def read_package(path: Path, tmp: Path) -> dict[str, Any]:
    marches: set[str] = set()
    zmm = 0
    with zipfile.ZipFile(path) as zf:
        for name in zf.namelist():
            if name.endswith(".cpp"):
                for line in COMPILE_LINE.findall(zf.read(name).decode(errors="replace")):
                    marches |= {f for f in line.split() if f.startswith("-march=")}
            elif name.endswith(".so"):
                data = zf.read(name)
                for producer in PRODUCER.findall(data):
                    marches |= {f for f in producer.decode(errors="replace").split() if f.startswith("-march=")}
                if shutil.which("objdump"):
                    so = tmp / Path(name).name
                    so.write_bytes(data)
                    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(so)], capture_output=True,
                                          text=True, check=True).stdout
                    zmm += sum(1 for ln in text.splitlines() if "\t" in ln and AVX512_REGISTERS.search(ln))
    return {"marches": sorted(marches), "avx512_register_lines": zmm if shutil.which("objdump") else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--march", default="x86-64-v3")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import torch

    from compiler.compat.aoti import aoti_load_package
    from compiler.compat.isa import _wrapped_cflags, has_march_config

    if not torch.cuda.is_available():
        raise SystemExit("cuda_host_march.py: needs a CUDA GPU")
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 16)).cuda().eval()
    x = torch.randn(8, 64, device="cuda")
    ep = torch.export.export(model, (x,))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="aotc-host-march-") as tmp_s:
        tmp = Path(tmp_s)
        for pinned in (False, True):
            from torch._inductor import config as inductor_config

            # -g1: the .so records its g++ flags (DW_AT_producer) where this torch has the option
            configs: dict[str, Any] = ({"aot_inductor.enable_line_tables": True}
                                       if hasattr(inductor_config.aot_inductor, "enable_line_tables") else {})
            ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
            if pinned and has_march_config():
                configs["cpp.march"] = args.march
            elif pinned:
                ctx = _wrapped_cflags(args.march)
            out = tmp / f"pkg-{'pinned' if pinned else 'native'}.pt2"
            t0 = time.perf_counter()
            with ctx:
                torch._inductor.aoti_compile_and_package(ep, package_path=str(out), inductor_configs=configs)
            seconds = time.perf_counter() - t0
            fn = aoti_load_package(str(out), "cuda:0")
            with torch.no_grad():
                err = (fn(x) - model(x)).abs().max().item()
            rows.append({"pinned": pinned, "march_asked": args.march if pinned else "native",
                         "via": ("cpp.march" if has_march_config() else "wrapped cflags") if pinned else "-",
                         "compile_s": round(seconds, 1), "max_abs_err": err, **read_package(out, tmp)})
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "rows": rows}
    print(f"torch {result['torch']} on {result['device']}")
    print(f"{'pinned':7s} {'via':15s} {'compile s':>9s} {'max err':>9s} {'zmm lines':>9s}  marches")
    for r in rows:
        print(f"{str(r['pinned']):7s} {r['via']:15s} {r['compile_s']:>9.1f} {r['max_abs_err']:>9.2g} "
              f"{str(r['avx512_register_lines']):>9s}  {' '.join(r['marches']) or '(none recorded)'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
