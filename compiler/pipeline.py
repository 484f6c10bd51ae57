"""The compile pipeline as named stages: load -> specialize -> compile (Inductor + AOTInductor packaging).

Each stage is reported through `on_stage` before it runs and timed; the result says which dims stayed dynamic.
This module knows nothing of HTTP or Redis: the worker runs it in a child process and relays the stages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compiler import torch_compat
from compiler.errors import CompileError
from compiler.inputs import Spec
from compiler.loading import load_program
from compiler.options import CompileOptions
from compiler.specialize import specialize

StageHook = Callable[[str], None]


def compile_model(
    model_path: str,
    spec: Spec,
    program_inputs: list[dict[str, Any]],
    options: CompileOptions,
    device: str,
    out_path: str,
    on_stage: StageHook = lambda stage: None,
) -> dict[str, Any]:
    timings: dict[str, float] = {}

    def run(stage: str, fn: Callable[[], Any]) -> Any:
        on_stage(stage)
        t0 = time.perf_counter()
        try:
            return fn()
        except CompileError as e:
            e.stage = e.stage or stage
            raise
        except Exception as e:
            raise CompileError(f"{type(e).__name__}: {e}", stage=stage) from e
        finally:
            timings[stage] = round(time.perf_counter() - t0, 3)

    ep = run("load", lambda: load_program(model_path))
    special = run("specialize", lambda: specialize(ep, spec, program_inputs, device))
    package = run(
        "compile",
        lambda: torch_compat.aoti_compile_and_package(special, out_path, options.inductor_configs()),
    )
    dynamic = [
        {"input": i["name"], "dim": j, "min": d["min"], "max": d["max"]}
        for i in spec
        for j, d in enumerate(i["shape"])
        if isinstance(d, dict)
    ]
    return {"package": str(package), "size": Path(package).stat().st_size, "timings": timings, "dynamic_dims": dynamic}
