"""The console over plain HTTP (no browser, no compile): sign-in, the cookie, CSRF, the CSP, scopes, static files."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from html import unescape

import httpx
import pytest

from procs import ADMIN_KEY, ROOT, api

VENDOR = ROOT / "service" / "ui" / "static" / "vendor"
NO_JOB = "0" * 32


def signed_in(api_url: str, key: str) -> httpx.Client:
    """A client holding the console's cookies after signing in with `key` (the login form, as a browser posts it)."""
    c = httpx.Client(base_url=api_url, timeout=10)
    page = c.get("/ui/login")
    token = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert token, page.text
    r = c.post("/ui/login", data={"key": key, "csrf": token.group(1), "next": "/ui/models"},
               headers={"Origin": api_url})
    assert r.status_code == 303 and r.headers["location"] == "/ui/models", r.text
    return c


def csrf_of(c: httpx.Client, path: str = "/ui/models") -> str:
    m = re.search(r'name="csrf" value="([^"]+)"', c.get(path).text)
    assert m
    return m.group(1)


def test_pages_need_a_key(api_url: str) -> None:
    r = httpx.get(f"{api_url}/ui/jobs?state=failed")
    assert r.status_code == 303
    assert r.headers["location"] == "/ui/login?next=%2Fui%2Fjobs%3Fstate%3Dfailed"


def test_sign_in_sets_a_strict_httponly_cookie_for_ui_only(api_url: str, keys: dict[str, str]) -> None:
    c = signed_in(api_url, keys["a"])
    cookie = next(h for h in c.cookies.jar if h.name == "aotc_ui_key")
    assert cookie.path == "/ui" and cookie.has_nonstandard_attr("HttpOnly")
    r = c.get("/ui/models")
    assert r.status_code == 200 and "ui-team-a" in r.text
    # The cookie opens the console only: the JSON API takes bearer tokens, so a cross-site form cannot use it.
    assert httpx.get(f"{api_url}/v1/models", cookies={"aotc_ui_key": keys["a"]}).status_code == 401


def test_login_cookie_flags(api_url: str, keys: dict[str, str]) -> None:
    c = httpx.Client(base_url=api_url)
    token = csrf_of(c, "/ui/login")
    r = c.post("/ui/login", data={"key": keys["a"], "csrf": token}, headers={"Origin": api_url})
    header = next(v for k, v in r.headers.multi_items() if k == "set-cookie" and v.startswith("aotc_ui_key="))
    assert "HttpOnly" in header and "SameSite=strict" in header and "Path=/ui" in header


def test_a_wrong_key_is_refused(api_url: str) -> None:
    c = httpx.Client(base_url=api_url)
    r = c.post("/ui/login", data={"key": "aotc_000000000000_nope", "csrf": csrf_of(c, "/ui/login")},
               headers={"Origin": api_url})
    assert r.status_code == 401 and "not a key this server knows" in r.text
    assert "aotc_ui_key" not in r.headers.get("set-cookie", "")


def test_no_open_redirect_after_sign_in(api_url: str, keys: dict[str, str]) -> None:
    c = httpx.Client(base_url=api_url)
    for bad in ("https://evil.example/", "//evil.example/ui", "/\\evil.example"):
        r = c.post("/ui/login", data={"key": keys["a"], "csrf": csrf_of(c, "/ui/login"), "next": bad},
                   headers={"Origin": api_url})
        assert r.status_code == 303 and r.headers["location"] == "/ui/jobs", bad


@pytest.mark.parametrize("case", ["no token", "wrong token", "other origin", "cross-site fetch"])
def test_buttons_refuse_cross_site_requests(api_url: str, keys: dict[str, str], case: str) -> None:
    c = signed_in(api_url, keys["a"])
    token = csrf_of(c)
    data = {"csrf": {"no token": "", "wrong token": "x" * 43}.get(case, token)}
    headers = {"Origin": "https://evil.example"} if case == "other origin" else (
        {"Sec-Fetch-Site": "cross-site"} if case == "cross-site fetch" else {"Origin": api_url})
    r = c.post(f"/ui/jobs/{NO_JOB}/cancel", data=data, headers=headers)
    assert r.status_code == 403 and 'data-code="cross_site"' in r.text, r.text
    # The same request from the console itself gets through the check (and finds no such job).
    ok = c.post(f"/ui/jobs/{NO_JOB}/cancel", data={"csrf": token}, headers={"Origin": api_url})
    assert ok.status_code == 404 and "no job" in ok.text


def test_pages_carry_a_strict_csp(api_url: str, keys: dict[str, str]) -> None:
    c = signed_in(api_url, keys["a"])
    r = c.get("/ui/jobs")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "style-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe" not in csp and "default-src 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff" and r.headers["cache-control"] == "no-store"
    assert "<script>" not in r.text and " style=" not in r.text and " on" + "click=" not in r.text


