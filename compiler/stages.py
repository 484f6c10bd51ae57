"""The compile pipeline's stages, each a function with a typed input and output, each recording what it saw.

    capture   ExportedProgram, shapes          -> Captured     ops that skip bounds checks rewritten to checked
                                                               forms (compiler.bounds), then torch.export
                                                               re-export at the requested shapes
    autograd  Captured, training?              -> Functional   functionalisation; for training the joint graph
                                                               and its forward/backward partition
    lowering  Functional, prims_view?          -> Lowered      decomposition to core ATen (and prims, on request)
    inductor  Captured, options, out_path      -> Compiled     the one Inductor + AOTInductor compile, observed
    fusion    Compiled                         -> dict         scheduler nodes before/after fusion, fused groups
    codegen   Compiled                         -> Generated    generated C++ or Triton source and the wrapper
    package   Compiled                         -> dict         the package's size and compile time
    scan      Compiled                         -> ScanResult   the generated sources scanned for calls no kernel
                                                               makes (compiler.scan); a hit raises UnsafeCode

capture, autograd and lowering run torch.export's own passes on the specialised program (cheap re-traces: the
compile does the same work inside Inductor, fused into one trace, where it cannot be seen apart). fusion, codegen
and package are read off the compile that builds the package: no second compile. Every torch-private hook lives in
compiler.compat; a stage whose hook this torch lacks reports itself "unavailable" and the compile goes on.
"""

from __future__ import annotations

import collections
import json
import operator
import os
import re
import time
import zipfile
from dataclasses import dataclass, field
from typing import Any

import torch

from compiler import bounds as bounds_mod
from compiler import convs as convs_mod
from compiler import inputs as inputs_mod
from compiler import isa as isa_mod
from compiler import report as rep
from compiler import scan as scan_mod
from compiler import weights as weights_mod
from compiler.compat.aoti import TRAIN_METADATA, aoti_compile_and_package, weightless_configs
from compiler.compat.autograd import aot_joint_and_partition
from compiler.compat.graphs import graph_facts, is_inplace_op, node_sources, op_name
from compiler.compat.isa import pinned_isa
from compiler.compat.observe import InductorObservation, observe_inductor, run_and_get_code, triton_kernels_in
from compiler.compat.prims import prims_graph
from compiler.compat.shims import checked_fallbacks
from compiler.errors import CompileError, UnsafeCode
from compiler.inputs import Spec
from compiler.options import CompileOptions
from compiler.specialize import specialize
from compiler.targets import IsaPin

ProgressHook = Any  # Callable[[str], None]


def _graph_block(facts: dict[str, Any], file: str) -> dict[str, Any]:
    code = facts["code"]
    block = {"nodes": facts["nodes"], "histogram": facts["histogram"], "file": file}
    block["code"] = code if len(code) <= rep.MAX_INLINE_CODE else code[: rep.MAX_INLINE_CODE]
    block["code_truncated"] = len(code) > rep.MAX_INLINE_CODE
    return block


def _val_shape(val: Any) -> list[int | str] | None:
    if not hasattr(val, "shape"):
        return None
    return [d if isinstance(d, int) else str(d) for d in val.shape]


def _dtype(val: Any) -> str | None:
    dt = getattr(val, "dtype", None)
    return str(dt).removeprefix("torch.") if dt is not None else None


# -- capture -----------------------------------------------------------------------------------------------------


@dataclass
class Captured:
    program: torch.export.ExportedProgram
    args: tuple[Any, ...]  # example inputs at the hint shapes, for the traces later stages run
    kwargs: dict[str, Any]
    facts: dict[str, Any]
    graphs: dict[str, str] = field(default_factory=dict)  # archive path -> FX code


def _io_facts(ep: torch.export.ExportedProgram) -> dict[str, Any]:
    vals = {n.name: n.meta.get("val") for n in ep.graph.nodes}
    inputs: list[dict[str, Any]] = []
    weights: collections.Counter[str] = collections.Counter()
    weight_bytes = 0
    for s in ep.graph_signature.input_specs:
        kind = getattr(s.kind, "name", str(s.kind)).lower()
        name = getattr(s.arg, "name", None)
        val = vals.get(name)
        if kind == "user_input":
            inputs.append({"name": name, "dtype": _dtype(val), "shape": _val_shape(val)})
        else:
            weights[kind] += 1
            if isinstance(val, torch.Tensor):
                try:
                    weight_bytes += int(val.numel()) * val.element_size()
                except Exception:
                    pass
    outputs = []
    for s in ep.graph_signature.output_specs:
        if getattr(s.kind, "name", "") == "USER_OUTPUT":
            name = getattr(s.arg, "name", None)
            val = vals.get(name)
            outputs.append({"name": name, "dtype": _dtype(val), "shape": _val_shape(val)})
    return {"inputs": inputs, "outputs": outputs, "weights": dict(weights), "weight_bytes": weight_bytes}


