"""The CLI shows what others uploaded (model names, error messages quoting an archive, reports): no terminal
control character from the server ever reaches the terminal raw."""

from __future__ import annotations

import io

from client import render

HOSTILE = "evil\x1b[2J\x1b]0;owned\x07\rname\u202egnp.exe\x00\ttab\nline"


def _shown(renderable: object) -> str:
    out = io.StringIO()
    render.show(renderable, file=out)  # type: ignore[arg-type]
    return out.getvalue()


def _clean(text: str) -> None:
    assert all(c.isprintable() or c == "\n" for c in text), ascii(text)
    assert "\x1b" not in text and "\u202e" not in text


def test_printable_escapes_what_is_not() -> None:
    assert render.printable("plain text, caf\u00e9") == "plain text, caf\u00e9"
    assert render.printable("a\x1b[31mb") == "a\\x1b[31mb"
    assert render.printable("bidi\u202e") == "bidi\\u202e"
    assert render.printable("two\nlines") == "two\\nlines"
    assert render.printable("two\nlines\x07", newlines=True) == "two\nlines\\x07"


def test_models_table_escapes_names() -> None:
    text = _shown(render.models_table([{"id": "a" * 64, "name": HOSTILE, "size": 1,
                                        "inputs": [{"name": "x\x1b", "dtype": "float32", "shape": [1]}]}]))
    _clean(text)
    assert "evil\\x1b[2J" in text and len(text.splitlines()) == 2  # header and one row: no line the name added


def test_jobs_table_escapes_errors() -> None:
    job = {"id": "j" * 32, "state": "failed", "stage": "load", "target": "cpu", "attempts": 1,
           "error": {"message": HOSTILE}}
    _clean(_shown(render.jobs_table([job])))


def test_report_and_progress_escape_server_text() -> None:
    meta = {"model_id": "m" * 64, "target": "cpu\x1b[31m"}
    report = {"torch": HOSTILE, "mode": "default", "spec": [], "stages": {
        "package": {"check": {"device": HOSTILE, "notes": [HOSTILE]}}}}
    _clean(_shown(render.report_summary("k" * 32, meta, report)))
    _clean(render.status({"state": "queued", "reason": HOSTILE, "stage": "", "attempts": 1}))
    _clean(render.artifact_line("k", {"size": 1, "timings": {}, "check": {"eager_ms": HOSTILE}}))
