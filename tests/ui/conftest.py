"""The console's tests: keys of two namespaces on the session's service, and one real Chromium (Debian's package,
driven by Playwright) shared by every browser test.

Playwright's own browser download cannot work on these machines: the tests launch /usr/bin/chromium, which `make`
installs as root (apt-get install chromium), as it installs bubblewrap.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from browsing import CHROMIUM, CHROMIUM_ARGS

from procs import api


def make_key(url: str, scope: str, namespace: str) -> str:
    r = api.post(f"{url}/v1/keys", json={"scope": scope, "namespace": namespace, "name": f"console test {scope}"})
    assert r.status_code == 201, r.text
    return str(r.json()["key"])


@pytest.fixture(scope="session")
def new_key(api_url: str) -> Callable[[str, str], str]:
    return lambda scope, namespace: make_key(api_url, scope, namespace)


@pytest.fixture(scope="session")
def keys(api_url: str) -> dict[str, str]:
    """Keys of team-a (compile and pull) and team-b (compile), made with the admin key."""
    return {"a": make_key(api_url, "compile", "ui-team-a"), "a_pull": make_key(api_url, "pull", "ui-team-a"),
            "b": make_key(api_url, "compile", "ui-team-b")}


@pytest.fixture(scope="session")
def shots_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots go: AOTC_SHOTS_DIR (docs/console, to refresh the docs' pictures), else a temp dir."""
    given = os.environ.get("AOTC_SHOTS_DIR")
    path = Path(given) if given else tmp_path_factory.mktemp("shots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Chromium for one test file. Not the session's: while sync_playwright is open, the thread's asyncio loop counts
    as running, and with two test processes (pytest-xdist) a later file of the same process that calls asyncio.run
    (tests/service/api/test_event_hub.py) failed with "asyncio.run() cannot be called from a running event loop"."""
    if not shutil.which(CHROMIUM) and not Path(CHROMIUM).exists():
        pytest.fail(f"the console's browser tests need Chromium at {CHROMIUM}: `make` installs it as root "
                    "(apt-get install chromium); elsewhere install Debian's chromium package")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()
