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

`--lanes N` (or `--gpus 0,1,2,3`) runs N lanes side by side (bench/trainlanes.py): each a process with its own
service and `--workers` workers, on one GPU (CUDA_VISIBLE_DEVICES) and a share of the cores, with its share of the
models (largest first, balanced by a rough cost). A lane times its models as soon as its own jobs have ended (its
workers stopped), whatever the other lanes do; with `--early`, as soon as a package lands while no other job of the
lane is in its check. Every timed row records `lane` and the `conditions` at its start and end (the lane's workers
and unfinished jobs, the other lanes' states, the load average). One JSON, merged from the lanes as rows finish.
On a CPU (`--device cpu --lanes 2`) a lane is a share of the cores, for a smoke test. bench/train_lanes.sh starts a
run detached and follows it.

    python bench/train.py --cpp --out bench/results/train-cpu.json            # CPU: tiny models, a few minutes
    # GPU (torch 2.11):
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6 python bench/train.py --device cuda --amp bf16 --batch 32 \\
        --workers 4 --zoo resnet50,mobilenet_v3_large,efficientnet_b0,convnext_tiny,timm_vit_small_patch16_224,\\
        hf_distilbert,hf_bert_base,hf_gpt2 --base /tmp/aotc-train-gpu --append --out bench/results/train-h100.json
    # four GPUs, two models and two workers each, detached: bench/README.md's "Running them"
    bench/train_lanes.sh start /tmp/train --device cuda --amp bf16 --batch 32 --lanes 4 --workers 2 --zoo ...

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
    # Eager's own distance from fp32 under the same autocast, in the same measure: what the package's is read
    # against (MobileNetV3's 0.45 on an H200 could not be told from eager's without it).
    amp_eager = copy.deepcopy(ref)
    amp_eager.zero_grad(set_to_none=True)
    with autocast(device, amp):
        loss, _ = amp_eager(*args)
    loss.backward()
    mine = dict(amp_eager.named_parameters())
    out["eager_grad_err_vs_fp32"] = max((grad_error(g, mine[n].grad, scales[n]) for n, g in want.items()
                                         if mine[n].grad is not None), default=0.0)
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
    extra = options_for(name, a.option)
    if extra:
        row["options"] = extra
    answer = c.submit(record["id"], shapes, "cpu" if a.device == "cpu" else "cuda", mode="training",
                      precision="keep" if a.amp == "none" else a.amp, **extra)
    row["_submitted"] = time.perf_counter()
    if answer["status"] == "cached":
        row["key"] = answer["key"]
    else:
        row["_job"] = answer["job"]["id"]
    return row


def options_for(name: str, given: list[str]) -> dict[str, Any]:
    """The compile options `--option [MODEL:]KEY=JSON` give model `name`: those without a model, then its own."""
    out: dict[str, Any] = {}
    for scoped in (False, True):
        for item in given:
            head, _, value = item.partition("=")
            model, _, key = head.rpartition(":")
            if not key or not value:
                raise SystemExit(f"--option {item!r}: expected [MODEL:]KEY=JSON, e.g. "
                                 "'efficientnet_b0:inductor={\"layout_optimization\": false}'")
            if bool(model) == scoped and model in ("", name):
                try:
                    out[key] = json.loads(value)
                except json.JSONDecodeError:
                    out[key] = value  # a bare word: a string
    return out


def check_options(names: list[str], given: list[str], amp: str) -> None:
    """Refuse, before any device time is spent, `--option`s the service would refuse for a model at its upload (an
    H200 run lost resnet50 and efficientnet_b0 to `layout_optimization=false`, which is an Inductor setting:
    `inductor={"layout_optimization": false}`)."""
    from pydantic import ValidationError

    from compiler.options import CompileOptions

    for name in names:
        extra = options_for(name, given)
        try:
            CompileOptions(mode="training", precision="keep" if amp == "none" else amp, **extra)
        except (ValidationError, TypeError) as e:
            raise SystemExit(f"--option for {name}: {extra} is not a compile option the service takes: "
                             f"{str(e).splitlines()[1:3]}") from None


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
    passed: dict[str, int] = {}  # values the float64 second opinion passed, by rule, over the check's steps
    for step in (check.get("training") or {}).get("steps") or []:
        for rule in (step.get("fp64_passed") or {}).values():
            passed[rule] = passed.get(rule, 0) + 1
    row["check_fp64_passed"] = passed
    row["check_seconds"] = check.get("seconds")  # by part: load, steps, timing, adversarial
    adv = check.get("adversarial") or {}
    row["adversarial"] = {k: adv.get(k) for k in ("probes", "probe_seconds", "probe_lanes", "outcomes")}
    if "_job" in row:
        row["job_timings"] = c.job(row["_job"]).get("timings")
    return row


def time_model(url: str, row: dict[str, Any], a: argparse.Namespace, base: Path,
               progress: Any = lambda: None) -> dict[str, Any]:
    """On a quiet device (no compile running), each in a fresh process: eager and the package's step, the package's
    time to first step, and torch.compile's cold time to first step and then its step. `progress()` is called after
    each part, so a run cut off in torch.compile's cold compile (minutes under max-autotune) keeps what was timed."""
    name = row["model"]
    # In a process of its own: a CPU package brings its own OpenMP runtime, whose threads spin beside torch's and
    # slow whatever runs after it (compiler/check.py measures eager first for that reason).
    timed = _fresh(["time", url, row["key"], name, str(row["batch"]), a.device, a.amp,
                    str(base / f"cache-time-{name}")])
    if "error" in timed:
        row["time_error"] = timed["error"]
        return row
    row.update({k: v for k, v in timed.items() if k != "wall_s"})
    progress()
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
        progress()
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


def finished(row: dict[str, Any], retry: list[str]) -> bool:
    """A row `--append` does not run again: timed, covered, or refused for a reason not named by `--retry`."""
    if not row.get("package"):
        return not any(str(row.get("reason", "")).startswith(prefix) for prefix in retry)
    return "speedup_vs_eager" in row or bool(row.get("coverage_only"))


def plan(a: argparse.Namespace, old_rows: list[dict[str, Any]]
         ) -> tuple[set[str], list[str], list[str], list[dict[str, Any]]]:
    """What an `--append` run does with an earlier run's rows: the models finished (not run again), those to time,
    those for coverage, and the rows kept. Every earlier row stays but those of the models this run runs: a row
    `--retry` names, of a model not asked for, is kept as it is (it was dropped, and HRNet's refusal with it, when
    only EVA02 and LeViT ran again)."""
    done = {r["model"] for r in old_rows if finished(r, a.retry)}
    timed = [n for n in a.zoo.split(",") if n and n not in done]
    cover = [n for n in a.coverage.split(",") if n and n not in done and n not in timed]
    return done, timed, cover, [r for r in old_rows if r["model"] not in timed + cover]


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
    p.add_argument("--retry", action="append", default=[], metavar="PREFIX",
                   help="with --append: run again the models refused with a reason that starts with PREFIX (e.g. "
                        "'check:' after the check changed); the other rows stay finished")
    p.add_argument("--cpp", action="store_true", help="also time the first step from C++ (examples/cpp's aotc_run, "
                   "built here: g++ and OpenSSL's headers), in a fresh process")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile (cold and step)")
    p.add_argument("--option", action="append", default=[], metavar="[MODEL:]KEY=JSON",
                   help="a compile option for every model's job, or for MODEL's alone (repeatable), e.g. "
                   "resnet50:layout_optimization=false; recorded in the row")
    p.add_argument("--lanes", type=int, default=1,
                   help="N lanes, each its own service, workers and timings: on GPUs 0..N-1 (--device cuda), or on "
                   "a share of the cores each (--device cpu, a smoke test); the models split by a rough cost")
    p.add_argument("--gpus", default=None, help="the lanes' GPUs, e.g. 0,1,2,3 (one lane each; implies --lanes)")
    p.add_argument("--early", action="store_true",
                   help="time a model as soon as its package lands if no job of its lane is in its check on the "
                   "device (the lane's compiles may still run; each row's conditions say what ran beside it)")
    p.add_argument("--lane", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--lane-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--lane-cpus", default=None, help=argparse.SUPPRESS)
    p.add_argument("--lane-gpu", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.lane is None:
        check_options([*filter(None, a.zoo.split(",")), *filter(None, a.coverage.split(","))], a.option, a.amp)
    if a.gpus or a.lanes > 1:
        sys.exit(run_lanes(a))
    if a.lane_cpus:  # a lane: pinned before torch starts a thread, so everything it starts inherits the cores
        from worker.cpus import parse  # a cpu list as taskset writes it, as AOTC_TIMING_CPUS is read

        os.sched_setaffinity(0, parse(a.lane_cpus))
    if a.device == "cuda":
        a.device = "cuda:0"
    run_lane(a)


def lane_args(a: argparse.Namespace) -> list[str]:
    """The options a lane gets from the parent as they were given (models, lanes and output are the parent's)."""
    out = ["--amp", a.amp, "--workers", str(a.workers)]
    out += ["--batch", str(a.batch)] if a.batch else []
    out += [x for o in a.option for x in ("--option", o)]
    flags = {"--max-autotune": a.max_autotune, "--no-ttfs": not a.ttfs, "--no-compile": not a.compile,
             "--cpp": a.cpp, "--early": a.early}
    return out + [k for k, on in flags.items() if on]


def run_lanes(a: argparse.Namespace) -> int:
    """The parent of a run in lanes (bench/trainlanes.py): resume from --out, split the models, start a lane per
    GPU (or per share of the cores), merge their files into --out until all have ended, print the table."""
    from bench import trainlanes

    if not a.out:
        raise SystemExit("--lanes/--gpus write one merged JSON: give --out")
    cuda = a.device.startswith("cuda")
    if a.gpus and not cuda:
        raise SystemExit("--gpus needs --device cuda (a CPU run takes --lanes N)")
    gpus: list[str | None] = (list(a.gpus.split(",")) if a.gpus else [str(i) for i in range(a.lanes)]) if cuda \
        else [None] * a.lanes
    base = Path(a.base) if a.base else Path(tempfile.mkdtemp(prefix="aotc-train-"))
    lane_dir = base / "lanes"
    lane_dir.mkdir(parents=True, exist_ok=True)
    for stale in lane_dir.glob("lane-*.json"):  # an earlier run's lanes: what they finished is in --out
        stale.unlink()
    out = Path(a.out)
    old = json.loads(out.read_text()) if a.append and out.exists() else {}
    done, names, cover, kept = plan(a, old.get("rows", []))
    trainlanes.write_atomic(lane_dir / "prev.json", {
        "meta": {k: v for k, v in old.items() if k not in ("rows", "untimed", "lanes")},
        "rows": kept,
        "untimed": [r for r in old.get("untimed", []) if r["model"] not in done]})
    print(f"{len(done)} models done in {out}; {len(names)} to time, {len(cover)} for coverage, on {len(gpus)} lanes",
          flush=True)
    t0 = time.perf_counter()
    procs = trainlanes.start(a, __file__, names, cover, base, lane_dir, gpus, lane_args(a))
    failed = trainlanes.follow(procs, lane_dir, out, every_s=15)
    merged = trainlanes.merge(lane_dir, out)
    print(table(merged["rows"]))
    print(f"lanes: {len(procs)}, wall {time.perf_counter() - T_START:.0f} s (lanes {time.perf_counter() - t0:.0f} s);"
          f" wrote {out}")
    if not a.base:
        shutil.rmtree(base, ignore_errors=True)
    return 1 if failed else 0


GPU_STAGES = ("check", "timing", "publish")  # a job's stages that run on the device (publish: right after them)


def run_lane(a: argparse.Namespace) -> None:
    """One service (its own Redis, API and workers) and the models given: queue all, record each job's end, and
    time each package: once every job of the lane has ended and its workers are stopped, or (--early) as soon as
    it lands while no other job of the lane is checking. Without --lane this is the whole run."""
    import torch

    from bench.farmkit import start_service
    from bench.trainlanes import cpu_spec, lane_file, merge, others, write_atomic
    from client import Client

    lane = a.lane if a.lane is not None else 0
    lane_dir = Path(a.lane_dir) if a.lane_dir else None
    prefix = f"[lane {lane}] " if lane_dir else ""

    def say(msg: str) -> None:
        print(f"{prefix}{msg}", file=sys.stderr, flush=True)

    base = Path(a.base) if a.base else Path(tempfile.mkdtemp(prefix="aotc-train-"))
    base.mkdir(parents=True, exist_ok=True)
    old = json.loads(Path(a.out).read_text())["rows"] if a.append and a.out and Path(a.out).exists() else []
    # A rerun (a GPU call cut off) resumes: a model with a finished row is not run again.
    _, timed_names, cover_names, rows = plan(a, old)
    device = "cuda" if a.device.startswith("cuda") else "cpu"
    cores = sorted(os.sched_getaffinity(0))

    untimed: list[dict[str, Any]] = []  # jobs ended, timing not reached yet: kept if the machine goes first
    status: dict[str, Any] = {"state": "starting", "jobs": {}, "timing": None, "rows": 0}

    def write() -> None:
        status.update(rows=len(rows), at=time.strftime("%H:%M:%S"))
        result = {"device": a.device, "amp": a.amp, "torch": torch.__version__, "host": platform.node(),
                  "cpu_count": os.cpu_count(), "workers": a.workers, "rows": rows,
                  "untimed": [public(r) for r in untimed if r["model"] not in {x["model"] for x in rows}],
                  "gpu": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else None,
                  "lane": lane, "gpu_index": a.lane_gpu, "cpus": cpu_spec(cores),
                  "models": timed_names + cover_names, "status": status}
        if lane_dir is not None:
            write_atomic(lane_file(lane_dir, lane), result)
            merge(lane_dir, Path(a.out))
        elif a.out:
            write_atomic(Path(a.out), result)

    def submit_all(c: Any, names: list[str]) -> list[dict[str, Any]]:
        out = []
        for name in names:
            try:
                out.append(submit_model(c, name, a))
            except Exception as e:  # noqa: BLE001 - a bench row (export or upload refused), not a crash
                out.append({"model": name, "package": False, "reason": f"upload: {reason(e)}"})
            out[-1]["lane"] = lane
            say(f"queued {name}")
        return out

    def wait_all(c: Any, pending: list[dict[str, Any]]) -> None:
        for row in pending:
            if "package" not in row:
                wait_model(c, row)
            say(json.dumps(public(row), default=str)[:600])
            untimed.append(row)
            write()

    def stages(c: Any, waiting: list[dict[str, Any]]) -> dict[str, str]:
        """Each job of the lane that has not ended: its stage, or its state when it ended since (a job's record)."""
        out = {}
        for row in waiting:
            if "_job" in row:
                job = c.job(row["_job"])
                out[row["model"]] = job["state"] if job["state"] in ("succeeded", "failed", "cancelled") \
                    else job.get("stage") or job["state"]
        return out

    def conditions(jobs: dict[str, str], workers_on: bool) -> dict[str, Any]:
        """What ran beside a timing: this lane's workers and unfinished jobs, the other lanes, the host's load."""
        return {"workers": "running" if workers_on else "stopped", "lane_jobs": dict(jobs),
                "other_lanes": others(lane_dir, lane) if lane_dir is not None else None,
                "loadavg": [round(x, 2) for x in os.getloadavg()], "lane_cores": len(cores),
                "cpu_count": os.cpu_count(), "at": time.strftime("%H:%M:%S")}

    def time_one(c: Any, svc: Any, row: dict[str, Any], waiting: list[dict[str, Any]], workers_on: bool) -> None:
        t0 = time.perf_counter()
        status.update(state="timing", timing=row["model"])
        write()
        start = conditions(status["jobs"], workers_on)
        try:
            time_model(svc.url, row, a, base, progress=write)
        except Exception as e:  # noqa: BLE001 - a bench row, not a crash
            row["time_error"] = f"bench: {reason(e)}"
        row["time_wall_s"] = round(time.perf_counter() - t0, 1)
        row["conditions"] = {"start": start, "end": conditions(stages(c, waiting), workers_on)}
        rows.append(public(row))
        status.update(timing=None)
        say(f"timed {row['model']} in {row['time_wall_s']} s: {row.get('step_ms') or row.get('time_error')}")
        write()

    def run_timed(c: Any, svc: Any, pending: list[dict[str, Any]]) -> None:
        """Record each job as it ends; time what landed when the lane's device is quiet (see run_lane)."""
        waiting, landed = list(pending), []
        workers_on = True
        while waiting or landed:
            jobs = stages(c, waiting)
            ended = False
            for row in list(waiting):
                if "package" in row or "_job" not in row or jobs.get(row["model"]) in ("succeeded", "failed",
                                                                                      "cancelled"):
                    if "package" not in row:
                        wait_model(c, row)
                    waiting.remove(row)
                    jobs.pop(row["model"], None)
                    ended = True
                    say(json.dumps(public(row), default=str)[:600])
                    if row.get("package"):
                        untimed.append(row)
                        landed.append(row)
                    else:
                        rows.append(public(row))
            if not waiting and workers_on:
                svc.stop_workers()  # a quiet device: no compile beside the timings
                workers_on = False
            busy = [m for m, s in jobs.items() if s in GPU_STAGES]
            state = "timing" if landed and (not workers_on or (a.early and not busy)) else "compiling"
            if ended or status["jobs"] != jobs or status["state"] != state:
                status.update(state=state, jobs=jobs)
                write()
            if state == "timing":
                time_one(c, svc, landed.pop(0), waiting, workers_on)
                continue
            time.sleep(2)
        if workers_on:
            svc.stop_workers()

    # A submit before any worker registered is refused (503: no live worker serves the target); a lane on a core or
    # two starts its worker slowly.
    svc = start_service(base / "svc", device, a.workers)
    try:
        with Client(svc.url, cache_dir=base / "client-cache", timeout=600) as c:
            run_timed(c, svc, submit_all(c, timed_names))
            if cover_names:
                svc.workers.clear()  # stopped above
                for _ in range(a.workers):
                    svc.add_worker()
                svc.wait_registered(a.workers)
                status.update(state="coverage")
                covered = submit_all(c, cover_names)
                for row in covered:
                    wait_all(c, [row])
                    row["coverage_only"] = True
                    rows.append(public(row))
                    write()
    finally:
        svc.stop()
    status.update(state="done", jobs={})
    write()
    if lane_dir is None:
        print(table(rows))
        if a.out:
            print(f"wrote {a.out}")
    if not a.base:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
