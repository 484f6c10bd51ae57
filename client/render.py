"""What the CLI shows: tables and the report summary on stdout, a job's progress on stderr.

On a terminal these are rich renderables. On a pipe the same content comes out as plain lines, with no colour, no
wrapping and no trailing spaces, so scripts and tests can read it (`aotc models | awk ...`). Each function here takes
the JSON the service answered and returns something to show; the commands in client/cli.py do the asking.
"""

from __future__ import annotations

import io
import json
import sys
import time
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import IO, Any

from rich.console import Console, Group, RenderableType
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from compiler import ontarget, speed
from compiler import report as rep
from compiler.shapes import format_spec

# The stages a job walks through, in order: the worker fetches the model, the compiler loads it and runs its report
# stages, then the worker checks the artifact and publishes it. Older workers report specialize/compile in place of
# capture..package; the bar stays put on a stage it does not know.
JOB_STAGES = rep.JOB_STAGES
TERMINAL_STATES = ("succeeded", "failed", "cancelled")


# -- output --------------------------------------------------------------------------------------------------------


def printable(value: Any, *, newlines: bool = False) -> str:
    """`value` as text that cannot drive a terminal. The service echoes what others uploaded (model names, error
    messages quoting an archive, compiler output), so every character that is not printable (control characters
    such as ESC, format characters such as bidi overrides, line separators) is shown as its escape (\\x1b, \\u202e).
    With `newlines`, line breaks stay line breaks (for multi-line compiler output)."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or (newlines and c == "\n") else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def plain(renderable: RenderableType) -> str:
    """The text of a renderable as a pipe gets it: no styles, no wrapping, no trailing spaces."""
    buf = io.StringIO()
    Console(file=buf, width=1_000_000, color_system=None, highlight=False, soft_wrap=True).print(renderable)
    return "".join(line.rstrip() + "\n" for line in buf.getvalue().splitlines())


def show(renderable: RenderableType, file: IO[str] | None = None) -> None:
    """Print to stdout (or `file`): rich on a terminal, plain() elsewhere."""
    out = file or sys.stdout
    console = Console(file=out, highlight=False)
    if console.is_terminal:
        console.print(renderable)
    else:
        out.write(plain(renderable))
        out.flush()


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Table:
    """Left-aligned columns two spaces apart, as `column -t` would print them. Cells are text, never markup, and
    never terminal control (printable())."""
    t = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for h in header:
        t.add_column(h, no_wrap=True)
    for r in rows:
        t.add_row(*(Text(printable(v)) for v in r))
    return t


# -- listings ------------------------------------------------------------------------------------------------------


def models_table(models: list[dict[str, Any]]) -> Table:
    return table(["MODEL", "NAME", "BYTES", "INPUTS"],
                 [[m["id"][:12], m["name"], m["size"], format_spec(m["inputs"], dtypes=True)] for m in models])


def jobs_table(jobs: list[dict[str, Any]]) -> Table:
    rows = []
    for j in jobs:
        err = (j.get("error") or {}).get("message", "") if j["state"] == "failed" else ""
        rows.append([j["id"][:12], j["state"], j.get("stage", ""), j["target"], j.get("attempts", 0),
                     j.get("artifact", "") or err[:60]])
    return table(["JOB", "STATE", "STAGE", "TARGET", "ATTEMPTS", "ARTIFACT / ERROR"], rows)


def served(worker: dict[str, Any]) -> str:
    """The targets a worker serves, highest first, the lower x86-64 levels by their level alone:
    'cpu-x86_64-v4 v3 v2 v1'; a target it builds without running there (AOTC_BUILD_ONLY_TARGETS) marked
    'v3 (build only)'."""
    targets = [str(t) for t in worker.get("targets") or [worker["target"]]]
    blind = set(worker.get("build_only") or ())
    first, rest = targets[0], targets[1:]
    prefix = first.rsplit("-", 1)[0] + "-"
    shown = [first, *(t[len(prefix):] if t.startswith(prefix) else t for t in rest)]
    return " ".join(f"{s} (build only)" if t in blind else s for s, t in zip(shown, targets))


def workers_table(workers: list[dict[str, Any]]) -> RenderableType:
    """One row per worker; then, for each unhealthy one (it claims no jobs), why: its children's failure and the
    tail of their stderr."""
    rows = table(["WORKER", "TARGETS", "DEVICE", "TOOLCHAIN", "HEALTH", "JOB"],
                 [[w["id"], served(w), w["device_name"], json.dumps(w["toolchain"]),
                   "ok" if w.get("healthy", True) else "UNHEALTHY", w.get("job") or "idle"] for w in workers])
    broken = [w for w in workers if w.get("healthy", True) is False]
    if not broken:
        return rows
    return Group(rows, *(Text(printable(f"\n{w['id']} is unhealthy since {_when(w.get('unhealthy_since'))}: "
                                        f"{w.get('unhealthy_reason') or '(no reason given)'}"
                                        + (f"\nthe last job that ran out of space: {w['last_disk_full']}"
                                           if w.get("last_disk_full") else ""), newlines=True))
                         for w in broken))


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else ""


def keys_table(keys: list[dict[str, Any]]) -> Table:
    return table(["KEY", "SCOPE", "NAMESPACE", "NAME", "CREATED", "REVOKED"],
                 [[k["id"], k["scope"], k["namespace"], k.get("name", ""), _when(k["created"]),
                   _when(k.get("revoked")) or "-"] for k in keys])


def namespaces_table(usages: list[dict[str, Any]]) -> Table:
    return table(["NAMESPACE", "MODELS", "JOBS", "MAX JOBS", "STORED GB", "MAX GB"],
                 [[u["namespace"], u["models"], u["jobs"], u["quota"]["max_jobs"],
                   f"{u['stored_bytes'] / 2**30:.3f}", f"{u['quota']['max_stored_gb']:g}"] for u in usages])


def caches_summary(caches: dict[str, Any]) -> Group:
    return Group(
        table(["NAMESPACE", "TARGET", "SYSTEM", "MAX-AUTOTUNE TIMINGS"],
              [[g.get("namespace") or "-", g["target"], g["system"][:16], g["entries"]]
               for g in caches["gemm_timings"]]),
        Text(printable(f"Inductor remote-cache entries (Triton autotune results): {caches['inductor_entries']}")),
    )


def sources_table(files: list[dict[str, Any]]) -> Table:
    return table(["PATH", "KIND", "BYTES"], [[f["path"], f["kind"], f["bytes"]] for f in files])


# -- the stage report ----------------------------------------------------------------------------------------------


def _seconds(v: Any) -> str:
    return "-" if v is None else f"{v:.2f} s"


def _dash(v: Any) -> str:
    return "-" if v is None else str(v)


def report_notes(key: str, report: dict[str, Any]) -> list[str]:
    """The lines under the stage table: what each stage found worth saying, then where the sources are."""
    st = report.get("stages", {})
    lines = []
    for d in st.get("capture", {}).get("dynamic_dims") or []:
        state = (f"stayed dynamic as {d['symbol']} in {d.get('min')}..{d.get('max')}" if d.get("stayed_dynamic")
                 else f"was specialised to {d.get('specialized_to')}")
        lines.append(f"dynamic dim: {d['input']} dim {d['dim']} (asked {d['requested']['min']}.."
                     f"{d['requested']['max']}) {state}")
    convs = st.get("capture", {}).get("convolutions")
    if convs:  # options.convolutions=generated (compiler/convs.py)
        lines.append(printable(convs.get("note") or f"convolutions: {convs.get('generated')} depthwise lowered to "
                               f"generated kernels ({convs.get('taps')} taps), {convs.get('left_to_library')} left "
                               "to the library"))
    ag = st.get("autograd", {})
    if ag.get("inplace_ops"):
        lines.append("in-place ops removed by functionalisation: "
                     + ", ".join(f"{op} x{n}" for op, n in ag["inplace_ops"].items()))
    tr = ag.get("training")
    if tr and tr.get("unavailable"):
        lines.append(f"training: {str(tr['unavailable'])[:300]}")
    elif tr:
        lines.append(f"training: joint graph {tr['joint']['nodes']} nodes -> forward {tr['forward']['nodes']} + "
                     f"backward {tr['backward']['nodes']} ({tr['partitioner']}); {tr['saved_for_backward']} tensors "
                     f"saved for backward, {tr['saved_activations']} of them activations")
    low = st.get("lowering", {})
    if low.get("decomposed"):
        lines.append("decomposed to core ATen: " + ", ".join(
            f"{d['op']} -> {' + '.join(d['into']) or '(nothing)'}" for d in low["decomposed"]))
    fu, cg = st.get("fusion", {}), st.get("codegen", {})
    if cg.get("status") == "ok":
        names = cg.get("kernels") or []
        lines.append(f"kernels generated: {cg.get('kernel_count')} ({cg.get('language')}): " + ", ".join(names[:8])
                     + (f", ... {len(names) - 8} more" if len(names) > 8 else ""))
    if fu.get("status") == "ok" and fu.get("externs"):
        lines.append(f"extern calls: {fu['extern_calls']}: " + ", ".join(
            f"{e['kernel']} ({e['library']})" for e in fu["externs"][:8]))
    check = st.get("package", {}).get("check") or {}
    if check:
        lines.append(f"on the worker ({check.get('device')}): {check.get('eager_ms')} ms eager -> "
                     f"{check.get('compiled_ms')} ms compiled, speedup {check.get('speedup')}x; max error vs eager "
                     f"{check.get('max_rel_err', 0):.2g}")
        verdict = speed.verdict(check, report.get("spec") or [])
        if verdict["slower_than_eager"]:
            lines.append(f"SLOWER THAN EAGER on the worker ({verdict['vs_eager']}x): published because it is "
                         "correct; lookup ranks it below any artifact that is not slower")
        if (check.get("graphs") or {}).get("replayable") is False:  # the worker dropped its graph figures
            lines.append(f"CUDA graphs: {speed.NOT_REPLAYABLE}")
        lines.extend(f"check note: {note}" for note in check.get("notes") or [])
    gemm = (report.get("caches") or {}).get("gemm_timings")
    if gemm:
        lines.append(f"max-autotune timings: {gemm.get('shared')} from other workers, {gemm.get('measured')} "
                     f"measured here, {gemm.get('published')} published"
                     + (f" ({gemm['note']})" if gemm.get("note") else ""))
    missing = {k: v for k, v in (report.get("hooks") or {}).items() if v.startswith("not in torch")}
    if missing:
        lines.append("not available in this torch: " + ", ".join(f"{k} ({v})" for k, v in missing.items()))
    lines.append(f"generated code and graphs: aotc source {key[:12]}... (GET /v1/artifacts/{key}/source)")
    return lines


def report_summary(key: str, meta: dict[str, Any], report: dict[str, Any]) -> Group:
    """`aotc report KEY`: one line on the artifact, the stage table (compiler.report.summary_rows), then notes."""
    head = (f"artifact {key}: model {meta['model_id'][:12]} on {meta['target']}, torch {report.get('torch')}, "
            f"mode {report.get('mode')}, shapes {format_spec(report.get('spec', []))}")
    stages = table(["STAGE", "STATUS", "TIME", "NODES IN", "NODES OUT", "DETAIL"],
                   [[r["stage"], r["status"], _seconds(r["seconds"]), _dash(r["nodes_before"]),
                     _dash(r["nodes_after"]), r["detail"]] for r in rep.summary_rows(report)])
    # The record's word (compiler.ontarget), as the service has it; a pull believes only what trusted keys signed.
    marked = [Text(printable(f"on target: {ontarget.describe(meta)}"))] if meta.get("on_target") else []
    return Group(Text(printable(head)), *marked, Text(""), stages, Text(""),
                 *(Text(printable(line)) for line in report_notes(key, report)))


def artifact_line(key: str, meta: dict[str, Any]) -> str:
    """What `aotc compile` says about the artifact it got, before printing the key."""
    check = meta.get("check") or {}
    blind = "" if ontarget.ran_on_target(meta) else f"; {ontarget.describe(meta)}"
    return printable(f"artifact {key}: {meta['size']} bytes, compiled in "
                     f"{meta['timings'].get('compile_total', 0):.1f} s, max error vs eager "
                     f"{check.get('max_rel_err', 0):.2g}, {check.get('eager_ms')} ms eager -> "
                     f"{check.get('compiled_ms')} ms compiled on the worker{blind}")


# -- job progress --------------------------------------------------------------------------------------------------


def stages_done(job: dict[str, Any], before: int = 0) -> int:
    """How many of JOB_STAGES the job has passed: all once it succeeded, `before` for a stage not in the list."""
    state, stage = job["state"], job.get("stage", "")
    if state == "succeeded":
        return len(JOB_STAGES)
    if state == "queued":
        return 0
    return JOB_STAGES.index(stage) if stage in JOB_STAGES else before


def status(job: dict[str, Any]) -> str:
    """'running: capture', 'queued: queued again after: worker lost', 'running: check, attempt 2'."""
    stage = job.get("stage", "")
    if job["state"] == "queued" and job.get("reason"):
        stage = f"queued again after: {job['reason']}"
        if job.get("not_before"):  # a retry waiting out its backoff
            stage += f" (next attempt in {max(0.0, float(job['not_before']) - time.time()):.0f} s)"
    attempt = f", attempt {job['attempts']}" if job.get("attempts", 0) > 1 else ""
    return printable(f"{job['state']}: {stage}{attempt}")


class JobProgress:
    """The `progress` callback for Client.wait. On a terminal, a rich progress bar on stderr; elsewhere one line per
    change, `[  3.0s] job a26295e1 [######--------------] running: capture` (scripts and tests read these)."""

    WIDTH = 20  # of the plain bar

    def __init__(self, file: IO[str] | None = None) -> None:
        self.file = file or sys.stderr
        self.console = Console(file=self.file, highlight=False)
        self.t0 = time.monotonic()
        self.done = 0
        self.last = ""
        self.bar: Progress | None = None
        self.task: TaskID | None = None

    def __enter__(self) -> JobProgress:
        if self.console.is_terminal:
            self.bar = Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                                TextColumn("{task.fields[status]}", markup=False), TimeElapsedColumn(),
                                console=self.console)
            self.bar.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.bar is not None:
            self.bar.stop()

    def line(self, job: dict[str, Any]) -> str:
        n = round(self.WIDTH * self.done / len(JOB_STAGES))
        return f"job {printable(job['id'][:8])} [{'#' * n}{'-' * (self.WIDTH - n)}] {status(job)}"

    def __call__(self, job: dict[str, Any]) -> None:
        self.done = stages_done(job, self.done)
        if self.bar is not None:
            if self.task is None:
                self.task = self.bar.add_task(f"job {printable(job['id'][:8])}", total=len(JOB_STAGES), status="")
            self.bar.update(self.task, completed=self.done, status=status(job))
            return
        line = self.line(job)
        if line != self.last:
            self.file.write(f"[{time.monotonic() - self.t0:6.1f}s] {line}\n")
            self.file.flush()
        self.last = line
