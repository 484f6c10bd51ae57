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
