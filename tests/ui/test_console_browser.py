"""The console in a real browser (Debian's Chromium, driven by Playwright) against the session's real service: a key
signs in, watches a real compile's timeline advance over SSE to `succeeded`, opens the artifact, its kernels, the
code view and the provenance; another namespace's key sees none of it; hostile strings from the upload (the model's
name, and a string argument of the graph that Inductor pastes into the generated C++) show as text, with no script
run, no dialog and no CSP violation.

One compile for the whole module: a small conv net whose forward asserts with a message of markup.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from html import escape
from pathlib import Path
from typing import Any

import pytest
import torch
from browsing import Watched

from modelzoo import export
from procs import api, wait_job

pytestmark = pytest.mark.slow
# Markup that the upload's grammars let through: no quote, backslash or backtick (a graph string argument), and
# printable text (a model name).
HOSTILE_MSG = "<img src=x onerror=alert(1)><script>alert(2)</script>"
HOSTILE_NAME = "<img src=x onerror=alert(3)> smallnet <b>bold</b>"


class HostileNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._assert_async(x.sum() > -1e9, HOSTILE_MSG)
        y = torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3))
        return torch.softmax(self.fc(y), dim=-1)


@pytest.fixture(scope="module")
def job(api_url: str, worker: dict, keys: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Team A uploads the hostile net and asks for a compile; the job is returned as soon as it is queued."""
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=1, max=8)
    path = export(HostileNet().eval(), (torch.randn(2, 3, 16, 16),), tmp_path_factory.mktemp("ui") / "net.pt2",
                  dynamic_shapes={"x": {0: batch}})
    auth = {"Authorization": f"Bearer {keys['a']}"}
    up = api.post(f"{api_url}/v1/models", params={"name": HOSTILE_NAME}, content=path.read_bytes(), headers=auth,
                  timeout=60)
    assert up.status_code == 201, up.text
    r = api.post(f"{api_url}/v1/compilations", headers=auth, timeout=30, json={
        "model_id": up.json()["id"], "shapes": {"x": [{"min": 1, "max": 4}, 3, 16, 16]}, "target": "cpu"})
    assert r.status_code == 202, r.text
    return {"model_id": up.json()["id"], **r.json()["job"]}


@pytest.fixture(scope="module")
def team_a(browser: Any, api_url: str, keys: dict[str, str]) -> Iterator[Watched]:
    w = Watched(browser, api_url)
    w.sign_in(keys["a"])
    yield w
    w.close()


def shot(page: Any, shots: Path, name: str) -> None:
    # Chromium's full_page capture stretches the page past the viewport without repainting out-of-process frames,
    # so the sandboxed code view came out blank: grow the viewport to the page instead, and put it back after.
    size = page.viewport_size
    height = page.evaluate("document.documentElement.scrollHeight")
    page.set_viewport_size({"width": size["width"], "height": max(size["height"], height)})
    page.wait_for_timeout(200)
    page.screenshot(path=str(shots / f"{name}.png"))
    page.set_viewport_size(size)


def test_timeline_goes_live_to_succeeded(team_a: Watched, job: dict, api_url: str, shots_dir: Path) -> None:
    page = team_a.page
    page.goto(f"{api_url}/ui/jobs/{job['id']}")
    page.evaluate("window.__loadedOnce = true")  # gone if the page reloads: the updates must come over SSE
    stages: list[str] = []
    deadline = time.monotonic() + 600
    shot_taken = False
    while time.monotonic() < deadline:
        live = page.locator("section.live")
        state, stage = live.get_attribute("data-state"), live.get_attribute("data-stage")
        if stage and (not stages or stages[-1] != stage):
            stages.append(stage)
        if stage in ("codegen", "package") and not shot_taken:
            shot(page, shots_dir, "job-running")
            shot_taken = True
        if state in ("succeeded", "failed", "cancelled"):
            break
        page.wait_for_timeout(150)
    assert state == "succeeded", (state, stages, api.get(f"{api_url}/v1/jobs/{job['id']}").json().get("error"))
    assert page.evaluate("window.__loadedOnce") is True, "the page reloaded instead of updating in place"
    # The timeline advanced in place through the compiler's stages, as the SSE events arrived.
    assert len(stages) >= 4 and stages[-1] == "succeeded", stages
    rows = page.locator("table.timeline tr.step").evaluate_all("(rs) => rs.map((r) => r.dataset.stage)")
    assert {"queued", "fetch", "capture", "fusion", "codegen", "check", "succeeded"} <= set(rows), rows
    shot(page, shots_dir, "job")
    assert not team_a.problems and not team_a.violations(), (team_a.problems, team_a.violations())


