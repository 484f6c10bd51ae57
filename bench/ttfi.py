"""Time to first inference, split into its parts, each run in a fresh process: `import torch` (apart), then what
the client's own start (`client_s`: `from client import Client`, the Client, the artifact's record fetched), then
what `Client.load(..., timings=...)` reports: verify (manifest, signature, the cached copy's check), pull (the download,
hashed as it streams), bind (the device: the target check, which initialises CUDA on a GPU), weights (a weightless
package's blob: pulled, verified, onto the device), load (the package opened) and the first call (synchronised on a
GPU). Prints a table of medians, writes JSON.

    python bench/ttfi.py --out bench/results/ttfi-cpu.json              # CPU: a service of its own, one worker,
                                                                        # one 64 MB MLP compiled, 5 rounds
    # GPU (the lead): zoo models compiled by a service of its own, plain and with CUDA graphs
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6 python bench/ttfi.py --device cuda:0 --graphs \\
        --zoo mobilenet_v3_large,efficientnet_b0,timm_convnext_small,hf_bert_large --out bench/results/ttfi-h100.json
    python bench/ttfi.py --url http://127.0.0.1:8000 --keys KEY1,KEY2 --device cuda:0 ...   # a running service
    python bench/ttfi.py --pulls default,ranges-8,sha256 ...   # how each process pulls, alternating (PULLS)

Each round runs, per artifact, a `cold` process (an empty client cache: the whole pull) and a `warm` one (the cache
the cold one left: its verified record checked, nothing downloaded or hashed). With --graphs each also runs with
`cuda_graphs=True`. `ttfi_s` is the sum of the parts after import (the process's own start-up and `import torch`
are in `import_s`, apart); `wall_s` is the child's whole life as this script saw it. Runs before 2026-11-29 left
`client_s` out of `ttfi_s` (and did not record it): about 0.3 s on the 2-core box, mostly the client's imports.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PARTS = ("client_s", "verify_s", "pull_s", "bind_s", "weights_s", "load_s", "first_call_s")
# Within weights_pull_s, where the blob went onto a GPU as it arrived: compiler.weights.Follower.seconds (0 otherwise).
FOLLOW = ("follow_setup_s", "follow_waiting_s", "follow_reading_s", "follow_buffers_s")


def child(url: str, key: str, device: str, graphs: bool, cache: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    import torch

    out: dict[str, Any] = {"import_s": time.perf_counter() - t0, "started_s": t0 - T_START}
    t1 = time.perf_counter()
    from client import Client

    out["client_import_s"] = time.perf_counter() - t1  # within client_s
    # Whether the client came from bytecode, as an installed one does (bench/device_env.sh compiles it; before
    # 2026-11-30's last session a GPU host's runs compiled it from source in every process).
    import importlib.util

    import client

    out["client_bytecode"] = os.path.exists(importlib.util.cache_from_source(client.__file__))
    timings: dict[str, float] = {}
    with Client(url, cache_dir=cache, timeout=600) as c:
        t2 = time.perf_counter()
        art = c.artifact(key)
        out["client_record_s"] = time.perf_counter() - t2  # within client_s: the artifact's record over HTTP
        timings["client_s"] = time.perf_counter() - t1  # what a server does before it can ask for the package
        fn = c.load(art, device, cuda_graphs=graphs, timings=timings)
    inputs = []
    for spec in art.meta.get("spec", []):
        shape = [d if isinstance(d, int) else max(1, int(d.get("min") or 1)) for d in spec["shape"]]
        dtype = getattr(torch, str(spec["dtype"]))
        inputs.append(torch.randn(shape, dtype=dtype, device=device) if dtype.is_floating_point
                      else torch.zeros(shape, dtype=dtype, device=device))
    with torch.inference_mode():
        fn(*inputs)
    out.update({p: timings.get(p, 0.0) for p in PARTS})  # weights_s: 0 for a package that carries its weights
    out["weights_pull_s"] = timings.get("weights_pull_s", 0.0)  # within weights_s: the blob's download and hash
    out["weights_load_s"] = timings.get("weights_load_s", 0.0)  # within weights_s: the blob onto the device
    # Within the blob's pull, where it went onto the GPU as it arrived (compiler.weights.Follower.seconds).
    out.update({k: v for k, v in timings.items() if k.startswith("follow_")})
    out["ttfi_s"] = sum(out[p] for p in PARTS)
    out["size_bytes"] = int(art.meta.get("size") or 0)
    return out


# --pulls: how a process pulls and binds (its environment): the default (BLAKE3 where signed, one stream, the
# weights onto a GPU in pinned chunks), eight ranges at once (BLAKE3 over the whole file after), sha256, and
# `copy-tensors` (the weights onto the GPU one pageable copy per tensor, as before 2026-11-30's last session). (In
# the run of 2026-11-30 `default` was eight ranges, then AOTC_PULL_STREAMS=auto on 16 cores, and `blake3-1` one
# stream: bench/README.md.)
PULLS = {"default": {}, "ranges-8": {"AOTC_PULL_STREAMS": "8"}, "sha256": {"AOTC_PULL_DIGEST": "sha256"},
         "copy-tensors": {"AOTC_WEIGHTS_COPY": "tensors"}}


def _run_child(url: str, key: str, device: str, graphs: bool, cache: Path, pull: str = "default") -> dict[str, Any]:
    """One fresh process's TTFI; `pull`: how it pulls (PULLS)."""
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "AOTC_PULL_DIGEST": "", "AOTC_PULL_STREAMS": "1",
           "AOTC_WEIGHTS_COPY": "", **PULLS[pull]}
    p = subprocess.run([sys.executable, __file__, "--child", url, key, device, "1" if graphs else "0", str(cache)],
                       capture_output=True, text=True, timeout=900, env=env)
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout)[-2000:]}
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out


