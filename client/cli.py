"""The `aotc` command line: the SDK's calls as commands, shown by client/render.py.

    aotc compile model.pt2 --shape x=8x3x224x224 --target cpu   progress on stderr; the key is stdout's last line
      [--target cpu-x86_64-avx2 --target cuda-sm90 | --target all]  several targets: one job each
      [--name bert-base --tag prod]               record bert-base@N for the model, move the tag `prod` to it
    aotc pull KEY -o model.so.pt2                 fetch an artifact, verified against its signed manifest; the path
                                                  comes last
    aotc pull bert-base:prod --shape x=8x128      by name: the artifact for this machine, and why it was picked
    aotc pull KEY --self-contained -o m.pt2       its build with the weights inside (built on request, waited for)
    aotc versions NAME [--history] | names        a name's versions (tags, artifacts per target) | every name
    aotc tag NAME@3 canary | untag NAME:canary    move a tag (recorded: who, when) | remove one
    aotc delete-version NAME@3                    its tags go; its model stays pinned while another version holds it
    aotc run KEY [--cuda-graphs]                  pull, load and run it on example inputs: what ran, latency
    aotc signing-keys [--revoke KID]              the keys artifacts are signed with; revoke one (admin)
    aotc report KEY                               a table of the compiler's stages for one artifact
    aotc source KEY [PATH]                        its generated code and graphs
    aotc caches [--clear]                         the compile caches workers share through Redis
    aotc pin KEY | unpin KEY                      keep an artifact from eviction, or let it go again
    aotc models | jobs | workers | lookup | cancel
    aotc serve | worker                           exec `aotc-server` / `aotc-worker` (aotc[server], aotc[worker])

Exit status: 0 done, 1 the job failed (or nothing fits, for lookup), 2 a request the service refused, a service that
cannot be reached, or a command line that cannot be read, 3 an artifact refused because its signed manifest does not
verify (client/verify.py). This module imports no server, no Redis and no torch (`run` imports it to load).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

import httpx
import typer

from client import render
from client.sdk import Artifact, Client, ClientError, JobFailed, asked_by_pick
from client.verify import Asked, check_here
from compiler.errors import BadSignature, Unprocessable
from compiler.options import Convolutions, Mode, Precision
from compiler.refs import Ref
from compiler.shapes import Dim, parse_shape_args
from compiler.targets import Target
from compiler.weightsfile import sidecar

Priority = Literal["interactive", "batch"]

app = typer.Typer(
    name="aotc",
    help="Ahead-of-time compilation of torch.export programs: compile on the service, pull checked AOTInductor "
    "packages.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)


def _say(message: str) -> None:
    """A progress or status line: stderr, so that stdout keeps only what scripts read."""
    typer.echo(message, err=True)


def _fail(message: str, code: int = 2) -> NoReturn:
    # The message may quote what someone else uploaded (a model name, an archive entry): never raw to the terminal.
    _say(f"aotc: {render.printable(message, newlines=True)}")
    raise typer.Exit(code)


@contextmanager
def _service(ctx: typer.Context) -> Iterator[Client]:
    """A Client for the command, and the service's answers turned into exit statuses."""
    client = Client(ctx.obj)
    try:
        with client:
            yield client
    except ClientError as e:
        _fail(f"the service refused: {e.message} (HTTP {e.status})", 2)
    except JobFailed as e:
        err = e.job.get("error") or {}
        _say(f"aotc: {e}")
        if err.get("excerpt"):
            _say("--- compiler output (last lines) ---\n" + err["excerpt"][-2000:])
        raise typer.Exit(1) from None
    except httpx.TransportError as e:
        _fail(f"cannot reach the service at {client.url}: {e} (is `aotc-server` running? set AOTC_URL or --url)", 2)


def _shapes(args: list[str]) -> dict[str, list[Dim]]:
    try:
        return parse_shape_args(args)
    except Unprocessable as e:
        _fail(f"--shape: {e.message}")


def _target(text: str) -> str:
    try:
        return str(Target.parse(text))
    except Unprocessable as e:
        _fail(f"--target: {e.message}")


def _inductor_settings(args: list[str]) -> dict[str, Any]:
    """--inductor KEY=VALUE, VALUE read as JSON (true, 64, "ATEN,TRITON") or else as a string; the service checks KEY
    against its allow-list and refuses anything else."""
    out: dict[str, Any] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key.strip():
            _fail(f"--inductor: cannot read {arg!r}: write KEY=VALUE, e.g. epilogue_fusion=false")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


