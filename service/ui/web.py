"""How the console answers: Jinja2 pages with a strict Content-Security-Policy, its static files, and its errors as
pages rather than JSON.

Every page is rendered with autoescape on, and nothing a user uploaded or a compile produced is ever marked safe:
names, kernel names, error messages and generated code reach the browser as text. The CSP forbids inline script,
`eval` and inline styles, so even a string that slipped through escaping could not run.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import Any
from urllib.parse import quote

import redis
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.routing import APIRoute
from jinja2 import Environment, PackageLoader, select_autoescape

from compiler.errors import AotcError

# The pages: scripts and styles only from /ui/static, no inline script or style, no eval; frames only of the
# console's own code view; nothing may frame a page.
PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
            "frame-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
CSRF_COOKIE = "aotc_ui_csrf"
SIGNIN_COOKIE = "aotc_ui_key"
COOKIE_PATH = "/ui"


def page_headers() -> dict[str, str]:
    return {
        "Content-Security-Policy": PAGE_CSP,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "same-origin",
        "X-Frame-Options": "DENY",
        # Pages hold what one key may see: no shared cache keeps them, and the back button after sign-out
        # asks the server again.
        "Cache-Control": "no-store",
    }


# -- static files ----------------------------------------------------------------------------------------------

_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


@dataclass(frozen=True)
class StaticFile:
    body: bytes
    media_type: str
    version: str  # the first 12 hex digits of its sha256: the URL's ?v=, so a changed file gets a new URL


def _load_static() -> dict[str, StaticFile]:
    out: dict[str, StaticFile] = {}
    root = resources.files("service.ui") / "static"
    for folder in (root, root / "vendor"):
        for entry in folder.iterdir():
            suffix = "." + entry.name.rsplit(".", 1)[-1]
            if entry.is_file() and suffix in _TYPES:
                body = entry.read_bytes()
                out[entry.name] = StaticFile(body, _TYPES[suffix], hashlib.sha256(body).hexdigest()[:12])
    return out


STATIC = _load_static()  # small (about 120 KB), read once: served from memory


def static_url(name: str) -> str:
    return f"/ui/static/{name}?v={STATIC[name].version}"


def static_response(name: str, version: str | None) -> Response:
    f = STATIC.get(name)
    if f is None:
        raise NotFoundPage(f"no static file {name!r}")
    # The page links each file with its hash: that URL never changes content, so browsers keep it for a year.
    cache = "public, max-age=31536000, immutable" if version == f.version else "no-cache"
    return Response(f.body, media_type=f.media_type, headers={
        "Cache-Control": cache, "ETag": f'"{f.version}"', "X-Content-Type-Options": "nosniff"})


class NotFoundPage(AotcError):
    status, code = 404, "not_found"


# -- templates ---------------------------------------------------------------------------------------------------


def when(ts: float | str | None) -> str:
    if ts in (None, ""):
        return "-"
    return datetime.fromtimestamp(float(ts), UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def ago(ts: float | str | None, now: float | None = None) -> str:
    if ts in (None, ""):
        return "-"
    s = max(0.0, (now or time.time()) - float(ts))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.0f} {unit} ago"
    return f"{s:.0f} s ago"


def seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f} s" if value < 100 else f"{value:.0f} s"


def millis(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g} ms" if value < 1000 else f"{value:.0f} ms"


def size(n: int | float | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GB"


def dims(shape: list[Any]) -> str:
    return "x".join(f"{d['min']}..{d['max']}" if isinstance(d, dict) else str(d) for d in shape)


def spec_text(spec: list[dict[str, Any]] | None) -> str:
    """`x:float32[1..32x3x64x64]`, as the CLI prints a spec."""
    return ", ".join(f"{i.get('name')}:{i.get('dtype')}[{dims(i.get('shape') or [])}]" for i in spec or [])


env = Environment(loader=PackageLoader("service.ui", "templates"), autoescape=select_autoescape(default=True),
                  trim_blocks=True, lstrip_blocks=True)
env.filters.update(when=when, ago=ago, seconds=seconds, millis=millis, size=size, dims=dims, spec=spec_text,
                   json=lambda v: json.dumps(v, sort_keys=True))  # a str, escaped like any other
env.globals.update(static=static_url)


def csrf_token(request: Request) -> str:
    """The token forms carry, equal to this browser's CSRF cookie (double submit): another site can neither
    read the cookie nor the page, so it cannot forge a form that matches."""
    token = getattr(request.state, "csrf", None) or request.cookies.get(CSRF_COOKIE)
    if not token or len(token) != 43:
        token = secrets.token_urlsafe(32)
    request.state.csrf = token
    return str(token)


def render(request: Request, template: str, *, status: int = 200, **context: Any) -> HTMLResponse:
    token = csrf_token(request)
    html = env.get_template(template).render(
        path=request.url.path, csrf=token, who=getattr(request.state, "viewer", None),
        open_mode=bool(getattr(request.app.state, "keyring", None) and request.app.state.keyring.open),
        **context)
    response = HTMLResponse(html, status_code=status, headers=page_headers())
    if request.cookies.get(CSRF_COOKIE) != token:
        response.set_cookie(CSRF_COOKIE, token, path=COOKIE_PATH, httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")
    return response


# -- errors as pages ---------------------------------------------------------------------------------------------


class SignIn(Exception):
    """No key yet (or one no longer valid): the browser goes to the sign-in page."""

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message


def error_page(request: Request, status: int, code: str, message: str) -> HTMLResponse:
    if request.headers.get("hx-request"):  # a fragment for htmx to show in place
        return render(request, "_error.html", status=status, code=code, message=message)
    return render(request, "error.html", status=status, code=code, message=message)


def _validation_message(exc: RequestValidationError) -> tuple[int, str]:
    problems = exc.errors()
    # A path id outside its pattern names nothing: the API answers 404 for it too.
    if problems and all(tuple(e.get("loc", ()))[:1] == ("path",) for e in problems):
        return 404, "no such page: " + "; ".join(f"{e['loc'][-1]} {str(e.get('input'))[:80]!r}" for e in problems)
    return 422, "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in problems)


class UiRoute(APIRoute):
    """A route whose failures answer as pages: a user's mistake is a 4xx page naming it, a missing key the
    sign-in page, Redis out of reach a 503 page (the JSON API's handlers answer JSON for /v1)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except SignIn as e:
                target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
                where = f"/ui/login?next={quote(target, safe='')}" + (f"&why={quote(e.message)}" if e.message else "")
                if request.headers.get("hx-request"):  # htmx follows HX-Redirect with a full page load
                    return Response(status_code=204, headers={"HX-Redirect": where})
                response = RedirectResponse(where, status_code=303)
                if e.message:
                    response.delete_cookie(SIGNIN_COOKIE, path=COOKIE_PATH)
                return response
            except AotcError as e:
                return error_page(request, e.status, e.code, e.message)
            except RequestValidationError as e:
                status, message = _validation_message(e)
                return error_page(request, status, "not_found" if status == 404 else "invalid", message)
            except (redis.ConnectionError, redis.TimeoutError) as e:
                return error_page(request, 503, "redis_unavailable",
                                  f"the service cannot reach its Redis ({e}); try again shortly")

        return guarded
