"""compiler.loading.load_program and the compiler.compat.safe_load guard, against real and hostile archives.

Each hostile archive carries a payload that writes a marker file. "Control" tests show that plain
torch.export.load really runs the payload (so the refusals below are not vacuous); every other test checks the
marker never appears.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.export import Dim

from archives import (
    GRAD_REGION,
    LEAK_MARK,
    AddBytes,
    ConvBNReLU,
    Mixed,
    TinyMLP,
    call_in_grad_region,
    edit_json,
    excluded_op_call,
    exec_pickle,
    hostile_callables,
    nodes,
    positional,
    read_json,
    rewrite,
    subgraph_nodes,
    system_pickle,
    torch_zip_with,
)
from compiler.archive.exprs import check_sym_expr
from compiler.archive.inspect import inspect_archive
from compiler.compat.safe_load import DeserializationRefused, guarded_export_load
from compiler.errors import BadModel, UnsafeArchive, UnsafeModel
from compiler.loading import load_program, on_device
from modelzoo import ConvNet, export


class Pair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((5,), 2.0))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * self.scale + b


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    out = {}
    for name, model, args, dyn in [
        ("mlp", TinyMLP(), (torch.randn(4, 16),), None),
        ("conv", ConvBNReLU(), (torch.randn(2, 3, 16, 16),), {"x": {0: Dim("batch", min=1, max=64)}}),
        ("pair", Pair(), (torch.randn(3, 5), torch.randn(3, 5)), {"a": {0: Dim("n")}, "b": {0: Dim("n")}}),
        ("mixed", Mixed(), (torch.randn(4, 8),), None),
        ("add_bytes", AddBytes(), (torch.zeros(16, dtype=torch.uint8),), None),
    ]:
        ep = torch.export.export(model.eval(), args, dynamic_shapes=dyn)
        torch.export.save(ep, str(d / f"{name}.pt2"))
        out[name] = d / f"{name}.pt2"
    return out


# -- hostile archives ---------------------------------------------------------------------------------------------


def evil_sample_inputs(src: Path, dst: Path, marker: Path) -> Path:
    return rewrite(src, dst, {"data/sample_inputs/model.pt": torch_zip_with(system_pickle(marker))})


def evil_weight(src: Path, dst: Path, marker: Path) -> Path:
    cfg = read_json(src, "data/weights/model_weights_config.json")
    fqn, meta = next(iter(cfg["config"].items()))
    meta["use_pickle"] = True
    return rewrite(
        src,
        dst,
        {
            "data/weights/model_weights_config.json": json.dumps(cfg).encode(),
            f"data/weights/{meta['path_name']}": torch_zip_with(exec_pickle(marker)),
        },
    )


def evil_opaque_constant(src: Path, dst: Path, marker: Path) -> Path:
    cfg = {"config": {"obj": {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True, "tensor_meta": None}}}
    return rewrite(
        src,
        dst,
        {"data/constants/model_constants_config.json": json.dumps(cfg).encode()},
        add={"data/constants/opaque_obj_0": system_pickle(marker)},
    )


def evil_sympify(src: Path, dst: Path, marker: Path) -> Path:
    with zipfile.ZipFile(src) as z:
        root = z.namelist()[0].split("/")[0]
        body = z.read(f"{root}/models/model.json").decode()
    sym = "Symbol('" + body.split("Symbol('", 1)[1].split("'", 1)[0] + "', positive=True, integer=True)"
    evil = body.replace(sym, f"__import__('os').system('touch {marker}') or {sym}", 1)
    assert evil != body
    return rewrite(src, dst, {"models/model.json": evil.encode()})


def evil_guard(src: Path, dst: Path, marker: Path) -> Path:
    doc = read_json(src, "models/model.json")
    doc["guards_code"] = [*doc.get("guards_code", []), f"__import__('os').system('touch {marker}') == 0"]
    return rewrite(src, dst, {"models/model.json": json.dumps(doc).encode()})


EVIL: dict[str, Callable[[Path, Path, Path], Path]] = {
    "sample_inputs": evil_sample_inputs,
    "use_pickle_weight": evil_weight,
    "opaque_constant": evil_opaque_constant,
    "sympify": evil_sympify,
    "guards_code": evil_guard,
}


# -- good archives ------------------------------------------------------------------------------------------------


def test_loads_and_runs_like_the_original(models: dict[str, Path]) -> None:
    ep = load_program(str(models["conv"]))
    assert isinstance(ep, torch.export.ExportedProgram)
    x = torch.randn(5, 3, 16, 16)
    reference = torch.export.load(str(models["conv"])).module()(x)
    torch.testing.assert_close(ep.module()(x), reference)
    assert torch.load is torch.serialization.load  # guard undone


def test_dynamic_pair(models: dict[str, Path]) -> None:
    ep = load_program(str(models["pair"]))
    a, b = torch.randn(7, 5), torch.randn(7, 5)
    torch.testing.assert_close(ep.module()(a, b), a * 2 + b)


def test_static_mlp(models: dict[str, Path]) -> None:
    ep = load_program(str(models["mlp"]))
    assert len(ep.state_dict) == 4


def test_pickled_real_tensor_weight_loads(models: dict[str, Path], tmp_path: Path) -> None:
    """use_pickle weights are fine when they are plain tensors: they load under weights_only=True."""
    src = models["mlp"]
    cfg = read_json(src, "data/weights/model_weights_config.json")
    fqn, meta = next(iter(cfg["config"].items()))
    meta["use_pickle"] = True
    original = torch.export.load(str(src)).state_dict[fqn]
    buf = io.BytesIO()
    torch.save(torch.nn.Parameter(original.detach().clone()), buf)
    p = rewrite(
        src,
        tmp_path / "pickled.pt2",
        {
            "data/weights/model_weights_config.json": json.dumps(cfg).encode(),
            f"data/weights/{meta['path_name']}": buf.getvalue(),
        },
    )
    ep = load_program(str(p))
    torch.testing.assert_close(ep.state_dict[fqn], original)


# -- refusals -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(EVIL))
def test_hostile_archive_refused_by_api_and_loader(kind: str, models: dict[str, Path], tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    src = models["pair"]
    path = EVIL[kind](src, tmp_path / "evil.pt2", marker)
    with pytest.raises(UnsafeArchive):
        inspect_archive(str(path))
    with pytest.raises(UnsafeModel) as info:
        load_program(str(path))
    assert info.value.stage == "load"
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["sample_inputs", "use_pickle_weight", "opaque_constant", "sympify"])
def test_control_plain_torch_export_load_runs_the_payload(kind: str, models: dict[str, Path], tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    path = EVIL[kind](models["pair"], tmp_path / "evil.pt2", marker)
    try:
        torch.export.load(str(path))
    except Exception:
        pass
    assert marker.exists(), "the hostile archive did not exploit torch.export.load; the refusal tests prove nothing"


def test_control_guards_code_runs_when_the_program_runs(models: dict[str, Path], tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    path = evil_guard(models["pair"], tmp_path / "evil.pt2", marker)
    torch.export.load(str(path)).module()(torch.randn(3, 5), torch.randn(3, 5))
    assert marker.exists()


@pytest.mark.parametrize("kind", ["sample_inputs", "use_pickle_weight", "opaque_constant", "sympify"])
def test_guard_alone_blocks_the_payload(kind: str, models: dict[str, Path], tmp_path: Path) -> None:
    """Defence in depth: with the static checks skipped, the guard by itself keeps the payload from running."""
    marker = tmp_path / "PWNED"
    path = EVIL[kind](models["pair"], tmp_path / "evil.pt2", marker)
    original_load, original_pickle_load_obj = torch.load, torch._C._pickle_load_obj
    with guarded_export_load(check_sym_expr) as events:
        with pytest.raises(DeserializationRefused):
            torch.export.load(str(path))
    assert not marker.exists()
    assert any(e.startswith("refused") for e in events), events
    assert torch.load is original_load and torch._C._pickle_load_obj is original_pickle_load_obj


def test_guard_keeps_good_archives_loading(models: dict[str, Path]) -> None:
    with guarded_export_load(check_sym_expr) as events:
        ep = torch.export.load(str(models["conv"]))
    assert isinstance(ep, torch.export.ExportedProgram)
    assert not any(e.startswith("refused") for e in events)


def test_custom_obj_constant_refused(models: dict[str, Path], tmp_path: Path) -> None:
    cfg = {"config": {"obj": {"path_name": "custom_obj_0", "is_param": False, "use_pickle": True, "tensor_meta": None}}}
    path = rewrite(
        models["mlp"],
        tmp_path / "obj.pt2",
        {"data/constants/model_constants_config.json": json.dumps(cfg).encode()},
        add={"data/constants/custom_obj_0": b"PK\x03\x04"},
    )
    with pytest.raises(UnsafeModel, match="custom"):
        load_program(str(path))


def test_not_a_zip_is_bad_model(tmp_path: Path) -> None:
    p = tmp_path / "x.pt2"
    p.write_bytes(b"definitely not a zip")
    with pytest.raises(BadModel, match="not a zip"):
        load_program(str(p))


def test_zip_without_program_is_bad_model(tmp_path: Path) -> None:
    p = tmp_path / "x.pt2"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("x/archive_format", "pt2")
    with pytest.raises(BadModel, match="torch.export"):
        load_program(str(p))


def test_unreadable_by_torch_is_bad_model(models: dict[str, Path], tmp_path: Path) -> None:
    """Passes the static checks but torch cannot build a program from it: BadModel, not a crash."""
    doc = read_json(models["mlp"], "models/model.json")
    doc["graph_module"]["graph"]["nodes"][0]["target"] = "torch.ops.aten.add.Tensor"  # a real op, wrong arguments
    p = rewrite(models["mlp"], tmp_path / "bad.pt2", {"models/model.json": json.dumps(doc).encode()})
    with pytest.raises(BadModel):
        load_program(str(p))


def test_loader_without_static_checks_still_refuses(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layers 2 and 3 of load_program on their own: the guard's refusal becomes UnsafeModel, nothing runs."""
    from compiler import loading

    monkeypatch.setattr(loading, "_validate", lambda path: [])
    for kind in ("sample_inputs", "use_pickle_weight", "opaque_constant", "sympify"):
        marker = tmp_path / f"PWNED-{kind}"
        path = EVIL[kind](models["pair"], tmp_path / f"{kind}.pt2", marker)
        with pytest.raises(UnsafeModel):
            load_program(str(path))
        assert not marker.exists(), kind


