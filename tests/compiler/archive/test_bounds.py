"""Bounded work for every upload: the zip's layout, names and sizes, the JSON inside, weights against their files,
and expressions whose evaluation could explode. Each refusal is quick and names the setting that bounds it."""

from __future__ import annotations

import json
import struct
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from archives import TinyMLP, edit_json, read_json, rewrite, rezip
from compiler.archive.container import check_json_shape
from compiler.archive.exprs import check_guard, check_sym_expr
from compiler.archive.inspect import inspect_archive
from compiler.archive.limits import DEFAULT_LIMITS, Limits
from compiler.errors import AotcError, Unprocessable, UnsafeArchive
from modelzoo import export


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export(TinyMLP(), (torch.randn(2, 16),), tmp_path_factory.mktemp("b") / "mlp.pt2")


def refuse(path: Path, *needles: str, limits: Limits = DEFAULT_LIMITS, error: type[AotcError] = Unprocessable) -> str:
    t0 = time.perf_counter()
    with pytest.raises(error) as info:
        inspect_archive(str(path), limits)
    assert time.perf_counter() - t0 < 1.0
    for needle in needles:
        assert needle in info.value.message, info.value.message
    return info.value.message


# -- the zip -------------------------------------------------------------------------------------------------------


def test_torch_archives_and_plain_rezips_pass(mlp: Path, tmp_path: Path) -> None:
    """torch writes data descriptors and zip64 end records; Python's zipfile writes neither; both pass, deflated too."""
    assert zipfile.ZipFile(mlp).infolist()[0].flag_bits & 0x8
    inspect_archive(str(mlp))
    inspect_archive(str(rezip(mlp, tmp_path / "stored.pt2")))
    inspect_archive(str(rezip(mlp, tmp_path / "deflated.pt2", compression=zipfile.ZIP_DEFLATED)))


