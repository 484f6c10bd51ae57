"""Every callable an upload can name is checked against the operator list by meaning, not by field: node targets,
operator-valued arguments, the callables of higher-order ops and the subgraphs they call, and every field of the
export schema is checked or refused. Each hostile archive is a real export (tests/archives.py `Mixed`: a no_grad
region, an autocast region and a torch.cond) with its model.json edited; refusals are shown at the API over HTTP
and in compiler.archive directly, and the same program unedited is accepted, compiled once on the CPU and checked.

The worker's side (the guard during torch.export.load and the walk of the loaded graph) is in
tests/compiler/test_loading.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from archives import (
    GRAD_REGION,
    Mixed,
    call_in_grad_region,
    edit_json,
    hostile_callables,
    nodes,
    positional,
    read_json,
    subgraph_nodes,
)
from compiler.archive.inspect import inspect_archive
from compiler.archive.ops import known_targets
from compiler.errors import UnsafeArchive
from compiler.loading import load_program
from modelzoo import export


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return export(Mixed(), (torch.randn(4, 8),), tmp_path_factory.mktemp("mixed") / "mixed.pt2")


def upload(api_url: str, path: Path) -> Any:
    from procs import api  # the HTTP tests only: the others run without the service's dependencies

    return api.post(f"{api_url}/v1/models", content=path.read_bytes(), timeout=60)


def refused(path: Path, *needles: str) -> UnsafeArchive:
    with pytest.raises(UnsafeArchive) as info:
        inspect_archive(str(path))
    for needle in needles:
        assert needle in info.value.message, info.value.message
    return info.value


def edited(src: Path, dst: Path, fn: Any) -> Path:
    def edit(doc: Any) -> Any:
        fn(doc)
        return doc

    return edit_json(src, dst, "models/model.json", edit)


def _hop(doc: dict[str, Any], target: str) -> dict[str, Any]:
    return next(n for n in nodes(doc) if n["target"] == target)


# -- what real programs hold passes --------------------------------------------------------------------------------


def test_grad_autocast_and_cond_regions_pass(mixed: Path) -> None:
    doc = read_json(mixed, "models/model.json")
    targets = [n["target"] for n in nodes(doc)]
    for hop in (GRAD_REGION, "torch.ops.higher_order.wrap_with_autocast", "torch.ops.higher_order.cond"):
        assert hop in targets, targets
    assert inspect_archive(str(mixed))["inputs"] == [{"name": "x", "dtype": "float32", "shape": [4, 8]}]


@pytest.mark.slow
def test_grad_autocast_and_cond_regions_compile_end_to_end(api_url: str, worker: dict, client: Any,
                                                            mixed: Path) -> None:
    """Upload over HTTP, a real compile on the CPU, the check against eager, a pull and a call."""
    torch.manual_seed(0)
    model = Mixed().eval()
    art = client.compile(mixed, {"x": [4, 8]}, target="cpu")
    assert art.meta["check"]["passed"] is True
    fn = client.load(art)
    for sign in (1, -1):  # both branches of the cond
        x = sign * torch.rand(4, 8)
        with torch.no_grad():
            torch.testing.assert_close(fn(x), model(x), rtol=1e-4, atol=1e-5)


# -- an operator passed as a value, to an op that calls it -----------------------------------------------------------


@pytest.mark.parametrize("variant", ["print", "triton_kernel_wrapper_mutation", "inline_asm_elementwise",
                                     "run_const_graph", "os_system"])
def test_callables_passed_through_a_grad_region_are_refused_over_http(api_url: str, mixed: Path, tmp_path: Path,
                                                                      variant: str) -> None:
    name, args = hostile_callables(tmp_path / "PWNED")[variant]
    path = call_in_grad_region(mixed, tmp_path / f"{variant}.pt2", name, args)
    r = upload(api_url, path)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "unsafe_archive", error
    assert name in error["message"] and "wrap_with_set_grad_enabled" in error["message"], error["message"]
    assert error["path"] == "graph_module.graph.nodes[0].inputs[1].arg.as_operator", error
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("name", ["torch.ops.higher_order.print", "torch.os.system", "torch.ops.aten.sin.default"])
def test_operator_valued_arguments_are_refused_wherever_they_stand(mixed: Path, tmp_path: Path, name: str) -> None:
    """At a position the op does not call, as a keyword, inside a dict or a list of arguments, and in the graph's
    outputs: an operator is never data, whether or not the list holds it."""

    def as_keyword(doc: Any) -> None:
        nodes(doc)[-1]["inputs"].append({"name": "fn", "arg": {"as_operator": name}, "kind": 2})

    def third_positional(doc: Any) -> None:
        _hop(doc, GRAD_REGION)["inputs"].append(positional({"as_operator": name})[0])

    def in_a_dict(doc: Any) -> None:
        _hop(doc, GRAD_REGION)["inputs"].append(
            positional({"as_string_to_argument": {"f": {"as_operator": name}}})[0])

    def in_the_outputs(doc: Any) -> None:
        doc["graph_module"]["graph"]["outputs"].append({"as_operator": name})

    for i, edit in enumerate((as_keyword, third_positional, in_a_dict, in_the_outputs)):
        err = refused(edited(mixed, tmp_path / f"{i}.pt2", edit), "operator-valued argument", name)
        assert err.detail["path"].endswith("as_operator"), err.detail


def test_an_allowed_operator_is_still_not_a_callable_argument(mixed: Path, tmp_path: Path) -> None:
    path = call_in_grad_region(mixed, tmp_path / "sin.pt2", "torch.ops.aten.sin.default",
                               [{"as_tensor": {"name": "x"}}])
    refused(path, "torch.ops.aten.sin.default", "must be a subgraph")


# -- higher-order ops and their subgraphs ------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["torch.ops.higher_order.print", "torch.os.system",
                                    "torch.ops.higher_order.run_const_graph", "torch.ops.aten.sin"])
def test_a_subgraph_is_walked_with_the_same_rules(mixed: Path, tmp_path: Path, target: str) -> None:
    def swap(doc: Any) -> None:
        subgraph_nodes(doc)[0]["target"] = target

    err = refused(edited(mixed, tmp_path / "sub.pt2", swap), target, "not a torch operator this service compiles")
    assert err.detail["path"] == "graph_module.graph.nodes[0].inputs[1].arg.as_graph.graph.nodes[0].target"


def test_a_callable_passed_inside_a_subgraph_is_refused(mixed: Path, tmp_path: Path, api_url: str) -> None:
    """The grad region's subgraph holds a grad region of its own that calls print: the subgraph's nodes get the
    same rules as the program's, at any depth."""
    name, args = hostile_callables(tmp_path / "PWNED")["print"]

    def nest(doc: Any) -> None:
        inner = subgraph_nodes(doc)[0]
        inner["target"], inner["inputs"] = GRAD_REGION, positional({"as_bool": True}, {"as_operator": name}, *args)

    path = edited(mixed, tmp_path / "nested.pt2", nest)
    err = refused(path, name, "must be a subgraph")
    assert err.detail["path"] == ("graph_module.graph.nodes[0].inputs[1].arg.as_graph.graph.nodes[0].inputs[1].arg."
                                  "as_operator")
    r = upload(api_url, path)
    assert r.status_code == 422 and r.json()["error"]["code"] == "unsafe_archive", r.text


