"""Hostile uploads over HTTP against the real API: code smuggled in graph strings, and every bound on the work one
upload may cost. Each is a 4xx naming the problem (and the setting, for a bound) in under a second; nothing is
stored, and the API's memory stays put."""

from __future__ import annotations

import json
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch

from archives import TinyMLP, edit_json, read_json, rewrite, rezip
from modelzoo import export
from procs import api, start_api, stop
from realistic import Assert, export_realistic

BREAKOUT = '"); system("touch /tmp/pwned"); //'
SMALL = {  # the bounds of the API under test: small, so small uploads can cross them
    "AOTC_MAX_ENTRY_MB": "2", "AOTC_MAX_UNPACKED_MB": "3", "AOTC_MAX_ZIP_ENTRIES": "40", "AOTC_MAX_JSON_MB": "1",
    "AOTC_MAX_JSON_DEPTH": "32", "AOTC_MAX_JSON_VALUES": "200000", "AOTC_MAX_GRAPH_STRING_CHARS": "64",
    "AOTC_MAX_INPUT_MB": "1", "AOTC_MAX_MODEL_NAME_CHARS": "40",
}


@pytest.fixture(scope="module")
def small_api(service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url, proc = start_api({**service_env, **SMALL}, tmp_path_factory.mktemp("logs") / "small-api.log")
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def default_api(service_env: dict[str, str],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, psutil.Process]]:
    """An API with the default bounds in a process of its own, so its memory can be watched."""
    url, proc = start_api(service_env, tmp_path_factory.mktemp("logs") / "default-api.log")
    yield url, psutil.Process(proc.pid)
    stop(proc)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(7)
    return export(TinyMLP(), (torch.randn(2, 16),), tmp_path_factory.mktemp("m") / "mlp.pt2")


def upload(url: str, path_or_bytes: Path | bytes, **params: str) -> tuple[httpx.Response, float]:
    body = path_or_bytes.read_bytes() if isinstance(path_or_bytes, Path) else path_or_bytes
    t0 = time.perf_counter()
    r = api.post(f"{url}/v1/models", content=body, params=params, timeout=30)
    return r, time.perf_counter() - t0


def refused(url: str, body: Path | bytes, *needles: str, status: int = 422, code: str | None = None,
            **params: str) -> dict[str, Any]:
    r, seconds = upload(url, body, **params)
    assert r.status_code == status, r.text
    assert seconds < 1.0, f"took {seconds:.2f} s"
    error = r.json()["error"]
    for needle in needles:
        assert needle in error["message"], error["message"]
    if code:
        assert error["code"] == code, error
    return error


# -- graph strings are data, never code ---------------------------------------------------------------------------


def test_assert_message_that_breaks_out_of_a_cpp_literal(api_url: str, tmp_path: Path) -> None:
    """Built honestly: torch._assert_async(cond, MSG) in forward, exported and saved by torch. Inductor would paste
    MSG into `throw std::runtime_error("{msg}")`, and the C++ would run at compile time and in every client."""
    path = export(Assert(BREAKOUT), (torch.randn(3),), tmp_path / "assert.pt2")
    assert json.dumps(BREAKOUT).encode() in zipfile.ZipFile(path).read("assert/models/model.json")
    error = refused(api_url, path, "node '_assert_async'", "argument 'assert_msg'", code="unsafe_archive")
    assert error["node"] == "'_assert_async'" and error["argument"] == "'assert_msg'"
    assert not Path("/tmp/pwned").exists()


@pytest.mark.parametrize("value", ["floor\n", "fl'oor", 'fl"oor', "fl\\oor", "fl\x00oor", "f" * 10_000])
def test_hostile_string_argument(api_url: str, tmp_path: Path, value: str) -> None:
    src = export_realistic(tmp_path)["kwargs"]

    def edit(doc: Any) -> Any:
        node = next(n for n in doc["graph_module"]["graph"]["nodes"]
                    if any("as_string" in i["arg"] for i in n["inputs"]))
        next(i for i in node["inputs"] if "as_string" in i["arg"])["arg"]["as_string"] = value
        return doc

    refused(api_url, edit_json(src, tmp_path / "evil.pt2", "models/model.json", edit), "node '", "argument '",
            code="unsafe_archive")


def test_hostile_parameter_fqn(api_url: str, mlp: Path, tmp_path: Path) -> None:
    def edit(doc: Any) -> Any:
        doc["config"] = {('fc1.weight"; system("x"); "' if k == "fc1.weight" else k): v
                         for k, v in doc["config"].items()}
        return doc

    refused(api_url, edit_json(mlp, tmp_path / "fqn.pt2", "data/weights/model_weights_config.json", edit),
            "could not quote safely", code="unsafe_archive")


