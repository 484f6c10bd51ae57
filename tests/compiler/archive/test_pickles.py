"""compiler.archive.pickles: the static opcode scan against what torch.save writes and hand-built hostile pickles."""

from __future__ import annotations

import io
import os
import pickle
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from archives import TinyMLP, exec_pickle, system_pickle
from compiler.archive import pickles
from compiler.errors import UnsafeArchive


def test_scan_what_torch_save_writes() -> None:
    objects: list[Any] = [
        torch.randn(3),
        torch.nn.Parameter(torch.randn(2)),
        torch.nn.Parameter(torch.randn(2), requires_grad=False),
        TinyMLP().state_dict(),
        ((torch.randn(2, 3), torch.ones(2, dtype=torch.int64)), {}),
        ((torch.randn(1),), {"y": torch.randn(1), "d": torch.device("cpu"), "t": torch.float16}),
        ((torch.randn(2), 3, 2.5, True, None, "s", torch.Size([2])), {}),
        torch.randn(4, 4).t(),
        torch.randn(2).bfloat16(),
        torch.randn(2).to(torch.float8_e4m3fn),
        torch.ones(2, dtype=torch.uint16),
        {f"w{i}": torch.randn(1) for i in range(2000)},  # enough to need memo gets and frames
    ]
    for obj in objects:
        for protocol in (2, 3, 4, 5):
            buf = io.BytesIO()
            torch.save(obj, buf, pickle_protocol=protocol)
            found = pickles.scan_pickle(buf.getvalue())
            assert found and not pickles.disallowed(found), (obj, protocol, found)
            pickles.check_pickle(buf.getvalue(), "x")


def _sbu(s: str) -> bytes:
    return b"\x8c" + bytes([len(s)]) + s.encode()


def test_stack_global_through_memo_is_resolved() -> None:
    data = (
        b"\x80\x04" + _sbu("posix") + b"\x94" + b"0" + _sbu("system") + b"\x94" + b"0"
        + b"h\x00h\x01\x93" + _sbu("true") + b"\x85R."
    )
    assert pickles.scan_pickle(data) == ["posix.system"]
    with pytest.raises(UnsafeArchive, match="posix.system"):
        pickles.check_pickle(data, "entry")


def test_unresolvable_stack_global_is_unsafe() -> None:
    data = b"\x80\x04" + _sbu("posix") + _sbu("system") + b")0\x93" + _sbu("true") + b"\x85R."
    with pytest.raises(pickles.PickleError):
        pickles.scan_pickle(data)
    with pytest.raises(UnsafeArchive, match="entry: the pickle cannot be verified"):
        pickles.check_pickle(data, "entry")


@pytest.mark.parametrize(
    "data",
    [
        pickle.dumps(1, protocol=0),  # protocol 0/1: no header to recognise, refused outright
        b"\x80\x02K\x01",  # no STOP
        b"\x80\x02K\x01.garbage",  # trailing bytes
        b"\x80\x02\x82\x01R.",  # EXT1
        b"\x80\x02cos system\n.",  # GLOBAL os.system
        b"\x80\x02cos x\nsystem\n.",  # GLOBAL whose module has a space
        b"\x80\x02cposix\n.",  # truncated GLOBAL
        b"\x80\x09.",  # unknown protocol
        b"PK\x03\x04 not really a zip",
    ],
)
def test_malformed_pickles_are_unsafe(data: bytes) -> None:
    with pytest.raises(UnsafeArchive):
        pickles.check_pickle(data, "entry")


def test_second_pickle_in_stream_is_scanned() -> None:
    data = pickle.dumps(1, protocol=2) + system_pickle(Path("/nonexistent"))
    assert f"{os.system.__module__}.system" in pickles.scan_pickle(data)


def _torch_save_with(name: str, data: bytes, compression: int = zipfile.ZIP_STORED) -> bytes:
    """A torch.save zip of one tensor with an entry of our own added."""
    good = io.BytesIO()
    torch.save(torch.zeros(1), good)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(good.getvalue())) as src, zipfile.ZipFile(out, "w") as z:
        for info in src.infolist():
            z.writestr(info, src.read(info))
        z.writestr(name, data, compress_type=compression)
    return out.getvalue()


def test_a_nested_zip_with_another_pkl_than_its_data_pkl_is_refused() -> None:
    """torch.save writes one data.pkl. Every other `.pkl` was scanned too, each up to 256 MiB of opcodes walked in
    Python: a few kB of upload that cost minutes of CPU. Now any other `.pkl` is refused unread."""
    out = _torch_save_with("archive/other.pkl", exec_pickle(Path("/nonexistent")))
    with pytest.raises(UnsafeArchive, match=r"holds one data.pkl; this one holds \['archive/data.pkl', 'archive/ot"):
        pickles.check_pickle(out, "nested")


def test_a_nested_entry_that_inflates_like_a_bomb_is_refused() -> None:
    out = _torch_save_with("archive/data/9", b"\0" * (8 << 20), zipfile.ZIP_DEFLATED)
    with pytest.raises(UnsafeArchive, match="inflates .* to 8388608, more than 100 times"):
        pickles.check_pickle(out, "nested")


def test_one_uploads_pickles_share_one_budget() -> None:
    """Each stream was bounded alone (256 MiB); the scan walks opcodes in Python, about 0.8 s of CPU a MiB."""
    cheap = b"\x80\x02" + b"N" * (3 << 20) + b"."  # 3 MiB of one-byte opcodes
    budget = pickles.Budget()
    assert pickles.check_file(io.BytesIO(cheap), "first", budget) == []
    assert 0 < budget.left < (1 << 20)
    t0 = time.perf_counter()
    with pytest.raises(UnsafeArchive, match="pickles hold more than 4194304 bytes together"):
        pickles.check_file(io.BytesIO(cheap), "second", budget)
    assert time.perf_counter() - t0 < 2.0