ShapeOption = Annotated[list[str], typer.Option(
    "--shape", metavar="NAME=SHAPE",
    help="Once per input: 8x3x224x224, or 1..32x3x224x224 for a dynamic dim (each dim a size or a range).")]
TargetOption = Annotated[str, typer.Option(help="cpu, cuda, or a concrete target such as cuda-sm90.")]


@app.callback()
def _main(
    ctx: typer.Context,
    url: Annotated[str | None, typer.Option(
        help="The service's URL (default: $AOTC_URL or http://127.0.0.1:8000).", show_default=False)] = None,
) -> None:
    ctx.obj = url


# -- compile and fetch ---------------------------------------------------------------------------------------------


@app.command("compile")
def compile_(
    ctx: typer.Context,
    model: Annotated[Path, typer.Argument(exists=True, dir_okay=False, metavar="MODEL",
                                          help="A torch.export.save archive (.pt2).")],
    shape: ShapeOption,
    target: Annotated[list[str] | None, typer.Option(
        help="cpu, cuda, a concrete target such as cuda-sm90, or all (every target the farm serves). Repeat it for "
        "several: one job each.")] = None,
    mode: Annotated[Mode, typer.Option(help="max-autotune: slower compile, faster kernels. training: a train-step "
                                       "package (docs/training.md).")] = "default",
    loss_output: Annotated[int, typer.Option(
        min=0, help="With --mode training: which output of the program is the loss.")] = 0,
    autotune: Annotated[bool, typer.Option(
        "--autotune", help="With --mode training: tune the train step's matmuls at build time, as max-autotune "
        "does for inference (a slower compile).")] = False,
    precision: Annotated[Precision, typer.Option(
        help="Compute in bf16/fp16 for inference; inputs and outputs keep their dtypes. With --mode training: "
        "autocast to it.")] = "keep",
    freezing: Annotated[bool, typer.Option("--freezing", help="Fold weights into the graph as constants.")] = False,
    allow_nonfinite: Annotated[bool, typer.Option(
        "--allow-nonfinite", help="Publish even if outputs hold NaN or inf (they must match eager's).")] = False,
    convolutions: Annotated[Convolutions, typer.Option(
        help="generated: depthwise convolutions as generated kernels and 1x1 ones as matmuls, so the package's first "
        "call builds no cuDNN plan for them (on a GPU a start 10x faster, steady calls as fast).")] = "library",
    inductor: Annotated[list[str] | None, typer.Option(
        "--inductor", metavar="KEY=VALUE",
        help="An allow-listed Inductor setting, e.g. coordinate_descent_tuning=true (repeatable).")] = None,
    priority: Annotated[Priority, typer.Option(help="Interactive jobs are served before batch jobs.")] = "interactive",
    name: Annotated[str | None, typer.Option(
        help="Record a new version of this registry name (NAME@N) pointing at the model; also the model's name "
        "(default: the file's stem, and no version).")] = None,
    tag: Annotated[list[str] | None, typer.Option(
        "--tag", help="Move this tag to the new version (needs --name; repeatable).")] = None,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="Print the job id and return.")] = False,
) -> None:
    """Upload a .pt2 and compile it. Progress goes to stderr; the artifact key is stdout's last line (with several
    targets: one `TARGET KEY` line per target built)."""
    shapes = _shapes(shape)
    targets = [t if t.strip().lower() == "all" else _target(t) for t in (target or ["cpu"])]
    if tag and name is None:
        _fail("--tag moves a tag to the version --name records: give --name too")
    options: dict[str, Any] = {"mode": mode, "precision": precision, "freezing": freezing}
    if allow_nonfinite:  # only when set: an option at its default is not part of the cache key
        options["allow_nonfinite"] = True
    if loss_output:  # likewise
        options["loss_output"] = loss_output
    if convolutions != "library":  # likewise
        options["convolutions"] = convolutions
    if autotune:  # likewise
        options["autotune"] = True
    if inductor:
        options["inductor"] = _inductor_settings(inductor)
    with _service(ctx) as c:
        record = c.upload(model, name=name)
        _say(f"uploaded {model} as model {record['id'][:12]} ({record['size']} bytes)")
        several = len(targets) > 1 or targets[0] == "all"
        answer = c.submit(record["id"], shapes, targets[0], priority=priority,
                          targets=targets if several else None, name=name, tags=tag or (), **options)
        if answer.get("version"):
            v = answer["version"]
            _say(f"recorded {v['ref']} -> model {v['model_id'][:12]}"
                 + (f" (tags: {', '.join(t for t in v['tags'])})" if v["tags"] else ""))
        if several:
            _compile_several(c, answer, no_wait)
            return
        if answer["status"] == "cached":
            _say("cache hit: already compiled")
            typer.echo(answer["key"])
            return
        job = answer["job"]
        _say(f"{answer['status']} job {job['id']} for target {job['target']}")
        if no_wait:
            typer.echo(job["id"])
            return
        with render.JobProgress() as progress:
            art = c.wait(job["id"], progress=progress)
        _say(render.artifact_line(art.key, art.meta))
        typer.echo(art.key)


