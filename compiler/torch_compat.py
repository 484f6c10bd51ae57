"""The one place aotc touches torch APIs that are private or moved between versions.

aotc runs on torch 2.13 (the CPU build in CI) and torch 2.11 (the GPU workers). Anything here may need a
version check; code elsewhere in compiler/ and worker/ uses only these wrappers and torch's public API.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as _pytree

# torch's pytree utilities are private by name but stable across 2.11-2.13; every other module takes them from here.
pytree = _pytree

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]


# -- AOTInductor --------------------------------------------------------------------------------------------
# aoti_compile_and_package / aoti_load_package live under torch._inductor (documented, but private by name).


def aoti_compile_and_package(ep: torch.export.ExportedProgram, package_path: str, inductor_configs: dict) -> str:
    from torch._inductor import aoti_compile_and_package as _compile

    return str(_compile(ep, package_path=package_path, inductor_configs=inductor_configs))


class LoadedPackage:
    """A loaded AOTInductor package, callable like the model.

    torch's `aoti_load_package` goes through `_load_aoti`, which calls `get_device_information` only to print a
    warning, and that builds and runs a test program per CPU vector ISA with g++: 30 s in a fresh process on
    the GPU machine (torch 2.11), for every package, CPU or CUDA. This wrapper goes straight to the C++ loader
    and the package's own call spec, which is what `AOTICompiledModel` does after that check.
    """

    def __init__(self, package_path: str, device: str = "cpu") -> None:
        index = -1
        if device.startswith("cuda"):
            index = torch.device(device).index or 0
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(package_path), "model", False, 1, index)
        in_spec, out_spec = self.loader.get_call_spec()
        self.in_spec = _pytree.treespec_loads(in_spec)
        self.out_spec = _pytree.treespec_loads(out_spec)

    def __call__(self, *args: _Any, **kwargs: _Any) -> _Any:
        if kwargs:
            from torch.export._tree_utils import reorder_kwargs

            kwargs = reorder_kwargs(kwargs, self.in_spec)
        flat = [x for x in _pytree.tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        return _pytree.tree_unflatten(self.loader.boxed_run(flat), self.out_spec)

    def get_metadata(self) -> dict[str, str]:
        return dict(self.loader.get_metadata())


def aoti_load_package(package_path: str, device: str = "cpu") -> _Callable[..., _Any]:
    """Load a package for `device` (cuda:N picks the GPU). Falls back to torch's own loader if the C++ loader's
    signature differs in this torch version."""
    try:
        return LoadedPackage(package_path, device)
    except (AttributeError, TypeError):
        from torch._inductor import aoti_load_package as _load

        index = torch.device(device).index
        if device.startswith("cuda") and index is not None:
            return _load(package_path, device_index=index)
        return _load(package_path)


# -- Safe loading of untrusted exported programs ---------------------------------------------------------------
# torch.export.load trusts its archive: it unpickles with weights_only=False, pickle.loads opaque constants,
# loads torchbind objects, loads AOTInductor shared libraries and sympify()s (evals) expression strings.
# compiler.loading validates the archive first; this guard is the second line, patching those call sites for
# the duration of one load. Every lookup is defensive: torch 2.11 may lack some of these attributes.

import contextlib as _contextlib
import functools as _functools
import importlib as _importlib
import pickle as _pickle
import threading as _threading
import types as _types
from collections.abc import Callable as _Callable
from collections.abc import Iterator as _Iterator
from typing import Any as _Any


class DeserializationRefused(Exception):
    """A call the load guard blocked. Deliberately not a RuntimeError: torch.export.load catches those."""


_GUARD_LOCK = _threading.RLock()


def _optional_module(name: str) -> _types.ModuleType | None:
    try:
        return _importlib.import_module(name)
    except Exception:
        return None


class _RefusingPickle(_types.ModuleType):
    """Stands in for the `pickle` module inside torch's pt2 reader: dumps works, loads/load/Unpickler refuse."""

    def __init__(self, refuse: _Callable[[str], _Any]) -> None:
        super().__init__("pickle")
        self._refuse = refuse

    def __getattr__(self, name: str) -> _Any:
        if name in ("loads", "load", "Unpickler", "_loads", "_load", "_Unpickler"):
            return lambda *a, **k: self._refuse(f"pickle.{name}")
        return getattr(_pickle, name)


