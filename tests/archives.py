"""Small exported programs and hostile-archive builders shared by the archive and loader tests."""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class ConvBNReLU(torch.nn.Module):
    """One conv, a BatchNorm and a ReLU (tests/modelzoo.py's ConvNet is the bigger net the compile tests use)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.bn = torch.nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class TinyMLP(torch.nn.Module):
    """16 -> 32 -> 4 (tests/modelzoo.py's MLP is the configurable one the compile tests use)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class _Reduce:
    """Pickles as a call of `fn(*args)`; the pickle names fn's module and name as its global."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.fn, self.args


def system_pickle(marker: Path, protocol: int = 2) -> bytes:
    return pickle.dumps(_Reduce(os.system, f"touch {marker}"), protocol=protocol)


def exec_pickle(marker: Path, protocol: int = 4) -> bytes:
    return pickle.dumps(_Reduce(exec, f"open({str(marker)!r}, 'w').write('pwned')"), protocol=protocol)


def torch_zip_with(payload: bytes) -> bytes:
    """A torch.save zip whose data.pkl is `payload` (what torch.load would unpickle)."""
    buf = io.BytesIO()
    torch.save(torch.zeros(2), buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for info in src.infolist():
            z.writestr(info, payload if info.filename.endswith("data.pkl") else src.read(info))
    return out.getvalue()


def rewrite(
    src: Path, dst: Path, replace: dict[str, bytes | None] | None = None, add: dict[str, bytes] | None = None
) -> Path:
    """Copy an archive, replacing (None: dropping) entries by path below the root and adding new ones."""
    replace, add = replace or {}, add or {}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        root = zin.namelist()[0].split("/")[0]
        for info in zin.infolist():
            rel = info.filename[len(root) + 1 :]
            if rel in replace:
                if replace[rel] is not None:
                    zout.writestr(info, replace[rel])  # type: ignore[arg-type]
            else:
                zout.writestr(info, zin.read(info))
        for rel, data in add.items():
            zout.writestr(f"{root}/{rel}", data)
    return dst


def read_json(path: Path, rel: str) -> Any:
    with zipfile.ZipFile(path) as z:
        root = z.namelist()[0].split("/")[0]
        return json.loads(z.read(f"{root}/{rel}"))


def edit_json(src: Path, dst: Path, rel: str, fn: Callable[[Any], Any]) -> Path:
    """Copy an archive with the JSON entry `rel` (below the root) replaced by fn(its parsed content)."""
    doc = read_json(src, rel)
    return rewrite(src, dst, {rel: json.dumps(fn(doc)).encode()})


def nodes(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The top-level graph's nodes of a parsed models/model.json."""
    return doc["graph_module"]["graph"]["nodes"]


def rezip(src: Path, dst: Path, *, compression: int = zipfile.ZIP_STORED, comment: bytes = b"",
          prefix: bytes = b"", rename: Callable[[str], str] = lambda n: n,
          add: dict[str, bytes] | None = None) -> Path:
    """Copy an archive entry by entry into a zip of our own making: another compression, a comment, bytes before
    it, renamed entries, extra entries (full names, root included)."""
    with open(dst, "wb") as out:
        out.write(prefix)
        with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "a" if prefix else "w") as zout:
            for info in zin.infolist():
                zout.writestr(zipfile.ZipInfo(rename(info.filename)), zin.read(info), compress_type=compression)
            for name, data in (add or {}).items():
                zout.writestr(zipfile.ZipInfo(name), data, compress_type=compression)
            zout.comment = comment
    return dst


class Mixed(torch.nn.Module):
    """What export keeps as higher-order ops in real models: a no_grad region (HF Llama's rotary embedding), an
    autocast region and a torch.cond, each a subgraph the op calls."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            r = torch.sin(x) * 2
        with torch.autocast("cpu", enabled=False):
            a = self.lin(x)
        return torch.cond(x.sum() > 0, lambda t: t.cos(), lambda t: t.sin() + 1, (a + r,))


GRAD_REGION = "torch.ops.higher_order.wrap_with_set_grad_enabled"
LEAK_MARK = "AOTC_LEAK_MARK"  # an environment variable that the print variant below reads and prints


def positional(*args: dict[str, Any]) -> list[dict[str, Any]]:
    """A higher-order op's inputs as torch serializes them: positional, named ''."""
    return [{"name": "", "arg": a, "kind": 1} for a in args]