def test_a_subgraph_in_a_cond_branch_is_walked(mixed: Path, tmp_path: Path) -> None:
    def swap(doc: Any) -> None:
        subgraph_nodes(doc, "torch.ops.higher_order.cond")[0]["target"] = "torch.ops.higher_order.print"

    refused(edited(mixed, tmp_path / "cond.pt2", swap), "torch.ops.higher_order.print")


@pytest.mark.parametrize("target", [
    "torch.ops.higher_order.print", "torch.ops.higher_order.triton_kernel_wrapper_mutation",
    "torch.ops.higher_order.triton_kernel_wrapper_functional", "torch.ops.higher_order.inline_asm_elementwise",
    "torch.ops.higher_order.run_const_graph", "torch.ops.higher_order.executorch_call_delegate",
    "torch.ops.higher_order.call_torchbind", "torch.ops.higher_order.with_effects",
    "torch.ops.higher_order.auto_functionalized", "torch.ops.higher_order.auto_functionalized_v2",
    "torch.ops.higher_order.flex_attention", "torch.ops.higher_order.wrap", "torch.ops.higher_order.strict_mode",
])
def test_higher_order_ops_off_the_list_are_refused_as_targets(mixed: Path, tmp_path: Path, target: str) -> None:
    """The grad region's node, subgraph and all, retargeted: only the higher-order ops whose callables the checks
    know pass."""

    def retarget(doc: Any) -> None:
        _hop(doc, GRAD_REGION)["target"] = target

    assert target not in known_targets()
    refused(edited(mixed, tmp_path / "hop.pt2", retarget), target)


