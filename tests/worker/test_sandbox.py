"""The sandbox around compile and check children (worker/isolation.py, shim.py, limits.py), for real: its own
redis-server, API and workers, real compiles, and code an attacker got to run inside both children.

That code comes from tests/worker/faultops (on the workers' PYTHONPATH; see aotc_faultops.py): in the compile and
the check child of a model whose input is named `probe`, it connects to Redis's, the API's and a test listener's
ports, writes files outside its dir, reads files only the worker may read, and reports its uid and the rest to the
child's log. Everything is asserted from the outside: the files do not exist, the listener saw nobody, the secrets
appear in no record and no log, and the uid is not 0. The cluster lives outside /tmp (the child's /tmp is its own),
so the secrets are hidden by what the sandbox hides on purpose (the data and work dirs under the bound job dir's
path) or not mounted at all (a root 0600 file beside them); the probe's plan beside them is bound in with
AOTC_SANDBOX_MOUNT.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch

from modelzoo import MLP, export, seeded
from procs import HEADERS_DIR, ROOT, Cluster, api, stop
from service.store import keys
from worker.limits import Counted, Limits, breach
from worker.sandbox import read_untrusted, take

FAULTOPS = Path(__file__).resolve().parent / "faultops"
sys.path.insert(0, str(FAULTOPS))
from aotc_faultops import POISON  # noqa: E402
from aotc_faultops import model as armed  # noqa: E402

ALLOWED_ENV = {"PATH", "LANG", "HOME", "USER", "LOGNAME", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "TMPDIR",
               "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE",
               "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "CUDA_VISIBLE_DEVICES", "LD_PRELOAD", "OMP_NUM_THREADS",
               "LC_CTYPE", "PWD"}  # LC_CTYPE: Python's UTF-8 coercion may add it; PWD: bwrap --chdir sets it


@pytest.fixture(scope="module")
def outside() -> Iterator[Path]:
    """A dir outside /tmp that the sandbox does not hide: it holds the cluster (data dir, work dir), the probe's
    plan and a secret beside the cluster."""
    base = Path(tempfile.mkdtemp(prefix="aotc-sandbox-test-", dir="/var/tmp"))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(outside: Path) -> Iterator[Cluster]:
    base = outside / "service"
    base.mkdir()
    c = Cluster(base, env={"AOTC_MAX_UPLOAD_MB": "32"}, worker_path=[str(FAULTOPS)])
    yield c
    c.close()


@pytest.fixture(autouse=True)
def _stop_what_the_test_started(request: pytest.FixtureRequest) -> Iterator[None]:
    if "cluster" not in request.fixturenames:
        yield
        return
    cluster = request.getfixturevalue("cluster")
    n = len(cluster.procs)
    yield
    for proc in cluster.procs[n:]:
        stop(proc)


def _record(cluster: Cluster, worker_id: str) -> dict[str, Any]:
    workers = api.get(f"{cluster.url}/v1/workers", timeout=30).json()["workers"]
    return next(w for w in workers if w["id"] == worker_id)


def _reports(log: Path, where: str) -> list[dict[str, Any]]:
    marker = f"AOTC-PROBE {where} "
    return [json.loads(line[line.index(marker) + len(marker):]) for line in log.read_text().splitlines()
            if marker in line]


def _worker_log(cluster: Cluster, proc: subprocess.Popen[bytes]) -> str:
    return (cluster.base / f"worker-{cluster.procs.index(proc)}.log").read_text(errors="replace")


class Listener:
    """A TCP listener on loopback that counts who connects."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.accepted: list[Any] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return
            self.accepted.append(addr)
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("early", ["off", "on"])  # on: the check child starts beside the compile (on CUDA, the default)
def test_code_in_the_compile_and_check_children_reaches_nothing_of_the_workers(cluster, outside, tmp_path, early):
    token = secrets.token_hex(12)
    secret_files = {
        "data dir": cluster.base / "secret.txt",  # AOTC_DATA_DIR, beside the embedded Redis's data: hidden
        "work dir": cluster.base / "work" / "secret.txt",  # AOTC_WORK_DIR: hidden
        "beside": outside / "secret-beside.txt",  # root's 0600 file, not mounted (the plan beside it is)
    }
    contents = {}
    for where, path in secret_files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        contents[where] = f"SECRET-{where.replace(' ', '-')}-{token}"
        path.write_text(contents[where])
        os.chmod(path, 0o600)
    listener = Listener()
    api_port = urlparse(cluster.url).port
    markers = [outside / f"marker-{token}", ROOT / "tests" / "worker" / f"marker-{token}",
               Path("/var/tmp") / f"aotc-marker-{token}", cluster.base / f"marker-{token}", tmp_path / "marker"]
    plan = {"ports": [cluster.redis.port, api_port, listener.port],
            "paths": [f"w:{m}" for m in markers] + [f"r:{p}" for p in secret_files.values()]
            + ["r:/etc/shadow", "r:/proc/1/environ"]}
    (outside / "probe-plan.json").write_text(json.dumps(plan))
    os.chmod(outside / "probe-plan.json", 0o644)
    try:
        proc, wid = cluster.start_worker(AOTC_KEEP_WORK="1", AOTC_CHECK_EARLY=early,
                                         AOTC_SANDBOX_MOUNT=json.dumps([str(outside / "probe-plan.json")]))
        record = _record(cluster, wid)
        # The finished sets: a worker of the other pytest-xdist process may be swapping one in meanwhile, through
        # .new-<pid> and .old-<pid> dirs (worker/headers.py), which are gone a moment later.
        headers = [p for p in HEADERS_DIR.glob("*/*.h*") if not p.parent.name.startswith(".")]
        before = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in headers}
        assert (record["sandbox"], record["sandbox_mechanism"]) == ("on", "bwrap"), record
        assert record["sandbox_uid"] != 0

        job = cluster.submit(cluster.upload(export(armed("probe").eval(), (torch.randn(2, 4),),
                                                   tmp_path / "probe.pt2")), {"probe": [2, 4]})
        done = cluster.wait_end(job["id"], timeout=600)
        assert done["state"] == "succeeded", done.get("error")
        jobdir = cluster.base / "work" / f"{job['id']}-1"
        reports = {where: _reports(jobdir / f"{where}.log", where) for where in ("compile", "check")}
    finally:
        listener.close()

    for where, found in reports.items():
        assert len(found) == 1, (where, found)
        r = found[0]
        assert r["plan_error"] is None, r
        # An unprivileged uid, without capabilities, with no_new_privs; its own pid namespace and network.
        assert r["uid"] == r["euid"] == record["sandbox_uid"] != 0, r
        assert r["gid"] != 0 and 0 not in r["groups"], r
        assert r["no_new_privs"] == "1" and r["cap_eff"] == "0000000000000000", r
        assert r["interfaces"] == ["lo"], r
        assert len(r["pids"]) < 10, r
        # Nothing of the worker's environment.
        assert set(r["env"]) <= ALLOWED_ENV, set(r["env"]) - ALLOWED_ENV
        # Redis, the API and the test's listener are unreachable.
        for port in plan["ports"]:
            assert r["tried"][f"tcp:{port}"] != "connected", r["tried"]
        # No secret was read (the writes may succeed inside the sandbox's private /tmp: checked from outside).
        for path in secret_files.values():
            assert not r["tried"][f"r:{path}"].startswith("read"), r["tried"]
        assert not r["tried"]["r:/etc/shadow"].startswith("read") and not r["tried"]["r:/proc/1/environ"].startswith(
            "read"), r["tried"]

    # The trusted precompiled headers were in the compile's TMPDIR, read-only: nothing was planted in them.
    # HEADERS_DIR holds one set per toolchain key (other tests build for other ISA levels): the compile saw its own.
    seen = set(reports["compile"][0]["headers"])
    own = [p for p in headers if p.parent in {q.parent for q in headers if q.name in seen}]
    assert seen == {p.name for p in own} and len(own) >= 2 and len({p.parent for p in own}) == 1, reports
    for tried in reports["compile"][0]["headers"].values():  # EROFS or EACCES (root's 0444 file), EBUSY to remove
        assert tried.startswith(("OSError", "PermissionError")) and "removed" not in tried, tried
    assert {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in headers} == before
    assert listener.accepted == []
    assert cluster.store.r.get("aotc:probe:pwned") is None
    for m in markers:
        for where in ("compile", "check"):
            assert not Path(f"{m}-{where}").exists(), f"{m}-{where}"
    # Each child wrote in a tmpfs of its own, gone with it: the worker copied out what it uses (the package, the
    # report, the sources) and took it into its results, where it is the worker's.
    assert "tmpfs" in record["sandbox_bounds"]["disk"] and "cgroup" in record["sandbox_bounds"]["memory"], record
    assert not (jobdir / "compile" / "tmp").exists() and not (jobdir / "check" / "tmp").exists()
    assert (jobdir / "results" / "artifact.pt2").stat().st_uid == os.getuid()
    # The secrets appear nowhere: not in the job, the artifact, its report, the logs.
    artifact = api.get(f"{cluster.url}/v1/artifacts/{done['artifact']}/meta", timeout=30).text
    report = api.get(f"{cluster.url}/v1/artifacts/{done['artifact']}/report", timeout=30).text
    job_json = api.get(f"{cluster.url}/v1/jobs/{job['id']}", timeout=30).text
    # With AOTC_CHECK_EARLY=on the check child that was probed is the one that waited for the package.
    assert ("early" in json.loads(artifact)["check"]) is (early == "on")
    logs = [_worker_log(cluster, proc), *(p.read_text(errors="replace") for p in jobdir.glob("*.log"))]
    for text in (artifact, report, job_json, json.dumps(reports), *logs):
        for secret in contents.values():
            assert secret not in text
    # And the report says how the compile was confined.
    print(f"\nprobe: uid {reports['compile'][0]['uid']}, interfaces {reports['compile'][0]['interfaces']}, "
          f"{len(reports['compile'][0]['pids'])} pids visible; tried: {reports['check'][0]['tried']}; "
          f"headers: {reports['compile'][0]['headers']}")