def test_real_programs_with_strings_and_asserts_upload(api_url: str, tmp_path: Path) -> None:
    for name, path in export_realistic(tmp_path).items():
        r, _ = upload(api_url, path)
        assert r.status_code in (200, 201), (name, r.text)


def test_target_that_is_not_an_operator(api_url: str, mlp: Path, tmp_path: Path) -> None:
    def edit(doc: Any) -> Any:
        doc["graph_module"]["graph"]["nodes"][0]["target"] = "torch.ops.aten.add.overloads"
        return doc

    refused(api_url, edit_json(mlp, tmp_path / "t.pt2", "models/model.json", edit), "not a torch operator")


# -- bounded work: the zip ---------------------------------------------------------------------------------------


def test_compression_bomb(api_url: str, mlp: Path, tmp_path: Path) -> None:
    """256 MiB of zeros under extra/ in a small upload: refused from the central directory, nothing inflated."""
    p = tmp_path / "bomb.pt2"
    rezip(mlp, p, compression=zipfile.ZIP_DEFLATED)
    with zipfile.ZipFile(p, "a", compression=zipfile.ZIP_DEFLATED) as z, z.open("mlp/extra/zeros", "w",
                                                                               force_zip64=True) as f:
        chunk = bytes(64 * 2**20)
        for _ in range(4):
            f.write(chunk)
    assert p.stat().st_size < 4 * 2**20
    refused(api_url, p, "extra/zeros", "AOTC_MAX_COMPRESSION_RATIO")


def test_entry_total_and_count_bounds(small_api: str, mlp: Path, tmp_path: Path) -> None:
    one = rezip(mlp, tmp_path / "entry.pt2", add={"mlp/extra/blob": bytes(2560 * 1024)})
    refused(small_api, one, "AOTC_MAX_ENTRY_MB")
    two = rezip(mlp, tmp_path / "total.pt2", add={f"mlp/extra/blob{i}": bytes(1200 * 1024) for i in range(3)})
    refused(small_api, two, "AOTC_MAX_UNPACKED_MB")
    many = rezip(mlp, tmp_path / "many.pt2", add={f"mlp/extra/f{i}": b"x" for i in range(50)})
    refused(small_api, many, "AOTC_MAX_ZIP_ENTRIES")


def test_names_the_worker_would_read_otherwise(api_url: str, mlp: Path, tmp_path: Path) -> None:
    """torch's reader looks names up ignoring case: it would read Archive_format for archive_format."""
    refused(api_url, rezip(mlp, tmp_path / "case.pt2", add={"mlp/Archive_format": b"zzz"}), "ignoring case")
    refused(api_url, rezip(mlp, tmp_path / "uni.pt2", add={"mlp/caf\u00e9": b"x"}), "names may use only")


def test_weight_that_declares_a_terabyte(api_url: str, mlp: Path, tmp_path: Path) -> None:
    cfg = read_json(mlp, "data/weights/model_weights_config.json")
    meta = next(iter(cfg["config"].values()))
    meta["tensor_meta"]["sizes"] = [{"as_int": 2**20}, {"as_int": 2**18}]
    meta["tensor_meta"]["strides"] = [{"as_int": 2**18}, {"as_int": 1}]
    p = rewrite(mlp, tmp_path / "tb.pt2", {"data/weights/model_weights_config.json": json.dumps(cfg).encode(),
                                           f"data/weights/{meta['path_name']}": b""})
    refused(api_url, p, "1099511627776 bytes", "holds 0 bytes")


# -- bounded work: JSON and expressions ---------------------------------------------------------------------------


def test_json_bounds(small_api: str, mlp: Path, tmp_path: Path) -> None:
    deep = rewrite(mlp, tmp_path / "deep.pt2", {"models/model.json": b"[" * 1000 + b"]" * 1000})
    refused(small_api, deep, "AOTC_MAX_JSON_DEPTH")
    wide = rewrite(mlp, tmp_path / "wide.pt2", {"models/model.json": b"[" + b"0," * 300_000 + b"0]"})
    refused(small_api, wide, "AOTC_MAX_JSON_VALUES")
    big = rewrite(mlp, tmp_path / "big.pt2", {"models/model.json": b'["' + b"a" * (3 * 2**19) + b'"]'})
    refused(small_api, big, "AOTC_MAX_JSON_MB")
    long = edit_json(mlp, tmp_path / "long.pt2", "models/model.json", lambda d: {**d, "torch_version": "9" * 65})
    refused(small_api, long, "AOTC_MAX_GRAPH_STRING_CHARS")