def test_scope_decides_the_pages(api_url: str, keys: dict[str, str]) -> None:
    pull = signed_in(api_url, keys["a_pull"])
    r = pull.get("/ui/jobs")
    assert r.status_code == 403 and "scope 'compile'" in unescape(r.text)  # GET /v1/jobs needs compile too
    assert pull.get("/ui/models").status_code == 200
    for path in ("/ui/farm", "/ui/admin"):  # admin only, as /v1/workers and /v1/keys
        r = signed_in(api_url, keys["a"]).get(path)
        assert r.status_code == 403 and "scope 'admin'" in unescape(r.text), path


def test_bad_ids_are_404_pages(api_url: str, keys: dict[str, str]) -> None:
    c = signed_in(api_url, keys["a"])
    for path in ("/ui/jobs/not-a-job", f"/ui/jobs/{NO_JOB}", "/ui/artifacts/" + "f" * 32, "/ui/models/zz"):
        r = c.get(path)
        assert r.status_code == 404 and r.headers["content-type"].startswith("text/html"), path


def test_a_revoked_key_is_signed_out(api_url: str, new_key: Callable[[str, str], str]) -> None:
    key = new_key("compile", "ui-revoked")
    c = signed_in(api_url, key)
    assert c.get("/ui/models").status_code == 200
    assert api.delete(f"{api_url}/v1/keys/{key.split('_')[1]}").status_code == 200
    time.sleep(5.5)  # AOTC_AUTH_CACHE_S: an API process trusts a checked key this long
    r = c.get("/ui/models")
    assert r.status_code == 303 and r.headers["location"].startswith("/ui/login?next=%2Fui%2Fmodels&why=")


def vendored() -> dict[str, str]:
    table = (VENDOR / "README.md").read_text()
    return dict(re.findall(r"^\| `([^`]+)` \|.*\| `([0-9a-f]{64})` \|$", table, re.M))


def test_vendored_files_match_their_recorded_hashes() -> None:
    files = vendored()
    assert set(files) == {"htmx.min.js", "sse.min.js", "uPlot.iife.min.js", "uPlot.min.css"}
    for name, digest in files.items():
        assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == digest, name


def test_static_files_cached_by_content(api_url: str) -> None:
    body = (VENDOR / "htmx.min.js").read_bytes()
    v = hashlib.sha256(body).hexdigest()[:12]
    r = httpx.get(f"{api_url}/ui/static/htmx.min.js?v={v}")
    assert r.status_code == 200 and r.content == body
    assert r.headers["cache-control"] == "public, max-age=31536000, immutable"
    assert r.headers["content-type"].startswith("text/javascript")
    assert httpx.get(f"{api_url}/ui/static/htmx.min.js?v=old").headers["cache-control"] == "no-cache"
    assert httpx.get(f"{api_url}/ui/static/../../api/app.py").status_code == 404


def test_the_form_is_bounded(api_url: str, keys: dict[str, str]) -> None:
    c = signed_in(api_url, keys["a"])
    r = c.post("/ui/logout", data={"csrf": csrf_of(c), "pad": "x" * 20_000}, headers={"Origin": api_url})
    assert r.status_code == 413 and "AOTC_UI_FORM_MAX_BYTES" in r.text


def test_signing_out_drops_the_cookie(api_url: str, keys: dict[str, str]) -> None:
    c = signed_in(api_url, keys["a"])
    r = c.post("/ui/logout", data={"csrf": csrf_of(c)}, headers={"Origin": api_url})
    assert r.status_code == 303
    assert c.get("/ui/models").status_code == 303


def test_the_farm_shows_an_admin_the_job_that_filled_a_disk_escaped_and_readyz_does_not(api_url: str, store) -> None:
    """A full disk's last job is in its own words, a child's output: the farm page (admin) shows it as text, and the
    keyless /readyz leaves it out."""
    wid = f"ui-disk-{time.time_ns()}"
    words = "the compile ran out of disk space <script>alert(1)</script> in /work/job-42"
    store.workers.heartbeat({"id": wid, "target": "cpu-zui-disk", "toolchain": {"torch": "x"}, "device_name": "none",
                             "started": time.time(), "healthy": False, "unhealthy_since": time.time(),
                             "unhealthy_reason": "disk full: /work has 1.0 MB free", "last_disk_full": words},
                            ttl_s=60)
    try:
        page = signed_in(api_url, ADMIN_KEY).get("/ui/farm")
        assert page.status_code == 200
        assert "<script>alert(1)</script>" not in page.text
        assert f"the last job that ran out of space: {words}" in unescape(page.text)
        ready = api.get(f"{api_url}/readyz", timeout=10).json()
        [mine] = [u for u in ready["unhealthy_workers"] if u["id"] == wid]
        assert mine["reason"] == "disk full: /work has 1.0 MB free" and "job-42" not in str(ready)
    finally:
        store.workers.remove(wid)