def hostile_callables(marker: Path) -> dict[str, tuple[str, list[dict[str, Any]]]]:
    """Callables an upload could name as an `as_operator` argument, each with the arguments it would be called on:
    ops.txt leaves each out on purpose. The print HOP's format string walks from the op to its module's globals and
    prints an environment variable (when run eagerly, as the check child runs the program); os.system touches
    `marker`."""
    return {
        "print": ("torch.ops.higher_order.print",
                  [{"as_string": "LEAK {0.__init__.__globals__[torch].os.environ[" + LEAK_MARK + "]}"},
                   {"as_operator": "torch.ops.higher_order.print"}]),
        "triton_kernel_wrapper_mutation": ("torch.ops.higher_order.triton_kernel_wrapper_mutation",
                                           [{"as_int": 0}, {"as_int": 0}, {"as_tensor": {"name": "x"}}]),
        "inline_asm_elementwise": ("torch.ops.higher_order.inline_asm_elementwise",
                                   [{"as_tensor": {"name": "x"}}, {"as_string": "mov.b32 $0, $1;"},
                                    {"as_string": "=r,r"}]),
        "run_const_graph": ("torch.ops.higher_order.run_const_graph", [{"as_tensor": {"name": "x"}}]),
        "os_system": ("torch.os.system", [{"as_string": f"touch {marker}"}]),
    }


def call_in_grad_region(src: Path, dst: Path, name: str, args: list[dict[str, Any]]) -> Path:
    """A copy of `src` whose first wrap_with_set_grad_enabled node calls the operator `name` on `args` where it
    called its subgraph: wrap_with_set_grad_enabled(enable, fn, *args) calls fn(*args)."""

    def edit(doc: Any) -> Any:
        node = next(n for n in nodes(doc) if n["target"] == GRAD_REGION)
        node["inputs"] = positional({"as_bool": True}, {"as_operator": name}, *args)
        return doc

    return edit_json(src, dst, "models/model.json", edit)


def subgraph_nodes(doc: dict[str, Any], target: str = GRAD_REGION) -> list[dict[str, Any]]:
    """The nodes of the subgraph that the first `target` node of the top-level graph calls."""
    node = next(n for n in nodes(doc) if n["target"] == target)
    return next(i["arg"]["as_graph"]["graph"]["nodes"] for i in node["inputs"] if "as_graph" in i["arg"])


class AddBytes(torch.nn.Module):
    """x + a tensor the graph makes (aten.zeros): the node that excluded_op_call swaps for another op."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.zeros(16, dtype=torch.uint8)


def excluded_op_call(src: Path, dst: Path, op: str, arg: str) -> Path:
    """A copy of an exported AddBytes that calls an operator compiler.archive.ops.EXCLUDED leaves off, as torch's
    serializer would write the call: "from_file" reads 16 bytes of the file `arg` where AddBytes made its zeros (the
    output is then that file's bytes), "print" prints `arg` before the add. Plain torch.export.load loads either,
    and running the program does what the op does."""

    def edit(doc: Any) -> Any:
        graph = nodes(doc)
        if op == "from_file":
            zeros = next(n for n in graph if n["target"] == "torch.ops.aten.zeros.default")
            zeros["target"] = "torch.ops.aten.from_file.default"
            zeros["inputs"] = [{"name": "filename", "arg": {"as_string": arg}, "kind": 1},
                               {"name": "shared", "arg": {"as_bool": False}, "kind": 1},
                               {"name": "size", "arg": {"as_int": 16}, "kind": 1},
                               {"name": "dtype", "arg": {"as_scalar_type": 1}, "kind": 2}]  # uint8
        elif op == "print":
            graph.insert(1, {"name": "p", "target": "torch.ops.aten._print.default",
                             "inputs": [{"name": "s", "arg": {"as_string": arg}, "kind": 1}], "outputs": [],
                             "metadata": {}, "is_hop_single_tensor_return": None})
        else:
            raise ValueError(op)
        return doc

    return edit_json(src, dst, "models/model.json", edit)
