"""The queue under faults, with real processes: its own redis-server, API and workers, which the tests kill.

Workers here renew a 3 s lease every 0.5 s and reapers run every 0.5 s, so a lost worker is noticed within
seconds; jobs get 2 attempts. The workers have tests/worker/faultops on their PYTHONPATH, whose sitecustomize makes
the compile of a model whose input is named `segv` or `hang` segfault or hang in Inductor for real, inside the
sandboxed compile child (see faultops/aotc_faultops.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from modelzoo import MLP, export, seeded
from procs import Cluster as BaseCluster
from procs import api, stop
from service.store import Store

FAULTOPS = Path(__file__).resolve().parent / "faultops"
sys.path.insert(0, str(FAULTOPS))
from aotc_faultops import model as armed  # noqa: E402

pytestmark = pytest.mark.slow

LEASE_S = 3.0
# The segv/hang child reaches Inductor ~6 s after it starts on 2 loaded cores (import torch, load, then the capture,
# autograd and lowering stages' traces), and over 10 s when other compiles share the cores, so the timeout leaves
# room for that: a segfault must show as a crash, not as a timeout.
COMPILE_TIMEOUT_S = 20


class Cluster(BaseCluster):
    """A cluster whose workers load the fault ops, with short leases and timeouts."""

    def __init__(self, base: Path) -> None:
        super().__init__(
            base,
            env={"AOTC_MAX_UPLOAD_MB": "8", "AOTC_LEASE_S": str(LEASE_S), "AOTC_REAP_INTERVAL_S": "0.5",
                 "AOTC_JOB_MAX_ATTEMPTS": "2"},
            worker_env={"AOTC_HEARTBEAT_S": "0.5", "AOTC_POLL_MS": "500", "AOTC_WORKER_TTL_S": "3"},
            worker_path=[str(FAULTOPS)],
        )

    def submit(self, model_id: str, url: str | None = None, **extra: Any) -> dict[str, Any]:
        record = self.store.models.get(model_id)
        assert record is not None
        return super().submit(model_id, {record["inputs"][0]["name"]: [2, 4]}, url=url, **extra)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("faults"))
    yield c
    c.close()


@pytest.fixture(autouse=True)
def _stop_what_the_test_started(cluster: Cluster) -> Iterator[None]:
    """Workers and APIs a test starts stop with it, pass or fail, so none lives on to take the next test's jobs."""
    n = len(cluster.procs)
    yield
    for proc in cluster.procs[n:]:
        stop(proc)


def _model(tmp_path: Path, name: str, seed: int) -> Path:
    torch.manual_seed(seed)
    m = armed(name) if name in ("segv", "hang") else seeded(MLP, seed, d_in=4, hidden=8, d_out=4)
    return export(m.eval(), (torch.randn(2, 4),), tmp_path / f"{name}-{seed}.pt2")


def _compiling(job: dict[str, Any]) -> bool:
    """The job's compile child is past loading the model, i.e. in the compiler proper (whatever its stage names)."""
    return job["state"] == "running" and job["stage"] not in ("queued", "fetch", "load")