def test_a_job_over_a_limit_fails_naming_the_setting_and_the_worker_takes_the_next(cluster, tmp_path):
    # RLIMIT_FSIZE: 8 MiB lets a small model compile (the largest file, a preprocessed header, is under 3 MiB);
    # a model with 12 MiB of weights writes a package larger than that.
    proc, wid = cluster.start_worker(AOTC_CHILD_MAX_FILE_MB="8")
    big = cluster.upload(export(seeded(MLP, 1, d_in=1024, hidden=1536, d_out=1024).eval(), (torch.randn(2, 1024),),
                                tmp_path / "big.pt2"))
    job = cluster.wait_end(cluster.submit(big, {"x": [2, 1024]})["id"], timeout=600)
    err = job["error"]
    assert job["state"] == "failed" and job["attempts"] == 1, err  # final: the same compile would fail again
    assert (err["type"], err["stage"], err["limit"]) == ("LimitExceeded", "compile", "AOTC_CHILD_MAX_FILE_MB"), err
    assert err["message"] == "the compile wrote a file larger than 8 MiB; the limit is AOTC_CHILD_MAX_FILE_MB", err

    small = cluster.upload(export(seeded(MLP, 2, d_in=4, hidden=8, d_out=4).eval(), (torch.randn(2, 4),),
                                  tmp_path / "small.pt2"))
    job = cluster.wait_end(cluster.submit(small, {"x": [2, 4]})["id"], timeout=600)
    assert job["state"] == "succeeded" and job["worker"] == wid, job.get("error")
    assert proc.poll() is None
    stop(proc)

    # The sandbox's memory (its cgroup: importing torch takes some 150 MiB of its own) and RLIMIT_CPU: too little to
    # even import torch. Nothing of the model ran, so the worker's setting
    # is at fault, not the job (worker.health): the worker stops claiming and says why, naming the setting, and the
    # job keeps its attempts.
    for seed, setting, value, what in (
            (3, "AOTC_COMPILE_MAX_MEMORY_GB", "0.1", "used more than 0.1 GiB of memory"),
            (4, "AOTC_CHILD_MAX_CPU_S", "1", "used more than 1 s of CPU time")):
        proc, wid = cluster.start_worker(**{setting: value}, AOTC_WORKER_MAX_EARLY_CRASHES="1")
        model = cluster.upload(export(seeded(MLP, seed, d_in=4, hidden=8, d_out=4).eval(), (torch.randn(2, 4),),
                                      tmp_path / f"small{seed}.pt2"))
        job_id = cluster.submit(model, {"x": [2, 4]})["id"]
        deadline = time.monotonic() + 300
        while (record := _record(cluster, wid))["healthy"]:
            assert time.monotonic() < deadline, record
            time.sleep(0.3)
        assert f"the compile {what}; the limit is {setting}" in record["unhealthy_reason"], record
        job = cluster.job(job_id)
        assert (job["state"], job["attempts"]) == ("queued", 0), job
        assert api.delete(f"{cluster.url}/v1/jobs/{job_id}").status_code == 200  # no other test's worker runs it
        assert proc.poll() is None
        stop(proc)