def _compile_several(c: Client, answer: dict[str, Any], no_wait: bool) -> None:
    """Every target's job, one after another with its progress; then `TARGET KEY` per target built on stdout.
    Exit 1 when some target was not built (unserved, refused or failed): the others are still printed."""
    entries = answer["targets"]
    for e in entries:
        if e["status"] in ("unserved", "refused"):
            _say(f"{e['target']}: {e['status']}: {render.printable(e['error']['message'])}")
        elif e["status"] == "cached":
            _say(f"{e['target']}: cache hit")
        else:
            _say(f"{e['target']}: {e['status']} job {e['job']['id']} for target {e['job']['target']}")
    if no_wait:
        for e in entries:
            if e.get("job"):
                typer.echo(f"{e['job']['target']} {e['job']['id']}")
        return
    missing = [e for e in entries if e["status"] in ("unserved", "refused")]
    for e in entries:
        if e.get("job"):
            _say(f"{e['target']}: waiting for job {e['job']['id'][:8]}")
            try:
                with render.JobProgress() as progress:
                    art = c.wait(e["job"]["id"], progress=progress)
            except JobFailed as failed:
                _say(f"aotc: {e['target']}: {failed}")
                missing.append(e)
                continue
            _say(render.artifact_line(art.key, art.meta))
            typer.echo(f"{art.meta['target']} {art.key}")
        elif e["status"] == "cached":
            typer.echo(f"{e['artifact']['target']} {e['key']}")
    if missing:
        _say(f"aotc: not built for {', '.join(e['target'] for e in missing)}")
        raise typer.Exit(1)