def _children(job_id: str) -> list[int]:
    """Compile/check children still alive for a job (their command line names the job's work folder)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "worker.child" in cmd and job_id in cmd:
            pids.append(int(d.name))
    return pids


def _events(store: Store, job_id: str) -> list[tuple[str, str]]:
    return [(ev["state"], ev["stage"]) for _, ev in store.jobs.events(job_id)]


def test_segfault_and_hang_fail_their_jobs_with_the_reason_and_the_worker_lives_on(cluster, tmp_path):
    proc, wid = cluster.start_worker(AOTC_COMPILE_TIMEOUT_S=str(COMPILE_TIMEOUT_S))

    crash = cluster.submit(cluster.upload(_model(tmp_path, "segv", 1)))
    job = cluster.wait_end(crash["id"])
    err = job["error"]
    assert job["state"] == "failed" and job["attempts"] == 2, err
    assert err["type"] == "Crashed" and err["signal"] == 11
    assert err["message"] == ("compile crashed: the child process died of SIGSEGV (signal 11) "
                              "(attempt 2 of 2; no attempts left)")
    assert "Segmentation fault" in err["excerpt"] and "aotc_faultops.py" in err["excerpt"]  # faulthandler's stack
    assert [(f["attempt"], f["type"], f["worker"]) for f in err["failures"]] == [(1, "Crashed", wid),
                                                                               (2, "Crashed", wid)]
    assert crash["id"] in [j["id"] for j in api.get(f"{cluster.url}/v1/jobs/deadletter").json()["jobs"]]

    # The worker is alive and takes the next job: one that hangs in the compiler, until the timeout kills it.
    assert proc.poll() is None and wid in [w["id"] for w in cluster.store.workers.live()]
    hang = cluster.submit(cluster.upload(_model(tmp_path, "hang", 2)))
    assert cluster.wait_for(hang["id"], lambda j: j["state"] == "running")["worker"] == wid
    job = cluster.wait_end(hang["id"])
    assert job["state"] == "failed" and job["attempts"] == 2
    assert job["error"]["type"] == "Timeout" and job["error"]["stage"] == "compile"
    assert job["error"]["message"] == (f"compile timed out after {COMPILE_TIMEOUT_S} s and was killed "
                                       "(attempt 2 of 2; no attempts left)")
    assert _children(hang["id"]) == []
    assert proc.poll() is None
    stop(proc)


def _kinds(job_id: str) -> set[str]:
    """The kinds (compile, check) of the job's children alive now."""
    out = set()
    for pid in _children(job_id):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"worker.child" in argv and len(argv) > argv.index(b"worker.child") + 2:
            out.add(argv[argv.index(b"worker.child") + 2].decode())
    return out


def test_an_early_check_dies_with_its_compile_waits_for_its_package_or_gives_way_to_a_fresh_check(
        cluster, tmp_path):
    """AOTC_CHECK_EARLY=on (the default on CUDA devices only): the check child starts beside the compile and waits
    for the package. A compile that crashes takes it down with it; a check that comes checks the package, its
    stage shown only once the package is there; an early check that fails before its package gives way to a
    fresh check child, which the record says."""
    proc, wid = cluster.start_worker(AOTC_CHECK_EARLY="on")

    crash = cluster.submit(cluster.upload(_model(tmp_path, "segv", 3)))
    deadline = time.monotonic() + 120
    while _kinds(crash["id"]) != {"compile", "check"}:  # both children, side by side
        assert time.monotonic() < deadline and cluster.job(crash["id"])["state"] in ("queued", "running")
        time.sleep(0.05)
    job = cluster.wait_end(crash["id"])
    assert job["state"] == "failed" and job["error"]["type"] == "Crashed" and job["error"]["signal"] == 11, job
    assert _children(crash["id"]) == [] and proc.poll() is None

    good = cluster.submit(cluster.upload(_model(tmp_path, "good", 4)))
    assert cluster.wait_end(good["id"])["state"] == "succeeded"
    meta = api.get(f"{cluster.url}/v1/artifacts/{cluster.job(good['id'])['artifact']}/meta", timeout=30).json()
    early, phases = meta["check"]["early"], meta["check"]["phases"]
    assert early["prepared_s"] > 0 and early["waited_s"] > 0 and early["idle_s"] >= early["waited_s"], early
    assert {"program", "eager", "eager_timed", "load", "plain"} <= set(phases), phases  # eager timed after the wait
    # The check's time is counted from its package on: the prepared part and the wait are not in it.
    assert meta["timings"]["check"] < meta["timings"]["compile_total"]
    stages = [stage for _, stage in _events(cluster.store, good["id"])]
    assert "check" in stages and "package" in stages[:stages.index("check")], stages

    fell = cluster.submit(cluster.upload(export(armed("early").eval(), (torch.randn(2, 4),), tmp_path / "e.pt2")),
                          )
    assert cluster.wait_end(fell["id"])["state"] == "succeeded"
    meta = api.get(f"{cluster.url}/v1/artifacts/{cluster.job(fell['id'])['artifact']}/meta", timeout=30).json()
    assert meta["check"]["early"]["fell_back"].startswith("the early check ended before its package came: ")
    assert "CUDA out of memory (faultops" in meta["check"]["early"]["fell_back"]
    assert _children(fell["id"]) == [] and proc.poll() is None
    stop(proc)


