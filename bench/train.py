"""Training ahead of time (issue 23): which models make a train-step package, and what one buys, in one run.

For each model: wrap it with a loss (vision: cross-entropy on random labels; text: cross-entropy of a linear head
over the mean hidden state) and queue it, all at once, as mode=training on a service of its own (`--workers`
compile workers). Record whether a checked, signed train-step package came back, or the exact reason it did not.
Once every job has ended, the workers stop (a quiet device) and each package is timed, each part in a fresh process:

  step_ms    one training step (forward + backward, gradients set; no optimizer step, the same for all), median:
             eager and the aotc package (Client.load_training, bound to a live copy of the module) in one process;
             torch.compile (default; `--max-autotune` adds mode="max-autotune") in its cold process, after its first
             step. On CUDA by CUDA events (compiler.check.measure)
  ttfs_s     time to first step in a FRESH process: import, pull (verified), load, bind, first step (aotc) against
             import, torch.compile and the first step with an empty Inductor cache (cold). Building the module is
             timed apart (`build_s`), outside both. With `--cpp`, also from C++ (`ttfs_cpp`): examples/cpp's
             aotc_run in a fresh process (no Python: libtorch's load, the signature and digests verified, load,
             bind, one step, the stepped weights written), plus the verified pull (`with_pull_s`, the table's)
  grad_err   the training check's worst relative error over 3 SGD steps (package vs eager, same autocast), and the
             package's gradients against fp32 eager's (no autocast) at one batch

`--coverage` names more models that are only packaged and checked (after the timings, the workers back on). The JSON
is rewritten after each model, and a rerun with `--append` skips the models it has finished (a GPU call cut off).

    python bench/train.py --cpp --out bench/results/train-cpu.json            # CPU: tiny models, a few minutes
    # GPU (torch 2.11):
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6 python bench/train.py --device cuda --amp bf16 --batch 32 \\
        --workers 4 --zoo resnet50,mobilenet_v3_large,efficientnet_b0,convnext_tiny,timm_vit_small_patch16_224,\\
        hf_distilbert,hf_bert_base,hf_gpt2 --base /tmp/aotc-train-gpu --append --out bench/results/train-h100.json

Prints a table, writes JSON.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import copy  # noqa: E402
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
sys.path.insert(0, str(ROOT / "tests"))

TINY = ("train_mlp", "conv_bn", "mlp_deep")


def autocast(device: str, amp: str) -> Any:
    import contextlib

    import torch

    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast("cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16)


def eager_step(model: Any, args: tuple[Any, ...], device: str, amp: str) -> Any:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        with autocast(device, amp):
            loss, _ = model(*args)
        loss.backward()
    return step


# -- the fresh processes -------------------------------------------------------------------------------------------


def _built(name: str, batch: int, device: str, out: dict[str, Any]) -> tuple[Any, Any]:
    """The model and its batch, the time it took in out["build_s"] (apart from the time to first step)."""
    t1 = time.perf_counter()
    from bench.trainmodels import build

    built = build(name, batch, device)
    out["build_s"] = time.perf_counter() - t1
    return built


def child_aotc(url: str, key: str, name: str, batch: int, device: str, cache: str) -> dict[str, Any]:
    """Time to first step of the package: import, pull (verified), load, bind, first step."""
    t0 = time.perf_counter()
    import torch

    from client import Client

    out: dict[str, Any] = {"import_s": time.perf_counter() - t0}
    model, args = _built(name, batch, device, out)
    t2 = time.perf_counter()
    with Client(url, cache_dir=cache, timeout=600) as c:
        step = c.load_training(key, model, device)
    out["load_s"] = time.perf_counter() - t2
    t3 = time.perf_counter()
    loss, _ = step(*args)
    float(loss)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    out["first_step_s"] = time.perf_counter() - t3
    out["ttfs_s"] = out["import_s"] + out["load_s"] + out["first_step_s"]
    return out


def child_cppfiles(url: str, key: str, name: str, batch: int, dest: str) -> dict[str, Any]:
    """What examples/cpp's aotc_run reads, on disk before it is timed: the package and its weights blob pulled
    (verified, `pull_s`), the signed manifest, the service's signing keys and the signer's key pinned
    (tests/cppbuild.py, as the C++ tests save them), and the batch as in.pt. A deployer's own download (curl,
    `aotc pull`) stands for the pull; the C++ process verifies again."""
    import torch

    from client import Client
    from cppbuild import save_verification

    d = Path(dest)
    d.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    _, args = _built(name, batch, "cpu", out)
    torch.save([t.cpu() for t in args], d / "in.pt")
    t0 = time.perf_counter()
    with Client(url, cache_dir=d / "cache", timeout=600) as c:
        package = c.pull(key, d / "step.pt2")
        blob = c.pull_weights(key)
    out["pull_s"] = time.perf_counter() - t0
    manifest, signing_keys, trusted_key, _ = save_verification(url, key, d)
    out.update(package=str(package), weights=str(blob), manifest=str(manifest), signing_keys=str(signing_keys),
               trusted_key=str(trusted_key))
    return out


def time_cpp(exe: Path, key: str, files: dict[str, Any], dest: Path, device: str) -> dict[str, Any]:
    """Time to first step from C++ (no Python, no `import torch`): aotc_run in a fresh process loads libtorch,
    verifies the manifest's signature and the files' digests, loads the package, binds the weights blob, runs one
    step and writes the loss and the stepped weights out. `ttfs_s` is that process's wall time; `with_pull_s` adds
    the verified pull the Python figure includes."""
    argv = [str(exe), "--package", files["package"], "--weights", files["weights"], "--artifact-key", key,
            "--manifest", files["manifest"], "--trusted-key", files["trusted_key"],
            "--signing-keys", files["signing_keys"], "--inputs", str(dest / "in.pt"),
            "--outputs", str(dest / "out.pt"), "--device", device, "--train-steps", "1"]
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout)[-800:]}
    step = next((ln for ln in done.stdout.splitlines() if " train steps " in ln), "")
    ms = float(step.rsplit(" in ", 1)[1].split()[0]) if " in " in step else None
    return {"ttfs_s": round(wall, 3), "first_step_ms": ms, "pull_s": round(files["pull_s"], 3),
            "with_pull_s": round(wall + files["pull_s"], 3)}


def build_cpp() -> Path | str:
    """examples/cpp's aotc_run against this Python's torch (tests/cppbuild.py's build, kept across runs; outside any
    timing), or why it did not build."""
    from cppbuild import build_aotc_run

    try:
        return build_aotc_run()
    except AssertionError as e:  # make's output, as the tests' build reports it
        return f"examples/cpp did not build: {str(e)[-600:]}"


def child_compile(name: str, batch: int, device: str, amp: str, mode: str) -> dict[str, Any]:
    """Time to first step of torch.compile with an empty Inductor cache (the caller empties it): import, compile and
    the first step; then, in the same process, its step time (so each model is compiled once per mode)."""
    t0 = time.perf_counter()
    import torch

    from compiler.check import measure

    out: dict[str, Any] = {"import_s": time.perf_counter() - t0}
    model, args = _built(name, batch, device, out)
    t2 = time.perf_counter()
    compiled = torch.compile(model, mode=None if mode == "default" else mode)
    with autocast(device, amp):
        loss, _ = compiled(*args)
    loss.backward()
    float(loss)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    out["first_step_s"] = time.perf_counter() - t2
    out["ttfs_s"] = out["import_s"] + out["first_step_s"]
    timed = measure(eager_step(compiled, args, device, amp), device)
    out["step_ms"] = round(timed["median_ms"], 3)
    out["step_spread_ms"] = [round(timed["p25_ms"], 3), round(timed["p75_ms"], 3)]
    return out


def child_time(url: str, key: str, name: str, batch: int, device: str, amp: str, cache: str) -> dict[str, Any]:
    """Step times, eager first, then the aotc package (its OpenMP runtime last, on a CPU), and the package's gradients
    against fp32 eager's at one batch. torch.compile's step is timed in its own cold process (child_compile)."""
    from bench.trainmodels import build
    from client import Client
    from compiler.check import measure
    from compiler.traincheck import grad_error, grad_scales

    model, args = build(name, batch, device)
    out: dict[str, Any] = {}
    times: dict[str, Any] = {"eager": measure(eager_step(model, args, device, amp), device)}
    bound = copy.deepcopy(model)
    with Client(url, cache_dir=cache, timeout=600) as c:
        step = c.load_training(key, bound, device)

    def aotc_step() -> None:
        bound.zero_grad(set_to_none=True)
        step(*args)

    times["aotc"] = measure(aotc_step, device)
    # The package's gradients against fp32 eager's (no autocast), on the same weights and batch, in the check's
    # measure (compiler.traincheck.grad_scales): max|diff| relative to each gradient's own scale.
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    ref(*args)[0].backward()
    bound.load_state_dict(ref.state_dict())  # copies values into the bound tensors: the step still reads them
    bound.zero_grad(set_to_none=True)
    step(*args)
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    got = dict(bound.named_parameters())
    scales = grad_scales(want)
    out["grad_err_vs_fp32"] = max((grad_error(g, got[n].grad, scales[n]) for n, g in want.items()
                                   if got[n].grad is not None), default=0.0)
    out["step_ms"] = {k: round(v["median_ms"], 3) for k, v in times.items()}
    out["step_spread_ms"] = {k: [round(v["p25_ms"], 3), round(v["p75_ms"], 3)] for k, v in times.items()}
    out["step_method"] = times["eager"]["method"]
    return out


def _fresh(argv: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    from bench.ttfi import _pythonpath

    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True, timeout=1800,
                       env={**os.environ, "PYTHONPATH": _pythonpath(), **(env or {})})
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout)[-1500:]}
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out


# -- one model -----------------------------------------------------------------------------------------------------


def reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


def submit_model(c: Any, name: str, a: argparse.Namespace) -> dict[str, Any]:
    """Build, export, upload and queue one model as mode=training; the row, with the job to wait for (or the key of
    a package already cached) under "_job" / "key"."""
    from bench.trainmodels import build

    row: dict[str, Any] = {"model": name}
    model, args = build(name, a.batch, a.device)
    row["batch"] = int(args[0].shape[0])
    row["params_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 2)
    record = c.upload(model, list(args))
    shapes = {i["name"]: list(x.shape) for i, x in zip(record["inputs"], args, strict=True)}
    answer = c.submit(record["id"], shapes, "cpu" if a.device == "cpu" else "cuda", mode="training",
                      precision="keep" if a.amp == "none" else a.amp)
    row["_submitted"] = time.perf_counter()
    if answer["status"] == "cached":
        row["key"] = answer["key"]
    else:
        row["_job"] = answer["job"]["id"]
    return row


def public(row: dict[str, Any]) -> dict[str, Any]:
    """The row without the driver's own keys (`_job`, `_submitted`): what the JSON keeps."""
    return {k: v for k, v in row.items() if not k.startswith("_")}


