"""The `aotc` command line.

    aotc serve                                    API + embedded Redis + a worker for this machine's device
    aotc worker                                   one worker (one per GPU, or one for the CPU)
    aotc compile model.pt2 --shape x=8x3x224x224 --target cpu   progress on stderr; the key is stdout's last line
    aotc pull KEY -o model.so.pt2                 fetch an artifact, verified against its sha256
    aotc report KEY                               a table of the compiler's stages for one artifact
    aotc source KEY [PATH]                        its generated code and graphs
    aotc caches [--clear]                         the compile caches workers share through Redis
    aotc models | jobs | workers | lookup | cancel
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

from client.sdk import Client, ClientError, JobFailed


def _shapes(args: list[str]) -> dict[str, str]:
    out = {}
    for a in args:
        name, sep, shape = a.partition("=")
        if not sep:
            raise SystemExit(f"aotc: cannot read --shape {a!r}: write NAME=SHAPE, e.g. x=8x3x224x224 or x=1..32x3x224x224")
        out[name.strip()] = shape.strip()
    return out


class Progress:
    """A live progress bar on stderr, fed by the job's server-sent events: rewritten in place on a terminal,
    one line per change otherwise."""

    # The stages a job goes through, in order (older workers report specialize/compile in place of
    # capture..package); the bar stays put on a stage it does not know.
    STAGES = ("queued", "fetch", "load", "specialize", "capture", "autograd", "lowering", "compile", "fusion",
              "codegen", "package", "check", "publish")
    WIDTH = 20

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.t0 = time.monotonic()
        self.last = ""
        self.done = 0

    def bar(self, state: str, stage: str) -> str:
        if state == "succeeded":
            self.done = len(self.STAGES)
        elif state == "queued":
            self.done = 0
        elif stage in self.STAGES:
            self.done = self.STAGES.index(stage)
        n = round(self.WIDTH * self.done / len(self.STAGES))
        return "[" + "#" * n + "-" * (self.WIDTH - n) + "]"

    def __call__(self, job: dict[str, Any]) -> None:
        attempt = f", attempt {job['attempts']}" if job.get("attempts", 0) > 1 else ""
        stage = job.get("stage", "")
        if job["state"] == "queued" and job.get("reason"):
            stage = f"queued again after: {job['reason']}"
        line = f"job {job['id'][:8]} {self.bar(job['state'], job.get('stage', ''))} {job['state']}: {stage}{attempt}"
        if self.tty:
            sys.stderr.write(f"\r[{time.monotonic() - self.t0:6.1f}s] {line}\033[K")
            if job["state"] in ("succeeded", "failed", "cancelled"):
                sys.stderr.write("\n")
        elif line != self.last:
            sys.stderr.write(f"[{time.monotonic() - self.t0:6.1f}s] {line}\n")
        sys.stderr.flush()
        self.last = line


def cmd_compile(c: Client, a: argparse.Namespace) -> int:
    model = c.upload(a.model, name=a.name)
    print(f"uploaded {a.model} as model {model['id'][:12]} ({model['size']} bytes)", file=sys.stderr)
    options: dict[str, Any] = {"mode": a.mode, "precision": a.precision, "freezing": a.freezing}
    if a.inductor:
        options["inductor"] = _inductor_settings(a.inductor)
    answer = c.submit(model["id"], _shapes(a.shape), a.target, priority=a.priority, **options)
    if answer["status"] == "cached":
        print("cache hit: already compiled", file=sys.stderr)
        print(answer["key"])
        return 0
    job = answer["job"]
    print(f"{answer['status']} job {job['id']} for target {job['target']}", file=sys.stderr)
    if a.no_wait:
        print(job["id"])
        return 0
    art = c.wait(job["id"], progress=Progress())
    check = art.meta.get("check") or {}
    print(f"artifact {art.key}: {art.meta['size']} bytes, compiled in {art.meta['timings'].get('compile_total', 0):.1f} s, "
          f"max error vs eager {check.get('max_rel_err', 0):.2g}, {check.get('eager_ms')} ms eager -> "
          f"{check.get('compiled_ms')} ms compiled on the worker", file=sys.stderr)
    print(art.key)
    return 0


def _inductor_settings(args: list[str]) -> dict[str, Any]:
    """--inductor KEY=VALUE, VALUE read as JSON (true, 64, "ATEN,TRITON") or else as a string; the service
    checks KEY against its allow-list and answers 422 for anything else."""
    out: dict[str, Any] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep:
            raise SystemExit(f"aotc: cannot read --inductor {arg!r}: write KEY=VALUE, e.g. epilogue_fusion=false")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


def cmd_pull(c: Client, a: argparse.Namespace) -> int:
    path = c.pull(a.key, a.output)
    print(f"pulled {a.key} ({path.stat().st_size} bytes, sha256 verified)", file=sys.stderr)
    print(path)
    return 0


def _table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())


def _fmt_shapes(inputs: list[dict[str, Any]]) -> str:
    from compiler.shapes import format_shape

    return " ".join(f"{i['name']}:{i['dtype']}[{format_shape(i['shape'])}]" for i in inputs)


def cmd_models(c: Client, a: argparse.Namespace) -> int:
    _table([[m["id"][:12], m["name"], str(m["size"]), _fmt_shapes(m["inputs"])] for m in c.models()],
           ["MODEL", "NAME", "BYTES", "INPUTS"])
    return 0


def cmd_jobs(c: Client, a: argparse.Namespace) -> int:
    rows = []
    for j in c.jobs(a.limit):
        err = (j.get("error") or {}).get("message", "") if j["state"] == "failed" else ""
        rows.append([j["id"][:12], j["state"], j.get("stage", ""), j["target"], str(j.get("attempts", 0)),
                     j.get("artifact", "") or err[:60]])
    _table(rows, ["JOB", "STATE", "STAGE", "TARGET", "ATTEMPTS", "ARTIFACT / ERROR"])
    return 0


def cmd_workers(c: Client, a: argparse.Namespace) -> int:
    _table([[w["id"], w["target"], w["device_name"], json.dumps(w["toolchain"]), w.get("job") or "idle"]
            for w in c.workers()], ["WORKER", "TARGET", "DEVICE", "TOOLCHAIN", "JOB"])
    return 0


def cmd_caches(c: Client, a: argparse.Namespace) -> int:
    if a.clear:
        removed = c.clear_caches()
        print(f"removed {removed['gemm_timings']} max-autotune timing table(s) and {removed['inductor_entries']} "
              "Inductor remote-cache entries")
        return 0
    caches = c.caches()
    _table([[g["target"], g["system"][:16], str(g["entries"])] for g in caches["gemm_timings"]],
           ["TARGET", "SYSTEM", "MAX-AUTOTUNE TIMINGS"])
    print(f"Inductor remote-cache entries (Triton autotune results): {caches['inductor_entries']}")
    return 0


def cmd_lookup(c: Client, a: argparse.Namespace) -> int:
    art = c.lookup(a.model_id, _shapes(a.shape), a.target)
    if art is None:
        print("no artifact fits", file=sys.stderr)
        return 1
    print(art.key)
    return 0


def cmd_cancel(c: Client, a: argparse.Namespace) -> int:
    job = c.cancel(a.job_id)
    print(f"job {job['id']}: {job['state']}{' (cancelling)' if job.get('cancel_requested') else ''}")
    return 0


def _fmt_s(v: Any) -> str:
    return "-" if v is None else f"{v:.2f} s"


def _dash(v: Any) -> str:
    return "-" if v is None else str(v)


def cmd_report(c: Client, a: argparse.Namespace) -> int:
    from compiler.report import summary_rows  # torch-free

    if a.json:
        print(json.dumps(c.report(a.key), indent=1))
        return 0
    art, rep = c.artifact(a.key), c.report(a.key)
    st = rep.get("stages", {})
    from compiler.shapes import format_shape

    shapes = " ".join(f"{i['name']}={format_shape(i['shape'])}" for i in rep.get("spec", []))
    print(f"artifact {a.key}: model {art.meta['model_id'][:12]} on {art.meta['target']}, torch {rep.get('torch')}, "
          f"mode {rep.get('mode')}, shapes {shapes}")
    print()
    _table([[r["stage"], r["status"], _fmt_s(r["seconds"]), _dash(r["nodes_before"]), _dash(r["nodes_after"]),
             r["detail"]] for r in summary_rows(rep)], ["STAGE", "STATUS", "TIME", "NODES IN", "NODES OUT", "DETAIL"])
    print()
    cap = st.get("capture", {})
    for d in cap.get("dynamic_dims") or []:
        state = f"stayed dynamic as {d['symbol']} in {d.get('min')}..{d.get('max')}" if d.get("stayed_dynamic") \
            else f"was specialised to {d.get('specialized_to')}"
        print(f"dynamic dim: {d['input']} dim {d['dim']} (asked {d['requested']['min']}..{d['requested']['max']}) {state}")
    ag = st.get("autograd", {})
    if ag.get("inplace_ops"):
        print("in-place ops removed by functionalisation: "
              + ", ".join(f"{op} x{n}" for op, n in ag["inplace_ops"].items()))
    tr = ag.get("training")
    if tr:
        print(f"training: joint graph {tr['joint']['nodes']} nodes -> forward {tr['forward']['nodes']} + backward "
              f"{tr['backward']['nodes']} ({tr['partitioner']}); {tr['saved_for_backward']} tensors saved for backward, "
              f"{tr['saved_activations']} of them activations")
    low = st.get("lowering", {})
    if low.get("decomposed"):
        print("decomposed to core ATen: " + ", ".join(
            f"{d['op']} -> {' + '.join(d['into']) or '(nothing)'}" for d in low["decomposed"]))
    fu, cg = st.get("fusion", {}), st.get("codegen", {})
    if cg.get("status") == "ok":
        names = cg.get("kernels") or []
        print(f"kernels generated: {cg.get('kernel_count')} ({cg.get('language')}): " + ", ".join(names[:8])
              + (f", ... {len(names) - 8} more" if len(names) > 8 else ""))
    if fu.get("status") == "ok" and fu.get("externs"):
        print(f"extern calls: {fu['extern_calls']}: " + ", ".join(
            f"{e['kernel']} ({e['library']})" for e in fu["externs"][:8]))
    check = st.get("package", {}).get("check") or {}
    if check:
        print(f"on the worker ({check.get('device')}): {check.get('eager_ms')} ms eager -> {check.get('compiled_ms')} ms "
              f"compiled, speedup {check.get('speedup')}x; max error vs eager {check.get('max_rel_err', 0):.2g}")
        for note in check.get("notes") or []:
            print(f"check note: {note}")
    gemm = (rep.get("caches") or {}).get("gemm_timings")
    if gemm:
        print(f"max-autotune timings: {gemm.get('shared')} from other workers, {gemm.get('measured')} measured here, "
              f"{gemm.get('published')} published" + (f" ({gemm['note']})" if gemm.get("note") else ""))
    missing = {k: v for k, v in (rep.get("hooks") or {}).items() if v.startswith("not in torch")}
    if missing:
        print("not available in this torch: " + ", ".join(f"{k} ({v})" for k, v in missing.items()))
    print(f"generated code and graphs: aotc source {a.key[:12]}... (GET /v1/artifacts/{a.key}/source)")
    return 0


def cmd_source(c: Client, a: argparse.Namespace) -> int:
    if a.path:
        sys.stdout.write(c.source(a.key, a.path))
        return 0
    _table([[f["path"], f["kind"], str(f["bytes"])] for f in c.sources(a.key)], ["PATH", "KIND", "BYTES"])
    return 0


def cmd_worker(a: argparse.Namespace) -> int:
    from worker.main import serve
    from worker.settings import WorkerSettings

    overrides: dict[str, Any] = {}
    if a.device:
        overrides["device"] = a.device
    if a.redis_url:
        overrides["redis_url"] = a.redis_url
    serve(WorkerSettings(**overrides))
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from service.api.app import create_app
    from service.store.embedded import EmbeddedRedis
    from service.api.settings import Settings

    settings = Settings()
    redis_proc = None
    if not settings.redis_url:
        redis_proc = EmbeddedRedis(settings.data_dir / "redis", port=a.redis_port).start()
        settings = settings.model_copy(update={"redis_url": redis_proc.url})
        print(f"aotc: embedded redis-server on {redis_proc.url} (data in {redis_proc.data_dir}, AOF on)", file=sys.stderr)
    worker = None
    if a.workers:
        env = {**os.environ, "AOTC_REDIS_URL": settings.redis_url or "", "AOTC_DEVICE": a.device,
               "AOTC_WORK_DIR": str(settings.data_dir / "work")}
        try:
            import torch  # noqa: F401  # a worker needs torch; the API does not
        except ImportError:
            print("aotc: torch is not installed, so no worker starts (install aotc[worker])", file=sys.stderr)
        else:
            worker = subprocess.Popen([sys.executable, "-m", "worker"], env=env)
            print(f"aotc: worker pid {worker.pid} for device {a.device}", file=sys.stderr)
    # uvicorn re-raises the SIGTERM it caught once it has drained; turn it into SystemExit so the worker
    # and Redis below are stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    try:
        uvicorn.run(create_app(settings), host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=30)
    finally:
        if worker and worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
        if redis_proc:
            redis_proc.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aotc", description="Ahead-of-time compilation of torch.export programs.")
    p.add_argument("--url", default=None, help="service URL (default: $AOTC_URL or http://127.0.0.1:8000)")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run the API, an embedded Redis (unless AOTC_REDIS_URL is set) and a worker")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--redis-port", type=int, default=None, help="port of the embedded Redis (default: a free one)")
    s.add_argument("--device", default="auto", help="device of the local worker: auto, cpu, cuda:N")
    s.add_argument("--workers", type=int, default=1, choices=[0, 1], help="0 runs the API alone")
    s.add_argument("--log-level", default="info")

    s = sub.add_parser("worker", help="run one worker (one per GPU, or one for the CPU)")
    s.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N (default: $AOTC_DEVICE or auto)")
    s.add_argument("--redis-url", default=None, help="default: $AOTC_REDIS_URL")

    s = sub.add_parser("compile", help="upload a .pt2 and compile it; prints the artifact key last")
    s.add_argument("model", help="a torch.export.save archive")
    s.add_argument("--shape", action="append", default=[], required=True,
                   help="NAME=SHAPE, once per input: 8x3x224x224, or 1..32x3x224x224 for a dynamic dim")
    s.add_argument("--target", default="cpu", help="cpu, cuda, or a concrete target such as cuda-sm90")
    s.add_argument("--mode", default="default", choices=["default", "max-autotune", "training"])
    s.add_argument("--precision", default="keep", choices=["keep", "bf16", "fp16"],
                   help="compute in bf16/fp16 for inference; inputs and outputs keep their dtypes")
    s.add_argument("--freezing", action="store_true", help="fold weights into the graph as constants")
    s.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                   help="an allow-listed Inductor setting, e.g. coordinate_descent_tuning=true (repeatable)")
    s.add_argument("--priority", default="interactive", choices=["interactive", "batch"],
                   help="interactive jobs are served before batch jobs")
    s.add_argument("--name", default=None)
    s.add_argument("--no-wait", action="store_true", help="print the job id and return")

    s = sub.add_parser("pull", help="download an artifact (sha256-verified)")
    s.add_argument("key")
    s.add_argument("-o", "--output", default=None, help="where to write it (default: the local cache)")

    sub.add_parser("models", help="list uploaded models")
    s = sub.add_parser("jobs", help="list recent jobs")
    s.add_argument("--limit", type=int, default=20)
    sub.add_parser("workers", help="list live workers")
    s = sub.add_parser("caches", help="the compile caches workers share (max-autotune timings, Inductor entries)")
    s.add_argument("--clear", action="store_true", help="drop them (artifacts stay; later compiles start cold)")
    s = sub.add_parser("lookup", help="find the artifact for a model, shapes and target")
    s.add_argument("model_id")
    s.add_argument("--shape", action="append", default=[], required=True)
    s.add_argument("--target", default="cpu")
    s = sub.add_parser("cancel", help="cancel a job")
    s.add_argument("job_id")
    s = sub.add_parser("report", help="what each compiler stage saw and took, for one artifact")
    s.add_argument("key")
    s.add_argument("--json", action="store_true", help="print the whole report as JSON")
    s = sub.add_parser("source", help="list an artifact's generated code and graphs, or print one file")
    s.add_argument("key")
    s.add_argument("path", nargs="?", default=None, help="a path from the listing, e.g. code/kernel.cpp")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.cmd in ("serve", "worker"):  # long-running processes log; client commands print only what they report
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if a.cmd == "serve":
        return cmd_serve(a)
    if a.cmd == "worker":
        return cmd_worker(a)
    handlers = {"compile": cmd_compile, "pull": cmd_pull, "models": cmd_models, "jobs": cmd_jobs,
                "workers": cmd_workers, "caches": cmd_caches, "lookup": cmd_lookup, "cancel": cmd_cancel,
                "report": cmd_report, "source": cmd_source}
    try:
        with Client(a.url) as c:
            return handlers[a.cmd](c, a)
    except ClientError as e:
        print(f"aotc: the service refused: {e.message} (HTTP {e.status})", file=sys.stderr)
        return 2
    except JobFailed as e:
        err = e.job.get("error") or {}
        print(f"aotc: {e}", file=sys.stderr)
        if err.get("excerpt"):
            print("--- compiler output (last lines) ---\n" + err["excerpt"][-2000:], file=sys.stderr)
        return 1
    except (OSError, Exception) as e:
        import httpx

        if isinstance(e, httpx.TransportError):
            print(f"aotc: cannot reach the service at {a.url or os.environ.get('AOTC_URL') or 'http://127.0.0.1:8000'}: {e}"
                  " (is `aotc serve` running? set AOTC_URL)", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