def test_sigterm_hands_the_job_back_unspent_and_cancel_stops_queued_and_running_jobs(cluster, tmp_path):
    w1, w1_id = cluster.start_worker()
    hang = cluster.submit(cluster.upload(_model(tmp_path, "hang", 3)))
    cluster.wait_for(hang["id"], _compiling)

    # A queued job is cancelled at once, and its queue entry is gone.
    queued = cluster.submit(cluster.upload(_model(tmp_path, "hang", 4)))
    assert cluster.job(queued["id"])["state"] == "queued"
    t0 = time.monotonic()
    r = api.delete(f"{cluster.url}/v1/jobs/{queued['id']}")
    queued_cancel_ms = (time.monotonic() - t0) * 1000
    assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
    assert api.delete(f"{cluster.url}/v1/jobs/{queued['id']}").status_code == 409

    # SIGTERM mid-compile: the worker kills the compile, hands the job back without spending the attempt, exits.
    t0 = time.monotonic()
    w1.send_signal(signal.SIGTERM)
    assert w1.wait(15) == 0
    sigterm_s = time.monotonic() - t0
    job = cluster.job(hang["id"])
    assert (job["state"], job["attempts"]) == ("queued", 0)
    assert _children(hang["id"]) == []

    # Another worker takes it as attempt 1; cancelling the running job kills its compile within seconds.
    w2, w2_id = cluster.start_worker()
    cluster.wait_for(hang["id"], lambda j: _compiling(j) and j.get("worker") == w2_id)
    t0 = time.monotonic()
    r = api.delete(f"{cluster.url}/v1/jobs/{hang['id']}")
    assert r.status_code == 202 and r.json()["cancel_requested"] is True, r.text
    job = cluster.wait_end(hang["id"], timeout=15)
    running_cancel_s = time.monotonic() - t0
    assert job["state"] == "cancelled" and job["attempts"] == 1
    assert job["error"]["message"] == "cancelled while running (compile)"
    assert _children(hang["id"]) == []
    assert running_cancel_s < 5
    assert w2.poll() is None

    states = [s for s, _ in _events(cluster.store, hang["id"])]
    assert states[0] == "queued" and states[-1] == "cancelled"
    assert states.count("running") >= 2 and "queued" in states[1:]  # ran, handed back, ran again
    print(f"\ncancel queued: {queued_cancel_ms:.0f} ms; SIGTERM to exit with hand-back: {sigterm_s:.2f} s; "
          f"cancel running: {running_cancel_s:.2f} s")
    stop(w2)


def test_kill_9_mid_compile_another_worker_takes_over_and_the_artifact_is_stored_once(cluster, tmp_path):
    a, a_id = cluster.start_worker()
    b, b_id = cluster.start_worker()
    procs = {a_id: a, b_id: b}
    compiles0 = cluster.store.caches.compiles()
    job = cluster.submit(cluster.upload(_model(tmp_path, "mlp", 5)))
    running = cluster.wait_for(job["id"], _compiling)
    victim, survivor = running["worker"], ({a_id, b_id} - {running["worker"]}).pop()
    assert _children(job["id"])

    procs[victim].kill()  # SIGKILL: no hand-back, no cleanup
    t_kill = time.monotonic()
    procs[victim].wait()
    retaken = cluster.wait_for(job["id"], lambda j: j["state"] == "running" and j.get("worker") == survivor, 60)
    reclaim_s = time.monotonic() - t_kill
    assert retaken["attempt"] == 2
    time.sleep(0.5)
    assert [p for p in _children(job["id"]) if f"{job['id']}-1" in Path(f"/proc/{p}/cmdline").read_text()] == []

    done = cluster.wait_end(job["id"])
    assert done["state"] == "succeeded", done.get("error")
    assert done["attempts"] == 2 and done["worker"] == survivor
    assert [(f["type"], f["worker"]) for f in done["failures"]] == [("WorkerLost", victim)]
    assert done["failures"][0]["message"].startswith(f"worker lost: {victim} stopped renewing its lease during ")
    assert cluster.store.caches.compiles() == compiles0 + 2  # ran at most twice
    meta = api.get(f"{cluster.url}/v1/artifacts/{done['artifact']}/meta").json()
    assert meta["job_id"] == job["id"] and meta["worker"]["id"] == survivor
    assert cluster.store.r.zscore("aotc:artifacts:index", done["artifact"]) is not None
    assert len([k for k in cluster.store.r.zrange("aotc:artifacts:index", 0, -1) if k == done["artifact"]]) == 1
    assert LEASE_S - 0.6 <= reclaim_s < LEASE_S + 5  # the last renewal came up to a heartbeat before the kill
    print(f"\nkill -9 to re-claim by another worker: {reclaim_s:.2f} s (lease {LEASE_S:g} s)")
    stop(procs[survivor])