def wait_model(c: Any, row: dict[str, Any]) -> dict[str, Any]:
    """Until the model's job ends: a package (its key and check) or the exact reason there is none."""
    try:
        if "_job" in row:
            art = c.wait(row["_job"], timeout=3600)
            row["key"] = art.key
            row["compile_s"] = round(time.perf_counter() - row["_submitted"], 1)
            meta = art.meta
        else:
            meta = c.artifact(row["key"]).meta
    except Exception as e:  # a job that failed: its stage and message, as the service recorded them
        job = getattr(e, "job", None)
        err = (job or {}).get("error") or {}
        row["package"] = False
        row["reason"] = (f"{err.get('stage')}: {err.get('type')}: {str(err.get('message'))[:400]}" if err
                         else reason(e))
        return row
    row["package"] = True
    check = (meta or {}).get("check") or {}
    row["check_max_rel_err"] = check.get("max_rel_err")
    row["check_steps"] = len((check.get("training") or {}).get("steps") or [])
    row["check_seconds"] = check.get("seconds")  # by part: load, steps, timing, adversarial
    adv = check.get("adversarial") or {}
    row["adversarial"] = {k: adv.get(k) for k in ("probes", "probe_seconds", "outcomes")}
    if "_job" in row:
        row["job_timings"] = c.job(row["_job"]).get("timings")
    return row