def test_the_worker_refuses_to_start_without_a_sandbox_unless_told_to_run_unconfined(cluster, tmp_path):
    log = tmp_path / "refused.log"
    proc = subprocess.Popen([sys.executable, "-m", "worker"], cwd=ROOT, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT,
                            env={**cluster.worker_env, "AOTC_SANDBOX_BWRAP": "/nonexistent/bwrap"})
    assert proc.wait(120) != 0
    said = log.read_text()
    assert "refusing to start: the sandbox cannot be set up: no bubblewrap binary at " \
           "AOTC_SANDBOX_BWRAP='/nonexistent/bwrap'" in said, said
    assert "apt-get install bubblewrap" in said and "AOTC_SANDBOX=off" in said
    assert proc.pid not in [w["pid"] for w in cluster.store.workers.live()]

    proc, wid = cluster.start_worker(AOTC_SANDBOX="off")
    assert _record(cluster, wid)["sandbox"] == "off"
    model = cluster.upload(export(seeded(MLP, 5, d_in=4, hidden=8, d_out=4).eval(), (torch.randn(2, 4),),
                                  tmp_path / "m.pt2"))
    job = cluster.wait_end(cluster.submit(model, {"x": [2, 4]})["id"], timeout=600)
    assert job["state"] == "succeeded", job.get("error")
    said = _worker_log(cluster, proc)
    assert "AOTC_SANDBOX=off: compile and check children run UNCONFINED" in said
    assert f"job {job['id']} runs UNCONFINED" in said
    stop(proc)