@_contextlib.contextmanager
def guarded_export_load(check_expr: _Callable[[str], None] | None = None) -> _Iterator[list[str]]:
    """Context for calling torch.export.load on an untrusted archive.

    Inside it: every torch.load runs with weights_only=True whatever its caller asked (an unpickling error then
    becomes DeserializationRefused); pickle.loads in torch's pt2 reader, torch._C._pickle_load_obj (torchbind)
    and the AOTInductor loader raise DeserializationRefused; each expression string reaching the serde
    deserializer's _parse_sym_expr is passed to `check_expr` first. Yields a list that collects a line for every
    refused or overridden call, so a refusal that torch swallows internally is still seen by the caller.
    Holds a process-wide lock: the patches are global while it is active.
    """
    events: list[str] = []
    undo: list[tuple[object, str, _Any]] = []

    def patch(owner: object, name: str, value: _Any) -> None:
        if owner is None or not hasattr(owner, name):
            return
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def refuse(what: str) -> _Any:
        events.append(f"refused {what}")
        raise DeserializationRefused(f"{what} is not allowed while loading an uploaded program")

    def forced(orig: _Callable[..., _Any]) -> _Callable[..., _Any]:
        @_functools.wraps(orig)
        def load(f: _Any, map_location: _Any = None, pickle_module: _Any = None, *, weights_only: _Any = None,
                 mmap: _Any = None, **kwargs: _Any) -> _Any:
            if weights_only is not True:
                events.append(f"torch.load(weights_only={weights_only!r}) ran with weights_only=True")
            try:
                return orig(f, map_location=map_location, weights_only=True, mmap=mmap, **kwargs)
            except _pickle.UnpicklingError as e:
                events.append(f"refused torch.load: {str(e).splitlines()[0][:300] if str(e) else type(e).__name__}")
                raise DeserializationRefused(f"a pickle in the archive does not load with weights_only=True: {e}") from None

        return load

    with _GUARD_LOCK:
        try:
            serialization = _optional_module("torch.serialization")
            orig_load = getattr(serialization, "load", None) or torch.load
            safe_load = forced(orig_load)
            patch(torch, "load", safe_load)
            patch(serialization, "load", safe_load)
            patch(torch._C, "_pickle_load_obj", lambda *a, **k: refuse("torch._C._pickle_load_obj (torchbind object)"))
            package = _optional_module("torch.export.pt2_archive._package")
            if package is not None:
                patch(package, "pickle", _RefusingPickle(refuse))
                patch(package, "_load_aoti", lambda *a, **k: refuse("loading AOTInductor code from the archive"))
            serde = _optional_module("torch._export.serde.serialize")
            deserializer = getattr(serde, "GraphModuleDeserializer", None)
            original_parse = getattr(deserializer, "_parse_sym_expr", None)
            if check_expr is not None and original_parse is not None:

                @_functools.wraps(original_parse)
                def parse_sym_expr(self: _Any, expr_str: _Any, *args: _Any, **kwargs: _Any) -> _Any:
                    if isinstance(expr_str, str):
                        try:
                            check_expr(expr_str)
                        except Exception as e:
                            refuse(f"symbolic expression {expr_str[:200]!r} ({e})")
                    return original_parse(self, expr_str, *args, **kwargs)

                patch(deserializer, "_parse_sym_expr", parse_sym_expr)
            yield events
        finally:
            for owner, name, value in reversed(undo):
                setattr(owner, name, value)


