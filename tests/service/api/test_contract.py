"""The API keeps its contract, case by case (issue 11, item 5; issue 19): what fuzzing and a person found, each answered
the way the OpenAPI says, as JSON, never a 500. test_schemathesis.py covers the rest by generating requests.

The contract both ways: a request the published schema accepts is not refused as invalid (no 400 or 422), and one it
refuses is. `_schema_accepts` reads the schema the running server publishes and validates with jsonschema-rs, the
engine schemathesis judges requests with.

A Cluster of its own (its own redis-server and API): some tests corrupt records on purpose.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import pytest

from procs import Cluster, api
from service.store import keys

LISTS = ("/v1/models", "/v1/artifacts", "/v1/jobs", "/v1/jobs/deadletter")
TARGET = "cpu-x86_64-contract"  # a queue no worker serves: the test's job stays queued
DIGITS_5000 = "9" * 5000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("contract"))
    yield c
    c.close()


@pytest.fixture(scope="module")
def job_id(cluster: Cluster) -> str:
    job_id, created = cluster.store.jobs.submit("c" * 32, TARGET, {"model_id": "f" * 64, "spec": [], "options": {}})
    assert created and cluster.store.r.type(keys.job_events(job_id)) == "stream"
    return job_id


@pytest.fixture(scope="module")
def artifact(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    package = tmp_path_factory.mktemp("pkg") / "a.pt2"
    package.write_bytes(b"PK\x05\x06" + bytes(18))
    factors = {"format": 1, "model": "f" * 64, "options": {}, "spec": [], "target": TARGET, "toolchain": {}}
    return cluster.store.artifacts.put({"key": "b" * 32, "factors": factors, "model_id": "f" * 64,
                                        "target": TARGET, "spec": [], "options": {}}, package)


def _error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json", r.headers
    error: dict[str, Any] = r.json()["error"]
    assert error["code"] == code, error
    return error


@pytest.mark.parametrize("path", LISTS)
@pytest.mark.parametrize("limit, bound", [
    ("99999999999999999999", "less than or equal to 1000"),  # beyond int64: reached Redis, a 500
    ("1001", "less than or equal to 1000"),
    ("0", "greater than or equal to 1"),  # returned everything
    ("-1", "greater than or equal to 1"),
])
def test_limit_out_of_bounds_is_a_422_naming_the_bound(cluster: Cluster, path: str, limit: str, bound: str) -> None:
    error = _error(api.get(cluster.url + path, params={"limit": limit}), 422, "invalid")
    assert "limit" in error["message"] and bound in error["message"], error


@pytest.mark.parametrize("path", LISTS)
def test_limit_within_bounds_answers(cluster: Cluster, path: str) -> None:
    for limit in (1, 1000):
        assert api.get(cluster.url + path, params={"limit": limit}).status_code == 200


def test_job_state_is_an_enum(cluster: Cluster) -> None:
    error = _error(api.get(f"{cluster.url}/v1/jobs", params={"state": "bogus"}), 422, "invalid")
    assert "queued" in error["message"] and "cancelled" in error["message"]
    assert api.get(f"{cluster.url}/v1/jobs", params={"state": "queued"}).status_code == 200


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_a_jobs_event_stream_key_is_not_a_job(cluster: Cluster, job_id: str, method: str) -> None:
    # /v1/jobs/{id}:events read job:{id}:events, the job's event stream, as a job hash: WRONGTYPE, a 500.
    error = _error(api.request(method, f"{cluster.url}/v1/jobs/{job_id}:events"), 404, "not_found")
    assert "32 hex digits" in error["message"]
    assert cluster.job(job_id)["state"] == "queued"  # the DELETE cancelled nothing
    assert api.get(f"{cluster.url}/v1/jobs/{job_id}").json()["id"] == job_id


@pytest.mark.parametrize("path, noun", [
    ("/v1/jobs/{}", "job"), ("/v1/models/{}", "model"), ("/v1/artifacts/{}", "artifact"),
    ("/v1/artifacts/{}/meta", "artifact"), ("/v1/artifacts/{}/report", "artifact"),
])
def test_ids_outside_their_pattern_name_nothing(cluster: Cluster, path: str, noun: str) -> None:
    for bad in ("nope", "ABCDEF0123456789", "a" * 65, "0" * 31 + ":x"):
        error = _error(api.get(cluster.url + path.format(bad)), 404, "not_found")
        assert error["message"].startswith(f"no {noun} "), error


def test_a_5000_digit_dim_is_a_422(cluster: Cluster) -> None:
    # int() refuses 4300+ digits: the lookup and the compile request both answered 500.
    params = {"model_id": "f" * 64, "shape": f"x={DIGITS_5000}x3"}
    error = _error(api.get(f"{cluster.url}/v1/artifacts/lookup", params=params), 422, "invalid")
    assert "shape" in error["message"] and "256" in error["message"]


def test_a_dim_beyond_int64_is_a_422_naming_it(cluster: Cluster, tmp_path: Path) -> None:
    model = _upload(cluster, tmp_path)
    for shape in (f"x={'9' * 25}x32", f"x={DIGITS_5000[:200]}x32"):
        r = api.get(f"{cluster.url}/v1/artifacts/lookup", params={"model_id": model, "shape": shape})
        assert "int64" in _error(r, 422, "invalid")["message"], shape
    for dims in (f"{DIGITS_5000}x32", "9" * 25 + "x32"):
        r = api.post(f"{cluster.url}/v1/compilations", json={"model_id": model, "shapes": {"x": dims}})
        assert "int64" in _error(r, 422, "invalid")["message"]
    r = api.post(f"{cluster.url}/v1/compilations", content=b'{"model_id": "%s", "shapes": {"x": [%s, 32]}}' % (
        model.encode(), DIGITS_5000.encode()), headers={"content-type": "application/json"})
    _error(r, 400, "bad_request")  # Python's JSON reader refuses the number itself


def _upload(cluster: Cluster, tmp_path: Path) -> str:
    import torch

    from modelzoo import MLP, export, seeded

    path = export(seeded(MLP, 1105), (torch.randn(2, 32),), tmp_path / "mlp.pt2")
    r = api.post(f"{cluster.url}/v1/models", content=path.read_bytes(), timeout=60)
    assert r.status_code in (200, 201), r.text
    return str(r.json()["id"])


def test_bad_headers_are_422_not_a_broken_stream(cluster: Cluster, job_id: str) -> None:
    # An unreadable Last-Event-ID reached XREAD after the stream had started: the response broke mid-way.
    r = api.get(f"{cluster.url}/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "bogus"})
    assert "last-event-id" in _error(r, 422, "invalid")["message"]


def test_a_huge_range_is_unsatisfiable(cluster: Cluster, artifact: dict[str, Any]) -> None:
    url = f"{cluster.url}/v1/artifacts/{artifact['key']}"
    r = api.get(url, headers={"Range": f"bytes={DIGITS_5000}-"})
    assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{artifact['size']}", r.text
    r = api.get(url, headers={"Range": f"bytes=0-{DIGITS_5000}"})
    assert r.status_code == 206 and len(r.content) == artifact["size"]
    assert api.get(url, headers={"Range": f"bytes=-{DIGITS_5000}"}).status_code == 206


def test_redis_refusing_a_command_is_a_json_503_with_a_request_id(cluster: Cluster) -> None:
    broken = "d" * 32
    cluster.store.r.set(keys.job(broken), "not a hash")  # WRONGTYPE for HGETALL
    r = api.get(f"{cluster.url}/v1/jobs/{broken}", headers={"X-Request-ID": "contract-wrongtype-1"})
    error = _error(r, 503, "redis_error")
    assert "WRONGTYPE" in error["message"] and r.headers["retry-after"]
    assert error["request_id"] == r.headers["x-request-id"] == "contract-wrongtype-1"
    assert "contract-wrongtype-1" in _api_log(cluster)


def test_an_unexpected_failure_is_a_json_500_logged_under_a_request_id(cluster: Cluster) -> None:
    broken = "e" * 32
    cluster.store.r.set(keys.artifact(broken), "{not json")  # a record no code path expects
    r = api.get(f"{cluster.url}/v1/artifacts/{broken}/report")
    error = _error(r, 500, "internal")
    rid = error["request_id"]
    assert rid == r.headers["x-request-id"] and len(rid) >= 8 and rid in error["message"]
    assert r.headers["connection"] == "close"  # the server drops the connection after a 500
    log = _api_log(cluster)
    assert f"request {rid}: GET /v1/artifacts/{broken}/report failed" in log and "JSONDecodeError" in log
    assert api.get(f"{cluster.url}/healthz").json() == {"ok": True}


def _api_log(cluster: Cluster) -> str:
    return (cluster.base / "api-0.log").read_text(errors="replace")


def test_http_errors_are_json(cluster: Cluster) -> None:
    assert "/v1/nothing" in _error(api.get(f"{cluster.url}/v1/nothing"), 404, "not_found")["message"]
    r = api.patch(f"{cluster.url}/v1/jobs")
    _error(r, 405, "method_not_allowed")
    assert r.headers["allow"] == "GET"
    r = api.post(f"{cluster.url}/v1/compilations", content=b"{", headers={"content-type": "application/json"})
    assert "JSON" in _error(r, 422, "invalid")["message"]


def test_the_openapi_declares_security_bounds_and_errors(cluster: Cluster) -> None:
    doc = httpx.get(f"{cluster.url}/openapi.json").json()
    bearer = doc["components"]["securitySchemes"]["bearer"]
    assert (bearer["type"], bearer["scheme"]) == ("http", "bearer")
    ops = [(path, method, op) for path, item in doc["paths"].items() for method, op in item.items()]
    assert len(ops) >= 30
    for path, method, op in ops:
        where, codes = f"{method.upper()} {path}", set(op["responses"])
        if path in ("/healthz", "/readyz"):
            assert "security" not in op, where
            continue
        assert op["security"] == [{"bearer": []}], where
        assert {"401", "403", "503", "507"} <= codes, where
        for code in codes - {"200", "201", "202", "206", "304", "307"}:
            content = op["responses"][code].get("content", {}).get("application/json", {})
            assert content.get("schema") == {"$ref": "#/components/schemas/ErrorBody"}, (where, code)
        for p in op.get("parameters", []):
            schema = p["schema"]
            if p["name"] == "limit":
                assert (schema["minimum"], schema["maximum"]) == (1, 1000), where
            if p["in"] == "path":
                assert "pattern" in schema or "maxLength" in schema, (where, p["name"])
    assert "429" in doc["paths"]["/v1/compilations"]["post"]["responses"]
    assert "429" in doc["paths"]["/v1/models"]["post"]["responses"]
    assert "requestBody" in doc["paths"]["/v1/models"]["post"]


def test_the_upload_still_names_a_too_long_name(cluster: Cluster) -> None:
    r = api.post(f"{cluster.url}/v1/models", params={"name": "n" * 201}, content=b"PK")
    assert "AOTC_MAX_MODEL_NAME_CHARS" in _error(r, 422, "invalid")["message"]


# -- 405: every path owns its methods ------------------------------------------------------------------------------

METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
PATH_VALUES = {"job_id": "c" * 32, "key": "b" * 32, "model_id": "f" * 64, "key_id": "0" * 12, "kid": "0" * 16,
               "namespace": "default", "path": "code/a/b.cpp", "name": "bert", "tag": "prod", "version": "1",
               "ref": "bert:prod"}


@pytest.fixture(scope="module")
def doc(cluster: Cluster) -> dict[str, Any]:
    published: dict[str, Any] = httpx.get(f"{cluster.url}/openapi.json").json()
    return published


def test_a_405_lists_every_method_of_the_path(cluster: Cluster, doc: dict[str, Any]) -> None:
    # Allow named one route's methods (GET and HEAD of /v1/artifacts/{key} are two routes: `Allow: HEAD`), and a
    # method a literal path lacks reached a parameterised one: DELETE /v1/jobs/deadletter was a 404 for job
    # "deadletter", HEAD /v1/artifacts/lookup one for artifact "lookup".
    wrong = []
    for template, item in doc["paths"].items():
        declared = {m.upper() for m in item}
        path = template.format(**PATH_VALUES)
        for method in sorted(set(METHODS) - declared):
            r = api.request(method, cluster.url + path)
            allow = {m.strip() for m in r.headers.get("allow", "").split(",") if m.strip()}
            if r.status_code != 405 or allow != declared:
                wrong.append(f"{method} {template}: {r.status_code}, Allow {sorted(allow)}, declared "
                             f"{sorted(declared)}")
            elif method != "HEAD":
                assert r.json()["error"]["code"] == "method_not_allowed", r.text
    assert not wrong, "\n".join(wrong)


# -- the schema says what the code requires ---------------------------------------------------------------------------

_UNSET: Any = object()


def _schema_accepts(doc: dict[str, Any], method: str, path: str, *, query: dict[str, Any] | None = None,
                    headers: dict[str, str | bytes] | None = None, json: Any = _UNSET,
                    content: bytes | None = None) -> bool:
    """Whether the published schema allows these query and header parameters and this body (path parameters are
    left out: the tests fill valid ones)."""
    op = doc["paths"][path][method.lower()]

    def valid(schema: dict[str, Any], value: Any) -> bool:
        return bool(jsonschema_rs.validator_for({**schema, "components": doc["components"]}).is_valid(value))

    given = {"query": query or {},
             "header": {k.lower(): v.decode("latin-1") if isinstance(v, bytes) else v
                        for k, v in (headers or {}).items()}}
    for param in op.get("parameters", []):
        values = given.get(param["in"])
        if values is None:
            continue
        if param["name"] not in values:
            if param.get("required"):
                return False
            continue
        value = values[param["name"]]
        if param["schema"].get("type") == "array" and not isinstance(value, list):
            value = [value]
        if not valid(param["schema"], value):
            return False
    body = op.get("requestBody", {}).get("content", {})
    if json is not _UNSET and not valid(body["application/json"]["schema"], json):
        return False
    if content is not None:  # binary: only its length is described
        schema = body["application/octet-stream"]["schema"]
        return bool(schema.get("minLength", 0) <= len(content) <= schema.get("maxLength", len(content)))
    return True


def _accepted(r: httpx.Response) -> bool:
    """Not refused as invalid. The cases below fit the program, so a 422 here is never one of its semantics."""
    return r.status_code not in (400, 422)


def _agree(doc: dict[str, Any], method: str, path: str, r: httpx.Response, **request: Any) -> str | None:
    says = _schema_accepts(doc, method, path, **request)
    if says == _accepted(r):
        return None
    shown = {k: f"<{len(v)} bytes>" if k == "content" else v for k, v in request.items()}
    return f"the schema {'allows' if says else 'refuses'} {shown}; the API answered {r.status_code}: {r.text[:300]}"


@pytest.fixture(scope="module")
def mlp(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, bytes]:
    """A real model (input x: float32[2, 32]) uploaded: its id and its bytes."""
    base = tmp_path_factory.mktemp("mlp")
    return _upload(cluster, base), (base / "mlp.pt2").read_bytes()


def test_compile_requests_are_valid_exactly_when_the_schema_says(cluster: Cluster, doc: dict[str, Any],
                                                                 mlp: tuple[str, bytes]) -> None:
    # `shapes: {}` was schema-valid and a 422 (no shape for input x); a true dim was a 422 too, and "CPU" worked
    # only because the schema did not say which targets exist.
    model_id, _ = mlp
    bodies: list[dict[str, Any]] = [
        {"shapes": {}},
        {"shapes": {"x": [2, 32]}},
        {"shapes": {"x": "2x32"}},
        {"shapes": {"x": ["2", {"min": 32, "max": 32}]}},
        {"shapes": {"x": [True, 32]}},
        {"shapes": {"x": [2.5, 32]}},
        {"shapes": {"x": [2.0, 32]}},  # an integer to JSON Schema
        {"shapes": {"x": "2 by 32"}},
        {"shapes": {"x-y": [2, 32]}},
        {"shapes": {"x": [2, 32]}, "buckets": [{}]},
        {"shapes": {"x": [2, 32]}, "buckets": [{"x": [2, 32]}]},
        {"shapes": {"x": [2, 32]}, "target": "CPU"},
        {"shapes": {"x": [2, 32]}, "target": "tpu"},
        {"shapes": {"x": [2, 32]}, "target": " cpu"},
        {"shapes": {"x": [2, 32]}, "options": {"freezing": 1}},
        {"shapes": {"x": [2, 32]}, "options": {"convolutions": "cudnn"}},
    ]
    wrong = []
    for body in bodies:
        body = {"model_id": model_id, **body}
        r = api.post(f"{cluster.url}/v1/compilations", json=body)
        wrong.append(_agree(doc, "POST", "/v1/compilations", r, json=body))
    assert not [w for w in wrong if w], "\n".join(w for w in wrong if w)


def test_uploads_are_valid_exactly_when_the_schema_says(cluster: Cluster, doc: dict[str, Any],
                                                        mlp: tuple[str, bytes]) -> None:
    # An empty body was schema-valid and a 400. A name was checked with Python's str.isprintable(), whose Unicode
    # is older than the validators': a letter added in Unicode 15 (U+31350) passed the schema and was a 422.
    _, data = mlp
    cases: list[dict[str, Any]] = [
        {"content": b""},
        {"content": data},
        {"content": data, "query": {"name": "caf\u00e9 model (v2)"}},
        {"content": data, "query": {"name": "new \U00031350 letter"}},
        {"content": data, "query": {"name": ""}},
        {"content": data, "query": {"name": "evil\x1b[2J"}},
        {"content": data, "query": {"name": "bidi\u202egnp.exe"}},
        {"content": data, "query": {"name": "   "}},
        {"content": data, "query": {"name": "private \U00102e8d use"}},  # schemathesis read \\p{C} as controls
        {"content": data, "headers": {"x-aotc-filename": "model.pt2"}},
        {"content": data, "headers": {"x-aotc-filename": b"bad\x85name"}},  # a C1 control, as latin-1
    ]
    wrong = []
    for case in cases:
        r = api.post(f"{cluster.url}/v1/models", content=case["content"], params=case.get("query"),
                     headers=case.get("headers"), timeout=60)
        wrong.append(_agree(doc, "POST", "/v1/models", r, **case))
    assert not [w for w in wrong if w], "\n".join(w for w in wrong if w)


def test_no_parameter_is_nullable(doc: dict[str, Any]) -> None:
    # A query or header parameter has no null: `Last-Event-ID: null` was schema-valid and a 422.
    nullable = [f"{method.upper()} {path} {p['in']} {p['name']}" for path, item in doc["paths"].items()
                for method, op in item.items() for p in op.get("parameters", [])
                if "null" in json.dumps(p["schema"])]
    assert not nullable, nullable


def test_headers_and_queries_are_valid_exactly_when_the_schema_says(cluster: Cluster, doc: dict[str, Any],
                                                                    job_id: str, mlp: tuple[str, bytes]) -> None:
    model_id, _ = mlp
    wrong = []
    events = "/v1/jobs/{job_id}/events"
    for value in ("null", "bogus", "0-0", "1700000000000-0"):
        # The stream of a queued job never ends by itself: read no further than the status line.
        with api.stream("GET", f"{cluster.url}/v1/jobs/{job_id}/events", headers={"Last-Event-ID": value}) as r:
            wrong.append(_agree(doc, "GET", events, r, headers={"last-event-id": value}))
    # ?shape= had only a length: "000..." was schema-valid and a 422 (no NAME=).
    for shape in ("0" * 256, "x=2x32", "x=2X32", "x =2x32", "x=2x" + "9" * 20, "1x=2", "x=2x32x"):
        query = {"model_id": model_id, "shape": shape}
        r = api.get(f"{cluster.url}/v1/artifacts/lookup", params=query)
        wrong.append(_agree(doc, "GET", "/v1/artifacts/lookup", r, query=query))
    for target in ("cpu", "CUDA", "cuda-sm90", "tpu", "cpu-", "cpu x"):
        query = {"model_id": model_id, "shape": "x=2x32", "target": target}
        r = api.get(f"{cluster.url}/v1/artifacts/lookup", params=query)
        wrong.append(_agree(doc, "GET", "/v1/artifacts/lookup", r, query=query))
    assert not [w for w in wrong if w], "\n".join(w for w in wrong if w)


def test_key_and_quota_bodies_are_valid_exactly_when_the_schema_says(cluster: Cluster, doc: dict[str, Any]) -> None:
    # A key's name was checked with str.isprintable() (a Unicode 15 letter: schema-valid, a 422), and a quota of
    # `true` jobs was taken as 1 (schema-invalid, a 200).
    wrong = []
    for body in ({"scope": "pull", "name": "ci \U00031350"}, {"scope": "pull", "name": "line\nbreak"},
                 {"scope": "pull", "name": ""}, {"scope": "pull", "namespace": "team-a", "nmae": "typo"}):
        r = api.post(f"{cluster.url}/v1/keys", json=body)
        wrong.append(_agree(doc, "POST", "/v1/keys", r, json=body))
    for body in ({"max_jobs": True}, {"max_jobs": "5"}, {"max_jobs": 5}, {"max_jobs": 5.0}, {"max_stored_gb": 2},
                 {"max_stored_gb": "2"}, {"max_stored_gb": False},
                 {"max_stored_gb": 1.5, "max_jobs": None}, {"max_job": 5}):
        r = api.put(f"{cluster.url}/v1/namespaces/contract/quota", json=body)
        wrong.append(_agree(doc, "PUT", "/v1/namespaces/{namespace}/quota", r, json=body))
    assert not [w for w in wrong if w], "\n".join(w for w in wrong if w)


def test_refusals_name_the_rule(cluster: Cluster, mlp: tuple[str, bytes]) -> None:
    model_id, data = mlp
    r = api.post(f"{cluster.url}/v1/compilations", json={"model_id": model_id, "shapes": {"x": "4xbanana"}})
    assert "shapes.x: cannot read shape '4xbanana'" in _error(r, 422, "invalid")["message"]
    r = api.post(f"{cluster.url}/v1/compilations", json={"model_id": model_id, "shapes": {"x": [-1, 32]}})
    assert "shapes.x.0: Input should be greater than or equal to 0" in _error(r, 422, "invalid")["message"]
    r = api.post(f"{cluster.url}/v1/compilations", json={"model_id": model_id, "shapes": {"x": [True, 32]}})
    assert "shapes.x.0: a dim is a size" in _error(r, 422, "invalid")["message"]
    r = api.post(f"{cluster.url}/v1/models", content=data, params={"name": "evil\x1b[2J"})
    assert "query.name: 'evil\\x1b[2J' is not printable text" in _error(r, 422, "invalid")["message"]
    r = api.get(f"{cluster.url}/v1/artifacts/lookup", params={"model_id": model_id, "shape": "x=2x32",
                                                              "target": "tpu"})
    assert "query.target: unknown target 'tpu'" in _error(r, 422, "invalid")["message"]


def test_bounds_are_published_as_json_schema_keywords(doc: dict[str, Any]) -> None:
    # A bound on an Optional number behind a validator came out as pydantic's own "ge"/"le", which no validator
    # reads: the quota's 0 GB passed the schema and was a 422.
    text = json.dumps(doc)
    assert not {'"ge":', '"gt":', '"le":', '"lt":'} & {k for k in ('"ge":', '"gt":', '"le":', '"lt":') if k in text}