def test_loaded_guards_are_checked_again(models: dict[str, Path], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """If the static check were bypassed, guards_code on the loaded program is still checked before use."""
    from compiler import loading

    marker = tmp_path / "PWNED"
    path = evil_guard(models["pair"], tmp_path / "evil.pt2", marker)
    monkeypatch.setattr(loading, "_validate", lambda path: [])
    with pytest.raises(UnsafeModel, match="guard"):
        load_program(str(path))
    assert not marker.exists()


# -- operators left off the list: compiler.archive.ops.EXCLUDED ---------------------------------------------------

SECRET = b"0123456789abcdef, and the rest of the file"


def _excluded_call(op: str, models: dict[str, Path], tmp_path: Path) -> Path:
    (tmp_path / "secret").write_bytes(SECRET)
    arg = str(tmp_path / "secret") if op == "from_file" else "AOTC-PRINTED"
    return excluded_op_call(models["add_bytes"], tmp_path / f"{op}.pt2", op, arg)


def test_control_plain_torch_runs_an_excluded_op(models: dict[str, Path], tmp_path: Path,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    """Why they are left off: a program that plain torch loads returns a file of the machine that runs it as its
    output, or writes to that process's stdout."""
    x = torch.zeros(16, dtype=torch.uint8)
    read = torch.export.load(str(_excluded_call("from_file", models, tmp_path))).module()(x)
    assert bytes(read.tolist()) == SECRET[:16]
    torch.export.load(str(_excluded_call("print", models, tmp_path))).module()(x)
    assert "AOTC-PRINTED" in capfd.readouterr().out


@pytest.mark.parametrize("op, target, does", [
    ("from_file", "torch.ops.aten.from_file.default", "reads the file its string argument names"),
    ("print", "torch.ops.aten._print.default", "writes its string argument to the standard output"),
])
@pytest.mark.parametrize("layer", ["load_program", "guard", "walk"])
def test_an_excluded_op_is_refused_by_the_worker_with_its_reason(
        op: str, target: str, does: str, layer: str, models: dict[str, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """Each layer on its own: load_program (its static check first), the guard during torch.export.load, and the
    walk of a graph plain torch loaded; each names the op and what it does, and nothing runs."""
    from compiler.loading import _check_callables

    path = _excluded_call(op, models, tmp_path)
    with pytest.raises(UnsafeModel) as info:
        if layer == "walk":
            _check_callables(torch.export.load(str(path)))
        else:
            if layer == "guard":
                _skip_static_checks(monkeypatch)
            load_program(str(path))
    assert target in info.value.message and does in info.value.message, info.value.message
    assert "left off the operator list" in info.value.message, info.value.message
    assert "AOTC-PRINTED" not in capfd.readouterr().out


# -- the loaded graph is safe for codegen -------------------------------------------------------------------------


def _mark_metadata(src: Path, dst: Path) -> Path:
    doc = read_json(src, "models/model.json")
    for node in doc["graph_module"]["graph"]["nodes"]:
        node["metadata"].update({
            "stack_trace": 'File "PWNED.py", line 1\n    )"); system("touch /tmp/x"); R"(',
            "custom": json.dumps({"PWNED": 1}),
        })
    return rewrite(src, dst, {"models/model.json": json.dumps(doc).encode()})


def test_free_text_metadata_is_dropped_after_loading(models: dict[str, Path], tmp_path: Path) -> None:
    """Stack traces end up in AOTInductor's C++ (KernelContextGuard's raw strings) and in the package's
    kernel_information.json; module stacks and source functions in comments and kernel names. None survive."""
    p = _mark_metadata(models["conv"], tmp_path / "marked.pt2")
    assert "PWNED" in str([n.meta for n in torch.export.load(str(p)).graph.nodes])  # plain torch keeps it
    ep = load_program(str(p))
    for gm in ep.graph_module.modules():
        if isinstance(gm, torch.fx.GraphModule):
            for node in gm.graph.nodes:
                assert set(node.meta) <= {"val", "tensor_meta", "unbacked_bindings"}, node.meta.keys()
    x = torch.randn(3, 3, 16, 16)
    torch.testing.assert_close(ep.module()(x), torch.export.load(str(models["conv"])).module()(x))


def test_loaded_strings_are_checked_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the static checks skipped, an assert message that would break out of a C++ literal is still refused
    before any stage runs."""
    from compiler import loading

    class Evil(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch._assert_async(x.sum() > -1e9, '"); system("touch /tmp/pwned"); //')
            return x + 1

    ep = torch.export.export(Evil(), (torch.randn(3),))
    torch.export.save(ep, str(tmp_path / "evil.pt2"))
    with pytest.raises(UnsafeModel, match="'_assert_async'"):
        load_program(str(tmp_path / "evil.pt2"))  # layer 1
    monkeypatch.setattr(loading, "_validate", lambda path: [])
    with pytest.raises(UnsafeModel, match="_assert_async"):
        load_program(str(tmp_path / "evil.pt2"))  # the check on the loaded graph


# -- callables: the guard during the load and the walk of the loaded graph -----------------------------------------

CALLABLES = ["print", "triton_kernel_wrapper_mutation", "inline_asm_elementwise", "run_const_graph", "os_system"]


def _skip_static_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    from compiler import loading

    monkeypatch.setattr(loading, "_validate", lambda path: [])


def test_grad_autocast_and_cond_regions_load(models: dict[str, Path]) -> None:
    ep = load_program(str(models["mixed"]))
    targets = {f"{n.target.__module__}.{n.target.__name__}" for gm in ep.graph_module.modules()
               if isinstance(gm, torch.fx.GraphModule) for n in gm.graph.nodes if n.op == "call_function"}
    hops = {t for t in targets if "higher_order" in t}
    assert hops == {f"torch.ops.higher_order.{h}" for h in ("wrap_with_set_grad_enabled", "wrap_with_autocast",
                                                             "cond")}, hops
    x = torch.randn(4, 8)
    torch.testing.assert_close(ep.module()(x), torch.export.load(str(models["mixed"])).module()(x))


@pytest.mark.parametrize("variant", CALLABLES)
def test_hostile_callables_refused_by_the_loader(variant: str, models: dict[str, Path], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """By the static re-check, and without it by the guard: the name is refused before torch looks it up."""
    marker = tmp_path / "PWNED"
    name, args = hostile_callables(marker)[variant]
    path = call_in_grad_region(models["mixed"], tmp_path / "evil.pt2", name, args)
    with pytest.raises(UnsafeModel, match="must be a subgraph"):
        load_program(str(path))
    _skip_static_checks(monkeypatch)
    with pytest.raises(UnsafeModel, match="not on the operator list") as info:
        load_program(str(path))
    assert name in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("variant", ["print", "triton_kernel_wrapper_mutation", "inline_asm_elementwise",
                                     "run_const_graph"])
def test_the_loaded_graph_walk_alone_refuses_them(variant: str, models: dict[str, Path], tmp_path: Path) -> None:
    """The last line: a program plain torch.export.load built (no static check, no guard) is refused by the walk of
    its graph before anything calls it."""
    from compiler.loading import _check_callables

    name, args = hostile_callables(tmp_path / "PWNED")[variant]
    ep = torch.export.load(str(call_in_grad_region(models["mixed"], tmp_path / "evil.pt2", name, args)))
    with pytest.raises(UnsafeModel, match="it must be a subgraph of the program"):
        _check_callables(ep)


def test_an_allowed_operator_as_a_callable_is_refused_on_the_loaded_graph(
        models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """aten.sin is on the list, so the guard resolves it; the graph walk still refuses it where the op calls it, and
    as a plain argument too."""
    called = call_in_grad_region(models["mixed"], tmp_path / "a.pt2", "torch.ops.aten.sin.default",
                                 [{"as_tensor": {"name": "x"}}])

    def as_data(doc: Any) -> Any:
        next(n for n in nodes(doc) if n["target"] == GRAD_REGION)["inputs"].append(
            positional({"as_operator": "torch.ops.aten.sin.default"})[0])
        return doc

    passed = edit_json(models["mixed"], tmp_path / "b.pt2", "models/model.json", as_data)
    _skip_static_checks(monkeypatch)
    with pytest.raises(UnsafeModel, match="OpOverload.*as argument 1.*must be a subgraph"):
        load_program(str(called))
    with pytest.raises(UnsafeModel, match="argument 3 holds OpOverload"):
        load_program(str(passed))


@pytest.mark.parametrize("target", ["torch.ops.higher_order.print", "torch.os.system"])
def test_a_subgraph_with_a_refused_target(target: str, models: dict[str, Path], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def swap(doc: Any) -> Any:
        subgraph_nodes(doc)[0]["target"] = target
        return doc

    path = edit_json(models["mixed"], tmp_path / "sub.pt2", "models/model.json", swap)
    with pytest.raises(UnsafeModel, match="not a torch operator this service compiles"):
        load_program(str(path))
    _skip_static_checks(monkeypatch)
    with pytest.raises(UnsafeModel, match="not on the operator list"):
        load_program(str(path))


def test_metadata_names_are_not_looked_up_during_the_guarded_load(models: dict[str, Path], tmp_path: Path) -> None:
    """torch resolves each source_fn_stack entry by getattr chains; under the guard no metadata is read at all."""
    import operator

    def annotate(doc: Any) -> Any:
        nodes(doc)[0]["metadata"]["source_fn_stack"] = "mul,_operator.mul;lin,torch.nn.modules.linear.Linear"
        return doc

    path = edit_json(models["mixed"], tmp_path / "meta.pt2", "models/model.json", annotate)
    plain = next(n for n in torch.export.load(str(path)).graph.nodes if n.op == "call_function")
    assert plain.meta["source_fn_stack"] == [("mul", operator.mul), ("lin", torch.nn.Linear)]  # looked up
    with guarded_export_load(check_sym_expr, lambda name: True):
        guarded = torch.export.load(str(path))
    assert not any("source_fn_stack" in n.meta or "stack_trace" in n.meta for n in guarded.graph.nodes)


_EAGER = """
import sys, torch
ep = torch.export.load(sys.argv[1])
print("LOADED", flush=True)
ep.module()(torch.randn(4, 8))
"""


def test_control_plain_torch_runs_the_print_variant_eagerly(models: dict[str, Path], tmp_path: Path) -> None:
    """What the check child would have done with the print variant on the tree before the fix (it loads the program
    and runs it eagerly): plain torch loads it without running anything, then the first call prints a secret from
    the environment. The refusals above are not vacuous."""
    name, args = hostile_callables(tmp_path / "PWNED")["print"]
    path = call_in_grad_region(models["mixed"], tmp_path / "print.pt2", name, args)
    secret = "s3cr3t-" + os.urandom(4).hex()
    run = subprocess.run([sys.executable, "-c", _EAGER, str(path)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, LEAK_MARK: secret})
    before, _, after = run.stdout.partition("LOADED")
    assert secret not in before, "the load itself ran the callable"
    assert f"LEAK {secret}" in after, (run.stdout[-2000:], run.stderr[-2000:])


class MadeAndCast(torch.nn.Module):
    """What a program exported on the CPU carries of its device: a factory call's `device=` (arange) and the asserts
    export puts before each cast (`.long()`, `.float()`)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        return x * self.scale + torch.arange(x.shape[0]).float()[:, None] + f.long().float().sum()


def test_a_program_exported_on_the_cpu_is_moved_whole_to_its_target_device(tmp_path):
    """`module.to(device)` moved the weights only: a CPU export compiled for a CUDA target failed its capture and its
    check ("Tensor device mismatch! Expected: cpu"). The CPU box has no GPU: the meta device stands in for it."""
    path = export(MadeAndCast(), (torch.randn(3, 4), torch.rand(2)), tmp_path / "m.pt2")
    args = (torch.randn(3, 4, device="meta"), torch.rand(2, device="meta"))
    with pytest.raises(RuntimeError, match="device"):
        load_program(str(path)).module().to("meta")(*args)  # as the check and the capture moved it
    ep = on_device(load_program(str(path)), "meta")
    burnt = [n.kwargs["device"] for n in ep.graph.nodes if "device" in n.kwargs]
    assert len(burnt) == 4 and {str(d) for d in burnt} == {"meta"}, burnt  # arange and three casts' asserts
    assert ep.state_dict["scale"].device.type == "meta"
    out = ep.module()(*args)
    assert out.device.type == "meta" and out.shape == (3, 4)
    assert on_device(ep, "cpu") is ep  # a CPU target: nothing to move
    plain = load_program(str(export(ConvNet(), (torch.randn(1, 3, 8, 8),), tmp_path / "c.pt2")))
    assert on_device(plain, "meta") is plain and plain.state_dict["conv1.weight"].device.type == "cpu"  # .to() will do