def test_timings_a_hostile_compile_writes_in_a_bad_shape_are_not_published(cluster, tmp_path):
    proc, _ = cluster.start_worker()
    model = cluster.upload(export(armed("poison", 64, 128).eval(), (torch.randn(16, 64),), tmp_path / "p.pt2"))
    job = cluster.wait_end(cluster.submit(model, {"poison": [16, 64]}, options={"mode": "max-autotune"})["id"],
                           timeout=900)
    assert job["state"] == "succeeded", job.get("error")
    meta = api.get(f"{cluster.url}/v1/artifacts/{job['artifact']}/meta", timeout=30).json()
    g = meta["caches"]["gemm_timings"]
    # The addmm's own timings (ATen and a C++ template at least) are published; every poisoned entry is refused.
    assert g["measured"] >= 2 and g["published"] == g["measured"] and g["refused"] == len(POISON), g
    [table] = list(cluster.store.r.scan_iter(match=keys.GEMM_TUNING_PATTERN))
    fields = [json.loads(f) for f in cluster.store.r.hkeys(table)]
    assert len(fields) == g["published"] and all(f[0] == "addmm" for f in fields), fields
    assert not {tuple(f) for f in fields} & {entry for entry, _ in POISON}
    stop(proc)


# -- the parent's reads of what a child wrote (in-process) -------------------------------------------------------