# -- Observing the Inductor compile that builds the package ------------------------------------------------------
# The report's fusion and codegen stages are read off the one compile that produces the package, through torch's
# own extension points. Each is looked up before use; one that a torch lacks is recorded as missing and the stage
# it feeds says so in the report, never failing the compile:
#   post_grad_custom_post_pass            the FX graph Inductor lowers, after its decompositions and post-grad
#                                         passes (public config; a plain callable in every supported torch)
#   _pre_fusion_custom_pass               the scheduler nodes before fusion (private: "prototype" in torch)
#   _post_fusion_custom_pass              the scheduler nodes after fusion (private, newer than the pre-fusion hook)
#   trace.provenance_tracking_level       kernel -> FX node mapping, logged as the trace artifact
#     (trace.provenance_tracking before)  inductor_provenance_tracking_node_mappings
#   torch._logging structured trace       a handler on torch's trace logger collects artifacts by name:
#                                         inductor_aot_wrapper_code (marks the end of codegen) and the provenance map
#   torch._inductor.utils.run_and_get_code  the Python wrapper module(s); on GPUs the first of AOTInductor's two
#                                         codegen passes is Python and holds every Triton kernel's source
# The observed compile runs with fx_graph_cache off: a cache hit would skip the scheduler and leave nothing to see.

import ast as _ast
import collections as _collections
import logging as _logging
import time as _time
from dataclasses import dataclass as _dataclass
from dataclasses import field as _field

_WANTED_TRACE_ARTIFACTS = (
    "inductor_post_grad_graph",
    "inductor_aot_wrapper_code",
    "inductor_aot_kernel_code",
    "inductor_provenance_tracking_node_mappings",
    "inductor_output_code",
    "inductor_autotune_at_compile_time_code",
)


@_dataclass
class InductorObservation:
    """What one observed Inductor compile showed. Plain data only: no torch objects outlive the compile."""

    graphs: list[dict[str, _Any]] = _field(default_factory=list)  # post-grad FX graphs, one per compiled graph
    scheduler_runs: list[dict[str, _Any]] = _field(default_factory=list)  # {"before": [...], "after": [...]}
    artifacts: dict[str, list[str]] = _field(default_factory=dict)  # structured-trace artifact name -> payloads
    output_code: list[str] = _field(default_factory=list)  # Python wrapper modules (run_and_get_code)
    marks: list[tuple[str, float]] = _field(default_factory=list)  # (event, perf_counter) as the compile went
    hooks: dict[str, str] = _field(default_factory=dict)  # hook -> "used" or why not
    errors: list[str] = _field(default_factory=list)  # an observer that failed (the compile carried on)


def _config_has(config: _Any, dotted: str) -> bool:
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


def graph_facts(graph: torch.fx.Graph) -> dict[str, _Any]:
    """Node count (calls only), op histogram, Python code and placeholder shapes of an FX graph."""
    hist: _collections.Counter[str] = _collections.Counter()
    placeholders = []
    for n in graph.nodes:
        if n.op in ("call_function", "call_method", "call_module"):
            hist[op_name(n.target)] += 1
        elif n.op == "placeholder":
            val = n.meta.get("val")
            shape = [d if isinstance(d, int) else str(d) for d in val.shape] if hasattr(val, "shape") else None
            placeholders.append({"name": n.name, "shape": shape})
    try:
        code = graph.python_code(root_module="self").src
    except Exception as e:  # a graph whose code cannot be printed still has counts
        code = f"# code unavailable: {type(e).__name__}: {e}"
    return {"nodes": sum(hist.values()), "histogram": dict(hist.most_common()), "code": code,
            "placeholders": placeholders}


def op_name(target: _Any) -> str:
    """'aten.add_.Tensor' for OpOverloads, 'operator.getitem' and the like for Python callables."""
    if isinstance(target, str):
        return target
    if hasattr(target, "_schema"):  # OpOverload
        return str(target)
    mod = getattr(target, "__module__", None) or ""
    qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    mod = "operator" if mod == "_operator" else mod
    return qual if mod in ("", "builtins") else f"{mod}.{qual}"


