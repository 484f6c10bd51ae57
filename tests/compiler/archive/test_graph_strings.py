"""Strings of the uploaded graph that codegen pastes into C++ or Python source: refused unless they fit their grammar.

Each hostile archive is a real export rewritten one string at a time (tests/archives.py), so every refusal below
is for that one string; real programs with string arguments, asserts and data-dependent shapes pass.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from archives import TinyMLP, edit_json, nodes
from compiler.archive.inspect import inspect_archive
from compiler.archive.limits import Limits
from compiler.archive.strings import check
from compiler.errors import UnsafeArchive
from modelzoo import export
from realistic import Assert, export_realistic

BREAKOUT = '"); system("touch /tmp/pwned"); //'


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("real")
    return {**export_realistic(d), "mlp": export(TinyMLP(), (torch.randn(2, 16),), d / "mlp.pt2")}


def _members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def refused(path: Path, *needles: str, limits: Limits | None = None) -> UnsafeArchive:
    with pytest.raises(UnsafeArchive) as info:
        inspect_archive(str(path), *([limits] if limits else []))
    for needle in needles:
        assert needle in info.value.message, info.value.message
    return info.value


# -- the grammars --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["floor", "tanh", "mean", "bij,bjk->bik", "...ij->...ji", "all tokens in range!",
                                  "Runtime assertion failed for expression u0 >= 0 on node 'ge_1'",
                                  "Runtime assertion failed for expression Eq(Mod(u1, 2), 0) on node 'eq'", ""])
def test_text_grammar_takes_what_torch_writes(text: str) -> None:
    check(text, "text", "arg")


@pytest.mark.parametrize("text", [BREAKOUT, "a\nb", 'say "hi"', "it's", "back\\slash", "nul\x00", "tick`",
                                  "esc\x1b[31m", "caf\u00e9", "tab\t", "\u202eevil", "x" * 257,
                                  "Runtime assertion failed for expression u0 on node 'a'); system('x'); #'"])
def test_text_grammar_refuses_what_could_close_a_literal(text: str) -> None:
    with pytest.raises(UnsafeArchive):
        check(text, "text", "arg")


def test_length_limit_is_a_named_setting() -> None:
    with pytest.raises(UnsafeArchive, match="AOTC_MAX_GRAPH_STRING_CHARS"):
        check("x" * 11, "text", "arg", Limits(max_graph_string_chars=10))


# -- real programs pass ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["lm", "kwargs", "data_dependent", "assert", "regions", "mlp"])
def test_real_programs_pass(real: dict[str, Path], name: str) -> None:
    assert inspect_archive(str(real[name]))["inputs"]


def test_string_kwargs_and_torch_asserts_are_in_the_real_programs(real: dict[str, Path]) -> None:
    """The accepted programs really hold what the grammars are about (so the tests above show something)."""
    text = "".join(real[n].read_bytes().decode("latin-1") for n in ("kwargs", "data_dependent", "lm"))
    for needle in ('"as_string": "floor"', '"as_string": "tanh"', '"as_string": "mean"', "bij,bjk->bik",
                   "Runtime assertion failed for expression", "aten.__and__"):
        assert needle in text, needle


# -- one hostile string at a time -------------------------------------------------------------------------------


def _set_string_arg(value: str) -> Callable[[Any], Any]:
    def edit(doc: Any) -> Any:
        for node in nodes(doc):
            for inp in node["inputs"]:
                if "as_string" in inp["arg"]:
                    inp["arg"]["as_string"] = value
                    return doc
        raise AssertionError("no string argument")

    return edit


@pytest.mark.parametrize("value", [BREAKOUT, "floor\n", "fl'oor", 'fl"oor', "fl\\oor", "fl\x00oor", "f" * 10_000])
def test_hostile_string_argument(real: dict[str, Path], tmp_path: Path, value: str) -> None:
    p = edit_json(real["kwargs"], tmp_path / "evil.pt2", "models/model.json", _set_string_arg(value))
    err = refused(p, "node '", "argument '")
    assert err.detail["node"] and err.detail["argument"]


def test_the_assert_message_names_node_and_argument(tmp_path: Path) -> None:
    p = export(Assert(BREAKOUT), (torch.randn(3),), tmp_path / "assert.pt2")
    err = refused(p, "node '_assert_async'", "argument 'assert_msg'", "could not quote safely")
    assert err.code == "unsafe_archive"


def test_hostile_strings_in_a_list_argument(real: dict[str, Path], tmp_path: Path) -> None:
    def edit(doc: Any) -> Any:
        nodes(doc)[0]["inputs"].append({"name": "extra", "arg": {"as_strings": ["ok", BREAKOUT]}, "kind": 2})
        return doc

    refused(edit_json(real["kwargs"], tmp_path / "evil.pt2", "models/model.json", edit), "argument 'extra'")


def test_grad_mode_regions_and_dashed_module_paths_pass(real: dict[str, Path]) -> None:
    """HF Llama and Qwen2 (a no_grad rotary embedding) and torchvision's RegNet ('block1-0') were refused once: the
    grammars must take what they hold, and only that."""
    doc = json.loads(next(v for k, v in _members(real["regions"]).items() if k.endswith("models/model.json")))
    hops = [n for n in nodes(doc) if n["target"].startswith("torch.ops.higher_order.wrap_with")]
    assert [n["target"] for n in hops] == ["torch.ops.higher_order.wrap_with_set_grad_enabled"]
    assert "torch.ops.higher_order.wrap_with_autocast" in json.dumps(hops)  # nested in the grad-mode region
    assert all(a["name"] == "" for a in hops[0]["inputs"])
    assert "trunk.block1-0.weight" in json.dumps(doc)
    check("trunk_output.block4.block4-1.activation", "fqn", "fqn")
    check("", "token", "positional argument")
    for bad in ('block1-0"; x', "block1 0", "a..b", "-\n"):
        with pytest.raises(UnsafeArchive):
            check(bad, "fqn", "fqn")


def test_an_empty_node_name_is_still_refused(real: dict[str, Path], tmp_path: Path) -> None:
    def blank(doc: Any) -> Any:
        nodes(doc)[0]["name"] = ""
        return doc

    refused(edit_json(real["regions"], tmp_path / "blank.pt2", "models/model.json", blank), "node ''")


def test_hostile_parameter_fqn(real: dict[str, Path], tmp_path: Path) -> None:
    def rename(doc: Any) -> Any:
        spec = next(s for s in doc["graph_module"]["signature"]["input_specs"] if "parameter" in s)
        spec["parameter"]["parameter_name"] = 'fc1.weight"; system("x"); "'
        return doc

    refused(edit_json(real["mlp"], tmp_path / "fqn.pt2", "models/model.json", rename), "parameter_name")


def test_hostile_weight_config_name(real: dict[str, Path], tmp_path: Path) -> None:
    def rename(doc: Any) -> Any:
        doc["config"] = {f"{k}\n": v for k, v in doc["config"].items()}
        return doc

    p = edit_json(real["mlp"], tmp_path / "cfg.pt2", "data/weights/model_weights_config.json", rename)
    refused(p, "model_weights_config.json")


def test_hostile_node_name(real: dict[str, Path], tmp_path: Path) -> None:
    def rename(doc: Any) -> Any:
        nodes(doc)[0]["name"] = "linear); import os #"
        return doc

    refused(edit_json(real["mlp"], tmp_path / "name.pt2", "models/model.json", rename), "name")


def test_hostile_forward_arg_name(real: dict[str, Path], tmp_path: Path) -> None:
    def rename(doc: Any) -> Any:
        doc["graph_module"]["module_call_graph"][0]["signature"]["forward_arg_names"] = ["x=__import__('os')"]
        return doc

    refused(edit_json(real["mlp"], tmp_path / "fwd.pt2", "models/model.json", rename), "forward_arg_names")


def test_hostile_tree_spec_key(real: dict[str, Path], tmp_path: Path) -> None:
    """FX pastes the dict keys of the input spec into ep.module()'s Python code as '{key}'."""

    def rekey(doc: Any) -> Any:
        sig = doc["graph_module"]["module_call_graph"][0]["signature"]
        spec = json.loads(sig["in_spec"])
        spec[1]["children_spec"][1] = {"type": "builtins.dict", "context": json.dumps(["x': __import__('os'), '"]),
                                       "children_spec": [{"type": None, "context": None, "children_spec": []}]}
        sig["in_spec"] = json.dumps(spec)
        return doc

    refused(edit_json(real["mlp"], tmp_path / "spec.pt2", "models/model.json", rekey), "tree spec")


def test_metadata_is_free_text(real: dict[str, Path], tmp_path: Path) -> None:
    """Stack traces hold quotes and code: the upload keeps them (the worker drops them after loading)."""

    def annotate(doc: Any) -> Any:
        for node in nodes(doc):
            node["metadata"]["stack_trace"] = f'File "x.py", line 1\n    {BREAKOUT}'
        return doc

    inspect_archive(str(edit_json(real["mlp"], tmp_path / "meta.pt2", "models/model.json", annotate)))


def test_integers_must_fit_int64(real: dict[str, Path], tmp_path: Path) -> None:
    def grow(doc: Any) -> Any:
        for meta in doc["graph_module"]["graph"]["tensor_values"].values():
            meta["sizes"][0] = {"as_int": 2**64}
        return doc

    with pytest.raises(Exception, match="int64"):
        inspect_archive(str(edit_json(real["mlp"], tmp_path / "big.pt2", "models/model.json", grow)))