def _dynamic_dims(ep: torch.export.ExportedProgram, spec: Spec) -> list[dict[str, Any]]:
    vals = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    ranges = {str(k): v for k, v in ep.range_constraints.items()}
    out = []
    for inp in spec:
        val: Any = vals.get(inp["name"])  # a FakeTensor, or None for an input the graph does not have
        for j, d in enumerate(inp["shape"]):
            if not isinstance(d, dict):
                continue
            size = val.shape[j] if hasattr(val, "shape") and j < len(val.shape) else None
            entry: dict[str, Any] = {"input": inp["name"], "dim": j, "requested": {"min": d["min"], "max": d["max"]}}
            if isinstance(size, torch.SymInt):
                sym = str(size)
                vr = ranges.get(sym)
                entry.update(symbol=sym, stayed_dynamic=True,
                             min=_int_or_none(getattr(vr, "lower", None)), max=_int_or_none(getattr(vr, "upper", None)))
            else:
                entry.update(symbol=None, stayed_dynamic=False, specialized_to=size if isinstance(size, int) else None)
            out.append(entry)
    return out


def _int_or_none(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError, OverflowError):
        return None


def capture(ep: torch.export.ExportedProgram, spec: Spec, program_inputs: list[dict[str, Any]], device: str,
            precision: str = "keep", autocast: bool = False, training: bool = False,
            generated_convs: bool = False) -> Captured:
    """Rewrite the ops of the uploaded program that skip bounds checks (compiler.bounds, in place: `ep` is the
    worker's own copy), then re-export it at the requested shapes: the FX graph that the rest of the pipeline sees.
    `generated_convs` (options.convolutions="generated"): its depthwise convolutions then become pointwise ops
    (compiler.convs).

    Facts: graph (nodes, histogram, code), inputs/outputs (name, dtype, shape), weights (count per kind),
    dynamic_dims (per requested range: the symbol, its range, and whether it stayed dynamic), bounds (each node
    rewritten to a checked form, and what it became), convolutions (with generated_convs: how many were lowered,
    their taps, how many were left to the library, and a note where none was because of MAX_PROGRAM_TAPS)."""
    t0 = time.perf_counter()
    # A train step keeps the kernels' own asserts only: AOTAutograd's joint trace cannot carry the range checks'
    # data-dependent count (.item(): DataDependentOutputException), and a training job's batches are its own.
    bounded = bounds_mod.bound_program(ep, device=None if training else device)
    special = specialize(ep, spec, program_inputs, device, precision, autocast)
    convs: dict[str, Any] = {}
    if generated_convs:
        lowering = convs_mod.lower_depthwise(special)
        special = lowering.program
        convs = {"generated": lowering.lowered, "taps": lowering.taps, "left_to_library": convs_mod.count(special),
                 **({"note": lowering.note} if lowering.note else {})}
    seconds = time.perf_counter() - t0
    shapes = inputs_mod.hint_shapes(spec, program_inputs)
    example = inputs_mod.random_inputs(spec, shapes, device, inputs_mod.int_ranges(ep))
    args, kwargs = inputs_mod.call_args(ep, example)
    g = graph_facts(special.graph)
    facts = rep.stage(
        seconds=seconds, observed_by="torch.export.export of the uploaded program's module at the requested shapes",
        graph=_graph_block(g, "graphs/capture.py"), **_io_facts(special), dynamic_dims=_dynamic_dims(special, spec),
        example_shapes={i["name"]: s for i, s in zip(spec, shapes)}, bounds=bounded.facts(),
    )
    if generated_convs:
        facts["convolutions"] = convs
    return Captured(special, args, kwargs, facts, {"graphs/capture.py": g["code"]})


# -- autograd ----------------------------------------------------------------------------------------------------