def test_the_worker_reads_a_childs_files_without_following_links_or_blocking(tmp_path):
    child = tmp_path / "child"
    (child / "cache").mkdir(parents=True)
    secret = tmp_path / "secret"
    secret.write_text("secret")
    (child / "result.json").symlink_to(secret)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "timings").write_text("secret")
    (child / "cache" / "cache").symlink_to(tmp_path / "elsewhere")  # a link higher up the path
    os.mkfifo(child / "events.jsonl")
    (child / "report.json").write_text("{}")
    os.link(child / "report.json", child / "linked.json")
    (child / "artifact.pt2").write_bytes(b"x" * 10)

    assert read_untrusted(child, "result.json", 100) is None
    assert read_untrusted(child, "cache/cache/timings", 100) is None
    assert read_untrusted(child, "events.jsonl", 100) is None  # a FIFO: refused at once, not waited on
    assert read_untrusted(child, "../secret", 100) is None
    assert read_untrusted(child, "artifact.pt2", 4) == b"xxxx"
    results = tmp_path / "results"
    assert take(child, "result.json", results) is None  # a symlink
    assert take(child, "report.json", results) is None  # two names for one file
    taken = take(child, "artifact.pt2", results)
    assert taken == results / "artifact.pt2" and stat.S_IMODE(taken.stat().st_mode) == 0o644
    assert not (child / "artifact.pt2").exists()


def test_a_limit_breach_is_recognised_from_the_signal_or_what_the_child_said():
    limits = Limits(memory_bytes=2**30, cpu_s=60, file_bytes=2**20, procs=100, open_files=64)
    assert breach(limits, 24, "").setting == "AOTC_CHILD_MAX_CPU_S"  # SIGXCPU
    assert breach(limits, 25, "").setting == "AOTC_CHILD_MAX_FILE_MB"  # SIGXFSZ
    assert breach(limits, None, "OSError: [Errno 27] File too large").setting == "AOTC_CHILD_MAX_FILE_MB"
    assert breach(limits, None, "terminate called after throwing an instance of 'std::bad_alloc'").what == \
        "used more than 1 GiB of memory"
    assert breach(limits, None, "ImportError: libtorch_cpu.so: failed to map segment from shared object").limit == \
        "memory"
    assert breach(limits, None, "OSError: [Errno 24] Too many open files").limit == "open_files"
    assert breach(limits, None, "RuntimeError: can't start new thread").limit == "procs"
    assert breach(limits, 11, "Segmentation fault") is None
    assert breach(Limits(), None, "MemoryError") is None  # no limit set: a real out-of-memory, not a breach
    # What the sandbox's cgroup and tmpfs counted comes first: an OOM kill (SIGKILL, nothing said), a refused fork.
    assert breach(limits, 9, "", Counted(oom_kills=1)).setting == "AOTC_COMPILE_MAX_MEMORY_GB"
    assert breach(limits, 9, "") is None  # a SIGKILL the cgroup did not count is a crash
    assert breach(limits, None, "RuntimeError: the compile failed", Counted(forks_refused=2)).setting == \
        "AOTC_CHILD_MAX_PROCS"
    disk = Limits(disk_bytes=64 * 2**20)
    assert breach(disk, None, "", Counted(disk_full=True)).what == "wrote more than 64 MiB in its dir"
    # With room left in its tmpfs, a child saying ENOSPC met a full host disk (worker.health: DiskFull), not its bound.
    assert breach(disk, None, "OSError: [Errno 28] No space left on device", Counted(disk_full=False)) is None


def test_limits_hold_in_the_exec_shim_before_the_command_runs(tmp_path):
    shim = [sys.executable, "-I", "-S", str(ROOT / "worker" / "shim.py")]
    code = ("import resource; print(resource.getrlimit(resource.RLIMIT_FSIZE)[0], "
            "resource.getrlimit(resource.RLIMIT_NOFILE)[0], open('/proc/self/status').read().count('NoNewPrivs:\\t1'))")
    out = subprocess.run([*shim, "--no-new-privs", *Limits(file_bytes=2**20, open_files=64).argv(), "--",
                          sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == [str(2**20), "64", "1"], out
    started = time.monotonic()
    spin = subprocess.run([*shim, *Limits(cpu_s=1).argv(), "--", sys.executable, "-c", "while True: pass"],
                          timeout=60)
    assert spin.returncode == -24 and time.monotonic() - started < 30  # SIGXCPU
