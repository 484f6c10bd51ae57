"""The OpenAPI document the API publishes: FastAPI's, with the two things it cannot say by itself.

- A parameter that may be left out is optional, not nullable. FastAPI writes `str | None = None` as
  `anyOf: [string, null]`, but a query or header parameter has no null: a client that sends one sends the text
  `null` (schemathesis did, as `Last-Event-ID: null`, and was refused a request the document allowed).
- A limit that is a setting (AOTC_MAX_MODEL_NAME_CHARS) is read when the document is built, so it states the bound
  this process enforces rather than the default. The upload's size limit (AOTC_MAX_UPLOAD_MB, gigabytes) stays in
  the body's description: as a `maxLength`, a fuzzer's boundary case would send that many bytes.

Everything else the document says comes from the routes' own parameter and body declarations, which are what
FastAPI validates: a check moved there is described by the same declaration that enforces it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from service.api.settings import Settings


def install(app: FastAPI, settings: Settings) -> None:
    """Serve `tighten(FastAPI's document)` at /openapi.json (built once, on the first request for it)."""
    generate = app.openapi

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = tighten(generate(), settings)
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]


def tighten(doc: dict[str, Any], settings: Settings) -> dict[str, Any]:
    for item in doc.get("paths", {}).values():
        for op in item.values():
            for param in op.get("parameters", []):
                param["schema"] = _not_null(param["schema"])
    upload = doc["paths"]["/v1/models"]["post"]
    for param in upload["parameters"]:
        if param["name"] in ("name", "x-aotc-filename"):
            param["schema"]["maxLength"] = settings.max_model_name_chars
    upload["requestBody"]["content"]["application/octet-stream"]["schema"]["minLength"] = 1  # bytes; empty is a 400
    return doc


def _not_null(schema: dict[str, Any]) -> dict[str, Any]:
    """`{anyOf: [X, {type: null}], ...}` as `{...X, ...}`, without a null default."""
    options = schema.get("anyOf")
    if not options or {"type": "null"} not in options or len(options) != 2:
        return schema
    (kept,) = [o for o in options if o != {"type": "null"}]
    out = {**kept, **{k: v for k, v in schema.items() if k != "anyOf" and not (k == "default" and v is None)}}
    return out