def test_json_bomb_leaves_the_api_memory_alone(default_api: tuple[str, psutil.Process], mlp: Path,
                                               tmp_path: Path) -> None:
    """A 100 KB deflated model.json that would inflate to 1.6 million small JSON objects (over 700 MB as Python
    objects): refused before json.loads, and the API's RSS barely moves."""
    url, proc = default_api
    bomb = b"[" + b"{}," * (1_600_000 - 1) + b"{}]"
    p = tmp_path / "bomb.pt2"
    with zipfile.ZipFile(mlp) as zin, zipfile.ZipFile(p, "w") as zout:
        for info in zin.infolist():
            data = bomb if info.filename.endswith("models/model.json") else zin.read(info)
            zout.writestr(zipfile.ZipInfo(info.filename), data, compress_type=zipfile.ZIP_DEFLATED)
    assert p.stat().st_size < 200 * 1024
    upload(url, mlp)  # warm up the API's imports and buffers first
    before = proc.memory_info().rss
    for _ in range(3):
        refused(url, p, "AOTC_MAX_COMPRESSION_RATIO")
    # ... and the same bomb under the ratio bound still stops at the value count
    stored = rewrite(mlp, tmp_path / "stored.pt2", {"models/model.json": b"[" + b"{}," * 2_100_000 + b"{}]"})
    refused(url, stored, "AOTC_MAX_JSON_VALUES")
    growth = proc.memory_info().rss - before
    print(f"API RSS {before >> 20} MB before, grew by {growth / 2**20:.1f} MB")
    assert growth < 64 * 2**20, f"the API grew by {growth >> 20} MB"


def test_exploding_guard(api_url: str, mlp: Path, tmp_path: Path) -> None:
    """`1 << 10**10` held the capture stage for 68 s; a tower of powers needed over 6 GB."""
    for guard in ["L['x'].size()[0] < 1 << 10**10", "L['x'].size()[0] < 2**2**2**2**2**2**2"]:
        p = edit_json(mlp, tmp_path / "g.pt2", "models/model.json", lambda d: {**d, "guards_code": [guard]})
        refused(api_url, p, "guards_code", code="unsafe_archive")


def test_sizes_that_do_not_fit_int64(api_url: str, mlp: Path, tmp_path: Path) -> None:
    def edit(doc: Any) -> Any:
        doc["range_constraints"] = {"s0": {"min_val": 0, "max_val": 2**70}}
        return doc

    refused(api_url, edit_json(mlp, tmp_path / "r.pt2", "models/model.json", edit), "int64")


# -- the compile request --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dynamic_model(small_api: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    class Cumsum(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.cumsum(0)

    path = export(Cumsum(), (torch.randn(5, 3),), tmp_path_factory.mktemp("d") / "cumsum.pt2",
                  {"x": {0: torch.export.Dim("n")}})
    r, _ = upload(small_api, path)
    assert r.status_code in (200, 201), r.text
    return r.json()


@pytest.mark.parametrize("shape, needles", [
    ([{"min": 1, "max": 10**12}, 3], ["input 'x'", "1000000000000x3", "12000000000000 bytes",
                                      "AOTC_MAX_INPUT_MB"]),
    ([2**70, 3], ["does not fit in int64"]),
    ([{"min": 1, "max": 2**64}, 3], ["does not fit in int64"]),
])
def test_compile_request_too_large(small_api: str, dynamic_model: dict[str, Any], shape: list[Any],
                                   needles: list[str]) -> None:
    t0 = time.perf_counter()
    r = api.post(f"{small_api}/v1/compilations", json={"model_id": dynamic_model["id"], "shapes": {"x": shape}})
    assert time.perf_counter() - t0 < 1.0
    assert r.status_code == 422, r.text
    for needle in needles:
        assert needle in r.json()["error"]["message"], r.json()


# -- model names ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, needle", [
    ("evil\x1b[2J\x1b[31mred", "not printable"),
    ("line\nbreak", "not printable"),
    ("bidi\u202egnp.exe", "not printable"),
    ("x" * 41, "AOTC_MAX_MODEL_NAME_CHARS"),
    ("   ", "not printable"),
])
def test_model_names(small_api: str, mlp: Path, name: str, needle: str) -> None:
    refused(small_api, mlp, needle, name=name)


def test_model_name_header(small_api: str, mlp: Path) -> None:
    r = api.post(f"{small_api}/v1/models", content=mlp.read_bytes(), headers={"x-aotc-filename": "x" * 41})
    assert r.status_code == 422 and "AOTC_MAX_MODEL_NAME_CHARS" in r.json()["error"]["message"]
    r = api.post(f"{small_api}/v1/models", content=mlp.read_bytes(), params={"name": "caf\u00e9 model (v2)"})
    assert r.status_code in (200, 201), r.text
