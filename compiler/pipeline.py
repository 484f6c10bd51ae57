"""The compile pipeline as named stages: load -> capture -> autograd -> lowering -> fusion -> codegen -> package.

Each stage is reported through `on_stage` before it runs and timed; compiler.stages says what each one records.
The stage report (report.json) and the sources archive (sources.zip: every stage's FX graph and the generated
code) are written beside the package. Before either, the generated sources are scanned (compiler.scan): a package
whose code makes calls no kernel makes fails the compile as UnsafeCode and is removed, never checked. For
mode=training the package is built from the joint forward/backward program (compiler/training.py): a train step.

This module knows nothing of HTTP or Redis: the worker runs it in a child process and relays the stages.
"""

from __future__ import annotations

import json
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from compiler import report as rep
from compiler import stages
from compiler import training as training_mod
from compiler.errors import CompileError, described
from compiler.inputs import Spec
from compiler.loading import load_program
from compiler.options import CompileOptions
from compiler.targets import Target

StageHook = Callable[[str], None]
T = TypeVar("T")


def write_sources(path: Path, files: dict[str, str]) -> None:
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, text in sorted(files.items()):
            zf.writestr(name, text)
    tmp.rename(path)


def compile_model(
    model_path: str,
    spec: Spec,
    program_inputs: list[dict[str, Any]],
    options: CompileOptions,
    device: str,
    out_path: str,
    on_stage: StageHook = lambda stage: None,
    target: str | None = None,
    isa_scan_timeout_s: float = 120.0,
) -> dict[str, Any]:
    """`target`: the concrete target of the job; for an x86-64 level (cpu-x86_64-v3) the compile is pinned to it
    and the package read against it (compiler.isa), spending at most `isa_scan_timeout_s` disassembling it."""
    timings: dict[str, float] = {}
    pin = Target.parse(target).pin if target and device == "cpu" else None

    def run(stage: str, fn: Callable[[], T]) -> T:
        on_stage(stage)
        t0 = time.perf_counter()
        try:
            return fn()
        except CompileError as e:
            e.stage = e.stage or stage
            raise
        except Exception as e:
            message, excerpt = described(e)
            raise CompileError(message, stage=stage, excerpt=excerpt) from e
        finally:
            timings[stage] = round(time.perf_counter() - t0, 3)

    out_dir = Path(out_path).parent
    report: dict[str, Any] = {
        "schema": rep.SCHEMA, "torch": torch.__version__, "device": device, "mode": options.mode,
        "options": options.canonical(), "spec": spec, "stages": {}, "notes": [],
        **({"target": target} if target else {}),
    }
    files: dict[str, str] = {}

    def observe(stage: str, fn: Callable[[], dict[str, Any]]) -> None:
        """A stage that only observes: if torch cannot show it, the report says so and the compile goes on."""
        try:
            report["stages"][stage] = fn()
        except Exception as e:
            report["stages"][stage] = rep.unavailable(f"{type(e).__name__}: {str(e)[:1000]}")

    ep = run("load", lambda: load_program(model_path))
    captured = run("capture", lambda: stages.capture(ep, spec, program_inputs, device, options.precision,
                                                          autocast=options.training, training=options.training,
                                                          generated_convs=options.convolutions == "generated"))
    report["stages"]["capture"] = captured.facts
    files.update(captured.graphs)

    def autograd() -> stages.Functional:
        try:
            return stages.autograd(captured, training=options.training)
        except Exception as e:
            if options.training:
                raise  # for mode=training the joint graph is the result: its failure is the job's
            why = rep.unavailable(f"{type(e).__name__}: {str(e)[:1000]}")
            return stages.Functional(None, why)

    saved = training_mod.snapshot(captured.program) if options.training else {}
    functional = run("autograd", autograd)
    report["stages"]["autograd"] = functional.facts
    files.update(functional.graphs)
    build_from = captured
    if options.training:  # the package is the joint program's: a train step (compiler/training.py)
        traced = timings["autograd"]
        joint = run("autograd", lambda: training_mod.joint(captured, options.loss_output))
        timings["joint"], timings["autograd"] = timings["autograd"], traced
        build_from = joint.captured
        training_mod.restore(saved, captured.program, build_from.program)
        report["stages"]["autograd"]["train_step"] = joint.manifest(options.loss_output)

    def lowering() -> dict[str, Any]:
        if functional.program is None:
            return rep.unavailable("needs the functional graph, which the autograd stage could not produce")
        lowered = stages.lowering(functional, captured, prims_view=options.prims_view)
        files.update(lowered.graphs)
        return lowered.facts

    run("lowering", lambda: observe("lowering", lowering))

    # One Inductor compile covers fusion, codegen and package; the stage hooks inside report progress and
    # split its time.
    current = ["fusion"]  # the stage a failure is charged to

    def progress(stage: str) -> None:
        current[0] = stage
        on_stage(stage)

    t0 = time.perf_counter()
    try:
        compiled = stages.inductor(build_from, options, out_path, device, progress, pin)
    except CompileError as e:
        e.stage = e.stage or current[0]
        raise
    except Exception as e:
        message, excerpt = described(e)
        raise CompileError(message, stage=current[0], excerpt=excerpt) from e
    timings["compile"] = round(time.perf_counter() - t0, 3)
    # The second line after codegen: nothing has run the package yet, and nothing will if its sources make
    # calls no kernel makes (UnsafeCode, final; the package is removed).
    scanned = stages.scan(compiled)
    timings["scan"] = round(scanned.seconds, 4)
    isa_facts = None
    if pin is not None:  # and the third: a package above its level would die of SIGILL on a host of it
        t_isa = time.perf_counter()
        isa_facts = stages.isa_check(compiled, pin, isa_scan_timeout_s)
        timings["isa"] = round(time.perf_counter() - t_isa, 4)
    for name in ("fusion", "codegen", "package"):
        if compiled.phases.get(name) is not None:
            timings[name] = compiled.phases[name]  # type: ignore[assignment]
    t_report = time.perf_counter()  # the report's own work from here on: timed as "report"
    observe("fusion", lambda: stages.fusion(compiled))

    def codegen() -> dict[str, Any]:
        generated = stages.codegen(compiled)
        files.update(generated.files)
        return generated.facts

    observe("codegen", codegen)
    if compiled.observation.graphs:
        files["graphs/inductor_post_grad.py"] = compiled.observation.graphs[-1]["code"]
    observe("package", lambda: stages.package(compiled, build_from))
    report["stages"]["package"]["scan"] = scanned.facts()
    if isa_facts is not None:
        report["stages"]["package"]["isa"] = isa_facts
    report["hooks"] = compiled.observation.hooks
    if compiled.observation.errors:
        report["notes"] += [f"observer error (the compile carried on): {e}" for e in compiled.observation.errors]
    result: dict[str, Any] = {"package": compiled.package, "size": Path(compiled.package).stat().st_size,
              "weights": compiled.weights}

    sources_path = out_dir / "sources.zip"
    write_sources(sources_path, files)
    timings["report"] = round(time.perf_counter() - t_report, 3)  # observers, graphs and sources written
    report["timings"] = timings
    report_path = out_dir / "report.json"
    report_path.write_text(json.dumps(report, default=str))
    dynamic = [
        {"input": i["name"], "dim": j, "min": d["min"], "max": d["max"]}
        for i in spec
        for j, d in enumerate(i["shape"])
        if isinstance(d, dict)
    ]
    return {**result, "timings": timings, "dynamic_dims": dynamic, "report": str(report_path),
            "sources": str(sources_path)}