def is_inplace_op(target: _Any) -> bool:
    """An op that mutates one of its arguments (add_, copy_, index_put_, ...), by its schema."""
    schema = getattr(target, "_schema", None)
    return bool(schema is not None and getattr(schema, "is_mutable", False))


def _scheduler_node(n: _Any) -> dict[str, _Any]:
    members = list(n.get_nodes()) if hasattr(n, "get_nodes") else [n]
    origins: set[str] = set()
    for m in members:
        for o in getattr(getattr(m, "node", None), "origins", None) or ():
            origins.add(getattr(o, "name", str(o)))
    kind = type(n).__name__
    extern = bool(getattr(n, "is_extern", lambda: False)())
    d: dict[str, _Any] = {
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


class _TraceCollector(_logging.Handler):
    def __init__(self, obs: InductorObservation, on_artifact: _Callable[[str], None]) -> None:
        super().__init__(_logging.DEBUG)
        self.obs = obs
        self.on_artifact = on_artifact

    def emit(self, record: _logging.LogRecord) -> None:
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


@_contextlib.contextmanager
def observe_inductor(on_event: _Callable[[str], None] = lambda e: None) -> _Iterator[InductorObservation]:
    """Inside this context an Inductor compile is observed (see the comment above) with `config.patch`, so no torch
    global outlives it. `on_event` gets "post_grad", "fusion", "codegen" and "codegen_done" as the compile reaches
    them, for progress reports."""
    from torch._inductor import config

    obs = InductorObservation()

    def mark(event: str) -> None:
        obs.marks.append((event, _time.perf_counter()))
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

    def pre_fusion(nodes: list[_Any]) -> list[_Any]:
        try:
            mark("fusion")
            obs.scheduler_runs.append({"before": [_scheduler_node(n) for n in nodes], "after": None})
        except Exception as e:
            obs.errors.append(f"_pre_fusion_custom_pass: {type(e).__name__}: {e}")
        return nodes

    def post_fusion(nodes: list[_Any]) -> list[_Any]:
        try:
            mark("codegen")
            if obs.scheduler_runs and obs.scheduler_runs[-1]["after"] is None:
                obs.scheduler_runs[-1]["after"] = [_scheduler_node(n) for n in nodes]
            else:
                obs.scheduler_runs.append({"before": None, "after": [_scheduler_node(n) for n in nodes]})
        except Exception as e:
            obs.errors.append(f"_post_fusion_custom_pass: {type(e).__name__}: {e}")
        return nodes

    patches: dict[str, _Any] = {}
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

    internal = _optional_module("torch._logging._internal")
    trace_log = getattr(internal, "trace_log", None)
    handler = _TraceCollector(obs, lambda name: mark("codegen_done") if name == "inductor_aot_wrapper_code" else None)
    old_level, old_propagate = None, True
    if isinstance(trace_log, _logging.Logger):
        old_level, old_propagate = trace_log.level, trace_log.propagate
        trace_log.addHandler(handler)
        trace_log.setLevel(_logging.DEBUG)
        trace_log.propagate = False  # the records are for this handler, not for the application's log
        obs.hooks["structured_trace"] = "used"
    else:
        obs.hooks["structured_trace"] = f"not in torch {torch.__version__}"
    try:
        with config.patch(patches):
            mark("start")
            yield obs
            mark("end")
    finally:
        if isinstance(trace_log, _logging.Logger):
            trace_log.removeHandler(handler)
            trace_log.propagate = old_propagate
            if old_level is not None:
                trace_log.setLevel(old_level)


def run_and_get_code(fn: _Callable[[], _Any], obs: InductorObservation) -> _Any:
    """Run `fn` under torch._inductor.utils.run_and_get_code (when this torch has it), keeping the generated Python
    wrapper modules in `obs.output_code`."""
    utils = _optional_module("torch._inductor.utils")
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
        tree = _ast.parse(python_code)
    except SyntaxError:
        return out
    for node in _ast.walk(tree):
        if not isinstance(node, _ast.Call) or len(node.args) < 2:
            continue
        f = node.func
        if isinstance(f, _ast.Attribute) and f.attr == "triton":
            name, src = node.args[0], node.args[1]
            if isinstance(name, _ast.Constant) and isinstance(src, _ast.Constant) and isinstance(src.value, str):
                out[str(name.value)] = src.value
    return out


# -- AOTAutograd for mode=training --------------------------------------------------------------------------------
# aot_module and min_cut_rematerialization_partition (the partitioner Inductor uses) are torch._functorch APIs,
# stable in name since torch 2.0. The joint graph is what the partitioner receives.


def aot_joint_and_partition(module: torch.nn.Module, args: tuple[_Any, ...],
                            kwargs: dict[str, _Any]) -> dict[str, torch.fx.GraphModule]:
    """Trace forward and backward of `module` through AOTAutograd with the core ATen decompositions; returns the
    joint graph and its forward/backward partition. Runs one forward and one backward (on sum of outputs) on
    `args`, because AOTAutograd compiles the backward when it is first needed."""
    import torch.utils._pytree as pytree
    from torch._decomp import core_aten_decompositions
    from torch._functorch.aot_autograd import aot_module
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    got: dict[str, torch.fx.GraphModule] = {}

    def partition(joint: torch.fx.GraphModule, joint_inputs: _Any, **kw: _Any) -> _Any:
        got["joint"] = joint
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kw)
        got["forward"], got["backward"] = fw, bw
        return fw, bw

    def boxed(gm: torch.fx.GraphModule) -> _Any:
        def run(args_list: list[_Any]) -> _Any:
            a = list(args_list)
            args_list.clear()
            return gm(*a)

        run._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd's boxed calling convention
        return run

    compiled = aot_module(module, fw_compiler=lambda gm, ex: boxed(gm), bw_compiler=lambda gm, ex: boxed(gm),
                          partition_fn=partition, decompositions=core_aten_decompositions())
    with torch.enable_grad():
        out = compiled(*args, **kwargs)
        leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if leaves:
            torch.autograd.backward([t.sum() for t in leaves])
    return got