@app.command()
def pull(
    ctx: typer.Context,
    key: Annotated[str, typer.Argument(help="The artifact key, or a registry reference: NAME:TAG, NAME@VERSION, "
                                       "NAME (its latest).")],
    output: Annotated[Path | None, typer.Option("-o", "--output",
                                                help="Where to write it (default: the local cache).")] = None,
    shape: Annotated[list[str] | None, typer.Option(
        "--shape", metavar="NAME=SHAPE", help="By reference: the shapes the artifact must serve.")] = None,
    target: Annotated[str | None, typer.Option(
        help="By reference: the concrete target to pick for (default: this machine's, detected).")] = None,
    device: Annotated[str, typer.Option(help="By reference: the device whose target is detected: cpu, cuda:0, "
                                        "auto.")] = "auto",
    allow_unverified: Annotated[bool, typer.Option(
        "--allow-unverified", help="Also take a package built for its target but not yet run there (no trusted "
        "countersignature yet).")] = False,
    verify: Annotated[Path | None, typer.Option(
        "--verify", metavar="MODEL.pt2", help="Run the artifact check here, against the exported program it was "
        "built from, before the path is printed (imports torch); implies --allow-unverified. Records nothing on "
        "the service.")] = None,
    self_contained: Annotated[bool, typer.Option(
        "--self-contained", help="The package with its weights inside (no weights blob to bind; torch's own "
        "aoti_load_package runs it), built on request: a compile, waited for.")] = False,
) -> None:
    """Download an artifact, verified against its signed manifest (keys: $AOTC_TRUSTED_KEYS, else the service's).
    By reference, the service picks the artifact for this machine (exact target first, then a compatible one) and
    says why. A weightless package's weights blob, verified too, goes beside it as NAME.weights.safetensors, where
    aotc's loader binds it. A package built for its target without running there is refused until a worker that
    serves the target countersigns it, unless --allow-unverified or --verify. The path is stdout's last line; exit 3
    when the artifact is refused (or fails --verify), with nothing written; exit 1 when nothing of a reference fits
    this machine (each candidate and why)."""
    asked: Asked | None = None
    with _service(ctx) as c:
        c.verifier.allow_unverified = allow_unverified or verify is not None
        if not re.fullmatch(r"[0-9a-f]{32}", key):
            try:
                Ref.parse(key)
            except Unprocessable as e:
                _fail(e.message)
            try:
                picked = c.pick(key, _shapes(shape or []), device=device,
                                target=_target(target) if target else None)
                asked = asked_by_pick(key, picked, _shapes(shape or []))
            except ClientError as e:
                if e.status != 404:
                    raise
                _fail(e.message, 1)
            _say(f"{key} is {picked['version']['ref']} (model {picked['version']['model_id'][:12]}); for "
                 f"{picked['host']}: {picked['key']} ({picked['target']}, {picked['match']}): {picked['reason']}")
            key = picked["key"]
        try:
            art: Artifact | str = key
            if self_contained:
                with render.JobProgress() as progress:
                    art = built = c.self_contained(key, progress=progress)
                _say(f"{key}: its self-contained build is {built.key}")
                key = built.key
            if asked is not None:  # the picked artifact's signed manifest must answer what the pick asked
                art = replace(art if isinstance(art, Artifact) else c.artifact(key), asked=asked)
            path = c.pull(art, output)
            weights = c.pull_weights(key, sidecar(path))
            checked = _verify_here(c, key, path, verify, device) if verify is not None else ""
        except BadSignature as e:
            _fail(f"refused artifact {key}: {e.message}", 3)
    extra = f"; weights {weights.name}, {weights.stat().st_size} bytes, verified" if weights else ""
    _say(f"pulled {key} ({path.stat().st_size} bytes, signature and digest verified{extra}){checked}")
    typer.echo(str(path))


def _verify_here(c: Client, key: str, path: Path, model: Path, device: str) -> str:
    """`pull --verify`: the check on this machine (client.verify.check_here); a failure removes what was pulled."""
    from compiler.errors import CompileError

    try:
        art = c.artifact(key)
        signed = c.verifier.manifest(key, art.meta)
        here = device if device != "auto" else str(art.meta.get("target", "cpu")).split("-")[0]
        result = check_here(path, model, signed, "cuda:0" if here == "cuda" else here)
    except (CompileError, BadSignature, OSError) as e:  # nothing it wrote is left for a script to pick up
        for p in (path, sidecar(path)):
            p.unlink(missing_ok=True)
        if isinstance(e, BadSignature):
            raise
        raise BadSignature("check_failed", f"the check here failed: {getattr(e, 'message', None) or e}") from None
    return (f"; checked here against {model.name}: max abs err {result['max_abs_err']:.2g} at "
            f"{len(result['points'])} point(s) (recorded nowhere)")


@app.command()
def run(
    ctx: typer.Context,
    key: Annotated[str, typer.Argument(help="The artifact key.")],
    shape: Annotated[list[str] | None, typer.Option(
        "--shape", metavar="NAME=SHAPE", help="Input shapes (needed for a dynamic spec; default: the artifact's).")
    ] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda:N (default: the artifact's kind).")] = None,
    cuda_graphs: Annotated[bool, typer.Option(
        "--cuda-graphs", help="Replay a CUDA graph per static shape; says why not where it cannot.")] = False,
    repeat: Annotated[int, typer.Option(min=0, help="Timed calls after the first.")] = 20,
) -> None:
    """Pull an artifact, load it and run it on example inputs: what ran (a CUDA graph or the plain run, and why),
    the output shapes, the first call and the median latency. A deployment's smoke test; imports torch."""
    shapes = _shapes(shape) if shape else None
    with _service(ctx) as c:
        try:
            art = c.artifact(key)
            device = device or ("cuda:0" if str(art.meta.get("target", "")).startswith("cuda") else "cpu")
            fn = c.load(art, device, cuda_graphs=cuda_graphs)
        except BadSignature as e:
            _fail(f"refused artifact {key}: {e.message}", 3)
    from client.graphs import run_once_and_time  # imports torch: only to load and run

    try:
        lines = run_once_and_time(fn, art.meta["spec"], shapes, device, repeat)
    except ValueError as e:
        _fail(str(e))
    for line in lines:
        typer.echo(line)


@app.command("signing-keys")
def signing_keys(
    ctx: typer.Context,
    revoke: Annotated[str | None, typer.Option(
        "--revoke", metavar="KID", help="Revoke this key (admin): what it signed is refused from now on.")] = None,
) -> None:
    """The public keys workers sign artifact manifests with, active and revoked. Pin them on inference servers
    with AOTC_TRUSTED_KEYS=KID=PUBLIC_KEY,... rather than trusting what the service lists."""
    with _service(ctx) as c:
        if revoke:
            record = c.verifier.revoke(revoke)
            typer.echo(f"revoked signing key {record['kid']}")
            return
        found = c.verifier.keys()
    render.show(render.table(["KID", "ALGORITHM", "CREATED", "REVOKED", "PUBLIC KEY"], [
        (k["kid"], k["algorithm"], _utc(k["created"]), _utc(k["revoked_at"]) if k.get("revoked_at") else "-",
         k["public_key"]) for k in found]))


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t))


