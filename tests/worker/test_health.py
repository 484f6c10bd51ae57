"""A worker that knows when it is broken, with real processes: its own redis-server, the API over HTTP, workers.

The broken worker's compile children cannot import torch: a `sitecustomize` on that worker's PYTHONPATH only (the
way tests/worker/faultops arms faults inside the children) makes `import torch` print a loader error and abort (or
raise ImportError, when the file says "raise") in every `python -m worker.child` while a BROKEN file lies beside
it; the worker process itself imports torch fine. Removing the file mends the environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from modelzoo import MLP, export, seeded
from procs import ROOT, Cluster, api, stop
from worker.health import Health
from worker.isolation import setup
from worker.sandbox import Outcome
from worker.settings import WorkerSettings

pytestmark = pytest.mark.slow

LOADER_ERROR = "libtorch_cpu.so: cannot open shared object file: No such file or directory (planted by test_health)"
DEVICE_ERROR = "CUDA error: unknown error (planted by test_health: the device fell off the bus mid-check)"

SITECUSTOMIZE = f'''
"""Breaks `import torch` in aotc's compile and check children (never in the worker) while BROKEN is beside it."""
import os
import sys


def _in_child():
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return b"worker.child" in f.read().split(b"\\0")
    except OSError:
        return False


class _BrokenTorch:
    def find_spec(self, name, path=None, target=None):
        switch = os.path.join(os.path.dirname(__file__), "BROKEN")
        if name == "torch" and os.path.exists(switch):
            sys.stderr.write({LOADER_ERROR!r} + "\\n")
            sys.stderr.flush()
            with open(switch) as f:
                if f.read() == "raise":
                    raise ImportError({LOADER_ERROR!r})
            os.abort()
        return None


class _LoseDevice:
    """While LOSE is beside this file: a check child's check, once it runs (after the handshake), breaks `import
    torch` for every child after it (BROKEN, "raise") and raises the error CUDA gives when the device fell off the
    bus mid-check."""

    def find_spec(self, name, path=None, target=None):
        here = os.path.dirname(__file__)
        if name != "compiler.check" or not os.path.exists(os.path.join(here, "LOSE")):
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)

            def lost(*args, **kwargs):
                with open(os.path.join(here, "BROKEN"), "w") as f:
                    f.write("raise")
                raise RuntimeError({DEVICE_ERROR!r})

            module.check_artifact = lost

        spec.loader.exec_module = exec_module
        return spec


if _in_child():
    sys.meta_path.insert(0, _BrokenTorch())
    sys.meta_path.insert(0, _LoseDevice())
