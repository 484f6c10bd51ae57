"""API keys, scopes and namespaces, over HTTP against the real server (the session's, with auth on).

Each scope rule is checked both ways (allowed and refused), and a key of namespace A can neither see, pull,
cancel nor learn of B's models, jobs and artifacts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch

from compiler import cachekey
from modelzoo import MLP, export, seeded
from procs import ADMIN_KEY, ROOT, api, start_api, stop
from service.store import Store
from service.store.embedded import free_port

TARGET = f"cpu-zauth-{uuid.uuid4().hex[:8]}"  # a target only a fake worker "serves": its jobs stay queued
SHAPES = {"x": [2, 4]}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class Key:
    """An API key created through the API, and an httpx client that sends it."""

    def __init__(self, url: str, scope: str, namespace: str) -> None:
        r = api.post(f"{url}/v1/keys", json={"scope": scope, "namespace": namespace, "name": f"test {scope}"})
        assert r.status_code == 201, r.text
        self.record = r.json()
        self.id, self.secret = self.record["id"], self.record["key"]
        self.http = httpx.Client(base_url=url, headers=_bearer(self.secret), timeout=30)


@pytest.fixture(scope="module")
def fake_worker(store: Store):  # type: ignore[no-untyped-def]
    store.workers.heartbeat({"id": f"fake-{TARGET}", "target": TARGET, "toolchain": {"torch": "fake"},
                             "device_name": "none", "started": time.time()}, ttl_s=3600)
    yield TARGET
    store.workers.remove(f"fake-{TARGET}")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    batch = torch.export.Dim("batch", min=1, max=64)  # several static shapes: several jobs of one model
    path = export(seeded(MLP, int(uuid.uuid4().int % 10**6), d_in=4, hidden=8, d_out=4), (torch.randn(2, 4),),
                  tmp_path_factory.mktemp("auth") / "m.pt2", dynamic_shapes={"x": {0: batch}})
    return path.read_bytes()


def _publish(store: Store, tmp: Path, model_id: str) -> str:
    """An artifact of `model_id`, stored as a worker would store one (only its bytes are made up)."""
    factors = cachekey.factors(model_id, [{"name": "x", "dtype": "float32", "shape": [2, 4]}], "cpu-x86_64-test",
                               {"torch": "test"}, {})
    key = cachekey.cache_key(factors)
    package = tmp / f"{key}.pt2"
    package.write_bytes(b"package of " + key.encode())
    store.artifacts.put({"key": key, "factors": factors, "model_id": model_id, "target": factors["target"],
                         "spec": factors["spec"], "options": {}, "created": time.time()}, package)
    return key


def test_a_request_without_a_known_key_is_401_and_health_stays_open(api_url: str) -> None:
    for headers in ({}, _bearer("not-a-key"), _bearer("aotc_0123456789ab_" + "A" * 43), {"Authorization": "Basic x"}):
        r = httpx.get(f"{api_url}/v1/models", headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "unauthorized"
    assert "AOTC_API_KEY" in httpx.get(f"{api_url}/v1/models").json()["error"]["message"]
    assert httpx.get(f"{api_url}/healthz").status_code == 200
    assert httpx.get(f"{api_url}/readyz").status_code in (200, 503)  # open: no 401
    schema = httpx.get(f"{api_url}/openapi.json").json()
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert {"bearer": []} in schema["paths"]["/v1/models"]["get"]["security"]


def test_each_scope_allows_its_routes_and_refuses_the_others(api_url: str, fake_worker: str, model_file: bytes,
                                                             store: Store, tmp_path: Path) -> None:
    ns = f"scopes-{uuid.uuid4().hex[:6]}"
    pull, comp = Key(api_url, "pull", ns), Key(api_url, "compile", ns)

    # pull: reads, never writes
    assert pull.http.get("/v1/models").status_code == 200
    assert pull.http.get("/v1/artifacts").status_code == 200
    r = pull.http.post("/v1/models", content=model_file)
    assert r.status_code == 403 and r.json()["error"]["needs"] == "compile", r.text
    for method, path in [("GET", "/v1/jobs"), ("POST", "/v1/compilations"), ("GET", "/v1/workers"),
                         ("GET", "/v1/keys"), ("GET", "/v1/caches"), ("DELETE", "/v1/caches"),
                         ("GET", "/v1/namespaces"), ("GET", "/metrics"), ("POST", "/v1/keys")]:
        r = pull.http.request(method, path, json={})
        assert r.status_code == 403, (method, path, r.status_code, r.text)

    # compile: upload, compile, see and cancel its jobs; still no admin routes
    up = comp.http.post("/v1/models", content=model_file)
    assert up.status_code == 201, up.text
    model_id = up.json()["id"]
    r = comp.http.post("/v1/compilations", json={"model_id": model_id, "shapes": SHAPES, "target": fake_worker})
    assert r.status_code == 202, r.text
    job_id = r.json()["job"]["id"]
    assert [j["id"] for j in comp.http.get("/v1/jobs").json()["jobs"]] == [job_id]
    assert comp.http.get(f"/v1/jobs/{job_id}").json()["state"] == "queued"
    assert pull.http.get(f"/v1/models/{model_id}").status_code == 200  # pull reads its namespace's models
    key = _publish(store, tmp_path, model_id)
    for path in (f"/v1/artifacts/{key}/meta", f"/v1/artifacts/{key}",
                 f"/v1/artifacts/lookup?model_id={model_id}&target=cpu-x86_64-test&shape=x=2x4"):
        assert pull.http.get(path).status_code == 200, path
    for method, path in [("GET", "/v1/workers"), ("GET", "/v1/keys"), ("DELETE", "/v1/caches"),
                         ("POST", f"/v1/artifacts/{key}/pin"), ("GET", "/v1/namespaces")]:
        assert comp.http.request(method, path).status_code == 403, (method, path)
    r = comp.http.delete(f"/v1/jobs/{job_id}")
    assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text

    # admin: everything, every namespace
    assert api.get(f"{api_url}/v1/workers").status_code == 200
    assert api.post(f"{api_url}/v1/artifacts/{key}/pin").status_code == 200
    assert api.get(f"{api_url}/v1/jobs/{job_id}").status_code == 200
    listed = {k["id"]: k for k in api.get(f"{api_url}/v1/keys").json()["keys"]}
    assert listed[pull.id]["scope"] == "pull" and listed[comp.id]["namespace"] == ns
    assert all("key" not in k and "sha256" not in k for k in listed.values())  # never the secret, nor its hash


def test_a_namespace_cannot_see_pull_cancel_or_learn_of_anothers_things(
        api_url: str, fake_worker: str, model_file: bytes, store: Store, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    a, b = Key(api_url, "compile", f"team-a-{tag}"), Key(api_url, "compile", f"team-b-{tag}")
    up = a.http.post("/v1/models?name=secret-a-name", content=model_file)
    assert up.status_code in (200, 201), up.text  # another test may have stored these bytes: A's answer is A's
    model_id = up.json()["id"]
    job = a.http.post("/v1/compilations", json={"model_id": model_id, "shapes": {"x": [3, 4]},
                                                "target": fake_worker}).json()["job"]
    key = _publish(store, tmp_path, model_id)

    # B: the model, its job and its artifact do not exist, by full id or prefix, on any route
    for path in (f"/v1/models/{model_id}", f"/v1/models/{model_id[:12]}", f"/v1/jobs/{job['id']}",
                 f"/v1/jobs/{job['id']}/events", f"/v1/artifacts/{key}", f"/v1/artifacts/{key}/meta",
                 f"/v1/artifacts/{key}/report", f"/v1/artifacts/{key}/source",
                 f"/v1/artifacts/lookup?model_id={model_id}&target=cpu-x86_64-test&shape=x=2x4",
                 f"/v1/artifacts/lookup?model_id={model_id[:12]}&target=cpu-x86_64-test&shape=x=2x4"):
        r = b.http.get(path)
        assert r.status_code == 404, (path, r.status_code, r.text)
    assert b.http.head(f"/v1/artifacts/{key}").status_code == 404
    assert b.http.delete(f"/v1/jobs/{job['id']}").status_code == 404
    r = b.http.post("/v1/compilations", json={"model_id": model_id, "shapes": SHAPES, "target": fake_worker})
    assert r.status_code == 404, r.text
    assert b.http.get("/v1/models").json()["models"] == []
    assert b.http.get("/v1/jobs").json()["jobs"] == []
    assert b.http.get("/v1/artifacts").json()["artifacts"] == []
    assert a.http.get(f"/v1/jobs/{job['id']}").json()["state"] == "queued"  # B's cancel did nothing

    # B uploads the same bytes: its own new model (201), under its own name; never A's name
    up_b = b.http.post("/v1/models?name=b-name", content=model_file)
    assert up_b.status_code == 201 and up_b.json()["name"] == "b-name", up_b.text
    assert b.http.post("/v1/models?name=b-name", content=model_file).status_code == 200  # now B's own again
    seen = b.http.get(f"/v1/models/{model_id}").json()
    assert seen["name"] == "b-name" and "secret-a-name" not in b.http.get("/v1/models").text
    assert a.http.get(f"/v1/models/{model_id}").json()["name"] == "secret-a-name"
    # ... and shares the content: the artifact, and the job for the same request (answered "queued", as new)
    assert b.http.get(f"/v1/artifacts/{key}/meta").status_code == 200
    r = b.http.post("/v1/compilations", json={"model_id": model_id, "shapes": {"x": [3, 4]},
                                              "target": fake_worker})
    assert r.status_code == 202 and r.json()["status"] == "queued" and r.json()["job"]["id"] == job["id"], r.text
    assert a.http.post("/v1/compilations", json={"model_id": model_id, "shapes": {"x": [3, 4]},
                                                 "target": fake_worker}).json()["status"] == "joined"
    # B cancels: B leaves the job, which goes on for A
    r = b.http.delete(f"/v1/jobs/{job['id']}")
    assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
    assert b.http.get(f"/v1/jobs/{job['id']}").status_code == 404
    assert a.http.get(f"/v1/jobs/{job['id']}").json()["state"] == "queued"
    assert a.http.delete(f"/v1/jobs/{job['id']}").json()["state"] == "cancelled"  # A's cancel ends it


def test_quotas_answer_429_for_jobs_and_507_for_stored_bytes(api_url: str, fake_worker: str,
                                                           model_file: bytes) -> None:
    ns = f"quota-{uuid.uuid4().hex[:6]}"
    k = Key(api_url, "compile", ns)
    r = api.put(f"{api_url}/v1/namespaces/{ns}/quota", json={"max_jobs": 1})
    assert r.status_code == 200 and r.json()["quota"]["max_jobs"] == 1, r.text
    model_id = k.http.post("/v1/models", content=model_file).json()["id"]
    first = k.http.post("/v1/compilations", json={"model_id": model_id, "shapes": {"x": [5, 4]},
                                                  "target": fake_worker})
    assert first.status_code == 202, first.text
    r = k.http.post("/v1/compilations", json={"model_id": model_id, "shapes": {"x": [6, 4]}, "target": fake_worker})
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "quota_jobs" and "max_jobs" in r.json()["error"]["message"]
    assert r.headers["retry-after"]
    k.http.delete(f"/v1/jobs/{first.json()['job']['id']}")  # an ended job frees its place
    again = k.http.post("/v1/compilations", json={"model_id": model_id, "shapes": {"x": [6, 4]},
                                                  "target": fake_worker})
    assert again.status_code == 202, again.text
    k.http.delete(f"/v1/jobs/{again.json()['job']['id']}")

    me = k.http.get("/v1/me").json()
    held = me["usage"]["stored_bytes"]  # the model, and any artifact of it another test stored
    assert me["namespace"] == ns and held >= len(model_file), me
    tiny = (held + 100) / 2**30  # room for what it has, not for another model
    api.put(f"{api_url}/v1/namespaces/{ns}/quota", json={"max_stored_gb": tiny})
    other = export(seeded(MLP, 7, d_in=4, hidden=8, d_out=4), (torch.randn(2, 4),), Path(f"/tmp/q-{ns}.pt2"))
    r = k.http.post("/v1/models", content=other.read_bytes())
    other.unlink()
    assert r.status_code == 507, r.text
    assert r.json()["error"]["code"] == "quota_storage" and "max_stored_gb" in r.json()["error"]["message"]

    # A namespace that holds its whole quota is refused new compiles too: an artifact's size is known only once it
    # is built, so a request that needs one is refused before anything is queued.
    api.put(f"{api_url}/v1/namespaces/{ns}/quota", json={"max_stored_gb": held / 2**30})
    r = k.http.post("/v1/compilations", json={"model_id": model_id, "shapes": {"x": [7, 4]}, "target": fake_worker})
    assert r.status_code == 507, r.text
    err = r.json()["error"]
    assert err["code"] == "quota_storage" and "1 more artifact(s) to store" in err["message"], err
    assert k.http.get("/v1/me").json()["usage"]["jobs"] == 0
    api.put(f"{api_url}/v1/namespaces/{ns}/quota", json={"max_stored_gb": 1.0})
    r = k.http.post("/v1/compilations", json={"model_id": model_id, "shapes": {"x": [7, 4]}, "target": fake_worker})
    assert r.status_code == 202, r.text
    k.http.delete(f"/v1/jobs/{r.json()['job']['id']}")


def test_a_revoked_key_is_refused(api_url: str) -> None:
    k = Key(api_url, "pull", "revoked")
    assert k.http.get("/v1/models").status_code == 200
    r = api.delete(f"{api_url}/v1/keys/{k.id}")
    assert r.status_code == 200 and r.json()["revoked"], r.text
    deadline = time.monotonic() + 15  # AOTC_AUTH_CACHE_S (5 s) at most
    while k.http.get("/v1/models").status_code != 401:
        assert time.monotonic() < deadline, "the revoked key still works"
        time.sleep(0.5)
    assert api.delete(f"{api_url}/v1/keys/{'0' * 12}").status_code == 404


def test_keys_through_the_cli_and_the_sdk(api_url: str, tmp_path: Path) -> None:
    env = {**os.environ, "AOTC_URL": api_url, "AOTC_API_KEY": ADMIN_KEY}
    out = subprocess.run([sys.executable, "-m", "client.cli", "keys", "create", "--scope", "pull", "--namespace",
                          "cli-ns", "--name", "deploy"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    secret = out.stdout.strip().splitlines()[-1]
    assert secret.startswith("aotc_") and "not shown again" in out.stderr
    from client import Client

    with Client(api_url, api_key=secret) as c:
        who = c.me()
        assert (who["scope"], who["namespace"]) == ("pull", "cli-ns")
        with pytest.raises(Exception, match="403|scope"):
            c.keys()
    listing = subprocess.run([sys.executable, "-m", "client.cli", "keys", "list"], env=env, cwd=ROOT,
                             capture_output=True, text=True)
    assert listing.returncode == 0 and "cli-ns" in listing.stdout and secret not in listing.stdout
    refused = subprocess.run([sys.executable, "-m", "client.cli", "models"], cwd=ROOT, capture_output=True,
                             text=True, env={**env, "AOTC_API_KEY": "wrong"})
    assert refused.returncode == 2 and "HTTP 401" in refused.stderr


def _non_loopback_ip() -> str | None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            ip = str(s.getsockname()[0])
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_open_mode_answers_loopback_only_and_aotc_server_refuses_the_network_without_keys(
        service_env: dict[str, str], tmp_path: Path) -> None:
    env = {k: v for k, v in service_env.items() if k != "AOTC_ADMIN_KEY"}
    url, proc = start_api(env, tmp_path / "api.log")  # binds 127.0.0.1
    try:
        r = httpx.get(f"{url}/v1/models")  # no key: open mode, from loopback
        assert r.status_code == 200, r.text
    finally:
        stop(proc)
    ip = _non_loopback_ip()
    if ip:  # the same open API bound to all addresses: a client from another address is refused
        port = free_port()
        p = subprocess.Popen([sys.executable, "-m", "uvicorn", "service.api.app:create_app", "--factory", "--host",
                              "0.0.0.0", "--port", str(port), "--log-level", "warning"], env=env, cwd=ROOT)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    r = httpx.get(f"http://{ip}:{port}/v1/models", timeout=2)
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
            assert r.status_code == 401 and "loopback" in r.json()["error"]["message"], r.text
            assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200
        finally:
            stop(p)
    server_env = {**env, "AOTC_DATA_DIR": str(tmp_path / "srv")}
    refused = subprocess.run([sys.executable, "-m", "service", "--host", "0.0.0.0", "--workers", "0"],
                             env=server_env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "AOTC_ADMIN_KEY" in refused.stderr and "--insecure" in refused.stderr


def test_the_admin_key_can_come_from_a_file(service_env: dict[str, str], tmp_path: Path) -> None:
    """AOTC_ADMIN_KEY_FILE (a docker secret) turns auth on as AOTC_ADMIN_KEY does."""
    secret = tmp_path / "aotc_admin_key"
    secret.write_text("from-a-file-" + uuid.uuid4().hex + "\n")
    env = {k: v for k, v in service_env.items() if k != "AOTC_ADMIN_KEY"}
    url, proc = start_api({**env, "AOTC_ADMIN_KEY_FILE": str(secret)}, tmp_path / "api.log")
    try:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers=_bearer(secret.read_text().strip())).status_code == 200
    finally:
        stop(proc)