@app.command()
def pin(ctx: typer.Context, key: Annotated[str, typer.Argument(help="The artifact key.")]) -> None:
    """Keep an artifact: the service never evicts a pinned one when its store is full."""
    with _service(ctx) as c:
        c.pin(key)
    typer.echo(f"pinned {key}")


@app.command()
def unpin(ctx: typer.Context, key: Annotated[str, typer.Argument(help="The artifact key.")]) -> None:
    """Let an artifact be evicted again (least recently pulled first) when the service's store is full."""
    with _service(ctx) as c:
        c.unpin(key)
    typer.echo(f"unpinned {key}")


@app.command()
def lookup(
    ctx: typer.Context,
    model_id: Annotated[str, typer.Argument(help="The model's id, or a unique prefix as `aotc models` shows.")],
    shape: ShapeOption,
    target: TargetOption = "cpu",
    cuda_graphs: Annotated[bool, typer.Option(
        "--cuda-graphs", help="You will replay CUDA graphs: rank by the check's graph-replay figures.")] = False,
    allow_unverified: Annotated[bool, typer.Option(
        "--allow-unverified", help="Also a package built for the target but not yet run there.")] = False,
) -> None:
    """Find the artifact that serves a model, shapes and target; exit 1 if none does."""
    shapes, target = _shapes(shape), _target(target)
    with _service(ctx) as c:
        c.verifier.allow_unverified = allow_unverified
        art = c.lookup(model_id, shapes, target, graphs=cuda_graphs)
    if art is None:
        _say("no artifact fits")
        raise typer.Exit(1)
    typer.echo(art.key)


@app.command()
def cancel(ctx: typer.Context, job_id: Annotated[str, typer.Argument(help="The job's id.")]) -> None:
    """Cancel a job: a queued one at once, a running one within seconds."""
    with _service(ctx) as c:
        job = c.cancel(job_id)
    typer.echo(f"job {job['id']}: {job['state']}{' (cancelling)' if job.get('cancel_requested') else ''}")


# -- the registry --------------------------------------------------------------------------------------------------


def _built(v: dict[str, Any]) -> str:
    """A version's artifacts per target, e.g. `cpu-x86_64-avx2: built 34be71ec; cuda-sm90: queued`."""
    per: dict[str, list[str]] = {}
    for a in v.get("artifacts") or []:
        per.setdefault(a["target"], []).append(f"{a['status']} {a['key'][:8]}" if a["status"] == "built" and a.get(
            "key") else a["status"])
    return "; ".join(f"{t}: {', '.join(s)}" for t, s in sorted(per.items())) or "-"


@app.command()
def versions(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The registry name.")],
    history: Annotated[bool, typer.Option("--history", help="Show the tag moves instead: who, when.")] = False,
) -> None:
    """A name's versions, newest first: model, created, tags, and per target what is built or still queued."""
    with _service(ctx) as c:
        if history:
            moves = c.tag_history(name)
            render.show(render.table(["WHEN", "TAG", "FROM", "TO", "BY"], [
                (_utc(m["at"]), m["tag"], m.get("from") or "-", m.get("to") or "(removed)", m["by"])
                for m in moves]))
            return
        found = c.versions(name)
    render.show(render.table(["VERSION", "MODEL", "CREATED", "TAGS", "ARTIFACTS"], [
        (v["ref"], v["model_id"][:12], _utc(v["created"]), ",".join(v["tags"]) or "-", _built(v)) for v in found]))