def node_sources(node: torch.fx.Node) -> list[str]:
    """Names of the nodes `node` was traced from, nearest first, from the `from_node` provenance that torch.fx
    records when a graph is re-traced (run_decompositions, ep.module()); [] when this torch records none."""
    names: list[str] = []
    src = (node.meta.get("from_node") or [None])[0]
    while src is not None and len(names) < 64:
        name = getattr(src, "name", None)
        if name:
            names.append(str(name))
        parents = getattr(src, "from_node", None) or []
        src = parents[0] if parents else None
    return names


# -- The prims view ----------------------------------------------------------------------------------------------
# torch._prims.context.TorchRefsMode maps ATen calls to their torch._refs implementations, which are written in
# prims; make_fx records the result. Private, and not every op has a ref: those stay as ATen in the view.


def prims_graph(module: torch.nn.Module, args: tuple[_Any, ...], kwargs: dict[str, _Any]) -> torch.fx.GraphModule:
    from torch._prims.context import TorchRefsMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def run(*a: _Any) -> _Any:
        return module(*a, **kwargs)

    with TorchRefsMode(strict=False):
        return make_fx(run, tracing_mode="symbolic", _allow_non_fake_inputs=True)(*args)


# -- Inductor's caches ---------------------------------------------------------------------------------------
# Three caches matter to a fleet of compile workers (torch 2.11 and 2.13 alike):
#   FX graph cache      compile_fx skips it when aot_mode is set (`... and not aot_mode`), so AOTInductor
#                       compiles neither read nor write it, locally or remotely.
#   autotune cache      the best Triton config per kernel source, local (beside the kernel) and, with
#                       autotune_remote_cache, in Redis (TORCHINDUCTOR_REDIS_URL). JSON, keyed by torch, Triton
#                       and the GPU, so sharing it is safe. It has no CPU counterpart.
#   max-autotune timings  AlgorithmSelectorCache (a PersistentCache) keeps every benchmarked matmul/conv choice's
#                       time in one local JSON file per system, {"cache": {op: {inputs: {precision: {choice:
#                       ms}}}}}; Inductor has no remote form of it. gemm_timings_file() and the two functions
#                       after it read and merge that file so the worker can share it (worker/tuning.py).