def test_every_listed_higher_order_op_has_its_callables_known() -> None:
    from compiler.archive.ops import HOP_PREFIX, HOPS

    assert {t for t in known_targets() if t.startswith(HOP_PREFIX)} == set(HOPS)


def test_a_higher_order_op_must_call_a_subgraph(mixed: Path, tmp_path: Path) -> None:
    def tensor_as_fn(doc: Any) -> None:
        _hop(doc, GRAD_REGION)["inputs"][1] = positional({"as_tensor": {"name": "x"}})[0]

    def callable_dropped(doc: Any) -> None:
        node = _hop(doc, GRAD_REGION)
        node["inputs"] = node["inputs"][:1]

    def cond_branch_swapped(doc: Any) -> None:
        _hop(doc, "torch.ops.higher_order.cond")["inputs"][2] = positional({"as_none": True})[0]

    refused(edited(mixed, tmp_path / "a.pt2", tensor_as_fn), "as_tensor", "must be a subgraph")
    refused(edited(mixed, tmp_path / "b.pt2", callable_dropped), "1 positional argument(s)")
    refused(edited(mixed, tmp_path / "c.pt2", cond_branch_swapped), "cond(pred, true_fn, false_fn, operands)")


def test_a_subgraph_where_no_higher_order_op_calls_it(mixed: Path, tmp_path: Path) -> None:
    def moved(doc: Any) -> None:
        node = _hop(doc, GRAD_REGION)
        graph = node["inputs"][1]
        node["inputs"].append(graph)  # a third positional argument: passed to the subgraph, never called by the op

    def into_an_aten_op(doc: Any) -> None:
        graph = _hop(doc, GRAD_REGION)["inputs"][1]["arg"]
        aten = next(n for n in nodes(doc) if n["target"].startswith("torch.ops.aten."))
        aten["inputs"].append({"name": "extra", "arg": graph, "kind": 2})

    refused(edited(mixed, tmp_path / "a.pt2", moved), "not at a position that a higher-order op")
    refused(edited(mixed, tmp_path / "b.pt2", into_an_aten_op), "not at a position that a higher-order op")


def test_an_input_the_torch_versions_would_place_differently(mixed: Path, tmp_path: Path) -> None:
    """torch 2.13 passes a named input of kind POSITIONAL positionally, torch 2.11 as a keyword."""

    def named(doc: Any) -> None:
        _hop(doc, GRAD_REGION)["inputs"][1]["name"] = "fn"

    refused(edited(mixed, tmp_path / "a.pt2", named), "marked positional")


def test_custom_objects_are_refused_wherever_they_stand(mixed: Path, tmp_path: Path) -> None:
    obj = {"name": "obj", "class_fqn": "__torch__.torch.classes.my.Obj"}

    def as_argument(doc: Any) -> None:
        nodes(doc)[-1]["inputs"].append({"name": "o", "arg": {"as_custom_obj": obj}, "kind": 2})

    def as_graph_value(doc: Any) -> None:
        doc["graph_module"]["graph"]["custom_obj_values"] = {"obj": obj}

    def as_input(doc: Any) -> None:
        doc["graph_module"]["signature"]["input_specs"].append(
            {"custom_obj": {"arg": obj, "custom_obj_name": "obj"}})

    for i, edit in enumerate((as_argument, as_graph_value, as_input)):
        refused(edited(mixed, tmp_path / f"{i}.pt2", edit), "torchbind")


# -- every field checked or refused ------------------------------------------------------------------------------