@pytest.mark.parametrize("name, needle", [
    ("mlp/extra/caf\u00e9.txt", "names may use only"),
    ("mlp/extra\\a.txt", "names may use only"),
    ("mlp/../evil.txt", "names may use only"),
    ("mlp/./x.txt", "names may use only"),
    ("mlp//x.txt", "names may use only"),
    ("mlp/extra/", "names may use only"),  # a directory entry
    ("/mlp/abs.txt", "names may use only"),
    ("mlp/Archive_Format", "ignoring case"),  # torch's reader would read this one for archive_format
    ("other/x", "root folder"),
])
def test_names_both_readers_read_alike(mlp: Path, tmp_path: Path, name: str, needle: str) -> None:
    p = rezip(mlp, tmp_path / "names.pt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with zipfile.ZipFile(p, "a") as z:
            z.writestr(name, b"zzz")
    refuse(p, needle)


def test_comment_and_trailing_bytes(mlp: Path, tmp_path: Path) -> None:
    refuse(rezip(mlp, tmp_path / "comment.pt2", comment=b"hello"), "comment")
    p = tmp_path / "trailing.pt2"
    p.write_bytes(mlp.read_bytes() + b"junk")
    refuse(p, "comment")


def _insert(src: Path, dst: Path, entry: int, gap: bytes) -> Path:
    """`src` (a zip without zip64 records) with `gap` inserted before its `entry`-th entry, offsets fixed up."""
    data = bytearray(src.read_bytes())
    zf = zipfile.ZipFile(src)
    cut = sorted(i.header_offset for i in zf.infolist())[entry]
    pos = zf.start_dir
    while data[pos:pos + 4] == b"PK\x01\x02":
        (offset,) = struct.unpack("<I", data[pos + 42:pos + 46])
        if offset >= cut:
            data[pos + 42:pos + 46] = struct.pack("<I", offset + len(gap))
        n, m, k = struct.unpack("<HHH", data[pos + 28:pos + 34])
        pos += 46 + n + m + k
    eocd = len(data) - 22
    (cd_offset,) = struct.unpack("<I", data[eocd + 16:eocd + 20])
    data[eocd + 16:eocd + 20] = struct.pack("<I", cd_offset + len(gap))
    data[cut:cut] = gap
    dst.write_bytes(bytes(data))
    return dst


def test_data_between_entries(mlp: Path, tmp_path: Path) -> None:
    """Hidden bytes between two entries: another zip reader could find an entry there that zipfile skips."""
    p = _insert(rezip(mlp, tmp_path / "plain.pt2"), tmp_path / "gap.pt2", 2, b"PK\x03\x04hidden")
    assert zipfile.ZipFile(p).testzip() is None  # zipfile itself reads it fine
    refuse(p, "not where the previous entry ends")


def test_encrypted_flag(mlp: Path, tmp_path: Path) -> None:
    p = rezip(mlp, tmp_path / "plain.pt2")
    data = bytearray(p.read_bytes())
    data[6] |= 0x1  # the first entry's local header
    data[zipfile.ZipFile(p).start_dir + 8] |= 0x1  # and its central directory header
    p.write_bytes(bytes(data))
    refuse(p, "encrypted")


def test_name_with_a_nul(mlp: Path, tmp_path: Path) -> None:
    """zipfile cuts a name at NUL (it sees mlp/x); torch's reader keeps it whole."""
    p = rezip(mlp, tmp_path / "nul.pt2", add={"mlp/xNy": b"x"})
    p.write_bytes(p.read_bytes().replace(b"mlp/xNy", b"mlp/x\x00y"))
    refuse(p, "names may use only")


def test_stored_entry_that_declares_more_than_it_holds(mlp: Path, tmp_path: Path) -> None:
    """A lying central directory: a stored entry of 4 bytes that claims 2 GiB."""
    p = rezip(mlp, tmp_path / "plain.pt2", add={"mlp/extra/blob": b"abcd"})
    data = bytearray(p.read_bytes())
    cd = data.rfind(b"PK\x01\x02")  # the last entry's central directory header
    data[cd + 24:cd + 28] = struct.pack("<I", 2**31)  # uncompressed size
    p.write_bytes(bytes(data))
    refuse(p, "extra/blob")


def test_compression_bomb(mlp: Path, tmp_path: Path) -> None:
    p = rezip(mlp, tmp_path / "bomb.pt2", compression=zipfile.ZIP_DEFLATED,
              add={"mlp/extra/zeros": bytes(64 * 2**20)})
    assert p.stat().st_size < 2**20
    refuse(p, "extra/zeros", "AOTC_MAX_COMPRESSION_RATIO")


def test_many_small_entries_that_inflate_like_a_bomb_are_refused(mlp: Path, tmp_path: Path) -> None:
    """Each entry under the 1 MiB floor where the ratio is checked: 512 entries of 1 MiB of zeros, each inflated once
    (a 9 MB upload of 8,000 such entries cost 26 s of CPU, accepted). The whole archive's ratio is checked too."""
    p = rezip(mlp, tmp_path / "small-bombs.pt2", compression=zipfile.ZIP_DEFLATED,
              add={f"mlp/extra/zeros{i}": bytes(2**20) for i in range(512)})
    assert p.stat().st_size < 2**20
    refuse(p, "the archive's entries inflate", "AOTC_MAX_COMPRESSION_RATIO")
    inspect_archive(str(rezip(mlp, tmp_path / "deflated.pt2", compression=zipfile.ZIP_DEFLATED)))  # a real one


def test_entry_and_total_size_limits(mlp: Path, tmp_path: Path) -> None:
    p = rezip(mlp, tmp_path / "big.pt2", add={"mlp/extra/blob": bytes(3 * 2**20)})
    refuse(p, "AOTC_MAX_ENTRY_MB", limits=Limits(max_entry_bytes=2**20))
    refuse(p, "AOTC_MAX_UNPACKED_MB", limits=Limits(max_unpacked_bytes=2 * 2**20))
    refuse(p, "AOTC_MAX_ZIP_ENTRIES", limits=Limits(max_entries=5))


def test_deflated_entry_longer_than_declared(mlp: Path, tmp_path: Path) -> None:
    """zipfile would quietly stop at the declared size; the check inflates and refuses."""
    p = rezip(mlp, tmp_path / "long.pt2", compression=zipfile.ZIP_DEFLATED,
              add={"mlp/extra/blob": b"x" * 1000})
    data = bytearray(p.read_bytes())
    cd = data.rfind(b"PK\x01\x02")
    data[cd + 24:cd + 28] = struct.pack("<I", 10)
    p.write_bytes(bytes(data))
    refuse(p, "extra/blob")


# -- the JSON inside ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bomb, setting", [
    (b"[" * 5_000 + b"]" * 5_000, "AOTC_MAX_JSON_DEPTH"),
    (b"[" + b"0," * 3_000_000 + b"0]", "AOTC_MAX_JSON_VALUES"),
    (b"[" + b"{}," * 3_000_000 + b"{}]", "AOTC_MAX_JSON_VALUES"),
    (b'{"a": "' + b"]" * 10 + b'", "b": ' + b"[" * 100 + b"]" * 100 + b"}", "AOTC_MAX_JSON_DEPTH"),
])
def test_json_bombs_are_refused_before_parsing(bomb: bytes, setting: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(Unprocessable, match=setting):
        check_json_shape(bomb, "models/model.json")
    assert time.perf_counter() - t0 < 1.0


def test_json_with_brackets_in_strings_passes() -> None:
    check_json_shape(b'{"a": "' + b"[" * 500 + b'", "b": [[1, 2], {"c": "]}]}"}]}', "x")


def test_strings_are_removed_in_linear_time_whatever_they_hold() -> None:
    """The regular expression that removed strings before the second depth count tried every quote of an unclosed
    run to the end of the text: 80 kB cost 20 s of CPU (the GIL held), a 120 kB upload stalled the API 47 s."""
    from compiler.archive.container import _without_strings

    for bomb in (b"[" + b'"\\' * 2_000_000, b"[" + b'"' * 4_000_000, b"[" + b'"a\\"' * 1_000_000):
        t0 = time.perf_counter()
        check_json_shape(bomb, "x")  # unbalanced, not deep: left to the parse that follows, which refuses it
        assert time.perf_counter() - t0 < 1.0, len(bomb)
        with pytest.raises(ValueError):
            json.loads(bomb)
    # On JSON, it removes exactly what the old expression did: strings of any content, escapes included.
    import random
    import re

    old = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # the expression, as it was
    rng = random.Random(0)
    alphabet = ['"', "\\", "[", "]", "{", "}", ",", ":", "a", " ", "\n", "\u0001", "é"]

    def doc(depth: int) -> object:
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
        if depth == 0 or rng.random() < 0.3:
            return word
        if rng.random() < 0.5:
            return [doc(depth - 1) for _ in range(rng.randint(0, 3))]
        return {"".join(rng.choice(alphabet) for _ in range(3)): doc(depth - 1) for _ in range(rng.randint(0, 3))}

    for _ in range(300):
        text = json.dumps(doc(4), ensure_ascii=rng.random() < 0.5).encode()
        assert _without_strings(text) == old.sub(b"", text), text
    deep = b'{"s": "\\"' + b'", "t": ' + b"[" * 100 + b"]" * 100 + b"}"
    with pytest.raises(Unprocessable, match="AOTC_MAX_JSON_DEPTH"):
        check_json_shape(deep, "x")


def test_an_uploads_pickles_are_scanned_within_one_budget(mlp: Path, tmp_path: Path) -> None:
    """The sample inputs swapped for a torch.save zip whose data.pkl is 6 MiB of one-byte opcodes: refused once the
    upload's pickles pass 4 MiB together, in about as long as 4 MiB take to walk. Deflated, such a member (a 15 kB
    upload, once accepted after 6.4 s of the API's CPU; 24 MiB ones cost 49 s) is refused before, as a bomb."""
    import io

    for compression, why in ((zipfile.ZIP_STORED, "pickles hold more than 4194304 bytes together"),
                             (zipfile.ZIP_DEFLATED, "more than 100 times")):
        bomb = io.BytesIO()
        with zipfile.ZipFile(bomb, "w", compression=compression) as z:
            z.writestr("archive/data.pkl", b"\x80\x02" + b"N" * (6 << 20) + b".")
            z.writestr("archive/version", b"3\n")
        p = rewrite(mlp, tmp_path / "pickle-bomb.pt2", {"data/sample_inputs/model.pt": bomb.getvalue()})
        t0 = time.perf_counter()
        with pytest.raises(UnsafeArchive, match=why):
            inspect_archive(str(p))
        assert time.perf_counter() - t0 < 8.0


def test_long_symbolic_expressions_are_parsed_within_one_budget(mlp: Path, tmp_path: Path) -> None:
    """Expressions past 512 characters are not cached, and were parsed each time with no budget over the document:
    400 distinct valid ones of 76 kB (a 7 MB upload) cost 24 s of CPU and were accepted. Now the distinct long
    ones share 2 MiB, and a repeated one is parsed once."""
    import random

    rnd = random.Random(0)

    def expr() -> str:
        return "Add(Symbol('s0')" + "".join(f", Integer({rnd.randrange(10**5, 10**6)})" for _ in range(4500)) + ")"

    def many(count: int, distinct: bool) -> Any:
        one = expr()

        def edit(doc: Any) -> Any:
            doc["graph_module"]["graph"]["sym_int_values"] = {
                f"e{k}": {"as_expr": {"expr_str": expr() if distinct else one, "hint": None}} for k in range(count)}
            return doc
        return edit

    t0 = time.perf_counter()
    with pytest.raises(Unprocessable, match="symbolic expressions longer than 512 characters hold more than"):
        inspect_archive(str(edit_json(mlp, tmp_path / "exprs.pt2", "models/model.json", many(60, True))))
    assert time.perf_counter() - t0 < 8.0
    t0 = time.perf_counter()
    inspect_archive(str(edit_json(mlp, tmp_path / "same.pt2", "models/model.json", many(200, False))))
    assert time.perf_counter() - t0 < 8.0  # one parse, not 200


def test_json_bomb_in_an_archive(mlp: Path, tmp_path: Path) -> None:
    p = rewrite(mlp, tmp_path / "bomb.pt2", {"models/model.json": b"[" * 10_000 + b"]" * 10_000})
    refuse(p, "AOTC_MAX_JSON_DEPTH")
    refuse(mlp, "AOTC_MAX_JSON_MB", limits=Limits(max_json_bytes=1000))


def test_json_bomb_inside_a_tree_spec_string(mlp: Path, tmp_path: Path) -> None:
    def nest(doc: Any) -> Any:
        doc["graph_module"]["module_call_graph"][0]["signature"]["in_spec"] = "[" * 1000 + "]" * 1000
        return doc

    refuse(edit_json(mlp, tmp_path / "spec.pt2", "models/model.json", nest), "AOTC_MAX_JSON_DEPTH")


# -- weights against their files ---------------------------------------------------------------------------------


def _first_weight(src: Path) -> tuple[dict[str, Any], str, dict[str, Any]]:
    cfg = read_json(src, "data/weights/model_weights_config.json")
    fqn = next(iter(cfg["config"]))
    return cfg, fqn, cfg["config"][fqn]


def test_empty_weight_file_that_declares_a_terabyte(mlp: Path, tmp_path: Path) -> None:
    """torch.export.load would call torch.zeros(declared size) for an empty weight file."""
    cfg, fqn, meta = _first_weight(mlp)
    meta["tensor_meta"]["sizes"] = [{"as_int": 2**20}, {"as_int": 2**18}]
    meta["tensor_meta"]["strides"] = [{"as_int": 2**18}, {"as_int": 1}]
    p = rewrite(mlp, tmp_path / "tb.pt2", {"data/weights/model_weights_config.json": json_bytes(cfg),
                                           f"data/weights/{meta['path_name']}": b""})
    refuse(p, f"weight {fqn!r}", "1099511627776 bytes", "holds 0 bytes")


def test_weight_file_shorter_than_its_view(mlp: Path, tmp_path: Path) -> None:
    cfg, fqn, meta = _first_weight(mlp)
    p = rewrite(mlp, tmp_path / "short.pt2", {f"data/weights/{meta['path_name']}": b"\0" * 12})
    refuse(p, f"weight {fqn!r}", "holds 12 bytes")


def test_weight_with_a_symbolic_size(mlp: Path, tmp_path: Path) -> None:
    cfg, fqn, meta = _first_weight(mlp)
    meta["tensor_meta"]["sizes"][0] = {"as_expr": {"expr_str": "Symbol('s0')"}}
    refuse(rewrite(mlp, tmp_path / "sym.pt2", {"data/weights/model_weights_config.json": json_bytes(cfg)}),
           "not a non-negative int")


def json_bytes(doc: Any) -> bytes:
    import json

    return json.dumps(doc).encode()


# -- expressions that would explode ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "LShift(Integer(1), Integer(10000000000))",
    "RShift(Symbol('s0'), Integer(100))",
    "Pow(Integer(2), Pow(Integer(2), Integer(64)))",  # the exponent is not a literal
    "Pow(Pow(Pow(Symbol('s0'), Integer(8)), Integer(8)), Integer(8))",  # a tower: degree 512
    "PowByNatural(Symbol('s0'), Symbol('s1'))",
    "Pow(Symbol('s0'), Integer(" + "9" * 50 + "))",
])
def test_exploding_sym_exprs_are_refused(text: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(UnsafeArchive):
        check_sym_expr(text)
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("text", ["Pow(Symbol('s0'), Integer(2))", "Pow(Symbol('s0'), Rational(1, 2))",
                                  "FloatPow(ToFloat(Symbol('s0')), Float('0.5', precision=53))",
                                  "Pow(Pow(Symbol('s0'), Integer(2)), Integer(4))", "LShift(Symbol('s0'), Integer(3))"])
def test_plain_powers_pass(text: str) -> None:
    check_sym_expr(text)


@pytest.mark.parametrize("text", [
    "L['x'].size()[0] < 1 << 10**10",
    "L['x'].size()[0] < 2**2**2**2**2**2",
    "L['x'].size()[0] < ((L['x'].size()[0]**64)**64)**64",
    "L['x'].size()[0] < max(L['x'].size()[0]**64, 1)**64",
    "L['x'].size()[0] < " + "9" * 60,
    "L['x'].size()[0] @ 2 == 1",
])
def test_exploding_guards_are_refused(text: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(UnsafeArchive):
        check_guard(text)
    assert time.perf_counter() - t0 < 1.0


def test_exploding_guard_in_an_archive(mlp: Path, tmp_path: Path) -> None:
    def add(doc: Any) -> Any:
        doc["guards_code"] = ["L['x'].size()[0] < 1 << 10**10"]
        return doc

    refuse(edit_json(mlp, tmp_path / "guard.pt2", "models/model.json", add), "guards_code", error=UnsafeArchive)


def test_plain_guards_still_pass() -> None:
    for g in ["L['x'].size()[0]**2 <= 4096", "L['x'].size()[0] << 1 == L['y'].size()[0]", "-L['x'].size()[0] < 0"]:
        check_guard(g)