def test_twenty_identical_requests_on_two_apis_make_one_compile_and_all_see_it(cluster, tmp_path):
    from client import Client

    w, _ = cluster.start_worker()
    url2, _ = cluster.start_api()
    model_id = cluster.upload(_model(tmp_path, "mlp", 6))
    compiles0 = cluster.store.caches.compiles()
    body = {"model_id": model_id, "shapes": {"x": [2, 4]}}

    def one(i: int) -> tuple[str, str, str]:
        url = (cluster.url, url2)[i % 2]
        answer = api.post(f"{url}/v1/compilations", json=body, timeout=30).json()
        with Client(url, timeout=30) as c:  # waits on the job's server-sent events
            seen: list[str] = []
            art = c.wait(answer["job"]["id"], progress=lambda j: seen.append(j["state"]), timeout=240)
        assert seen[-1] == "succeeded" and "running" in seen
        return answer["status"], answer["job"]["id"], art.key

    with cf.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    assert sorted(s for s, _, _ in results) == ["joined"] * 19 + ["queued"]
    assert len({j for _, j, _ in results}) == 1 and len({k for _, _, k in results}) == 1
    assert cluster.store.caches.compiles() == compiles0 + 1
    stop(w)


def test_redis_restart_loses_no_queued_job_and_the_api_says_503_meanwhile(cluster, tmp_path):
    w, w_id = cluster.start_worker()
    # The worker is busy with a compile that hangs, so the next two jobs wait in the queue through the restart.
    busy = cluster.submit(cluster.upload(_model(tmp_path, "hang", 7)))
    cluster.wait_for(busy["id"], _compiling)
    batch = cluster.submit(cluster.upload(_model(tmp_path, "mlp", 8)), priority="batch")
    inter = cluster.submit(cluster.upload(_model(tmp_path, "mlp", 9)))
    assert cluster.job(batch["id"])["state"] == cluster.job(inter["id"])["state"] == "queued"

    cluster.redis.stop()  # SIGTERM: redis-server flushes its append-only file
    t0 = time.monotonic()
    r = api.get(f"{cluster.url}/v1/jobs", timeout=30)
    down_answer_s = time.monotonic() - t0
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["code"] == "redis_unavailable"
    assert "cannot reach its Redis" in r.json()["error"]["message"]
    time.sleep(1.0)
    cluster.redis.start()  # same port, same data folder
    t0 = time.monotonic()
    while api.get(f"{cluster.url}/v1/jobs", timeout=30).status_code != 200:
        assert time.monotonic() - t0 < 10
        time.sleep(0.1)
    recovered_s = time.monotonic() - t0

    # The running job survived too (its lease is renewed again): cancel it, then the queue drains.
    assert cluster.job(busy["id"])["state"] == "running"
    assert api.delete(f"{cluster.url}/v1/jobs/{busy['id']}").status_code == 202
    assert cluster.wait_end(busy["id"], timeout=30)["state"] == "cancelled"
    done = [cluster.wait_end(j["id"]) for j in (inter, batch)]
    assert [j["state"] for j in done] == ["succeeded"] * 2, [j.get("error") for j in done]
    assert [j["attempts"] for j in done] == [1, 1] and {j["worker"] for j in done} == {w_id}
    assert done[0]["started"] < done[1]["started"]  # the interactive job went before the batch one
    assert w.poll() is None
    print(f"\nAPI answer while Redis was down: 503 in {down_answer_s:.2f} s; 200 again {recovered_s:.2f} s "
          f"after redis-server restarted")
    stop(w)
