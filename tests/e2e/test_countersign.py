"""Built, not run on target, and countersigned: on the CPU levels, a worker that builds cpu-x86_64-v3 without
serving it natively (AOTC_BUILD_ONLY_TARGETS, on this v3-or-above host) publishes a marked package and queues a
verify job; lookup and pulls refuse it unless asked; a verifier that serves v3 natively is killed in the middle of
its check (`kill -9`, a lost worker) and the verify job, out of attempts, fails for good; the next worker that starts
serving the target natively queues it again, checks the package there and countersigns it with its own key; clients
verify the countersignature against their pinned keys and refuse a tampered one. Real processes: a redis-server, the
API over HTTP (its reaper takes the dead verifier's lease), a builder and two verifiers running the real compiler.
One package serves every test here: the build is the bulk of the time."""

from __future__ import annotations

import base64
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from compiler.errors import BadSignature
from compiler.signing import Signer, b64, raw_public
from modelzoo import MLP, export, seeded
from procs import ROOT, Cluster, api, stop
from service.store import keys

pytestmark = [pytest.mark.slow, pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 levels only")]

V3 = "cpu-x86_64-v3"
LEVELS = [f"cpu-x86_64-v{n}" for n in range(1, 5)]
LEASE_S = 4.0  # short, so that the API's reaper takes a killed verifier's lease within seconds


def _host_level() -> str:
    from compiler.targets import detect_cpu_target

    return str(detect_cpu_target())


def _pin(signer: Signer) -> str:
    return f"{signer.kid}={b64(raw_public(signer.public))}"


class Fleet:
    def __init__(self, cluster: Cluster, builder: Signer, verifier: Signer, model: torch.nn.Module,
                 model_path: Path) -> None:
        self.cluster, self.builder, self.verifier, self.model, self.model_path = (
            cluster, builder, verifier, model, model_path)
        self.art: dict[str, Any] = {}  # the artifact record as the builder published it
        self.verify_job: dict[str, Any] = {}

    def client(self, tmp: Path, *pins: Signer, allow_unverified: bool = False) -> Any:
        from client import Client

        return Client(self.cluster.url, cache_dir=tmp / "cache", timeout=120, allow_unverified=allow_unverified,
                      trusted_keys=",".join(_pin(s) for s in pins))

    def lookup(self, **params: str) -> Any:
        return api.get(f"{self.cluster.url}/v1/artifacts/lookup", params={
            "model_id": self.art["model_id"], "target": V3, "shape": "x=4x32", **params}, timeout=30)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if LEVELS.index(_host_level()) < LEVELS.index(V3):
        pytest.skip(f"this host is {_host_level()}: it cannot build or check a v3 package")
    base = tmp_path_factory.mktemp("countersign")
    cluster = Cluster(base, env={"AOTC_LEASE_S": str(LEASE_S), "AOTC_REAP_INTERVAL_S": "0.5"},
                      worker_env={"AOTC_HEARTBEAT_S": "1"})
    # Each worker its own key, under the data dir (hidden from children): the countersigner is told apart by kid.
    builder = Signer.from_file(base / "keys" / "builder.pem", create=True)
    verifier = Signer.from_file(base / "keys" / "verifier.pem", create=True)
    model = seeded(MLP, 41)
    fleet = Fleet(cluster, builder, verifier, model, export(model, (torch.randn(4, 32),), base / "mlp.pt2"))
    try:
        # One attempt per verify job (the builder's setting: it queues them), so one lost verifier fails it for good.
        proc, _ = cluster.start_worker(AOTC_WORKER_TARGETS=json.dumps([V3]), AOTC_BUILD_ONLY_TARGETS=json.dumps([V3]),
                                       AOTC_SIGNING_KEY_FILE=str(builder.path), AOTC_VERIFY_MAX_ATTEMPTS="1")
        job = cluster.submit(cluster.upload(fleet.model_path), {"x": [4, 32]}, target=V3)
        done = cluster.wait_end(job["id"], timeout=600)
        assert done["state"] == "succeeded", done
        fleet.art = dict(api.get(f"{cluster.url}/v1/artifacts/{done['artifact']}/meta", timeout=30).json())
        verify = [j for j in cluster.store.jobs.recent(20) if j.get("kind") == "verify"]
        assert len(verify) == 1, verify
        fleet.verify_job = verify[0]
        stop(proc)  # the builder is gone before the verifiers come: it could never have taken the verify job
        yield fleet
    finally:
        cluster.close()


@dataclass
class Healed:
    failed: dict[str, Any]  # the first verify job, failed for good when its verifier was killed mid-check
    doomed: str  # that verifier's id
    after_loss: dict[str, Any]  # the artifact's on_target mark then
    job: dict[str, Any]  # the verify job the next verifier queued again, as it ended
    worker: str  # that verifier's id
    log: str  # its log
    seconds: float  # from its start to the countersignature


@pytest.fixture(scope="module")
def healed(fleet: Fleet) -> Healed:
    """The verify job's story after the tests of the unverified package: a verifier that serves v3 natively takes it
    and is killed in the middle of its check; the API's reaper takes its lease and, no attempt left, the job fails
    for good (WorkerLost). The next verifier queues it again at its start, checks it and countersigns."""
    cluster, first = fleet.cluster, fleet.verify_job
    doomed, doomed_id = cluster.start_worker(AOTC_WORKER_TARGETS=json.dumps([V3]),
                                             AOTC_SIGNING_KEY_FILE=str(fleet.verifier.path))
    cluster.wait_for(first["id"], lambda j: j["state"] == "running" and j.get("stage") == "check", 300)
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait()
    failed = cluster.wait_end(first["id"], timeout=60)
    after_loss = api.get(f"{cluster.url}/v1/artifacts/{fleet.art['key']}/meta", timeout=30).json()["on_target"]

    t0 = time.monotonic()
    log = cluster.base / f"worker-{len(cluster.procs)}.log"  # as Cluster.start_worker names it
    healthy, healthy_id = cluster.start_worker(AOTC_WORKER_TARGETS=json.dumps([V3]),
                                               AOTC_SIGNING_KEY_FILE=str(fleet.verifier.path))
    try:
        # The worker registers, then queues failed verify jobs again: wait for it (on a busy host it can lag).
        deadline, again = time.monotonic() + 60, []
        while not again and time.monotonic() < deadline:
            again = [j for j in cluster.store.jobs.recent(20) if j.get("kind") == "verify" and j["id"] != first["id"]]
            time.sleep(0.2)
        assert len(again) == 1, (again, failed, log.read_text(errors="replace")[-2000:])
        done = cluster.wait_end(again[0]["id"], timeout=300)
    finally:
        stop(healthy)
    return Healed(failed, doomed_id, after_loss, done, healthy_id, log.read_text(errors="replace"),
                  time.monotonic() - t0)


def test_a_build_only_target_is_published_marked_and_signed_so(fleet):
    art = fleet.art
    assert art["target"] == V3
    assert art["on_target"] == {"state": "unverified", "built_on": _host_level()}
    assert art["check"]["passed"] is True  # checked on the builder's own host, which is not the target
    envelope = api.get(f"{fleet.cluster.url}/v1/artifacts/{art['key']}/manifest", timeout=30).json()
    predicate = json.loads(base64.b64decode(envelope["payload"]))["predicate"]
    assert predicate["on_target"] == {"run": False, "built_on": _host_level()}
    assert envelope["signatures"][0]["keyid"] == fleet.builder.kid
    job = fleet.verify_job
    assert job["target"] == keys.verify_target(V3) and job["artifact"] == art["key"] and job["state"] == "queued"


def test_lookup_and_pull_refuse_an_unverified_package_unless_asked(fleet, tmp_path):
    refused = fleet.lookup()
    assert refused.status_code == 404, refused.text
    assert "built, not run on target" in refused.json()["error"]["message"]
    assert "allow_unverified=true" in refused.json()["error"]["message"]
    asked = fleet.lookup(allow_unverified="true")
    assert asked.status_code == 200 and asked.json()["key"] == fleet.art["key"]
    with fleet.client(tmp_path, fleet.builder, fleet.verifier) as c:
        assert c.lookup(fleet.art["model_id"], {"x": [4, 32]}, target=V3) is None
        with pytest.raises(BadSignature) as e:
            c.pull(fleet.art["key"], tmp_path / "mlp.pt2")
        assert e.value.reason == "unverified_on_target" and _host_level() in e.value.message
        assert not (tmp_path / "mlp.pt2").exists()
    with fleet.client(tmp_path, fleet.builder, allow_unverified=True) as c:
        found = c.lookup(fleet.art["model_id"], {"x": [4, 32]}, target=V3)
        assert found is not None and found.key == fleet.art["key"]
        assert c.pull(found, tmp_path / "mlp.pt2").is_file()


def _aotc(fleet: Fleet, *args: str, pins: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "client.cli", "--url", fleet.cluster.url, *args], cwd=ROOT,
                          env={**os.environ, "AOTC_TRUSTED_KEYS": pins}, capture_output=True, text=True, timeout=300)


