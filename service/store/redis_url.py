"""Redis URLs with a password: the one place that puts a password into a URL, reads it from a file, and masks it
for logs.

A password reaches a process in its URL (`redis://:PASSWORD@host:6379/0`, what the embedded Redis's `url` gives)
or in a file (AOTC_REDIS_PASSWORD_FILE, e.g. a Docker secret), which the settings of the API and the workers put
into a URL that has none. Everything downstream (service.store.Store, the API's async pool) takes the URL as is.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit


def read_password(path: Path, what: str | None = None) -> str:
    """The password in `path` (one line; a trailing newline is dropped). ValueError naming the file (as `what`,
    default "AOTC_REDIS_PASSWORD_FILE=PATH") when it cannot be read, is empty, or is not one printable line."""
    what = what or f"AOTC_REDIS_PASSWORD_FILE={path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{what}: cannot read the Redis password ({getattr(e, 'strerror', None) or e})") from None
    password = text.removesuffix("\n").removesuffix("\r")
    if not password:
        raise ValueError(f"{what}: the file is empty; it must hold the Redis password")
    if not password.isprintable():
        raise ValueError(f"{what}: the password must be one line of printable characters")
    return password


def has_password(url: str) -> bool:
    return urlsplit(url).password is not None


def with_password(url: str, password: str, username: str | None = None) -> str:
    """`url` with `password` (and `username`, else the URL's own) in its user part; any password it had is
    replaced. Works for redis://, rediss:// and unix:// URLs (redis-py reads `unix://:pw@/path/to.sock`)."""
    parts = urlsplit(url)
    user = username if username is not None else (parts.username or "")
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal keeps its brackets
        host = f"[{host}]"
    if parts.port is not None:
        host += f":{parts.port}"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def with_password_file(url: str, path: Path | str | None) -> str:
    """`url` as is when it has a password or no file is given; else with the password read from `path`."""
    if path is None or has_password(url):
        return url
    return with_password(url, read_password(Path(path)))


def masked(url: str) -> str:
    """`url` for a log line or a message: its password shown as ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.netloc.rsplit("@", 1)[0].split(":", 1)[0]
    return urlunsplit((parts.scheme, f"{user}:***@{netloc}", parts.path, parts.query, parts.fragment))