def _pythonpath() -> str:
    """This tree first, then whatever the caller's path had (wheels installed with --target, as on a GPU host)."""
    return os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])


def start_service(base: Path, device: str) -> tuple[str, list[subprocess.Popen[bytes]], Any]:
    """Embedded Redis, the API and one worker on `device`; returns the URL once the worker has registered."""
    import httpx

    from service.store.embedded import EmbeddedRedis, free_port

    redis_srv = EmbeddedRedis(base / "redis").start()
    port = free_port()
    env = {**os.environ, "AOTC_REDIS_URL": redis_srv.url, "AOTC_DATA_DIR": str(base), "AOTC_DEVICE": device,
           "AOTC_WORK_DIR": str(base / "work"), "AOTC_COMPILE_TIMEOUT_S": "1800",
           "AOTC_CHILD_LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
           "PYTHONPATH": _pythonpath()}
    log = open(base / "serve.log", "ab")
    procs = [subprocess.Popen([sys.executable, "-m", "uvicorn", "service.api.app:create_app", "--factory", "--port",
                               str(port), "--log-level", "warning"], env=env, stdout=log, stderr=subprocess.STDOUT,
                              cwd=ROOT),
             subprocess.Popen([sys.executable, "-m", "worker"], env=env, stdout=log, stderr=subprocess.STDOUT,
                              cwd=ROOT)]
    url = f"http://127.0.0.1:{port}"
    headers = {"authorization": f"Bearer {os.environ['AOTC_API_KEY']}"} if os.environ.get("AOTC_API_KEY") else {}
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/v1/workers", timeout=2, headers=headers)
            if r.status_code == 200 and r.json()["workers"]:
                return url, procs, redis_srv
        except httpx.TransportError:
            pass
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"the service exited: {(base / 'serve.log').read_text()[-3000:]}")
        time.sleep(0.5)
    raise RuntimeError("the service did not come up with its worker")