@app.command()
def names(ctx: typer.Context) -> None:
    """The registry names of this key's namespace, with their latest version and tags."""
    with _service(ctx) as c:
        found = c.names()
    render.show(render.table(["NAME", "VERSIONS", "LATEST", "TAGS"], [
        (n["name"], n["versions"], n["latest"] or "-",
         " ".join(f"{t}={v}" for t, v in sorted(n["tags"].items())) or "-") for n in found]))


@app.command()
def tag(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="The version: NAME@VERSION, or NAME:TAG for the version a tag names.")],
    tag: Annotated[str, typer.Argument(help="The tag to move there.")],
) -> None:
    """Move a tag to a version, atomically; the move is recorded (`aotc versions NAME --history`)."""
    with _service(ctx) as c:
        moved = c.tag(ref, tag)
    was = f" (was @{moved['previous']})" if moved["previous"] else " (new)"
    typer.echo(f"{moved['name']}:{moved['tag']} -> {moved['name']}@{moved['version']}{was}")


@app.command()
def untag(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="NAME:TAG.")],
) -> None:
    """Remove a tag; the version stays."""
    name, sep, which = ref.partition(":")
    if not sep:
        _fail(f"cannot read {ref!r}: write NAME:TAG")
    with _service(ctx) as c:
        gone = c.untag(name, which)
    typer.echo(f"removed {name}:{which} (was @{gone['previous']})")


@app.command("delete-version")
def delete_version(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="NAME@VERSION.")],
) -> None:
    """Delete a version and its tags. Its model's artifacts stay pinned while another version holds the model."""
    try:
        parsed = Ref.parse(ref)
    except Unprocessable as e:
        _fail(e.message)
    if parsed.version is None:
        _fail(f"cannot read {ref!r}: write NAME@VERSION")
    with _service(ctx) as c:
        gone = c.delete_version(parsed.name, parsed.version)
    removed = f"; tags removed: {', '.join(gone['tags_removed'])}" if gone["tags_removed"] else ""
    typer.echo(f"deleted {gone['ref']}{removed}; versions here still holding its model: {gone['model_still_held_by']}")


# -- listings ------------------------------------------------------------------------------------------------------


@app.command()
def models(ctx: typer.Context) -> None:
    """List uploaded models and their inputs."""
    with _service(ctx) as c:
        render.show(render.models_table(c.models()))


@app.command()
def jobs(ctx: typer.Context,
         limit: Annotated[int, typer.Option(min=1, max=1000, help="How many, newest first.")] = 20) -> None:
    """List recent jobs."""
    with _service(ctx) as c:
        render.show(render.jobs_table(c.jobs(limit)))


@app.command()
def workers(ctx: typer.Context) -> None:
    """List live workers."""
    with _service(ctx) as c:
        render.show(render.workers_table(c.workers()))


@app.command()
def caches(
    ctx: typer.Context,
    clear: Annotated[bool, typer.Option(
        "--clear", help="Drop them (artifacts stay; later compiles start cold).")] = False,
) -> None:
    """The compile caches workers share: max-autotune timings, Inductor remote-cache entries."""
    with _service(ctx) as c:
        if clear:
            removed = c.clear_caches()
            typer.echo(f"removed {removed['gemm_timings']} max-autotune timing table(s) and "
                       f"{removed['inductor_entries']} Inductor remote-cache entries")
            return
        render.show(render.caches_summary(c.caches()))


@app.command()
def report(
    ctx: typer.Context,
    key: Annotated[str, typer.Argument(help="The artifact key.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole report as JSON.")] = False,
) -> None:
    """What each compiler stage saw and took, for one artifact."""
    with _service(ctx) as c:
        if as_json:
            typer.echo(json.dumps(c.report(key), indent=1))
            return
        render.show(render.report_summary(key, c.artifact(key).meta, c.report(key)))


@app.command()
def source(
    ctx: typer.Context,
    key: Annotated[str, typer.Argument(help="The artifact key.")],
    path: Annotated[str | None, typer.Argument(help="A path from the listing, e.g. code/kernel.cpp.")] = None,
) -> None:
    """List an artifact's generated code and graphs, or print one file."""
    with _service(ctx) as c:
        if path:
            sys.stdout.write(c.source(key, path))
            return
        render.show(render.sources_table(c.sources(key)))