def test_pull_verify_checks_here_against_the_program_and_records_nothing(fleet, tmp_path):
    pins = ",".join(_pin(s) for s in (fleet.builder, fleet.verifier))
    key, out = fleet.art["key"], tmp_path / "mlp.pt2"
    refused = _aotc(fleet, "pull", key, "-o", str(out), pins=pins)
    assert refused.returncode == 3 and "not run on cpu-x86_64-v3" in refused.stderr, refused.stderr
    other = export(seeded(MLP, 42), (torch.randn(4, 32),), tmp_path / "other.pt2")
    wrong = _aotc(fleet, "pull", key, "-o", str(out), "--verify", str(other), pins=pins)
    assert wrong.returncode == 3 and "is not the program" in wrong.stderr, wrong.stderr
    assert not out.exists()
    checked = _aotc(fleet, "pull", key, "-o", str(out), "--verify", str(fleet.model_path), pins=pins)
    assert checked.returncode == 0, checked.stderr
    assert "checked here against mlp.pt2" in checked.stderr and checked.stdout.strip().endswith(str(out))
    # Recorded nowhere: the service still has it unverified.
    record = fleet.cluster.store.artifacts.get(key)
    assert record["on_target"]["state"] == "unverified" and not record.get("countersignatures")


def test_a_verify_job_lost_with_its_worker_is_queued_again_by_the_next_verifier(fleet, healed):
    first, failed = fleet.verify_job, healed.failed
    assert first["max_attempts"] == 1
    assert failed["state"] == "failed" and failed["error"]["type"] == "WorkerLost", failed
    assert healed.doomed in failed["error"]["message"]
    assert healed.after_loss["state"] == "unverified"
    done = healed.job
    assert done["state"] == "succeeded" and done["worker"] == healed.worker, done
    assert done["artifact"] == fleet.art["key"] and done["max_attempts"] == 10  # the verifier's own setting (default)
    mark = api.get(f"{fleet.cluster.url}/v1/artifacts/{fleet.art['key']}/meta", timeout=30).json()["on_target"]
    assert mark["state"] == "verified" and mark["by"] == fleet.verifier.kid and mark["worker"] == healed.worker, mark
    why = f"its verify job {first['id']} failed for the machine's reasons (WorkerLost"
    assert why in healed.log, healed.log[-3000:]
    print(f"\nverify job lost with its worker, failed for good; queued again by the next verifier and "
          f"countersigned {healed.seconds:.1f} s after it started")