'''

MAX_EARLY_CRASHES = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("health"), env={"AOTC_JOB_MAX_ATTEMPTS": "2"})
    yield c
    c.close()


def _broken_env(tmp_path: Path, how: str = "abort") -> Path:
    """The sitecustomize's folder: BROKEN holds `how`; "lose" writes LOSE instead (the check breaks the device)."""
    d = tmp_path / "broken-env"
    d.mkdir()
    (d / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (d / ("LOSE" if how == "lose" else "BROKEN")).write_text(how)
    return d


def _submit(cluster: Cluster, tmp_path: Path, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = export(seeded(MLP, seed, d_in=4, hidden=8, d_out=4).eval(), (torch.randn(2, 4),),
                   tmp_path / f"mlp-{seed}.pt2")
    up = api.post(f"{cluster.url}/v1/models", content=model.read_bytes(), timeout=60)
    assert up.status_code in (200, 201), up.text
    r = api.post(f"{cluster.url}/v1/compilations", json={"model_id": up.json()["id"], "shapes": {"x": [2, 4]}},
                 timeout=30)
    assert r.status_code == 202, r.text
    return r.json()["job"]


def test_a_worker_whose_children_cannot_import_torch_stops_claiming_and_its_jobs_keep_their_attempts(
        cluster, tmp_path):
    broken = _broken_env(tmp_path)
    proc, wid = cluster.start_worker(PYTHONPATH=os.pathsep.join([str(ROOT), str(broken)]),
                                     AOTC_WORKER_MAX_EARLY_CRASHES=str(MAX_EARLY_CRASHES),
                                     AOTC_WORKER_REPROBE_S="4")
    try:
        assert cluster.workers()[wid]["healthy"] is True
        job = _submit(cluster, tmp_path, 0)

        # After MAX_EARLY_CRASHES children in a row died importing torch, the worker says so over HTTP, with the
        # cause: how the child died and its stderr, where the loader error and the path of the code that aborted are.
        w = cluster.wait_worker(wid, healthy=False)
        reason = w["unhealthy_reason"]
        assert reason.startswith(f"{MAX_EARLY_CRASHES} children in a row failed before their work started "
                                 f"(AOTC_WORKER_MAX_EARLY_CRASHES={MAX_EARLY_CRASHES}), so this worker claims no jobs;")
        assert ("the compile child failed before the compile started, so this worker's environment is broken, not "
                "the model: compile crashed: the child process died of SIGABRT (signal 6)") in reason
        assert LOADER_ERROR in reason and str(broken / "sitecustomize.py") in reason  # stderr: cause and path
        assert w["unhealthy_since"] <= time.time() and proc.poll() is None

        ready = api.get(f"{cluster.url}/readyz", timeout=10)
        assert ready.status_code == 200, ready.text  # the API itself still serves: degraded, not down
        body = ready.json()
        assert body["degraded"] is True and body["targets"] == []  # no healthy worker serves a target
        assert [(u["id"], u["reason"]) for u in body["unhealthy_workers"]] == [(wid, reason)]

        shown = subprocess.run([sys.executable, "-m", "client.cli", "--url", cluster.url, "workers"],
                               capture_output=True, text=True, timeout=60, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert shown.returncode == 0, shown.stderr
        assert "UNHEALTHY" in shown.stdout and LOADER_ERROR in shown.stdout

        # The job went back each time without spending an attempt, and the unhealthy worker claims it no more.
        queued = cluster.job(job["id"])
        assert (queued["state"], queued["attempts"], queued.get("failures")) == ("queued", 0, None)
        handed_back = [ev["reason"] for _, ev in cluster.store.jobs.events(job["id"]) if ev.get("reason")]
        assert len(handed_back) == MAX_EARLY_CRASHES
        assert all(r.startswith(f"handed back by {wid} (the compile child failed before the compile started")
                   for r in handed_back)
        heartbeat = w["heartbeat"]
        time.sleep(6)  # over a heartbeat: it heartbeats on (no reaper takes it for lost) and claims nothing
        assert cluster.workers()[wid]["heartbeat"] > heartbeat
        assert cluster.job(job["id"])["state"] == "queued" and cluster.job(job["id"])["attempts"] == 0

        # A healthy worker started afterwards serves the job with its first attempt.
        _, healthy_id = cluster.start_worker()
        done = cluster.wait_end(job["id"])
        assert done["state"] == "succeeded", done.get("error")
        assert (done["attempts"], done["worker"], done.get("failures")) == (1, healthy_id, None)
        assert api.get(f"{cluster.url}/readyz", timeout=10).json()["unhealthy_workers"][0]["id"] == wid

        # Mend the environment: the unhealthy worker's next probe child gets through, and it serves again.
        (broken / "BROKEN").unlink()
        back = cluster.wait_worker(wid, healthy=True, timeout=90)
        assert back["unhealthy_reason"] is None and back["early_crashes"] == 0
        ready = api.get(f"{cluster.url}/readyz", timeout=10).json()
        assert ready["degraded"] is False and ready["targets"] == sorted(back["targets"])  # every level it serves
    finally:
        stop(proc)


def test_a_child_that_raises_importing_torch_counts_a_cancelled_one_does_not_and_one_that_gets_through_resets(
        tmp_path, monkeypatch):
    """The same judgement in-process, on real children (unconfined here): a child that reports an ImportError before
    its handshake is a BrokenEnvironment whose message names the error; a cancel before it counts for nothing;
    MAX_EARLY_CRASHES in a row make the worker unhealthy; one child that gets through makes it healthy again."""
    broken = _broken_env(tmp_path, "raise")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(broken)]))
    sandbox = setup(WorkerSettings(sandbox="off", work_dir=tmp_path / "work", data_dir=tmp_path / "data"), "cpu")
    health = Health(MAX_EARLY_CRASHES)

    def probe(n: int, **kw: Any) -> Outcome:
        return health.run_child({"kind": "probe", "device": "cpu"}, tmp_path / f"probe-{n}", sandbox=sandbox,
                                device="cpu", timeout_s=120, **kw)

    out = probe(1)
    assert out.failure is not None and out.failure.type == "BrokenEnvironment" and out.failure.retryable
    assert out.failure.message == ("the probe child failed before the probe started, so this worker's environment "
                                   f"is broken, not the model: ImportError: {LOADER_ERROR}")
    assert "Traceback" in out.failure.excerpt and "sitecustomize.py" in out.failure.excerpt
    assert (health.healthy, health.early_crashes) == (True, 1)

    cancelled = probe(2, should_cancel=lambda: True)
    assert cancelled.cancelled and cancelled.failure is not None and cancelled.failure.type == "Cancelled"
    assert (health.healthy, health.early_crashes) == (True, 1)

    probe(3)
    assert not health.healthy and health.early_crashes == MAX_EARLY_CRASHES and health.since is not None
    assert health.reason is not None and f"ImportError: {LOADER_ERROR}" in health.reason
    assert health.describe() == {"healthy": False, "unhealthy_reason": health.reason, "unhealthy_since": health.since,
                                 "early_crashes": MAX_EARLY_CRASHES, "last_disk_full": None}

    (broken / "BROKEN").unlink()
    assert health.probe(tmp_path / "probe-4", sandbox=sandbox, device="cpu", timeout_s=120)
    assert health.describe() == {"healthy": True, "unhealthy_reason": None, "unhealthy_since": None,
                                 "early_crashes": 0, "last_disk_full": None}


def _check_task(tmp_path: Path) -> dict[str, Any]:
    """A check child's task: its check never reads the paths (the planted device loss comes first)."""
    return {"kind": "check", "device": "cpu", "model_path": str(tmp_path / "model.pt2"),
            "package_path": str(tmp_path / "package.pt2"), "spec": [], "options": {}}


def test_a_device_that_stops_working_under_a_check_is_its_failure_not_the_models(tmp_path, monkeypatch):
    """A check child that fails after its handshake, on a device that then fails a fresh child (a GPU that fell off
    the bus mid-check), is DeviceLost: the probe's error and the check's own in the message, retryable, and the
    worker unhealthy at once until a probe gets through. A device that still works leaves the failure standing,
    and AOTC_WORKER_DEVICE_RECHECK=auto does not try a CPU again. Real children, unconfined."""
    broken = _broken_env(tmp_path, "lose")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(broken)]))
    sandbox = setup(WorkerSettings(sandbox="off", work_dir=tmp_path / "work", data_dir=tmp_path / "data"), "cpu")
    run = {"sandbox": sandbox, "device": "cpu", "timeout_s": 120}

    # auto: a CPU is not tried again, so the check's failure stands, though the device is broken now.
    auto = Health(MAX_EARLY_CRASHES, device_recheck="auto")
    out = auto.run_child(_check_task(tmp_path), tmp_path / "auto", **run)
    assert out.failure is not None and (out.failure.type, out.failure.message) == ("RuntimeError", DEVICE_ERROR)
    assert auto.healthy and not (tmp_path / "auto" / "check-device-probe").exists()
    (broken / "BROKEN").unlink()

    # always: the probe after it fails importing torch, so the device, not the model, failed the check.
    health = Health(MAX_EARLY_CRASHES, device_recheck="always")
    out = health.run_child(_check_task(tmp_path), tmp_path / "lost", **run)
    assert out.failure is not None and out.failure.type == "DeviceLost" and out.failure.retryable
    assert out.failure.message == (
        "the check failed and then a fresh child could not use cpu, so the device stopped working under the job, "
        f"not through the job's fault: ImportError: {LOADER_ERROR}; the check's own error: RuntimeError: "
        f"{DEVICE_ERROR}")
    assert out.failure.to_json()["device"] == "cpu" and out.failure.stage == "check"
    assert not health.healthy and health.since is not None and health.early_crashes == 0
    assert health.reason == (f"cpu stopped working under a check: a probe child right after it failed (ImportError: "
                             f"{LOADER_ERROR}), so this worker claims no jobs until a reprobe gets through "
                             "(AOTC_WORKER_REPROBE_S)")

    # The device works again: the reprobe gets through and the worker serves. Then a check that fails on a device
    # that still works (its model is not there) keeps its own failure, after the probe.
    (broken / "BROKEN").unlink()
    assert health.probe(tmp_path / "reprobe", **run) and health.healthy
    (broken / "LOSE").unlink()
    out = health.run_child(_check_task(tmp_path), tmp_path / "stands", **run)
    assert out.failure is not None and out.failure.type != "DeviceLost", out.failure
    assert "model.pt2" in out.failure.message  # the check's own error: the model it could not read
    assert (tmp_path / "stands" / "check-device-probe").exists() and health.healthy


def test_a_job_whose_device_stopped_working_goes_back_once_fails_the_second_time_and_the_worker_serves_again(
        tmp_path):
    """The worker's side over HTTP. The check breaks the device (LOSE): the job goes back with its attempt refunded
    and the refund counted, and the worker says why it is unhealthy. The device answers again (BROKEN gone), the
    reprobe gets through, the worker takes the job again, and its check breaks the device again: a device lost
    twice under one job is the job's doing, so it fails, final, rather than take more devices down. Mended (LOSE
    gone too), the worker serves the next job. Unconfined: the planted fault writes beside its sitecustomize,
    which the sandbox keeps read-only."""
    broken = _broken_env(tmp_path, "lose")
    cluster = Cluster(tmp_path / "cluster")  # of its own: the module's cluster keeps a healthy worker running
    proc, wid = cluster.start_worker(PYTHONPATH=os.pathsep.join([str(ROOT), str(broken)]), AOTC_SANDBOX="off",
                                     AOTC_WORKER_DEVICE_RECHECK="always", AOTC_WORKER_REPROBE_S="3")
    lost = (f"the check failed and then a fresh child could not use cpu, so the device stopped working under the job, "
            f"not through the job's fault: ImportError: {LOADER_ERROR}; the check's own error: RuntimeError: "
            f"{DEVICE_ERROR}")
    try:
        job = _submit(cluster, tmp_path, 1)
        w = cluster.wait_worker(wid, healthy=False, timeout=300)
        assert w["unhealthy_reason"].startswith(f"cpu stopped working under a check: a probe child right after it "
                                                f"failed (ImportError: {LOADER_ERROR})")
        deadline = time.monotonic() + 30
        while (queued := cluster.job(job["id"]))["state"] != "queued" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (queued["state"], queued["attempts"], queued.get("failures")) == ("queued", 0, None)
        assert int(queued["device_lost_refunds"]) == 1  # a field of the Redis hash
        reasons = [ev["reason"] for _, ev in cluster.store.jobs.events(job["id"]) if ev.get("reason")]
        assert reasons == [f"handed back by {wid} ({lost})"]

        (broken / "BROKEN").unlink()  # the device answers; the job still breaks it
        failed = cluster.wait_end(job["id"], timeout=300)
        assert (failed["state"], failed["attempts"], failed["worker"]) == ("failed", 1, wid)
        assert failed["error"]["type"] == "DeviceLost" and failed["error"]["retryable"] is False
        assert failed["error"]["message"] == ("the device stopped working under this job on 2 attempts, so it is not "
                                              "tried again (each took a device out of service); the last: " + lost)

        (broken / "LOSE").unlink()
        (broken / "BROKEN").unlink()
        cluster.wait_worker(wid, healthy=True, timeout=90)
        done = cluster.wait_end(_submit(cluster, tmp_path, 2)["id"], timeout=300)
        assert done["state"] == "succeeded", done.get("error")
        assert (done["attempts"], done["worker"], done.get("failures")) == (1, wid, None)
    finally:
        stop(proc)
        cluster.close()