def inductor_cache_settings() -> dict[str, _Any]:
    """What Inductor will do with its caches in this process (after the worker set TORCHINDUCTOR_* variables)."""
    import inspect as _inspect

    from torch._inductor import compile_fx as _compile_fx
    from torch._inductor import config

    try:  # the line that keeps AOTInductor away from the FX graph cache, present in 2.11 and 2.13
        fx_in_aot: bool | None = "and not aot_mode" not in _inspect.getsource(_compile_fx)
    except (OSError, TypeError):
        fx_in_aot = None
    return {
        "fx_graph_remote_cache": bool(getattr(config, "fx_graph_remote_cache", False)),
        "autotune_remote_cache": bool(getattr(config, "autotune_remote_cache", False)),
        "fx_graph_cache_used_by_aot_compiles": fx_in_aot,
    }


def gemm_timings_file() -> tuple[str, str] | None:
    """(path of the local max-autotune timings file, hash of the system it is valid for), or None where this
    torch lays the cache out differently. The hash covers the GPU (name, CUDA/HIP versions) and torch's
    version; on a machine without CUDA it is the hash of nothing, so callers add their own target to keys."""
    try:
        from torch._inductor.codecache import CacheBase

        return str(CacheBase.get_local_cache_path()), str(CacheBase.get_system()["hash"])
    except Exception:
        return None


def read_gemm_timings(path: str) -> dict[tuple[str, str, str, str], float]:
    """Every (op, inputs, precision, choice) -> time in the local timings file; {} if there is none or its
    layout is not the one above (then nothing is shared, and Inductor benchmarks as usual)."""
    import json as _json
    import math as _math

    try:
        with open(path) as f:
            cache = _json.load(f).get("cache", {})
    except (OSError, ValueError, AttributeError):
        return {}
    out: dict[tuple[str, str, str, str], float] = {}
    if not isinstance(cache, dict):
        return out
    for op, by_inputs in cache.items():
        for inputs, by_precision in (by_inputs.items() if isinstance(by_inputs, dict) else ()):
            for precision, by_choice in (by_precision.items() if isinstance(by_precision, dict) else ()):
                for choice, ms in (by_choice.items() if isinstance(by_choice, dict) else ()):
                    if isinstance(ms, (int, float)) and not isinstance(ms, bool) and _math.isfinite(ms):
                        out[(op, inputs, precision, choice)] = float(ms)
    return out


def merge_gemm_timings(path: str, timings: dict[tuple[str, str, str, str], float]) -> int:
    """Add the timings the local file lacks (local measurements win) and write it atomically, in the layout
    Inductor reads. Returns how many were added."""
    import json as _json
    import os as _os

    try:
        with open(path) as f:
            doc = _json.load(f)
        if not isinstance(doc, dict) or not isinstance(doc.get("cache"), dict):
            return 0
    except FileNotFoundError:
        doc = {"system": {}, "cache": {}}
    except (OSError, ValueError):
        return 0
    added = 0
    for (op, inputs, precision, choice), ms in timings.items():
        level = doc["cache"]
        for k in (op, inputs, precision):
            nxt = level.setdefault(k, {})
            if not isinstance(nxt, dict):
                break
            level = nxt
        else:
            if choice not in level:
                level[choice] = ms
                added += 1
    if added:
        _os.makedirs(_os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.aotc-{_os.getpid()}.tmp"
        with open(tmp, "w") as f:
            _json.dump(doc, f)
        _os.replace(tmp, path)
    return added