def compile_models(url: str, names: list[str], device: str, records: dict[str, Any],
                   given: list[str], hidden: int = 2048) -> dict[str, str]:
    """Compile each model (for `mlp` an MLP of four `hidden`-wide layers, 64 MB at 2048, else bench/zoo.py's at its
    serving batch) with the compile options
    `given` (`--option [MODEL:]KEY=JSON`); {name: key}. What each record says of its timing pass and speed goes into
    `records`."""
    import torch

    from bench.train import options_for
    from client import Client

    keys = {}
    with Client(url, timeout=600) as c:
        for name in names:
            if name == "mlp":
                model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU())
                                              for _ in range(4)]).eval()
                inputs: tuple[Any, ...] = (torch.randn(8, hidden),)
            else:
                from bench.zoo import build

                model, inputs = build(name, device=device)
            target = "cpu" if device == "cpu" else "cuda"
            t0 = time.perf_counter()
            options = options_for(name, given)
            art = c.compile(model, inputs, target=target, timeout=1800, **options)
            assert not isinstance(art, tuple)
            print(f"{name}: compiled in {time.perf_counter() - t0:.0f} s, {art.meta.get('size', 0) / 1e6:.0f} MB",
                  file=sys.stderr, flush=True)
            keys[name] = art.key
            check = art.meta.get("check") or {}
            records[name] = {"key": art.key, "compile_s": round(time.perf_counter() - t0, 1),
                             "speed": art.meta.get("speed"), "timing": check.get("timing"),
                             "check_host": check.get("host"), "timings": art.meta.get("timings"),
                             "graphs": check.get("graphs"), "options": options}
    return keys


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        url, key, device, graphs, cache = sys.argv[2:7]
        print(json.dumps(child(url, key, device, graphs == "1", cache)))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--zoo", default="mlp", help="Models to compile: 'mlp' (64 MB, any device) or bench/zoo.py names.")
    ap.add_argument("--url", help="A running service: measure --keys there instead of compiling.")
    ap.add_argument("--keys", default="", help="With --url: artifact keys, comma-separated (name=key also works).")
    ap.add_argument("--graphs", action="store_true", help="Also load with cuda_graphs=True (a GPU).")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--option", action="append", default=[], metavar="[MODEL:]KEY=JSON",
                    help="A compile option for every model, or MODEL's only, e.g. convolutions=generated.")
    ap.add_argument("--mlp-hidden", type=int, default=2048, help="The width of `mlp`'s layers (7168: 822 MB).")
    ap.add_argument("--pulls", default="default",
                    help=f"Comma-separated ways to pull, alternating: {', '.join(PULLS)}.")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ttfi.json")
    args = ap.parse_args()
    pulls = args.pulls.split(",")
    base = Path(tempfile.mkdtemp(prefix="aotc-ttfi-"))
    procs: list[subprocess.Popen[bytes]] = []
    redis_srv = None
    records: dict[str, Any] = {}
    try:
        if args.url:
            url = args.url
            keys = dict(k.split("=", 1) if "=" in k else (k, k) for k in args.keys.split(",") if k)
        else:
            url, procs, redis_srv = start_service(base, args.device)
            keys = compile_models(url, args.zoo.split(","), args.device, records, args.option, args.mlp_hidden)
        runs: dict[str, list[dict[str, Any]]] = {}
        for r in range(args.rounds):
            for name, key in keys.items():
                for graphs in (False, True) if args.graphs else (False,):
                    for pull in pulls[r % len(pulls):] + pulls[:r % len(pulls)]:
                        cache = base / f"cache-{key}-{int(graphs)}"
                        shutil.rmtree(cache, ignore_errors=True)
                        for mode in ("cold", "warm"):  # warm: the cache the cold process left
                            row = _run_child(url, key, args.device, graphs, cache, pull)
                            how = "graphs" if graphs else "plain"
                            runs.setdefault(f"{name}|{how}|{mode}|{pull}", []).append(row)
                            print(f"round {r + 1} {name} {how} {mode} {pull}: "
                                  f"{row.get('ttfi_s', row.get('error', '')[-300:])}", file=sys.stderr, flush=True)
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
        if redis_srv is not None:
            redis_srv.stop()
    rows = []
    for label, got in runs.items():
        name, how, mode, pull = label.split("|")
        ok = [g for g in got if "error" not in g]
        row: dict[str, Any] = {"model": name, "how": how, "cache": mode, "pull": pull, "runs": len(got),
                               "errors": len(got) - len(ok),
                               "size_mb": round(ok[0]["size_bytes"] / 1e6, 1) if ok else None,
                               "client_bytecode": all(g.get("client_bytecode") for g in ok) if ok else None}
        for part in ("import_s", "client_import_s", "client_record_s", *PARTS, "weights_pull_s", "weights_load_s",
                     *FOLLOW, "ttfi_s", "wall_s"):
            row[part] = round(statistics.median(g.get(part, 0.0) for g in ok), 4) if ok else None
        if not ok:
            row["error"] = got[-1]["error"]
        rows.append(row)
    head = ("model", "how", "cache", "pull", "MB", "import s", "client s", "verify s", "pull s", "bind s",
            "weights s", "(blob pull s)", "(blob load s)", "load s", "first call s", "TTFI s", "errors")
    table = [head] + [(r["model"], r["how"], r["cache"], r["pull"], r["size_mb"], r["import_s"], r["client_s"],
                       r["verify_s"], r["pull_s"], r["bind_s"], r["weights_s"], r["weights_pull_s"],
                       r["weights_load_s"], r["load_s"], r["first_call_s"], r["ttfi_s"], r["errors"]) for r in rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
    for line in table:
        print("  ".join(str(v).rjust(w) if i > 3 else str(v).ljust(w) for i, (v, w) in enumerate(zip(line, widths))))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_avg": os.getloadavg()},
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "device": args.device, "rounds": args.rounds,
        "options": args.option, "pulls": pulls, "rows": rows, "artifacts": records, "runs": runs}, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
