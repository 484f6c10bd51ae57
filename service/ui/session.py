"""Signing in to the console with an API key, and what guards its buttons.

The key lives in an HttpOnly, SameSite=Strict cookie scoped to /ui:
- pages load with plain GETs and work without JavaScript, which a key in sessionStorage would not allow;
- no script, the console's own included, can read it, so markup that slipped through escaping could not steal it;
- the browser sends it only on requests that start on this site, and never to /v1: the JSON API accepts only
  `Authorization: Bearer`, so the cookie opens nothing but the console.

Every request checks the cookie's key exactly as the API checks a bearer token (`service.api.auth.authenticate`):
a revoked key stops working within AOTC_AUTH_CACHE_S, and the key's scope and namespace decide what each page
shows. Without AOTC_ADMIN_KEY (open mode) there is no sign-in: loopback callers are admins, as on /v1.

The state-changing requests (sign in, sign out, cancel, retry) are POSTs that must carry the CSRF token the page
was rendered with, equal to this browser's CSRF cookie (double submit), and must come from this origin
(`Origin`, else `Sec-Fetch-Site`). GETs change nothing.
"""

from __future__ import annotations

import hmac
from typing import Annotated
from urllib.parse import parse_qs, urlsplit

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.security import HTTPAuthorizationCredentials

from compiler.errors import AotcError, Forbidden, PayloadTooLarge, Unauthorized, Unprocessable
from service.api.auth import Keyring, Principal, authenticate
from service.ui.settings import get_console_settings
from service.ui.web import COOKIE_PATH, CSRF_COOKIE, SIGNIN_COOKIE, SignIn, UiRoute, render

MAX_KEY_CHARS = 200  # far above any key aotc makes (aotc_<12 hex>_<secret>): a longer one is not a key


class BadOrigin(AotcError):
    status, code = 403, "cross_site"


async def viewer(request: Request) -> Principal:
    """The caller, from the sign-in cookie (or open mode); SignIn when there is no valid key."""
    keyring: Keyring = request.app.state.keyring
    if keyring.open:
        who = await authenticate(request, None)  # loopback only, as /v1 (Unauthorized beyond it)
    else:
        token = request.cookies.get(SIGNIN_COOKIE)
        if not token:
            raise SignIn()
        try:
            who = await authenticate(request, HTTPAuthorizationCredentials(scheme="Bearer", credentials=token))
        except Unauthorized:
            raise SignIn("that key is no longer valid (revoked?): sign in again") from None
    request.state.viewer = who
    return who


Viewer = Annotated[Principal, Depends(viewer)]


def needs(who: Principal, scope: str, what: str) -> None:
    """The scope the JSON route behind a page needs: the same 403 the API gives, as a page."""
    if not who.allows(scope):
        raise Forbidden(f"{what} needs a key of scope {scope!r}; the key {who.key_id} has scope {who.scope!r}")


def same_origin(request: Request) -> None:
    """Refuse a state-changing request that another site started (CSRF): its Origin must be this host, or, where
    a browser sends no Origin, Sec-Fetch-Site must say same-origin."""
    origin = request.headers.get("origin")
    host = request.headers.get("host", "")
    if origin is not None:
        if origin == "null" or urlsplit(origin).netloc != host:
            raise BadOrigin(f"refused: this request came from another site ({origin[:100]}), not from the console")
        return
    site = request.headers.get("sec-fetch-site")
    if site not in (None, "same-origin", "none"):
        raise BadOrigin(f"refused: this request came from another site (Sec-Fetch-Site: {site[:40]})")


async def read_form(request: Request) -> dict[str, str]:
    """A small urlencoded form (a key, a token, where to go next), bounded by AOTC_UI_FORM_MAX_BYTES."""
    limit = get_console_settings().form_max_bytes
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"the form is over {limit} bytes (AOTC_UI_FORM_MAX_BYTES)")
    try:
        fields = parse_qs(body.decode("ascii"), max_num_fields=8, strict_parsing=False)
    except (UnicodeDecodeError, ValueError):
        raise Unprocessable("the form is not a urlencoded ASCII form") from None
    return {k: v[0] for k, v in fields.items() if v}


async def checked_form(request: Request) -> dict[str, str]:
    """The form of a state-changing request, once it has passed the CSRF checks."""
    same_origin(request)
    form = await read_form(request)
    token = form.get("csrf", "")
    cookie = request.cookies.get(CSRF_COOKIE) or ""
    if not (cookie and token and hmac.compare_digest(cookie.encode(), token.encode())):
        raise BadOrigin("refused: the form's CSRF token does not match this browser's; reload the page and try "
                        "again")
    return form


CheckedForm = Annotated[dict[str, str], Depends(checked_form)]
router = APIRouter(prefix="/ui", route_class=UiRoute, include_in_schema=False)


def _local(next_url: str | None) -> str:
    """Where to go after signing in: a console path only (never another site: no open redirect)."""
    if next_url and next_url.startswith("/ui") and not next_url.startswith("//") and "\\" not in next_url:
        return next_url
    return "/ui/jobs"


@router.get("/login")
async def login_page(request: Request, next: Annotated[str | None, Query(max_length=2000)] = None,
                     why: Annotated[str | None, Query(max_length=200)] = None) -> Response:
    return render(request, "login.html", next=_local(next), message=why or "", status=200)


@router.post("/login")
async def login(request: Request, form: CheckedForm) -> Response:
    keyring: Keyring = request.app.state.keyring
    key, next = form.get("key", "").strip(), form.get("next")
    if len(key) > MAX_KEY_CHARS:
        key = ""  # not a key aotc makes: refused below like any unknown key
    if keyring.open:
        return RedirectResponse(_local(next), status_code=303)
    who = await keyring.principal(key) if key else None
    if who is None:
        return render(request, "login.html", next=_local(next), status=401,
                      message="that is not a key this server knows, or it was revoked")
    response = RedirectResponse(_local(next), status_code=303)
    settings = get_console_settings()
    response.set_cookie(SIGNIN_COOKIE, key, max_age=int(settings.session_hours * 3600), path=COOKIE_PATH,
                        httponly=True, samesite="strict",
                        secure=settings.secure_cookie or request.url.scheme == "https")
    return response


@router.post("/logout")
async def logout(form: CheckedForm) -> Response:
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(SIGNIN_COOKIE, path=COOKIE_PATH)
    return response


@router.get("")
@router.get("/")
async def home(who: Viewer) -> Response:
    return RedirectResponse("/ui/jobs" if who.allows("compile") else "/ui/models", status_code=303)
