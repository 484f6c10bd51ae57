"""A fleet scenario by name on this machine: one model name, every CPU ISA level plus a CUDA target in one request,
two tags, a tag move; then what `aotc pull bert-base:prod` picks, and why, on this host and on others.

It starts `aotc-server` (an embedded Redis and one CPU worker) with its own data dir on free ports and drives it
with the `aotc` CLI, as a user would. Each step's command, exit status and output are printed and written to the
JSON. The worker builds only its own target; a target no live worker serves is reported per target and does not
fail the others. Two real compiles (two versions of a small MLP), a few minutes on 2 cores.

    python bench/fleet.py --out bench/results/fleet-2cores.json
    python bench/fleet.py --targets all,cuda-sm90 --out ...                      # every level the farm serves
    python bench/fleet.py --device cuda:0 --targets cuda,cuda-sm80 --other-hosts cpu-x86_64-v3 \
        --out bench/results/fleet-h100.json                        # a GPU: compiled for cuda, pulled by tag there
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DEFAULT_TARGETS = "cpu-x86_64-v2,cpu-x86_64-v3,cpu-x86_64-v4,cuda-sm90"


def export_model(path: Path, seed: int) -> Path:
    import torch

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.net(x), dim=-1)

    torch.manual_seed(seed)
    batch = torch.export.Dim("batch", min=1, max=32)
    ep = torch.export.export(Head().eval(), (torch.randn(4, 64),), dynamic_shapes={"x": {0: batch}})
    torch.export.save(ep, str(path))
    return path


def load_by_tag(url: str, ref: str, program: Path, device: str) -> dict[str, Any]:
    """Client.load(ref) on this machine, run against the exported program run eagerly on the same device."""
    import logging

    import torch

    from client import Client

    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    x = torch.randn(8, 64, device=device)
    with Client(url) as c:
        picked = c.pick(ref, {"x": [8, 64]}, device=device)
        t0 = time.perf_counter()
        fn = c.load(ref, shapes={"x": [8, 64]}, device=device)
        load_s = time.perf_counter() - t0
    with torch.no_grad():
        err = (fn(x) - torch.export.load(str(program)).module().to(device)(x)).abs().max().item()
    out = {"ref": ref, "device": device, "host": picked["host"], "key": picked["key"], "target": picked["target"],
           "match": picked["match"], "reason": picked["reason"], "load_s": round(load_s, 2), "max_abs_err": err}
    print(f"Client.load({ref!r}, device={device!r}): {out}\n", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default=DEFAULT_TARGETS, help="comma-separated, all in one request")
    ap.add_argument("--name", default="bert-base")
    ap.add_argument("--device", default="cpu", help="the local worker's device, and the one pulled for")
    ap.add_argument("--other-hosts", default="cpu-x86_64-v3,cuda-sm90", help="comma-separated hosts to pick for")
    ap.add_argument("--out", type=Path, required=True, help="JSON results")
    args = ap.parse_args()

    from service.store.embedded import free_port

    steps: list[dict[str, Any]] = []
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
                               "loadavg_before": os.getloadavg(), "targets": args.targets.split(","), "steps": steps}
    with tempfile.TemporaryDirectory(prefix="aotc-fleet-") as tmp_s:
        tmp = Path(tmp_s)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**{k: v for k, v in os.environ.items() if k not in ("AOTC_REDIS_URL", "AOTC_ADMIN_KEY")},
               "AOTC_DATA_DIR": str(tmp / "data"), "AOTC_URL": url,
               # this tree first, then the caller's path (wheels installed with --target, as on a GPU host)
               "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
               "AOTC_HEADERS_DIR": os.environ.get("AOTC_HEADERS_DIR", str(ROOT / ".aotc" / "test-headers"))}
        log = tmp / "server.log"
        server = subprocess.Popen([sys.executable, "-m", "service", "--port", str(port), "--device", args.device,
                                   "--log-level", "warning"], env=env, cwd=ROOT, stdout=open(log, "wb"),
                                  stderr=subprocess.STDOUT)

        def aotc(*cli: str) -> dict[str, Any]:
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "client.cli", *cli], env=env, cwd=tmp, capture_output=True,
                                  text=True, timeout=900)
            step = {"command": "aotc " + " ".join(cli), "exit": done.returncode, "seconds":
                    round(time.perf_counter() - t0, 1), "stderr": done.stderr, "stdout": done.stdout}
            steps.append(step)
            print(f"$ {step['command']}\n{done.stderr}{done.stdout}(exit {done.returncode}, {step['seconds']} s)\n",
                  flush=True)
            return step

        try:
            import httpx

            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:  # the API, and a worker serving a target
                try:
                    ready = httpx.get(f"{url}/readyz", timeout=2)
                    if ready.status_code == 200 and ready.json().get("targets"):
                        break
                except httpx.TransportError:
                    pass
                if server.poll() is not None:
                    raise RuntimeError(log.read_text()[-3000:])
                time.sleep(0.5)
            results["worker_targets"] = httpx.get(f"{url}/readyz", timeout=2).json().get("targets")
            v1, v2 = export_model(tmp / "bert-v1.pt2", 1), export_model(tmp / "bert-v2.pt2", 2)
            target_args = [a for t in args.targets.split(",") for a in ("--target", t)]
            shape = ["--shape", "x=1..32x64"]
            aotc("compile", str(v1), *shape, *target_args, "--name", args.name, "--tag", "prod")
            aotc("compile", str(v2), *shape, *target_args, "--name", args.name, "--tag", "canary")
            aotc("versions", args.name)
            aotc("tag", f"{args.name}@2", "prod")
            aotc("versions", args.name)
            aotc("versions", args.name, "--history")
            aotc("pull", f"{args.name}:prod", "--shape", "x=8x64", "--device", args.device)
            results["load"] = load_by_tag(url, f"{args.name}:prod", v2, args.device)
            for other in args.other_hosts.split(","):  # what a host of another kind would be told
                aotc("pull", f"{args.name}:prod", "--shape", "x=8x64", "--target", other)

            def call(method: str, path: str, **kw: Any) -> None:  # the API's own answers, for docs/api.md
                r = httpx.request(method, f"{url}{path}", timeout=30, **kw)
                calls.append({"request": f"{method} {path}", "body": kw.get("json"), "status": r.status_code,
                              "answer": r.json()})
                print(f"{method} {path} {json.dumps(kw['json']) if 'json' in kw else ''}\n{r.status_code} "
                      f"{r.text}\n", flush=True)

            calls: list[dict[str, Any]] = []
            results["api"] = calls
            model_id = httpx.get(f"{url}/v1/refs/{args.name}@1", timeout=30).json()["model_id"]
            call("POST", "/v1/compilations", json={"model_id": model_id[:12], "shapes": {"x": "1..32x64"},
                                                   "targets": args.targets.split(",")})
            call("GET", f"/v1/refs/{args.name}:prod")
            call("GET", f"/v1/refs/{args.name}:prod/pick", params={"host": "cpu-x86_64-avx512", "shape": "x=8x64"})
            call("GET", f"/v1/refs/{args.name}:prod/pick", params={"host": "cuda-sm90", "shape": "x=8x64"})
            call("PUT", f"/v1/names/{args.name}/tags/canary", json={"version": 1})
            call("DELETE", f"/v1/names/{args.name}/tags/canary")
            call("GET", f"/v1/names/{args.name}/history")
            call("GET", "/v1/names")
        finally:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    results["loadavg_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"{'step':60s} {'exit':>4s} {'seconds':>8s}")
    for s in steps:
        print(f"{s['command'][:60]:60s} {s['exit']:>4d} {s['seconds']:>8.1f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
