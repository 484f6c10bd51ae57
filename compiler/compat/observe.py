"""Observing the Inductor compile that builds the package.

The report's fusion and codegen stages are read off the one compile that produces the package, through torch's
own extension points. Each is looked up before use; one that a torch lacks is recorded as missing and the stage
it feeds says so in the report, never failing the compile:
  post_grad_custom_post_pass            the FX graph Inductor lowers, after its decompositions and post-grad
                                        passes (public config; a plain callable in every supported torch)
  _pre_fusion_custom_pass               the scheduler nodes before fusion (private: "prototype" in torch)
  _post_fusion_custom_pass              the scheduler nodes after fusion (private, newer than the pre-fusion hook)
  trace.provenance_tracking_level       kernel -> FX node mapping, logged as the trace artifact
    (trace.provenance_tracking before)  inductor_provenance_tracking_node_mappings
  torch._logging structured trace       a handler on torch's trace logger collects artifacts by name:
                                        inductor_aot_wrapper_code (marks the end of codegen) and the provenance map
  torch._inductor.utils.run_and_get_code  the Python wrapper module(s); on GPUs the first of AOTInductor's two
                                        codegen passes is Python and holds every Triton kernel's source
  AsyncCompile.triton                   every Triton kernel module the compile hands to Triton, as it is handed
                                        (torch/_inductor/async_compile.py; `triton(self, kernel_name, source_code,
                                        device_str)` in 2.11 and 2.13): what becomes the package's cubins, for
                                        compiler.scan, wherever Inductor then writes it
The observed compile runs with fx_graph_cache off: a cache hit would skip the scheduler and leave nothing to see.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from compiler.compat import optional_module
from compiler.compat.graphs import graph_facts

_WANTED_TRACE_ARTIFACTS = (
    "inductor_post_grad_graph",
    "inductor_aot_wrapper_code",
    "inductor_aot_kernel_code",
    "inductor_provenance_tracking_node_mappings",
    "inductor_output_code",
    "inductor_autotune_at_compile_time_code",
)


@dataclass
class InductorObservation:
    """What one observed Inductor compile showed. Plain data only: no torch objects outlive the compile."""

    graphs: list[dict[str, Any]] = field(default_factory=list)  # post-grad FX graphs, one per compiled graph
    scheduler_runs: list[dict[str, Any]] = field(default_factory=list)  # {"before": [...], "after": [...]}
    artifacts: dict[str, list[str]] = field(default_factory=dict)  # structured-trace artifact name -> payloads
    output_code: list[str] = field(default_factory=list)  # Python wrapper modules (run_and_get_code)
    kernel_sources: dict[str, str] = field(default_factory=dict)  # Triton kernel name -> module source compiled
    marks: list[tuple[str, float]] = field(default_factory=list)  # (event, perf_counter) as the compile went
    hooks: dict[str, str] = field(default_factory=dict)  # hook -> "used" or why not
    errors: list[str] = field(default_factory=list)  # an observer that failed (the compile carried on)


def _config_has(config: Any, dotted: str) -> bool:
    owner = config
    parts = dotted.split(".")
    for p in parts[:-1]:
        owner = getattr(owner, p, None)
        if owner is None:
            return False
    try:
        getattr(owner, parts[-1])
    except AttributeError:
        return False
    return True


def _scheduler_node(n: Any) -> dict[str, Any]:
    members = list(n.get_nodes()) if hasattr(n, "get_nodes") else [n]
    origins: set[str] = set()
    for m in members:
        for o in getattr(getattr(m, "node", None), "origins", None) or ():
            origins.add(getattr(o, "name", str(o)))
    kind = type(n).__name__
    extern = bool(getattr(n, "is_extern", lambda: False)())
    d: dict[str, Any] = {
        "name": n.get_name(),
        "type": kind,
        "members": [m.get_name() for m in members],
        "origins": sorted(origins),
        "extern": extern,
        "nop": kind == "NopKernelSchedulerNode",
        "reduction": bool(getattr(n, "is_reduction", lambda: False)()),
        "template": bool(getattr(n, "is_template", lambda: False)()),
    }
    if extern:
        ir_node = getattr(n, "node", None)
        d["kernel"] = str(getattr(ir_node, "python_kernel_name", None) or getattr(ir_node, "op_overload", None)
                          or type(ir_node).__name__)
    return d


class _TraceCollector(logging.Handler):
    def __init__(self, obs: InductorObservation, on_artifact: Callable[[str], None]) -> None:
        super().__init__(logging.DEBUG)
        self.obs = obs
        self.on_artifact = on_artifact

    def emit(self, record: logging.LogRecord) -> None:
        try:
            meta = getattr(record, "metadata", None) or {}
            for kind in ("artifact", "graph_dump"):
                info = meta.get(kind)
                if isinstance(info, dict) and info.get("name") in _WANTED_TRACE_ARTIFACTS:
                    payload = getattr(record, "payload", None)
                    if isinstance(payload, str):
                        self.obs.artifacts.setdefault(info["name"], []).append(payload)
                    self.on_artifact(info["name"])
            if "inductor_output_code" in meta:  # logged under its own event name, not as an artifact
                payload = getattr(record, "payload", None)
                if isinstance(payload, str):
                    self.obs.artifacts.setdefault("inductor_output_code", []).append(payload)
        except Exception as e:  # observing must never break the compile
            self.obs.errors.append(f"trace handler: {type(e).__name__}: {e}")


@contextlib.contextmanager
def observe_inductor(on_event: Callable[[str], None] = lambda e: None) -> Iterator[InductorObservation]:
    """Inside this context an Inductor compile is observed (see the module docstring) with `config.patch`, so no torch
    global outlives it. `on_event` gets "post_grad", "fusion", "codegen" and "codegen_done" as the compile reaches
    them, for progress reports."""
    from torch._inductor import config

    obs = InductorObservation()

    def mark(event: str) -> None:
        obs.marks.append((event, time.perf_counter()))
        try:
            on_event(event)
        except Exception as e:
            obs.errors.append(f"progress callback: {e}")

    def post_grad(graph: torch.fx.Graph) -> None:
        try:
            mark("post_grad")
            obs.graphs.append(graph_facts(graph))
        except Exception as e:
            obs.errors.append(f"post_grad_custom_post_pass: {type(e).__name__}: {e}")

    def pre_fusion(nodes: list[Any]) -> list[Any]:
        try:
            mark("fusion")
            obs.scheduler_runs.append({"before": [_scheduler_node(n) for n in nodes], "after": None})
        except Exception as e:
            obs.errors.append(f"_pre_fusion_custom_pass: {type(e).__name__}: {e}")
        return nodes

    def post_fusion(nodes: list[Any]) -> list[Any]:
        try:
            mark("codegen")
            if obs.scheduler_runs and obs.scheduler_runs[-1]["after"] is None:
                obs.scheduler_runs[-1]["after"] = [_scheduler_node(n) for n in nodes]
            else:
                obs.scheduler_runs.append({"before": None, "after": [_scheduler_node(n) for n in nodes]})
        except Exception as e:
            obs.errors.append(f"_post_fusion_custom_pass: {type(e).__name__}: {e}")
        return nodes

    patches: dict[str, Any] = {}
    for name, value in (
        ("post_grad_custom_post_pass", post_grad),
        ("_pre_fusion_custom_pass", pre_fusion),
        ("_post_fusion_custom_pass", post_fusion),
        ("fx_graph_cache", False),
    ):
        if _config_has(config, name):
            patches[name] = value
            obs.hooks[name] = "off for the observed compile" if name == "fx_graph_cache" else "used"
        else:
            obs.hooks[name] = f"not in torch {torch.__version__}"
    if _config_has(config, "trace.provenance_tracking_level"):
        patches["trace.provenance_tracking_level"] = 1
        obs.hooks["provenance"] = "used (trace.provenance_tracking_level=1)"
    elif _config_has(config, "trace.provenance_tracking"):
        patches["trace.provenance_tracking"] = True
        obs.hooks["provenance"] = "used (trace.provenance_tracking=True)"
    else:
        obs.hooks["provenance"] = f"not in torch {torch.__version__}"

    internal = optional_module("torch._logging._internal")
    trace_log = getattr(internal, "trace_log", None)
    handler = _TraceCollector(obs, lambda name: mark("codegen_done") if name == "inductor_aot_wrapper_code" else None)
    old_level, old_propagate = None, True
    if isinstance(trace_log, logging.Logger):
        old_level, old_propagate = trace_log.level, trace_log.propagate
        trace_log.addHandler(handler)
        trace_log.setLevel(logging.DEBUG)
        trace_log.propagate = False  # the records are for this handler, not for the application's log
        obs.hooks["structured_trace"] = "used"
    else:
        obs.hooks["structured_trace"] = f"not in torch {torch.__version__}"
    async_compile = optional_module("torch._inductor.async_compile")
    owner = getattr(async_compile, "AsyncCompile", None)
    original_triton = owner.__dict__.get("triton") if isinstance(owner, type) else None
    if owner is not None and callable(original_triton):
        def triton(self: Any, kernel_name: str, source_code: str, *args: Any, **kwargs: Any) -> Any:
            try:
                obs.kernel_sources[str(kernel_name)] = str(source_code)
            except Exception as e:  # never break the compile; the scan then fails closed on what it lacks
                obs.errors.append(f"AsyncCompile.triton: {type(e).__name__}: {e}")
            return original_triton(self, kernel_name, source_code, *args, **kwargs)

        owner.triton = triton
        obs.hooks["async_compile.triton"] = "used"
    else:
        obs.hooks["async_compile.triton"] = f"not in torch {torch.__version__}"
    try:
        with config.patch(patches):
            mark("start")
            yield obs
            mark("end")
    finally:
        if owner is not None and callable(original_triton):
            owner.triton = original_triton
        if isinstance(trace_log, logging.Logger):
            trace_log.removeHandler(handler)
            trace_log.propagate = old_propagate
            if old_level is not None:
                trace_log.setLevel(old_level)


def run_and_get_code(fn: Callable[[], Any], obs: InductorObservation) -> Any:
    """Run `fn` under torch._inductor.utils.run_and_get_code (when this torch has it), keeping the generated Python
    wrapper modules in `obs.output_code`."""
    utils = optional_module("torch._inductor.utils")
    runner = getattr(utils, "run_and_get_code", None)
    if runner is None:
        obs.hooks["run_and_get_code"] = f"not in torch {torch.__version__}"
        return fn()
    obs.hooks["run_and_get_code"] = "used"
    result, codes = runner(fn)
    obs.output_code.extend(str(c) for c in codes)
    return result


def triton_kernels_in(python_code: str) -> dict[str, str]:
    """Triton kernel name -> source, from a Python wrapper module Inductor generated (the
    `async_compile.triton('name', '''source''', ...)` calls at its top)."""
    out: dict[str, str] = {}
    try:
        tree = ast.parse(python_code)
    except SyntaxError:
        return out
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or len(node.args) < 2:
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "triton":
            name, src = node.args[0], node.args[1]
            if isinstance(name, ast.Constant) and isinstance(src, ast.Constant) and isinstance(src.value, str):
                out[str(name.value)] = src.value
    return out