def time_model(url: str, row: dict[str, Any], a: argparse.Namespace, base: Path) -> dict[str, Any]:
    """On a quiet device (no compile running), each in a fresh process: eager and the package's step, the package's
    time to first step, and torch.compile's cold time to first step and then its step."""
    name = row["model"]
    # In a process of its own: a CPU package brings its own OpenMP runtime, whose threads spin beside torch's and
    # slow whatever runs after it (compiler/check.py measures eager first for that reason).
    timed = _fresh(["time", url, row["key"], name, str(row["batch"]), a.device, a.amp,
                    str(base / f"cache-time-{name}")])
    if "error" in timed:
        row["time_error"] = timed["error"]
        return row
    row.update({k: v for k, v in timed.items() if k != "wall_s"})
    if a.ttfs:
        row["ttfs_aotc"] = _fresh(["aotc", url, row["key"], name, str(row["batch"]), a.device,
                                   str(base / f"cache-{name}-{time.time_ns()}")])
    if a.ttfs and a.cpp:
        exe = build_cpp()
        dest = base / f"cpp-{name}"
        files = _fresh(["cppfiles", url, row["key"], name, str(row["batch"]), str(dest)])
        row["ttfs_cpp"] = ({"error": exe} if isinstance(exe, str) else files if "error" in files
                           else time_cpp(exe, row["key"], files, dest, a.device))
    modes = ["default", *(["max-autotune"] if a.max_autotune else [])] if a.compile else []
    for mode in modes:
        inductor_cache = tempfile.mkdtemp(prefix="inductor-cold-", dir=base)
        got = _fresh(["compile", name, str(row["batch"]), a.device, a.amp, mode],
                     env={"TORCHINDUCTOR_CACHE_DIR": inductor_cache,
                          "TRITON_CACHE_DIR": os.path.join(inductor_cache, "triton")})
        shutil.rmtree(inductor_cache, ignore_errors=True)
        if "error" in got:
            row[f"compile_{mode}_error"] = got["error"]
            continue
        row["step_ms"][f"compile_{mode}"] = got.pop("step_ms")
        row["step_spread_ms"][f"compile_{mode}"] = got.pop("step_spread_ms")
        row[f"ttfs_compile{'' if mode == 'default' else '_' + mode}"] = got
    e_ms = row["step_ms"]["eager"]
    row["speedup_vs_eager"] = round(e_ms / row["step_ms"]["aotc"], 3)
    if "compile_default" in row["step_ms"]:
        row["speedup_vs_compile"] = round(row["step_ms"]["compile_default"] / row["step_ms"]["aotc"], 3)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'model':<28}{'pkg':>4}{'eager ms':>10}{'aotc ms':>9}{'compile':>9}{'x eager':>8}{'x comp':>7}"
            f"{'ttfs aotc':>10}{'ttfs C++':>9}{'ttfs comp':>10}{'grad err':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if not r.get("package"):
            lines.append(f"{r['model']:<28}{'no':>4}  {r.get('reason', '')[:150]}")
            continue
        if r.get("coverage_only"):
            lines.append(f"{r['model']:<28}{'yes':>4}  (coverage: packaged and checked, not timed)")
            continue
        if "step_ms" not in r:
            lines.append(f"{r['model']:<28}{'yes':>4}  not timed: {str(r.get('time_error'))[-150:]}")
            continue
        s = r["step_ms"]
        ta = (r.get("ttfs_aotc") or {}).get("ttfs_s")
        tc = (r.get("ttfs_compile") or {}).get("ttfs_s")
        tcpp = (r.get("ttfs_cpp") or {}).get("with_pull_s")
        nan = float("nan")
        lines.append(f"{r['model']:<28}{'yes':>4}{s['eager']:>10.3f}{s['aotc']:>9.3f}"
                     f"{s.get('compile_default', float('nan')):>9.3f}{r['speedup_vs_eager']:>8.2f}"
                     f"{r.get('speedup_vs_compile', float('nan')):>7.2f}"
                     f"{ta if ta is not None else float('nan'):>10.2f}"
                     f"{tcpp if tcpp is not None else nan:>9.2f}{tc if tc is not None else nan:>10.2f}"
                     f"{r.get('check_max_rel_err') or float('nan'):>10.1e}")
    made = [r for r in rows if r.get("package") and "speedup_vs_eager" in r]
    if made:
        gm = statistics.geometric_mean([r["speedup_vs_eager"] for r in made])
        lines.append(f"{sum(1 for r in rows if r.get('package'))}/{len(rows)} models make a train-step package; "
                     f"step geomean vs eager {gm:.2f}x")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, rest = sys.argv[2], sys.argv[3:]
        if kind == "aotc":
            url, key, name, batch, device, cache = rest
            out = child_aotc(url, key, name, int(batch), device, cache)
        elif kind == "cppfiles":
            url, key, name, batch, dest = rest
            out = child_cppfiles(url, key, name, int(batch), dest)
        elif kind == "time":
            url, key, name, batch, device, amp, cache = rest
            out = child_time(url, key, name, int(batch), device, amp, cache)
        else:
            name, batch, device, amp, mode = rest
            out = child_compile(name, int(batch), device, amp, mode)
        print(json.dumps(out))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zoo", default=",".join(TINY), help="comma-separated: tiny models or bench/zoo.py names")
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", choices=("none", "bf16"), default="none", help="bf16: torch.autocast, as the papers")
    p.add_argument("--batch", type=int, default=None, help="training batch (default: per model)")
    p.add_argument("--max-autotune", action="store_true", help="also time torch.compile(mode='max-autotune')")
    p.add_argument("--no-ttfs", dest="ttfs", action="store_false", help="skip the fresh-process runs")
    p.add_argument("--url", default=None, help="a running service (default: start one with one worker)")
    p.add_argument("--base", default=None, help="the service's data dir, kept after the run (a GPU run in chunks "
                   "reuses its precompiled headers and caches); default: a temporary one, removed")
    p.add_argument("--out", default=None)
    p.add_argument("--append", action="store_true",
                   help="add this run's rows to --out's (a GPU run in chunks of a few models, each under 10 min)")
    p.add_argument("--workers", type=int, default=1,
                   help="compile workers (all models are queued at once; timing waits for a quiet device)")
    p.add_argument("--coverage", default="",
                   help="comma-separated: more models to make packages of after the timed ones (coverage, untimed)")
    p.add_argument("--cpp", action="store_true", help="also time the first step from C++ (examples/cpp's aotc_run, "
                   "built here: g++ and OpenSSL's headers), in a fresh process")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile (cold and step)")
    a = p.parse_args()
    if a.device == "cuda":
        a.device = "cuda:0"
    import torch

    from bench.farmkit import Service
    from client import Client

    base = Path(a.base) if a.base else Path(tempfile.mkdtemp(prefix="aotc-train-"))
    base.mkdir(parents=True, exist_ok=True)
    old = json.loads(Path(a.out).read_text())["rows"] if a.append and a.out and Path(a.out).exists() else []
    # A rerun (a GPU call cut off) resumes: a model with a finished row is not run again.
    done = {r["model"] for r in old if (not r.get("package")) or "speedup_vs_eager" in r or r.get("coverage_only")}
    timed_names = [n for n in a.zoo.split(",") if n and n not in done]
    cover_names = [n for n in a.coverage.split(",") if n and n not in done and n not in timed_names]
    rows: list[dict[str, Any]] = [r for r in old if r["model"] in done]
    device = "cuda" if a.device.startswith("cuda") else "cpu"

    untimed: list[dict[str, Any]] = []  # jobs ended, timing not reached yet: kept if the machine goes first

    def write() -> None:
        result = {"device": a.device, "amp": a.amp, "torch": torch.__version__, "host": platform.node(),
                  "cpu_count": os.cpu_count(), "workers": a.workers, "rows": rows,
                  "untimed": [public(r) for r in untimed if r["model"] not in {x["model"] for x in rows}],
                  "gpu": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else None}
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(result, indent=1, default=str))

    def submit_all(c: Any, names: list[str]) -> list[dict[str, Any]]:
        out = []
        for name in names:
            try:
                out.append(submit_model(c, name, a))
            except Exception as e:  # noqa: BLE001 - a bench row (export or upload refused), not a crash
                out.append({"model": name, "package": False, "reason": f"upload: {reason(e)}"})
            print(f"queued {name}", file=sys.stderr, flush=True)
        return out

    def wait_all(c: Any, pending: list[dict[str, Any]]) -> None:
        for row in pending:
            if "package" not in row:
                wait_model(c, row)
            print(json.dumps(public(row), default=str)[:600],
                  file=sys.stderr, flush=True)
            untimed.append(row)
            write()

    svc = Service(base / "svc", device, a.workers)
    try:
        with Client(svc.url, cache_dir=base / "client-cache", timeout=600) as c:
            pending = submit_all(c, timed_names)
            wait_all(c, pending)
            svc.stop_workers()  # a quiet device: no compile beside the timings
            for row in pending:
                t0 = time.perf_counter()
                if row.get("package"):
                    try:
                        time_model(svc.url, row, a, base)
                    except Exception as e:  # noqa: BLE001 - a bench row, not a crash
                        row["time_error"] = f"bench: {reason(e)}"
                row["time_wall_s"] = round(time.perf_counter() - t0, 1)
                rows.append(public(row))
                write()
            if cover_names:
                svc.workers.clear()  # stopped above
                for _ in range(a.workers):
                    svc.add_worker()
                svc.wait_registered(a.workers)
                covered = submit_all(c, cover_names)
                for row in covered:
                    wait_all(c, [row])
                    row["coverage_only"] = True
                    rows.append(public(row))
                    write()
    finally:
        svc.stop()
    write()
    print(table(rows))
    if a.out:
        print(f"wrote {a.out}")
    if not a.base:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
