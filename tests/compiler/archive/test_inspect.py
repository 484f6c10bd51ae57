"""compiler.archive.inspect_archive against real torch.export archives and hand-built hostile ones.

The test process imports torch to build archives; the modules under test must not (checked in a subprocess).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.export import Dim

from archives import ConvBNReLU, TinyMLP, exec_pickle, rewrite, system_pickle, torch_zip_with
from compiler.archive.inspect import inspect_archive
from compiler.archive.limits import Limits
from compiler.errors import AotcError, Unprocessable, UnsafeArchive, UnsupportedMedia
from modelzoo import export

ROOT = Path(__file__).resolve().parents[3]


# -- models -------------------------------------------------------------------------------------------------------


class SharedBatch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(a) + b, ids * 2


class Unbounded(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.cumsum(0)


class Derived(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x]) + y


class SymIntInput(torch.nn.Module):
    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x * n


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("zoo")
    batch = Dim("batch", min=1, max=64)
    shared = Dim("shared", min=2, max=32)
    half = Dim("half", min=1, max=16)
    return {
        "conv": export(ConvBNReLU(), (torch.randn(2, 3, 16, 16),), d / "conv.pt2", {"x": {0: batch}}),
        "mlp": export(TinyMLP(), (torch.randn(4, 16),), d / "mlp.pt2"),
        "shared": export(
            SharedBatch(),
            (torch.randn(4, 8), torch.randn(4, 8), torch.ones(4, dtype=torch.int64)),
            d / "shared.pt2",
            {"a": {0: shared}, "b": {0: shared}, "ids": None},
        ),
        "unbounded": export(Unbounded(), (torch.randn(5, 3),), d / "unbounded.pt2", {"x": {0: Dim("n")}}),
        "derived": export(
            Derived(), (torch.randn(3, 2), torch.randn(6, 2)), d / "derived.pt2", {"x": {0: half}, "y": {0: 2 * half}}
        ),
        "symint": export(SymIntInput(), (torch.randn(3), 3), d / "symint.pt2", {"x": None, "n": Dim.DYNAMIC}),
    }


# -- hostile archive builders -------------------------------------------------------------------------------------


def edit_json(src: Path, dst: Path, rel: str, fn: Callable[[Any], Any]) -> Path:
    with zipfile.ZipFile(src) as z:
        root = z.namelist()[0].split("/")[0]
        doc = json.loads(z.read(f"{root}/{rel}"))
    return rewrite(src, dst, {rel: json.dumps(fn(doc)).encode()})


def weight_use_pickle(payload: bytes) -> Callable[[Path, Path], Path]:
    def build(src: Path, dst: Path) -> Path:
        tmp = dst.with_suffix(".tmp.pt2")

        def flip(doc: dict[str, Any]) -> dict[str, Any]:
            first = next(iter(doc["config"].values()))
            first["use_pickle"] = True
            return doc

        edit_json(src, tmp, "data/weights/model_weights_config.json", flip)
        with zipfile.ZipFile(tmp) as z:
            root = z.namelist()[0].split("/")[0]
            cfg = json.loads(z.read(f"{root}/data/weights/model_weights_config.json"))
        first_path = next(iter(cfg["config"].values()))["path_name"]
        return rewrite(tmp, dst, {f"data/weights/{first_path}": payload})

    return build


def constant(prefix: str, payload: bytes) -> Callable[[Path, Path], Path]:
    def build(src: Path, dst: Path) -> Path:
        tmp = dst.with_suffix(".tmp.pt2")
        cfg = {"config": {"obj": {"path_name": f"{prefix}0", "is_param": False, "use_pickle": True,
                                  "tensor_meta": None}}}
        rewrite(src, tmp, {"data/constants/model_constants_config.json": json.dumps(cfg).encode()})
        return rewrite(tmp, dst, add={f"data/constants/{prefix}0": payload})

    return build


def refuse(path: Path, error: type[AotcError], *needles: str, **kwargs: Any) -> AotcError:
    with pytest.raises(error) as info:
        inspect_archive(str(path), **kwargs)
    for needle in needles:
        assert needle in info.value.message, info.value.message
    return info.value


# -- good archives ------------------------------------------------------------------------------------------------


def test_conv_net_dynamic_batch(zoo: dict[str, Path]) -> None:
    info = inspect_archive(str(zoo["conv"]))
    assert info["root"] == "conv"
    assert info["torch_version"] == torch.__version__
    assert info["schema_version"].count(".") == 1
    assert info["outputs"] == 1
    [x] = info["inputs"]
    assert x["name"] == "x" and x["dtype"] == "float32"
    batch, *rest = x["shape"]
    assert rest == [3, 16, 16]
    assert batch["min"] == 1 and batch["max"] == 64 and batch["symbol"].startswith("s")
    n_state = len(ConvBNReLU().state_dict())
    assert info["params"]["count"] == n_state
    assert info["params"]["bytes"] >= sum(t.numel() * t.element_size() for t in ConvBNReLU().parameters())
    assert info["pickles"] == ["conv/data/sample_inputs/model.pt"]
    json.dumps(info)  # JSON-able


def test_mlp_static(zoo: dict[str, Path]) -> None:
    info = inspect_archive(str(zoo["mlp"]))
    assert info["inputs"] == [{"name": "x", "dtype": "float32", "shape": [4, 16]}]
    assert info["params"] == {"count": 4, "bytes": (16 * 32 + 32 + 32 * 4 + 4) * 4}


def test_shared_dim_same_symbol_and_int64(zoo: dict[str, Path]) -> None:
    info = inspect_archive(str(zoo["shared"]))
    a, b, ids = info["inputs"]
    assert [a["name"], b["name"], ids["name"]] == ["a", "b", "ids"]
    assert a["shape"][0] == b["shape"][0]
    assert a["shape"][0]["min"] == 2 and a["shape"][0]["max"] == 32
    assert ids == {"name": "ids", "dtype": "int64", "shape": [4]}
    assert info["outputs"] == 2


def test_dim_without_max_is_unbounded(zoo: dict[str, Path]) -> None:
    [x] = inspect_archive(str(zoo["unbounded"]))["inputs"]
    assert x["shape"][0]["max"] is None
    assert x["shape"][1] == 3


def test_derived_dim_is_an_expression(zoo: dict[str, Path]) -> None:
    x, y = inspect_archive(str(zoo["derived"]))["inputs"]
    sym = x["shape"][0]["symbol"]
    assert y["shape"][0] == {"expr": f"2*{sym}", "min": 2, "max": 32}


def test_non_tensor_input_refused(zoo: dict[str, Path]) -> None:
    err = refuse(zoo["symint"], Unprocessable, "non-tensor", "n (as_sym_int)")
    assert not isinstance(err, UnsafeArchive)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.bool, torch.int32, torch.uint8, torch.float64])
def test_dtype_names(dtype: torch.dtype, tmp_path: Path) -> None:
    class Id(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

    path = export(Id(), (torch.zeros(2, 3, dtype=dtype),), tmp_path / "id.pt2")
    [x] = inspect_archive(str(path))["inputs"]
    assert x["dtype"] == str(dtype).removeprefix("torch.")


# -- not an export archive ----------------------------------------------------------------------------------------


def test_not_a_zip(tmp_path: Path) -> None:
    for i, data in enumerate([b"", b"hello world", b"\x80\x02K\x01.", b"PK\x03\x04garbage"]):
        p = tmp_path / f"x{i}.pt2"
        p.write_bytes(data)
        refuse(p, UnsupportedMedia, "not a zip", "torch.export.save")


def test_truncated_zip(zoo: dict[str, Path], tmp_path: Path) -> None:
    p = tmp_path / "cut.pt2"
    p.write_bytes(zoo["mlp"].read_bytes()[:-100])
    # Without its end record the outer zip is gone; zipfile may then find the nested sample-input zip's end
    # record instead (torch stores it uncompressed). Either way it is a refusal, not a crash.
    with pytest.raises((UnsupportedMedia, Unprocessable)):
        inspect_archive(str(p))


def test_zip_without_program(tmp_path: Path) -> None:
    p = tmp_path / "x.pt2"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("x/readme.txt", "hi")
    refuse(p, Unprocessable, "not a torch.export archive")
    rewrite_dst = tmp_path / "nomodel.pt2"
    with zipfile.ZipFile(rewrite_dst, "w") as z:
        z.writestr("m/archive_format", "pt2")
        z.writestr("m/archive_version", "0")
    refuse(rewrite_dst, Unprocessable, "not a torch.export archive", "models/model.json")


def test_torchscript_archive(tmp_path: Path) -> None:
    p = tmp_path / "ts.pt2"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("ts/data.pkl", pickle.dumps({}, protocol=2))
        z.writestr("ts/constants.pkl", pickle.dumps((), protocol=2))
        z.writestr("ts/code/__torch__.py", "def forward(self, x): return x\n")
        z.writestr("ts/version", "3")
    refuse(p, Unprocessable, "TorchScript")


def test_torch_save_checkpoint(tmp_path: Path) -> None:
    p = tmp_path / "ckpt.pt2"
    torch.save(TinyMLP().state_dict(), p)
    refuse(p, Unprocessable, "torch.save checkpoint")


def test_model_json_not_json(zoo: dict[str, Path], tmp_path: Path) -> None:
    for i, bad in enumerate([b"{not json", b"\xff\xfe\x00", b"[" * 100_000]):
        p = rewrite(zoo["mlp"], tmp_path / f"bad{i}.pt2", {"models/model.json": bad})
        refuse(p, Unprocessable, "models/model.json")


def test_model_json_missing_keys(zoo: dict[str, Path], tmp_path: Path) -> None:
    for key in ("graph_module", "range_constraints", "schema_version"):
        p = edit_json(zoo["mlp"], tmp_path / f"no_{key}.pt2", "models/model.json",
                      lambda d: {k: v for k, v in d.items() if k != key})
        refuse(p, Unprocessable, key)
    p = rewrite(zoo["mlp"], tmp_path / "list.pt2", {"models/model.json": b"[1, 2]"})
    refuse(p, Unprocessable, "graph_module")
    p = edit_json(zoo["mlp"], tmp_path / "sig.pt2", "models/model.json", lambda d: {**d, "graph_module": {"graph": 3}})
    refuse(p, Unprocessable)


def test_json_size_cap(zoo: dict[str, Path], tmp_path: Path) -> None:
    refuse(zoo["mlp"], Unprocessable, "limit", "AOTC_MAX_JSON_MB", limits=Limits(max_json_bytes=1000))
    bomb = b'{"x": "' + b"a" * (20 * 2**20) + b'"}'
    p = tmp_path / "bomb.pt2"
    with zipfile.ZipFile(zoo["mlp"]) as zin, zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            data = bomb if info.filename.endswith("models/model.json") else zin.read(info)
            zout.writestr(info.filename, data)
    assert p.stat().st_size < 1 * 2**20
    refuse(p, Unprocessable, "limit", limits=Limits(max_json_bytes=2**20))


def test_path_traversal_and_duplicates(zoo: dict[str, Path], tmp_path: Path) -> None:
    for i, name in enumerate(["mlp/../../etc/passwd", "/mlp/abs", "mlp/a\\..\\b", "C:/x"]):
        p = rewrite(zoo["mlp"], tmp_path / f"t{i}.pt2")
        with zipfile.ZipFile(p, "a") as z:
            z.writestr(name, b"x")
        refuse(p, Unprocessable)
    p = rewrite(zoo["mlp"], tmp_path / "dup.pt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with zipfile.ZipFile(p, "a") as z:
            z.writestr("mlp/models/model.json", b"{}")
    refuse(p, Unprocessable, "twice")


def test_second_program_refused(zoo: dict[str, Path], tmp_path: Path) -> None:
    with zipfile.ZipFile(zoo["mlp"]) as z:
        body = z.read("mlp/models/model.json")
    p = rewrite(zoo["mlp"], tmp_path / "two.pt2", add={"models/other.json": body})
    refuse(p, Unprocessable, "exactly one program")


# -- pickles ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [2, 4])
def test_malicious_sample_inputs(zoo: dict[str, Path], tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "PWNED"
    payload = torch_zip_with(system_pickle(marker, protocol))
    p = rewrite(zoo["mlp"], tmp_path / "evil.pt2", {"data/sample_inputs/model.pt": payload})
    err = refuse(p, UnsafeArchive, "mlp/data/sample_inputs/model.pt", f"{os.system.__module__}.system")
    assert err.detail["globals"] == [f"{os.system.__module__}.system"]
    assert not marker.exists()


def test_malicious_sample_inputs_exec_raw_pickle(zoo: dict[str, Path], tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    p = rewrite(zoo["mlp"], tmp_path / "evil.pt2", {"data/sample_inputs/model.pt": exec_pickle(marker)})
    refuse(p, UnsafeArchive, "sample_inputs", "builtins.exec")
    assert not marker.exists()


def test_use_pickle_weight(zoo: dict[str, Path], tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    p = weight_use_pickle(torch_zip_with(system_pickle(marker)))(zoo["mlp"], tmp_path / "evil.pt2")
    refuse(p, UnsafeArchive, "data/weights/weight_", ".system")
    assert not marker.exists()


def test_use_pickle_weight_that_is_a_real_tensor_is_fine(zoo: dict[str, Path], tmp_path: Path) -> None:
    buf = io.BytesIO()
    torch.save(torch.nn.Parameter(torch.zeros(32, 16)), buf)
    p = weight_use_pickle(buf.getvalue())(zoo["mlp"], tmp_path / "ok.pt2")
    info = inspect_archive(str(p))
    assert any(e.startswith("mlp/data/weights/weight_") for e in info["pickles"])


def test_legacy_weights_file(zoo: dict[str, Path], tmp_path: Path) -> None:
    p = rewrite(zoo["mlp"], tmp_path / "legacy.pt2",
                add={"data/weights/model.pt": torch_zip_with(system_pickle(tmp_path / "x"))})
    refuse(p, UnsafeArchive, "data/weights/model.pt")


@pytest.mark.parametrize("prefix", ["opaque_obj_", "custom_obj_"])
def test_custom_object_constants(zoo: dict[str, Path], tmp_path: Path, prefix: str) -> None:
    p = constant(prefix, pickle.dumps({"harmless": 1}))(zoo["mlp"], tmp_path / "obj.pt2")
    refuse(p, UnsafeArchive, prefix, "custom")


def test_unreferenced_pickle_entry(zoo: dict[str, Path], tmp_path: Path) -> None:
    p = rewrite(zoo["mlp"], tmp_path / "extra.pt2", add={"extra/blob.bin": system_pickle(tmp_path / "x")})
    refuse(p, UnsafeArchive, "extra/blob.bin")


def test_aotinductor_code_refused(zoo: dict[str, Path], tmp_path: Path) -> None:
    p = rewrite(zoo["mlp"], tmp_path / "aoti.pt2", add={"data/aotinductor/model/model.so": b"\x7fELF"})
    refuse(p, UnsafeArchive, "AOTInductor")


# -- expressions, guards, tree specs, node targets ---------------------------------------------------------------


def test_sympify_injection_in_archive(zoo: dict[str, Path], tmp_path: Path) -> None:
    with zipfile.ZipFile(zoo["shared"]) as z:
        body = z.read("shared/models/model.json").decode()
    sym = "Symbol('" + body.split("Symbol('", 1)[1].split("'", 1)[0] + "', positive=True, integer=True)"
    evil = body.replace(sym, f"__import__('os').system('touch {tmp_path}/PWNED') or {sym}", 1)
    p = rewrite(zoo["shared"], tmp_path / "sym.pt2", {"models/model.json": evil.encode()})
    refuse(p, UnsafeArchive, "symbolic expression")
    assert not (tmp_path / "PWNED").exists()


def test_guard_injection_in_archive(zoo: dict[str, Path], tmp_path: Path) -> None:
    def add_guard(doc: dict[str, Any]) -> dict[str, Any]:
        doc["guards_code"] = [*doc.get("guards_code", []), "__import__('os').system('touch /tmp/x') == 0"]
        return doc

    p = edit_json(zoo["shared"], tmp_path / "guard.pt2", "models/model.json", add_guard)
    refuse(p, UnsafeArchive, "guards_code")


@pytest.mark.parametrize(
    "spec",
    [
        [1, {"type": "collections.defaultdict", "context": "{}", "children_spec": []}],
        [1, {"type": "builtins.dict", "context": json.dumps({"__enum__": True, "fqn": "os:environ", "name": "x"}),
             "children_spec": []}],
    ],
)
def test_importing_treespecs_refused(zoo: dict[str, Path], tmp_path: Path, spec: Any) -> None:
    def set_spec(doc: dict[str, Any]) -> dict[str, Any]:
        doc["graph_module"]["module_call_graph"][0]["signature"]["in_spec"] = json.dumps(spec)
        return doc

    p = edit_json(zoo["mlp"], tmp_path / "spec.pt2", "models/model.json", set_spec)
    refuse(p, UnsafeArchive, "tree spec")


def test_odd_node_target_refused(zoo: dict[str, Path], tmp_path: Path) -> None:
    with zipfile.ZipFile(zoo["mlp"]) as z:
        body = z.read("mlp/models/model.json")
    evil = body.replace(b'"target": "torch.ops.aten.linear.default"', b'"target": "builtins.eval"', 1)
    assert evil != body
    p = rewrite(zoo["mlp"], tmp_path / "target.pt2", {"models/model.json": evil})
    refuse(p, Unprocessable, "builtins.eval")


# -- robustness ---------------------------------------------------------------------------------------------------


def test_mutated_archives_fail_cleanly(zoo: dict[str, Path], tmp_path: Path) -> None:
    """Random corruption never escapes as anything but an AotcError."""
    rng = random.Random(1234)
    original = zoo["shared"].read_bytes()
    p = tmp_path / "m.pt2"
    for _ in range(300):
        data = bytearray(original)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        p.write_bytes(bytes(data))
        try:
            inspect_archive(str(p))
        except AotcError:
            pass


def test_json_structure_mutations_fail_cleanly(zoo: dict[str, Path], tmp_path: Path) -> None:
    """Replacing any JSON subtree of model.json with junk gives a result or an AotcError, nothing else."""
    with zipfile.ZipFile(zoo["shared"]) as z:
        doc = json.loads(z.read("shared/models/model.json"))
    paths: list[list[Any]] = []
    stack: list[tuple[list[Any], Any]] = [([], doc)]
    while stack:
        path, node = stack.pop()
        paths.append(path)
        if isinstance(node, dict):
            stack.extend((path + [k], v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((path + [i], v) for i, v in enumerate(node))
    rng = random.Random(99)
    for n, path in enumerate(rng.sample(paths, min(150, len(paths)))):
        junk = rng.choice([None, 7, "x", [], {}, True, -1, 2**70, "Symbol('s1')"])
        mutated = json.loads(json.dumps(doc))
        if not path:
            mutated = junk
        else:
            node = mutated
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = junk
        p = rewrite(zoo["shared"], tmp_path / f"j{n}.pt2", {"models/model.json": json.dumps(mutated).encode()})
        try:
            inspect_archive(str(p))
        except AotcError:
            pass


def test_api_modules_do_not_import_torch() -> None:
    code = ("import compiler.archive, compiler.archive.container, compiler.archive.exprs, compiler.archive.inspect, "
            "compiler.archive.pickles, compiler.archive.program, compiler.archive.strings, compiler.archive.ops, "
            "compiler.archive.schema, "
            "compiler.archive.limits, compiler.shapes, sys; compiler.archive.ops.known_targets(); "
            "compiler.archive.schema.fields(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