@pytest.fixture(scope="module")
def artifact(job: dict, api_url: str) -> str:
    done = wait_job(api_url, job["id"])
    assert done["state"] == "succeeded", done
    return str(done["artifact"])


def test_artifact_kernels_code_and_provenance(team_a: Watched, job: dict, artifact: str, api_url: str,
                                              shots_dir: Path) -> None:
    page = team_a.page
    page.goto(f"{api_url}/ui/jobs/{job['id']}")
    page.click("a[data-artifact]")
    page.wait_for_url(f"**/ui/artifacts/{artifact}")
    assert page.locator("#report > table.grid > tbody > tr").count() == 6  # capture .. package
    kernels = page.locator("table.kernels tbody tr")
    assert kernels.count() >= 2
    names = kernels.evaluate_all("(rs) => rs.map((r) => r.dataset.kernel)")
    assert all(n.startswith("cpp_fused_") for n in names), names
    assert page.locator("[data-plot=latency] canvas").count() == 1  # uPlot drew the check's latency boxes

    frame = page.frame(name="codeview")
    assert frame is not None
    frame.wait_for_load_state()
    assert 'extern "C"' in frame.inner_text("body")
    page.wait_for_timeout(300)
    shot(page, shots_dir, "artifact")
    # Opening a kernel from the table scrolls the sandboxed frame to its definition.
    page.locator("table.kernels tbody tr a").first.click()
    page.wait_for_timeout(500)
    assert frame.url.split("#")[1].startswith("L-")
    frame.wait_for_load_state()
    page.locator("#code").screenshot(path=str(shots_dir / "code-view.png"))
    page.locator("#check").screenshot(path=str(shots_dir / "check.png"))

    page.goto(f"{api_url}/ui/artifacts/{artifact}/provenance")
    assert page.locator("table.prov").first.locator("tbody tr").count() >= 3
    assert page.locator("text=aten.convolution.default").count() >= 1
    shot(page, shots_dir, "provenance")
    assert not team_a.problems and not team_a.violations(), (team_a.problems, team_a.violations())


def test_hostile_strings_show_as_text_and_run_nothing(team_a: Watched, job: dict, artifact: str, api_url: str,
                                                     shots_dir: Path) -> None:
    page = team_a.page
    # The model's name, on pages and in the jobs filter.
    for path in ("/ui/models", f"/ui/models/{job['model_id']}", "/ui/jobs"):
        page.goto(api_url + path)
        page.wait_for_timeout(300)
        assert page.locator("img").count() == 0 and page.locator("b:text('bold')").count() == 0, path
        assert HOSTILE_NAME in page.content().replace("&lt;", "<").replace("&gt;", ">"), path
    assert page.get_by_text(HOSTILE_NAME).count() >= 1
    shot(page, shots_dir, "jobs")
    # The graph's string argument, pasted by Inductor into the generated C++ and present in the FX graphs.
    files = api.get(f"{api_url}/v1/artifacts/{artifact}/source").json()["files"]
    holding = [f["path"] for f in files if HOSTILE_MSG in api.get(f"{api_url}{f['url']}").text]
    assert any(p.startswith("code/") for p in holding) and any(p.startswith("graphs/") for p in holding), holding
    for path in holding:
        code = team_a.new_page()
        r = code.goto(f"{api_url}/ui/artifacts/{artifact}/code/{path}")
        assert r is not None and r.status == 200
        assert "sandbox" in r.headers["content-security-policy"] and "script-src" not in r.headers[
            "content-security-policy"]
        assert escape(HOSTILE_MSG, quote=False) in code.content()
        assert HOSTILE_MSG in code.inner_text("body")  # shown as the text it is
        assert code.locator("img").count() == 0 and code.locator("script").count() == 0
        code.close()
    page.goto(f"{api_url}/ui/artifacts/{artifact}")
    page.wait_for_timeout(300)
    assert not team_a.problems and not team_a.violations(), (team_a.problems, team_a.violations())