# -- keys and namespaces -------------------------------------------------------------------------------------------

keys_app = typer.Typer(help="API keys (admin): create, list, revoke.", no_args_is_help=True)
namespaces_app = typer.Typer(help="Namespaces and their quotas (admin).", invoke_without_command=True)
app.add_typer(keys_app, name="keys")
app.add_typer(namespaces_app, name="namespaces")


@keys_app.command("create")
def keys_create(
    ctx: typer.Context,
    scope: Annotated[str, typer.Option(help="pull (lookup and download), compile (upload, compile, jobs; and pull) "
                                            "or admin (everything, every namespace).")],
    namespace: Annotated[str, typer.Option(help="The namespace the key sees and creates in.")] = "default",
    name: Annotated[str, typer.Option(help="What the key is for.")] = "",
) -> None:
    """Create a key. It is printed once, on stdout: the service keeps only its hash."""
    with _service(ctx) as c:
        made = c.create_key(scope, namespace, name)
    _say(f"created key {made['id']}: scope {made['scope']}, namespace {made['namespace']}. "
         "Store it now; it is not shown again.")
    typer.echo(made["key"])


@keys_app.command("list")
def keys_list(ctx: typer.Context) -> None:
    """Every key, without its secret."""
    with _service(ctx) as c:
        render.show(render.keys_table(c.keys()))


@keys_app.command("revoke")
def keys_revoke(ctx: typer.Context, key_id: Annotated[str, typer.Argument(help="The key's id.")]) -> None:
    """Revoke a key: refused from now on (within AOTC_AUTH_CACHE_S on every API process)."""
    with _service(ctx) as c:
        c.revoke_key(key_id)
    typer.echo(f"revoked key {key_id}")


@namespaces_app.callback()
def namespaces_list(ctx: typer.Context) -> None:
    """Every namespace: its models, jobs and stored bytes against its quotas."""
    if ctx.invoked_subcommand is None:
        with _service(ctx) as c:
            render.show(render.namespaces_table(c.namespaces()))


@namespaces_app.command("quota")
def namespaces_quota(
    ctx: typer.Context,
    namespace: Annotated[str, typer.Argument(help="The namespace.")],
    max_jobs: Annotated[int | None, typer.Option(min=1, help="Queued plus running jobs.")] = None,
    max_gb: Annotated[float | None, typer.Option(min=0.000001, help="Stored bytes (models and artifacts).")] = None,
) -> None:
    """Set a namespace's quotas."""
    with _service(ctx) as c:
        render.show(render.namespaces_table([c.set_quota(namespace, max_jobs=max_jobs, max_stored_gb=max_gb)]))


@app.command()
def me(ctx: typer.Context) -> None:
    """The key in use ($AOTC_API_KEY): its scope, its namespace and what the namespace holds."""
    with _service(ctx) as c:
        who = c.me()
    typer.echo(f"key {who['key_id']}: scope {who['scope']}, namespace {who['namespace']}")
    render.show(render.namespaces_table([who["usage"]]))


# -- servers -------------------------------------------------------------------------------------------------------
# The servers are other packages' entry points (aotc-server, aotc-worker), installed with the extras. These two
# commands hand the whole command line over to them, --help included, so their options are defined once.

_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def _exec(command: str, module: str, needs: tuple[str, ...], extra: str, args: list[str]) -> NoReturn:
    """Replace this process with `python -m module args` (signals then reach the server itself)."""
    if any(importlib.util.find_spec(name) is None for name in needs):
        _fail(f"`aotc {command}` needs the {extra} parts, which are not installed here: install aotc[{extra}]")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


@app.command(context_settings=_PASS_THROUGH, add_help_option=False)
def serve(ctx: typer.Context) -> None:
    """Run the API, an embedded Redis and a worker (aotc-server, from the server extra)."""
    _exec("serve", "service", ("fastapi", "uvicorn", "redis"), "server", ctx.args)


@app.command(context_settings=_PASS_THROUGH, add_help_option=False)
def worker(ctx: typer.Context) -> None:
    """Run one worker, one per GPU or one for the CPU (aotc-worker, from the worker extra)."""
    _exec("worker", "worker", ("torch", "redis"), "worker", ctx.args)


if __name__ == "__main__":
    app()