def test_a_native_worker_countersigns_and_clients_verify_it(fleet, healed, tmp_path):
    """The verifier that countersigned is the one that queued the lost verify job again (the test before)."""
    cluster, done, wid = fleet.cluster, healed.job, healed.worker
    assert done["state"] == "succeeded" and done["worker"] == wid, done
    art = dict(api.get(f"{cluster.url}/v1/artifacts/{fleet.art['key']}/meta", timeout=30).json())
    mark = art["on_target"]
    assert mark["state"] == "verified" and mark["by"] == fleet.verifier.kid and mark["checked_on"] == V3
    assert mark["built_on"] == _host_level() and mark["worker"] == wid
    assert len(art["countersignatures"]) == 1
    # Lookup serves it now, without being asked.
    assert fleet.lookup().json()["key"] == art["key"]
    with fleet.client(tmp_path, fleet.builder, fleet.verifier) as c:
        signed = c.verifier.manifest(art["key"], art)
        cs = c.verifier.on_target(signed, art, c.verifier.trusted())
        assert cs is not None and cs.kid == fleet.verifier.kid
        assert cs.predicate["check"]["passed"] is True and cs.predicate["manifest_sha256"] == signed.payload_sha256
        fn = c.load(c.lookup(art["model_id"], {"x": [4, 32]}, target=V3))
        x = torch.randn(4, 32)
        with torch.no_grad():
            torch.testing.assert_close(fn(x), fleet.model(x), rtol=1e-4, atol=1e-5)
    # A client that trusts only the builder: a countersignature by a key it does not trust vouches for nothing.
    with fleet.client(tmp_path / "b", fleet.builder) as c, pytest.raises(BadSignature) as e:
        c.pull(art["key"])
    assert e.value.reason == "unverified_on_target" and fleet.verifier.kid in e.value.message