def test_another_namespace_sees_none_of_it(browser: Any, job: dict, artifact: str, api_url: str,
                                           keys: dict[str, str]) -> None:
    b = Watched(browser, api_url)
    try:
        b.sign_in(keys["b"])
        page = b.page
        for path in (f"/ui/jobs/{job['id']}", f"/ui/artifacts/{artifact}", f"/ui/artifacts/{artifact}/provenance",
                     f"/ui/artifacts/{artifact}/code/code/kernel.cpp", f"/ui/models/{job['model_id']}",
                     f"/ui/jobs/{job['id']}/stream"):
            r = page.goto(api_url + path)
            assert r is not None and r.status == 404, path
        for path in ("/ui/jobs", "/ui/models", "/ui/artifacts"):
            page.goto(api_url + path)
            html = page.content()
            assert job["id"][:12] not in html and artifact[:12] not in html and job["model_id"][:12] not in html
            assert "smallnet" not in html, path
    finally:
        b.close()


def test_cancel_and_retry_buttons(team_a: Watched, job: dict, artifact: str, api_url: str, keys: dict[str, str],
                                  shots_dir: Path) -> None:
    """Cancel a job from its page, then retry it: POST /v1/compilations again, a new job."""
    auth = {"Authorization": f"Bearer {keys['a']}"}
    r = api.post(f"{api_url}/v1/compilations", headers=auth, timeout=30, json={
        "model_id": job["model_id"], "shapes": {"x": [5, 3, 16, 16]}, "target": "cpu", "priority": "batch"})
    assert r.status_code == 202, r.text
    victim = r.json()["job"]["id"]
    page = team_a.page
    page.goto(f"{api_url}/ui/jobs/{victim}")
    page.click("button[data-action=cancel]")
    page.wait_for_selector("section.live[data-state=cancelled]", timeout=60_000)
    shot(page, shots_dir, "job-cancelled")
    page.click("button[data-action=retry]")
    page.wait_for_url(lambda url: "/ui/jobs/" in url and victim not in url)
    again = page.url.rsplit("/", 1)[1]
    retried = api.get(f"{api_url}/v1/jobs/{again}", headers=auth).json()
    assert retried["key"] == api.get(f"{api_url}/v1/jobs/{victim}", headers=auth).json()["key"]
    assert api.delete(f"{api_url}/v1/jobs/{again}", headers=auth).status_code in (200, 202)  # spare the worker
    assert not team_a.problems and not team_a.violations(), (team_a.problems, team_a.violations())


def test_admin_sees_the_farm_and_keys(browser: Any, artifact: str, api_url: str, shots_dir: Path) -> None:
    from procs import ADMIN_KEY

    admin = Watched(browser, api_url)
    try:
        admin.sign_in(ADMIN_KEY)
        page = admin.page
        page.goto(f"{api_url}/ui/farm")
        assert page.locator("text=cpu-x86_64").count() >= 1
        assert page.locator("[data-plot=farm] canvas").count() == 1
        shot(page, shots_dir, "farm")
        page.goto(f"{api_url}/ui/admin")
        assert page.locator("td:text('ui-team-a')").count() >= 1
        shot(page, shots_dir, "keys")
        page.goto(f"{api_url}/ui/models")
        shot(page, shots_dir, "models")
        assert not admin.problems and not admin.violations(), (admin.problems, admin.violations())
    finally:
        admin.close()