@dataclass
class Functional:
    program: torch.export.ExportedProgram | None  # None when torch could not functionalise (stage unavailable)
    facts: dict[str, Any]
    graphs: dict[str, str] = field(default_factory=dict)


def _map_back(nodes: list[torch.fx.Node], known: set[str]) -> dict[str, list[torch.fx.Node]]:
    """Earlier-graph node name -> the nodes of a re-traced graph that came from it (by from_node provenance)."""
    out: dict[str, list[torch.fx.Node]] = collections.defaultdict(list)
    for n in nodes:
        src = next((s for s in node_sources(n) if s in known), None)
        if src is not None:
            out[src].append(n)
    return out


def _calls(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function"]


class TrainingTraceError(CompileError):
    """The report's trace of forward and backward found no weight that needs a gradient (mode=training)."""


def _training_facts(c: Captured) -> tuple[dict[str, Any], dict[str, str]]:
    """The report's view of the train step: AOTAutograd's joint graph and its partition. Only the report reads it
    (the package is built from the joint program, compiler.training, and the check decides whether it is right), so
    a trace that fails says so in the facts (`unavailable`) and the job goes on: DeBERTa-v3's failed on an H200
    ("value cannot be converted to type c10::BFloat16 without overflow") and refused a model whose package was
    never built."""
    try:
        got, traced_on = aot_joint_and_partition(c.program.module(), c.args, c.kwargs)
    except Exception as e:  # noqa: BLE001 - whatever the trace raised: the report says it, the job goes on
        text = str(e).strip()
        return {"unavailable": f"tracing forward and backward for the report failed: {type(e).__name__}: "
                               f"{text[:1500]}", "traced_on": None}, {}
    if not {"joint", "forward", "backward"} <= set(got):
        raise TrainingTraceError("AOTAutograd handed no joint graph to the partitioner: no weight of the program "
                                 "needs a gradient", stage="autograd")
    blocks, codes = {}, {}
    for part in ("joint", "forward", "backward"):
        f = graph_facts(got[part].graph)
        blocks[part] = _graph_block(f, f"graphs/{part}.py")
        codes[f"graphs/{part}.py"] = f["code"]
    saved = [n for n in got["backward"].graph.nodes
             if n.op == "placeholder" and not n.name.startswith("tangents")
             and isinstance(n.meta.get("val"), torch.Tensor)]
    primals = [n.name for n in saved if n.name.startswith("primals")]
    facts = {
        **blocks,
        "partitioner": "min_cut_rematerialization_partition",
        "saved_for_backward": len(saved),
        "saved_activations": len(saved) - len(primals),
        "saved_inputs_and_weights": len(primals),
        "saved": [n.name for n in saved],
        "tangents": sum(1 for n in got["backward"].graph.nodes
                        if n.op == "placeholder" and n.name.startswith("tangents")),
        "traced_on": traced_on,
        "traced_at": {k: list(v.shape) for k, v in zip([f"arg{i}" for i in range(len(c.args))], c.args)
                      if isinstance(v, torch.Tensor)},
    }
    return facts, codes


def autograd(c: Captured, training: bool = False) -> Functional:
    """Functionalise the captured graph (export's own run_decompositions with an empty table) and count the
    in-place ops it removed. With training, also trace forward and backward through AOTAutograd and partition the
    joint graph as Inductor does.

    Facts: graph; inplace_removed (count), inplace_ops ({op: count}), inplace (each removed node and what it became);
    training: joint/forward/backward graphs, saved_for_backward, saved_activations (saved tensors that are
    intermediates, not weights or inputs), saved (names)."""
    t0 = time.perf_counter()
    functional = c.program.run_decompositions({})
    g = graph_facts(functional.graph)
    captured_inplace = [n for n in _calls(c.program.graph) if is_inplace_op(n.target)]
    left = [n for n in _calls(functional.graph) if is_inplace_op(n.target)]
    became = _map_back(_calls(functional.graph), {n.name for n in _calls(c.program.graph)})
    details = [{"node": n.name, "op": op_name(n.target),
                "became": [f"{m.name} ({op_name(m.target)})" for m in became.get(n.name, [])]}
               for n in captured_inplace]
    facts = rep.stage(
        seconds=time.perf_counter() - t0,
        observed_by="ExportedProgram.run_decompositions({}) on the captured program: AOTAutograd's "
        "functionalisation without decompositions (a separate trace; the compile repeats it inside Inductor)",
        graph=_graph_block(g, "graphs/functional.py"),
        inplace_removed=len(captured_inplace) - len(left),
        inplace_ops=dict(collections.Counter(op_name(n.target) for n in captured_inplace)),
        inplace=details,
        inplace_left=[op_name(n.target) for n in left],
    )
    graphs = {"graphs/functional.py": g["code"]}
    if training:
        t1 = time.perf_counter()
        tr, codes = _training_facts(c)
        facts["training"] = {**tr, "seconds": round(time.perf_counter() - t1, 3)}
        facts["seconds"] = round(time.perf_counter() - t0, 3)
        facts["observed_by"] += ("; training: torch._functorch.aot_autograd.aot_module with the core ATen "
                                 "decompositions, one forward and one backward at the example shapes")
        graphs.update(codes)
    return Functional(functional, facts, graphs)


# -- lowering ----------------------------------------------------------------------------------------------------


@dataclass
class Lowered:
    program: torch.export.ExportedProgram
    facts: dict[str, Any]
    graphs: dict[str, str] = field(default_factory=dict)


def lowering(f: Functional, c: Captured, prims_view: bool = False) -> Lowered:
    """Decompose the functional graph to core ATen (export's default decomposition table).

    Facts: graph (core ATen); before (the functional graph's nodes and histogram); decomposed (each op kind that
    did not survive as itself, with how many nodes and what it became); prims (on request)."""
    if f.program is None:
        raise ValueError("no functional program to decompose")
    t0 = time.perf_counter()
    core = f.program.run_decompositions()
    g = graph_facts(core.graph)
    before_nodes = _calls(f.program.graph)
    origin = _map_back(_calls(core.graph), {n.name for n in before_nodes})
    decomposed: dict[str, dict[str, Any]] = {}
    mapped = bool(origin)
    for n in before_nodes:
        op = op_name(n.target)
        if op == "operator.getitem":  # structural: it picks one output of a multi-output op
            continue
        into = [op_name(m.target) for m in origin.get(n.name, []) if m.target is not operator.getitem]
        if mapped and op in into:  # the op survived as itself (perhaps with view or getitem helpers)
            continue
        if not mapped and op in g["histogram"]:  # no provenance: only a vanished op counts as decomposed
            continue
        d = decomposed.setdefault(op, {"op": op, "count": 0, "into": collections.Counter()})
        d["count"] += 1
        d["into"].update(into)
    before = graph_facts(f.program.graph)
    facts = rep.stage(
        seconds=time.perf_counter() - t0,
        observed_by="ExportedProgram.run_decompositions() (core ATen table) on the functional program "
        "(a separate trace; Inductor applies its own, larger decomposition table inside the compile: see fusion)",
        graph=_graph_block(g, "graphs/core_aten.py"),
        before={"nodes": before["nodes"], "histogram": before["histogram"]},
        decomposed=[{**d, "into": dict(d["into"])} for d in decomposed.values()],
        provenance="from_node" if mapped else "histogram difference (this torch records no from_node)",
    )
    graphs = {"graphs/core_aten.py": g["code"]}
    if prims_view:
        t1 = time.perf_counter()
        try:
            pg = prims_graph(core.module(), c.args, c.kwargs)
            p = graph_facts(pg.graph)
            facts["prims"] = {**_graph_block(p, "graphs/prims.py"), "seconds": round(time.perf_counter() - t1, 3),
                              "observed_by": "make_fx under torch._prims.context.TorchRefsMode (ops without a "
                              "prims reference stay ATen)"}
            graphs["graphs/prims.py"] = p["code"]
        except Exception as e:
            facts["prims"] = {"status": "unavailable", "note": f"{type(e).__name__}: {str(e)[:500]}"}
    else:
        facts["prims"] = {"status": "skipped", "note": "not requested (options.prims_view)"}
    facts["seconds"] = round(time.perf_counter() - t0, 3)
    return Lowered(core, facts, graphs)


# -- the compile, observed ---------------------------------------------------------------------------------------

_ORDER = ("fusion", "codegen", "package")


@dataclass
class Compiled:
    package: str
    observation: InductorObservation
    seconds: float
    phases: dict[str, float | None]  # fusion / codegen / package seconds, from the compile's own marks
    device: str
    weights: str | None = None  # the weights sidecar of a weightless package (compiler/weights.py); None: embedded


def _phases(obs: InductorObservation, total: float) -> dict[str, float | None]:
    first: dict[str, float] = {}
    for name, t in obs.marks:
        first.setdefault(name, t)
    start, end = first.get("start"), first.get("end")
    cg, done = first.get("codegen"), first.get("codegen_done")
    out: dict[str, float | None] = {"fusion": None, "codegen": None, "package": None}
    if start is None or end is None:
        return out
    if cg is not None:
        out["fusion"] = cg - start
        if done is not None:
            out["codegen"], out["package"] = done - cg, end - done
        else:
            out["codegen"] = end - cg  # codegen and the C++ build together
    if "post_grad" in first and "fusion" in first:
        out["inductor_frontend"] = first["post_grad"] - start
        out["lowering_to_ir"] = first["fusion"] - first["post_grad"]
        if cg is not None:
            out["fuse"] = cg - first["fusion"]
    return {k: None if v is None else round(v, 3) for k, v in out.items()}


def inductor(c: Captured, options: CompileOptions, out_path: str, device: str,
             on_stage: ProgressHook = lambda s: None, pin: IsaPin | None = None) -> Compiled:
    """The one compile that builds the package (aoti_compile_and_package), with the observers attached and every
    ATen fallback of the C++ wrapper checking its error code (compiler.compat.shims). `pin`: the x86-64 level a
    CPU package keeps to (-march and the vector ISA, compiler.compat.isa)."""
    reached = {"i": 0}

    def on_event(event: str) -> None:  # forward-only progress: GPUs run scheduling and codegen twice
        stage = {"codegen": "codegen", "codegen_done": "package"}.get(event)
        if stage and _ORDER.index(stage) > reached["i"]:
            reached["i"] = _ORDER.index(stage)
            on_stage(stage)

    wanted = options.inductor_configs(pin)
    # Weightless where this torch can build it so (compiler.compat.aoti.weightless_configs); where it cannot, the
    # package carries its weights and the worker publishes it self-contained.
    weightless = weightless_configs() if options.weightless else None
    wanted.update(weightless or {})
    if options.training and "aot_inductor.metadata" in wanted:  # a train step says so (compiler.compat.aoti)
        wanted["aot_inductor.metadata"] = {**wanted["aot_inductor.metadata"], TRAIN_METADATA: str(options.loss_output)}
    on_stage("fusion")
    t0 = time.perf_counter()
    with (observe_inductor(on_event) as obs, checked_fallbacks() as patched,
          pinned_isa(pin, wanted) as configs):
        obs.hooks["checked_fallbacks"] = ", ".join(patched) or f"none in torch {torch.__version__}"
        if pin is not None:
            how = "cpp.march" if "cpp.march" in configs else "cpp_builder's cflags, wrapped"
            obs.hooks["isa"] = f"x86-64 {pin.level}: -march={pin.march} ({how}), vector ISA {pin.vec_isa or 'none'}"
        package = run_and_get_code(lambda: aoti_compile_and_package(c.program, out_path, configs), obs)
    total = time.perf_counter() - t0
    weights = None
    if weightless:
        # The program's own tensors, after the precision cast: what the package was compiled against.
        weights = str(weights_mod.sidecar(package))
        weights_mod.save(weights_mod.program_weights(c.program), weights)
    return Compiled(str(package), obs, total, _phases(obs, total), device, weights)


# -- fusion ------------------------------------------------------------------------------------------------------

GENERATED_PREFIXES = ("cpp_", "triton_")  # how Inductor names the kernels it generates (not library calls)


def _library(kernel: str, device: str) -> str:
    k = kernel.lower()
    gemm = any(w in k for w in ("addmm", "bmm", ".mm", "_mm", "mm_out", "matmul", "baddbmm", "linear"))
    if "mkldnn" in k or "onednn" in k:
        return "mkldnn"
    if device.startswith("cuda"):
        return "cuBLAS" if gemm else "cuDNN" if "conv" in k else "aten"
    return "BLAS (aten)" if gemm else "mkldnn (aten convolution)" if "conv" in k else "aten"


def _provenance(obs: InductorObservation) -> dict[str, dict[str, list[str]]]:
    """kernel name -> {"post_grad": [...], "capture": [...]} from the provenance trace artifact, if logged."""
    payloads = obs.artifacts.get("inductor_provenance_tracking_node_mappings") or []
    if not payloads:
        return {}
    try:
        m = json.loads(payloads[-1])
    except ValueError:
        return {}
    post_to_pre = m.get("postToPre") or {}
    out: dict[str, dict[str, list[str]]] = {}
    for key, mapping in m.items():
        if not key.endswith("CodeToPost") or not isinstance(mapping, dict):
            continue
        for kernel, posts in mapping.items():
            name = str(kernel).split(":")[0]
            entry = out.setdefault(name, {"post_grad": [], "capture": []})
            entry["post_grad"] = sorted(set(entry["post_grad"]) | set(posts))
            pre = {p for post in posts for p in post_to_pre.get(post, [])}
            entry["capture"] = sorted(set(entry["capture"]) | pre)
    return out


def fusion(compiled: Compiled) -> dict[str, Any]:
    """Facts: inductor_graph (the FX graph Inductor lowered: after its own decompositions and post-grad passes),
    nodes_before / nodes_after (scheduler nodes around fusion), before / after (each node with its FX origins),
    groups (each generated kernel: its name, the scheduler nodes emitted into it, the FX nodes of Inductor's graph
    it computes and the captured graph's nodes they came from, by torch's provenance map), kernels (generated
    kernels), scheduler_kernel_nodes, extern_calls and externs (library calls: cuBLAS, cuDNN, mkldnn, ...)."""
    obs = compiled.observation
    runs = [r for r in obs.scheduler_runs if r.get("after") is not None or r.get("before") is not None]
    prov = _provenance(obs)
    facts: dict[str, Any] = {}
    if obs.graphs:
        facts["inductor_graph"] = _graph_block(obs.graphs[-1], "graphs/inductor_post_grad.py")
    note = ""
    observed = "scheduler hooks (_pre_fusion_custom_pass/_post_fusion_custom_pass) in the package compile"
    last = runs[-1] if runs else None
    after: list[dict[str, Any]]  # scheduler nodes after fusion, from the hook or the provenance map
    if last is None or last.get("after") is None:
        if not prov:
            return rep.unavailable(
                f"torch {torch.__version__} showed neither the fused scheduler nodes nor the provenance map "
                f"(hooks: {obs.hooks})", compiled.phases.get("fusion"), observed) | facts
        # No post-fusion hook: the provenance map still says which FX nodes each kernel holds.
        note = "scheduler nodes after fusion come from the provenance map (no post-fusion hook in this torch)"
        observed = "provenance tracking (trace artifact inductor_provenance_tracking_node_mappings)"
        after = [{"name": k, "type": "kernel", "members": [], "origins": v["post_grad"],
                  "extern": not k.startswith(GENERATED_PREFIXES), "nop": False, "reduction": False, "template": False,
                  "kernel": k} for k, v in prov.items()]
        before = (last or {}).get("before") or []
    else:
        before, after = last.get("before") or [], last["after"]
    kernel_nodes = [n for n in after if not n["extern"] and not n["nop"]]
    externs = [n for n in after if n["extern"]]
    generated = {k: v for k, v in prov.items() if k.startswith(GENERATED_PREFIXES)}
    groups: list[dict[str, Any]] = []
    if generated:
        # The provenance map names the kernels as generated (a C++ backend may emit several scheduler nodes
        # into one function); each scheduler node joins the kernel sharing most of its FX nodes.
        by_kernel: dict[str, list[str]] = {k: [] for k in generated}
        for n in kernel_nodes:
            best = max(generated, key=lambda k: len(set(generated[k]["post_grad"]) & set(n["origins"])))
            if set(generated[best]["post_grad"]) & set(n["origins"]):
                by_kernel[best].append(n["name"])
        groups = [{"kernel": k, "scheduler_nodes": by_kernel[k], "fx_nodes": v["post_grad"],
                   "capture_nodes": v["capture"]} for k, v in generated.items()]
    else:
        groups = [{"kernel": None, "scheduler_nodes": [n["name"]], "fx_nodes": n["origins"]} for n in kernel_nodes]
        note = (note + "; " if note else "") + ("kernels counted as scheduler nodes (no provenance map in this "
                                                "torch; a C++ backend may emit several into one function)")
    facts.update(
        nodes_before=len(before) if before else None,
        nodes_after=len(after),
        before=before,
        after=after,
        groups=groups,
        kernels=len(groups),
        scheduler_kernel_nodes=len(kernel_nodes),
        extern_calls=len(externs),
        externs=[{"node": n["name"], "kernel": n.get("kernel"), "library": _library(str(n.get("kernel")),
                                                                                    compiled.device),
                  "fx_nodes": n["origins"]} for n in externs],
        scheduler_runs=len(runs),
        timing={k: compiled.phases.get(k) for k in ("inductor_frontend", "lowering_to_ir", "fuse")},
    )
    if len(runs) > 1:
        note = (note + "; " if note else "") + (f"the scheduler ran {len(runs)} times (AOTInductor's GPU codegen "
                                                "has two passes); the last run is shown")
    return rep.stage(seconds=compiled.phases.get("fusion"), observed_by=observed,
                     note=(note + "; " if note else "") + "seconds include Inductor's own AOTAutograd trace, "
                     "decompositions, post-grad passes and lowering to its loop-level IR", **facts)


# -- codegen -----------------------------------------------------------------------------------------------------

_CPP_KERNEL = re.compile(r'extern\s+"C"\s+void\s+(\w+)\s*\(')


@dataclass
class Generated:
    facts: dict[str, Any]
    files: dict[str, str]  # archive path -> source


def codegen(compiled: Compiled) -> Generated:
    """Facts: language (cpp or triton), kernel_count and kernels (names, as defined in the generated source),
    files (path, kind, bytes, lines), wrapper_bytes, kernel_bytes. The files are the package's own C++ sources and,
    on GPUs, each Triton kernel from the Python wrapper of AOTInductor's first codegen pass."""
    obs = compiled.observation
    files: dict[str, str] = {}
    kinds: dict[str, str] = {}
    with zipfile.ZipFile(compiled.package) as zf:
        for name in sorted(zf.namelist()):
            for suffix, path, kind in ((".wrapper.cpp", "code/wrapper{}.cpp", "wrapper"),
                                       (".kernel.cpp", "code/kernel{}.cpp", "kernels")):
                if name.endswith(suffix):
                    n = sum(1 for p in files if kinds[p] == kind)
                    p = path.format("" if n == 0 else f"_{n}")
                    files[p] = zf.read(name).decode("utf-8", "replace")
                    kinds[p] = kind
    cpp_kernels = [k for p, src in files.items() if kinds[p] == "kernels" for k in _CPP_KERNEL.findall(src)]
    triton: dict[str, str] = {}
    python_sources = list(obs.output_code) + obs.artifacts.get("inductor_autotune_at_compile_time_code", [])
    for code in python_sources:
        triton.update(triton_kernels_in(code))
    if obs.output_code and triton:
        files["code/wrapper.py"] = obs.output_code[0]
        kinds["code/wrapper.py"] = "wrapper"
    for name, src in sorted(triton.items()):
        files[f"code/triton/{name}.py"] = src
        kinds[f"code/triton/{name}.py"] = "kernels"
    listing = [{"path": p, "kind": kinds[p], "bytes": len(src.encode()), "lines": src.count("\n") + 1}
               for p, src in files.items()]
    kernels = sorted(triton) + cpp_kernels
    language = "triton" if triton else "cpp"
    facts = rep.stage(
        seconds=compiled.phases.get("codegen"),
        observed_by="the package's generated sources"
        + ("; Triton kernels from the Python wrapper (run_and_get_code)" if triton else ""),
        note="" if compiled.phases.get("codegen") is not None else "this torch logged no end-of-codegen event: "
        "the package stage's time includes codegen",
        language=language,
        kernel_count=len(kernels),
        kernels=kernels,
        triton_kernels=len(triton),
        cpp_kernels=len(cpp_kernels),
        files=listing,
        wrapper_bytes=sum(f["bytes"] for f in listing if f["kind"] == "wrapper"),
        kernel_bytes=sum(f["bytes"] for f in listing if f["kind"] == "kernels"),
    )
    if compiled.device.startswith("cuda") and not triton:
        facts["note"] = (facts["note"] + "; " if facts["note"] else "") + (
            "no Triton source was captured (the wrapper .cpp carries the kernels as comments)")
    return Generated(facts, files)


# -- package -----------------------------------------------------------------------------------------------------


def package(compiled: Compiled, captured: Captured) -> dict[str, Any]:
    """Facts: bytes, compile_seconds (the whole Inductor + AOTInductor call), contents (the package's files and
    sizes), dynamic_dims (which requested ranges stayed symbolic in the graph Inductor compiled). The artifact check
    (error against eager, eager vs compiled latency) is added by the worker once it has run."""
    with zipfile.ZipFile(compiled.package) as zf:
        contents = [{"path": i.filename.split("/", 1)[-1], "bytes": i.file_size} for i in zf.infolist()
                    if not i.is_dir()]
    dyn = [dict(d) for d in captured.facts.get("dynamic_dims", [])]
    graphs = compiled.observation.graphs
    if graphs and dyn:
        symbols = {s for p in graphs[-1].get("placeholders") or [] for s in (p.get("shape") or [])
                   if isinstance(s, str)}
        named = any(d.get("symbol") in symbols for d in dyn)
        for d in dyn:
            # True/False when Inductor's graph names the same symbols; None when it renamed them.
            d["dynamic_in_inductor"] = (d.get("symbol") in symbols) if (named or not symbols) else None
    return rep.stage(
        seconds=compiled.phases.get("package"),
        observed_by="aoti_compile_and_package's output",
        note="" if compiled.phases.get("package") is not None else "included in codegen's time",
        bytes=os.path.getsize(compiled.package),
        weights_bytes=os.path.getsize(compiled.weights) if compiled.weights else None,
        compile_seconds=round(compiled.seconds, 3),
        contents=contents,
        dynamic_dims=dyn,
    )


# -- scan --------------------------------------------------------------------------------------------------------

MAX_FINDINGS_IN_EXCERPT = 50


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def isa_check(compiled: Compiled, pin: IsaPin, timeout_s: float) -> dict[str, Any]:
    """The package read against its x86-64 level (compiler.isa): its recorded vector ISA, its g++ flags and its
    code. One that goes above the level is removed (IsaMismatch, final), before anything runs it."""
    try:
        return isa_mod.audit(compiled.package, pin, timeout_s=timeout_s)
    except Exception:
        _remove(compiled.package)
        raise


def scan(compiled: Compiled) -> scan_mod.ScanResult:
    """The second line after codegen, before anything runs the package: every generated source in it (C++ wrapper
    and kernels; on GPUs the wrapper's comment copy of each Triton kernel) and the Python the compile produced
    beside it: on GPUs every Triton kernel module the compile handed to Triton (what became the cubins), the Python
    wrapper of AOTInductor's first pass where this torch shows it, and the compile-time autotune code. A hit removes
    the package and raises UnsafeCode, which is final: the package is never checked or published. Facts: files,
    bytes, seconds, findings, scanned.

    The compile itself has run by now: on GPUs the Triton kernels' module code and the autotune code ran inside it,
    and g++ has read the C++. What the scan stops is everything after: the check, the publish, every load."""
    obs = compiled.observation
    python: dict[str, str] = {}
    for n, code in enumerate(obs.output_code):
        python[f"<python wrapper {n}>"] = code
    for n, code in enumerate(obs.artifacts.get("inductor_autotune_at_compile_time_code", [])):
        python[f"<autotune code {n}>"] = code
    kernels = {f"<triton kernel {name}>": src for name, src in obs.kernel_sources.items()}
    def refuse() -> None:
        _remove(compiled.package)
        if compiled.weights:
            _remove(compiled.weights)

    try:
        result = scan_mod.scan_package(compiled.package, python, kernels)
    except Exception as e:  # fail closed: a package that cannot be scanned is not checked either
        refuse()
        raise CompileError(f"the generated sources could not be scanned ({type(e).__name__}: {e}), so the "
                           "package was refused", stage="package") from e
    if result.findings:
        refuse()
        first, more = result.findings[0], len(result.findings) - 1
        raise UnsafeCode(
            f"the generated code calls what no kernel calls, so the package was refused before anything ran it: "
            f"{first.file} line {first.line}: {first.call} ({first.why})"
            + (f"; and {more} more finding(s), in the excerpt" if more else ""),
            stage="package",
            excerpt="\n".join(str(f) for f in result.findings[:MAX_FINDINGS_IN_EXCERPT]),
        )
    return result