def _rewrite(fleet: Fleet, change: Any) -> dict[str, Any]:
    """Rewrite the artifact's record in Redis, as whoever controls Redis could; returns the original."""
    name = keys.artifact(fleet.art["key"])
    original = json.loads(fleet.cluster.store.r.get(name))
    record = json.loads(json.dumps(original))
    change(record)
    fleet.cluster.store.r.set(name, json.dumps(record))
    return dict(original)


def _forged_check(record: dict[str, Any]) -> None:
    """The countersignature's payload altered (its check says something else), its signature kept."""
    envelope = record["countersignatures"][0]
    st = json.loads(base64.b64decode(envelope["payload"]))
    st["predicate"]["checked_on"] = "cpu-x86_64-v1"
    envelope["payload"] = base64.b64encode(json.dumps(st).encode()).decode()


def _signature_swapped(record: dict[str, Any]) -> None:
    """Its signature replaced by the builder manifest's: the right key id, a signature over other bytes."""
    record["countersignatures"][0]["signatures"][0]["sig"] = record["manifest"]["signatures"][0]["sig"]


def _dropped(record: dict[str, Any]) -> None:
    """The record still says verified, with no countersignature to show for it."""
    record["countersignatures"] = []


@pytest.mark.parametrize(("tamper", "reason"), [(_forged_check, "bad_signature"), (_signature_swapped,
                                                                                  "bad_signature"),
                                                (_dropped, "unverified_on_target")])
def test_a_tampered_countersignature_is_refused(fleet, healed, tmp_path, tamper, reason):
    assert fleet.cluster.store.artifacts.get(fleet.art["key"])["on_target"]["state"] == "verified"
    original = _rewrite(fleet, tamper)
    try:
        with fleet.client(tmp_path, fleet.builder, fleet.verifier) as c, pytest.raises(BadSignature) as e:
            c.pull(fleet.art["key"], tmp_path / "mlp.pt2")
        assert e.value.reason == reason, e.value.message
        assert not (tmp_path / "mlp.pt2").exists()
    finally:
        fleet.cluster.store.r.set(keys.artifact(fleet.art["key"]), json.dumps(original))