def unknown_field(src: Path, dst: Path, where: str) -> tuple[Path, str]:
    """A copy of `src` with a key the export schema does not have, at `where`; and the path a refusal must name."""
    entry, expected = "models/model.json", ""

    def edit(doc: Any) -> Any:
        nonlocal expected
        if where == "program":
            doc["callables"], expected = ["torch.os.system"], "callables"
        elif where == "node":
            nodes(doc)[0]["run_first"], expected = "torch.os.system", "graph_module.graph.nodes[0].run_first"
        elif where == "argument member":
            nodes(doc)[-1]["inputs"][0]["arg"] = {"as_callable": "torch.os.system"}
            expected = f"graph_module.graph.nodes[{len(nodes(doc)) - 1}].inputs[0].arg.as_callable"
        elif where == "tensor meta":
            meta = next(iter(doc["graph_module"]["graph"]["tensor_values"].values()))
            meta["hook"], expected = "torch.os.system", "hook"
        elif where == "subgraph node":
            subgraph_nodes(doc)[0]["hook"] = "torch.os.system"
            expected = "graph_module.graph.nodes[0].inputs[1].arg.as_graph.graph.nodes[0].hook"
        elif where == "signature":
            doc["graph_module"]["signature"]["input_specs"][0]["parameter"]["getter"] = "torch.os.system"
            expected = "graph_module.signature.input_specs[0].parameter.getter"
        else:
            doc["config"][next(iter(doc["config"]))]["loader"], expected = "torch.os.system", "loader"
        return doc

    if where == "weights config":
        entry = "data/weights/model_weights_config.json"
    return edit_json(src, dst, entry, edit), expected


@pytest.mark.parametrize("where", ["program", "node", "argument member", "tensor meta", "subgraph node",
                                   "signature", "weights config"])
def test_a_field_the_schema_does_not_know_is_refused_naming_its_path(mixed: Path, tmp_path: Path,
                                                                     where: str) -> None:
    path, expected = unknown_field(mixed, tmp_path / "key.pt2", where)
    err = refused(path, expected, "compiler/archive/schema.py")
    assert err.detail["path"].endswith(expected.rsplit(".", 1)[-1])


@pytest.mark.parametrize("where", ["node", "subgraph node", "weights config"])
def test_a_field_the_schema_does_not_know_is_refused_over_http(api_url: str, mixed: Path, tmp_path: Path,
                                                               where: str) -> None:
    path, expected = unknown_field(mixed, tmp_path / "key.pt2", where)
    r = upload(api_url, path)
    assert r.status_code == 422 and r.json()["error"]["code"] == "unsafe_archive", r.text
    assert expected in r.json()["error"]["message"]


@pytest.mark.parametrize("case", ["union of two members", "string for an int", "list for a string",
                                  "missing required field", "null where none may be", "unknown dtype"])
def test_a_value_that_does_not_fit_its_type_is_refused(mixed: Path, tmp_path: Path, case: str) -> None:
    def edit(doc: Any) -> None:
        node = nodes(doc)[-1]
        if case == "union of two members":
            node["inputs"][0]["arg"] = {"as_tensor": {"name": "x"}, "as_operator": "torch.os.system"}
        elif case == "string for an int":
            next(iter(doc["graph_module"]["graph"]["tensor_values"].values()))["sizes"][0] = {"as_int": "4"}
        elif case == "list for a string":
            node["target"] = ["torch", "os", "system"]
        elif case == "missing required field":
            del node["outputs"]
        elif case == "null where none may be":
            node["metadata"] = None
        else:
            next(iter(doc["graph_module"]["graph"]["tensor_values"].values()))["dtype"] = 99

    refused(edited(mixed, tmp_path / "t.pt2", edit))


def test_metadata_is_not_resolved_and_stays_free_text(mixed: Path, tmp_path: Path) -> None:
    """source_fn_stack names a callable that torch would look up; the worker's loader reads no metadata, so the
    upload may keep it as written."""

    def edit(doc: Any) -> None:
        nodes(doc)[0]["metadata"]["source_fn_stack"] = "x,torch.os.system"

    path = edited(mixed, tmp_path / "meta.pt2", edit)
    inspect_archive(str(path))
    ep = load_program(str(path))
    assert all("source_fn_stack" not in n.meta for n in ep.graph.nodes)

