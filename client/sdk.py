"""The Python client. It speaks HTTP, and imports torch only to export a module or load an artifact.

    from client import Client
    c = Client()                                   # AOTC_URL, default http://127.0.0.1:8000
    art = c.compile(model, (torch.randn(8, 3, 224, 224),), target="cpu")
    fn = c.load(art)                                # pulls (signature-verified, cached) and loads the package
    y = fn(x)
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote, urlsplit

import httpx
from httpx_sse import connect_sse

from client import transfer
from client.buckets import BucketedModel, Bundle
from client.verify import ENV as TRUSTED_KEYS_ENV
from client.verify import Asked, Fetched, TrustSpec, Verifier, check_digest, check_file
from client.verify import pool as verify_pool
from compiler import digests
from compiler.digests import Want
from compiler.errors import BadSignature, Unprocessable
from compiler.shapes import format_shape, parse_shape
from compiler.signing import ARTIFACT_KEY, Manifest
from compiler.targets import Target

DEFAULT_URL = "http://127.0.0.1:8000"
log = logging.getLogger("aotc.client")
_KEY = ARTIFACT_KEY  # an artifact key; anything else `load` reads as a registry reference


class ClientError(Exception):
    """The service refused a request; `status` and `message` are what it said."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.body = status, message, body


class JobFailed(Exception):
    def __init__(self, job: dict[str, Any]) -> None:
        err = job.get("error") or {}
        super().__init__(f"job {job['id']} {job['state']} at stage {err.get('stage') or job.get('stage')}: "
                         f"{err.get('message', 'no reason given')}")
        self.job = job


@dataclass(frozen=True)
class Artifact:
    key: str
    meta: dict[str, Any]
    # What the service was asked when it answered with this artifact (a lookup, a reference's pick): the signed
    # manifest is held to it before a byte is pulled (client/verify.py, Asked)
    asked: Asked | None = field(default=None, compare=False, repr=False)

    @property
    def sha256(self) -> str:
        return str(self.meta["sha256"])


def asked_by_pick(ref: str, answer: Mapping[str, Any], shapes: Mapping[str, Any] | None = None, *,
                  training: bool = False) -> Asked:
    """What a pick of `ref` asked (`Client.pick`'s `answer`), for the picked artifact's signed manifest to answer:
    the version's model (the service's word for which model a tag names: tags and versions are not signed), a
    target the host runs, the shapes, inference or a train step."""
    return Asked(model_id=str(answer["version"]["model_id"]), host=str(answer["host"]), training=training,
                 shapes={name: format_shape(_shape_of(s)) for name, s in (shapes or {}).items()},
                 how=f"the reference {ref!r}")


def _asked_by_compile(art: Artifact, model_id: str, shapes: Mapping[str, Any], target: str,
                      options: Mapping[str, Any]) -> Artifact:
    """`art` with what `Client.compile` asked for (the uploaded bytes' model, the target, the shapes, inference or a
    train step), which its signed manifest must answer when it is pulled."""
    return replace(art, asked=Asked(model_id=model_id, target=target, training=options.get("mode") == "training",
                                    shapes={n: format_shape(d) for n, d in shapes.items()}, how="the compile"))


def _raise_for(resp: httpx.Response) -> None:
    if resp.is_success or resp.status_code == 304:
        return
    try:
        body = resp.json()
        message = body.get("error", {}).get("message") or str(body)
    except ValueError:
        body, message = None, resp.text[:500]
    raise ClientError(resp.status_code, message, body)


def _shape_of(x: Any) -> list[Any]:
    """The dims of a tensor, of a shape string ('8x3x224x224', '1..32x3') or of a sequence of dims (sizes, '1..32',
    {'min', 'max'} ranges). compiler.shapes reads the strings; the service checks the dims against the program."""
    if hasattr(x, "shape"):
        return [int(d) for d in x.shape]
    try:
        if isinstance(x, str):
            return list(parse_shape(x))
        dims = [parse_shape(d) if isinstance(d, str) else [d] for d in x]
    except Unprocessable as e:  # what the service would have answered, without the round trip
        raise ClientError(422, e.message) from None
    if any(len(d) != 1 for d in dims):
        raise ClientError(422, f"cannot read shape {x!r}: each dim is one size (8) or one range (1..32)")
    return [d[0] for d in dims]


class Client:
    def __init__(self, url: str | None = None, *, timeout: float = 60.0, cache_dir: str | Path | None = None,
                 api_key: str | None = None, trusted_keys: TrustSpec | None = None,
                 allow_unverified: bool = False, redirect_hosts: str | Sequence[str] | None = None) -> None:
        """`api_key`: sent as `Authorization: Bearer`; default $AOTC_API_KEY (a server on loopback without keys
        needs none). `trusted_keys`: the public keys an artifact's manifest must be signed by, in AOTC_TRUSTED_KEYS's
        syntax (client/verify.py), default $AOTC_TRUSTED_KEYS; unset, the keys the service lists (pinning is the
        secure choice: a compromised service can list a key of its own). `allow_unverified`: lookups, picks and pulls
        also take a package built for its target but not yet run there (compiler/ontarget.py); by default one needs
        a countersignature by a trusted key. `redirect_hosts`: hosts a pull may be redirected to besides the
        service's own and https by host name (an object store on plain HTTP or addressed by IP), in
        AOTC_REDIRECT_HOSTS's syntax, default $AOTC_REDIRECT_HOSTS (client/transfer.py `refuse_redirect`)."""
        self.url = (url or os.environ.get("AOTC_URL") or DEFAULT_URL).rstrip("/")
        key = api_key or os.environ.get("AOTC_API_KEY")
        self.http = httpx.Client(base_url=self.url, timeout=timeout, verify=_tls_for(self.url),
                                 headers={"Authorization": f"Bearer {key}"} if key else None)
        self._own_http = self.http  # pulls go through client/transfer.py only while `http` is this one
        self._timeout = timeout
        self._direct: httpx.Client | None = None  # made on first use (`direct`): each httpx.Client loads the CA bundle
        self.cache_dir = Path(cache_dir or os.environ.get("AOTC_CACHE_DIR") or Path.home() / ".cache" / "aotc")
        pins = trusted_keys if trusted_keys is not None else os.environ.get(TRUSTED_KEYS_ENV) or None
        self.verifier = Verifier(self, _raise_for, pins, allow_unverified)
        self.redirect_hosts = transfer.redirect_hosts(
            redirect_hosts if redirect_hosts is not None else os.environ.get(transfer.REDIRECT_HOSTS_ENV))

    @property
    def direct(self) -> httpx.Client:
        """For presigned object-storage URLs on the httpx path: they carry their own signature, and must never see
        the API key. Made on first use: an httpx.Client loads the CA bundle (about 30 ms on 2 cores), and a server
        whose pulls take client/transfer.py's path never needs this one."""
        if self._direct is None:
            self._direct = httpx.Client(timeout=self._timeout)
        return self._direct

    def close(self) -> None:
        self.http.close()
        if self._direct is not None:
            self._direct.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        resp = self.http.request(method, path, **kw)
        _raise_for(resp)
        return resp.json()

    # -- models -------------------------------------------------------------------------------------------------

    def upload(self, model: Any, example_inputs: Sequence[Any] | None = None, *, name: str | None = None,
               dynamic_shapes: Any = None) -> dict[str, Any]:
        """Upload a .pt2 path, an ExportedProgram, or an nn.Module (exported here with `example_inputs`). The model
        id is the sha256 of the bytes: one the service names otherwise is refused (BadSignature, `mismatch`), so
        that what `compile` builds from it can be held to it."""
        if isinstance(model, (str, Path)):
            path = Path(model)
            digest = hashlib.sha256()

            def body(f: BinaryIO) -> Iterator[bytes]:  # hashed as it is sent: the file is read once
                while piece := f.read(1 << 20):
                    digest.update(piece)
                    yield piece

            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size  # announced: the service refuses an upload too large up front
                record = self._json("POST", "/v1/models", content=body(f), params={"name": name or path.stem},
                                    headers={"content-type": "application/octet-stream",
                                             "content-length": str(size)})
            sha256 = digest.hexdigest()
            if record.get("id") != sha256:
                raise BadSignature("mismatch", f"the service named the upload of {path.name} model "
                                               f"{str(record.get('id'))[:64]!r}, but its bytes' sha256 is {sha256}")
            return dict(record)
        import torch  # only to export

        ep = model
        if isinstance(model, torch.nn.Module):
            if example_inputs is None:
                raise ValueError("pass example inputs to export an nn.Module")
            ep = torch.export.export(model, tuple(example_inputs), dynamic_shapes=dynamic_shapes)
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / "model.pt2"
            torch.export.save(ep, str(p))
            return self.upload(p, name=name or type(model).__name__)

    def models(self) -> list[dict[str, Any]]:
        return list(self._json("GET", "/v1/models")["models"])

    # -- compile ------------------------------------------------------------------------------------------------

    def submit(self, model_id: str, shapes: Mapping[str, Any], target: str = "cpu", *,
               priority: str = "interactive", targets: Sequence[str] | None = None, name: str | None = None,
               tags: Sequence[str] = (), **options: Any) -> dict[str, Any]:
        """POST /v1/compilations: {'status': 'cached', 'artifact'} or {'status': 'queued'|'joined', 'job'}.
        `priority` is 'interactive' (served first) or 'batch'. `targets` (instead of `target`; 'all' for every
        target the farm serves): one job per target, and the answer's `targets` lists each. `name` records a new
        version of that registry name pointing at the model, and moves `tags` to it (the answer's `version`)."""
        body: dict[str, Any] = {"model_id": model_id, "shapes": dict(shapes), "options": options,
                                "priority": priority}
        if targets is not None:
            body["targets"] = list(targets)
        else:
            body["target"] = target
        if name is not None:
            body["name"] = name
            body["tags"] = list(tags)
        return dict(self._json("POST", "/v1/compilations", json=body))

    def compile(
        self,
        model: Any,
        example_inputs_or_shapes: Sequence[Any] | Mapping[str, Any],
        *,
        target: str = "cpu",
        dynamic_shapes: Any = None,
        buckets: Sequence[Sequence[Any] | Mapping[str, Any]] | None = None,
        progress: Callable[[dict[str, Any]], None] | None = None,
        timeout: float | None = None,
        priority: str = "interactive",
        name: str | None = None,
        tags: Sequence[str] = (),
        **options: Any,
    ) -> Artifact | Bundle:
        """Upload (or export and upload) a model, compile it for the given shapes, wait, and return the artifact.

        `example_inputs_or_shapes` is a sequence of tensors or shapes in input order, or {input name: shape}.
        With `buckets` (each like `example_inputs_or_shapes`, static, e.g. batch 1, 8 and 32), every bucket gets its
        own artifact too, and a Bundle comes back: `load` it for a callable that picks the smallest bucket that fits
        each call, else the main artifact. `name` records a new version of that registry name pointing at the
        model, and moves `tags` to it (then `load('NAME:TAG')` on a serving host).
        """
        by_name = isinstance(example_inputs_or_shapes, Mapping)
        if isinstance(model, (str, Path)):
            record = self.upload(model, name=name)
        else:
            record = self.upload(model, None if by_name else list(example_inputs_or_shapes),
                                 dynamic_shapes=dynamic_shapes, name=name)
        if isinstance(example_inputs_or_shapes, Mapping):
            shapes = {k: _shape_of(v) for k, v in example_inputs_or_shapes.items()}
        else:
            names = [i["name"] for i in record["inputs"]]
            given = list(example_inputs_or_shapes)
            if len(given) != len(names):
                raise ValueError(f"the program takes {len(names)} inputs {names}; got {len(given)}")
            shapes = {n: _shape_of(x) for n, x in zip(names, given, strict=True)}
            if dynamic_shapes is not None:
                # The module was exported with dynamic dims: compile one artifact for their whole (finite) range.
                for inp in record["inputs"]:
                    shapes[inp["name"]] = [
                        {"min": d["min"], "max": d["max"]} if isinstance(d, dict) and d.get("max") is not None else s
                        for d, s in zip(inp["shape"], shapes[inp["name"]], strict=False)  # the service checks ranks
                    ]
        if buckets is not None:
            names = [i["name"] for i in record["inputs"]]
            body = {"model_id": record["id"], "shapes": shapes, "target": target, "options": options,
                    "priority": priority, **({"name": name, "tags": list(tags)} if name is not None else {}),
                    "buckets": [{k: _shape_of(v) for k, v in (b.items() if isinstance(b, Mapping)
                                                            else zip(names, b, strict=False))}
                                for b in buckets]}
            answer = dict(self._json("POST", "/v1/compilations", json=body))
            parts = [answer, *answer.get("buckets", [])]
            arts = [Artifact(a["key"], a["artifact"]) if a["status"] == "cached"
                    else self.wait(a["job"]["id"], progress=progress, timeout=timeout) for a in parts]
            arts = [_asked_by_compile(a, record["id"], s, target, options)
                    for a, s in zip(arts, [shapes, *body["buckets"]], strict=True)]
            return Bundle(arts[0], arts[1:])
        answer = self.submit(record["id"], shapes, target, priority=priority, name=name, tags=tags, **options)
        art = (Artifact(answer["key"], answer["artifact"]) if answer["status"] == "cached"
               else self.wait(answer["job"]["id"], progress=progress, timeout=timeout))
        return _asked_by_compile(art, record["id"], shapes, target, options)

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(self._json("GET", f"/v1/jobs/{job_id}"))

    def jobs(self, limit: int = 50) -> list[dict[str, Any]]:
        return list(self._json("GET", "/v1/jobs", params={"limit": limit})["jobs"])

    def cancel(self, job_id: str) -> dict[str, Any]:
        return dict(self._json("DELETE", f"/v1/jobs/{job_id}"))

    def wait(self, job_id: str, *, progress: Callable[[dict[str, Any]], None] | None = None,
             timeout: float | None = None, poll_s: float = 0.5) -> Artifact:
        """Wait for a job by following its Server-Sent Events (GET /v1/jobs/{id}/events): no polling.

        `progress` gets {'id', 'state', 'stage', 'attempts', 'reason', 'not_before'} at each change, then the final
        job record.
        A dropped stream, an API restart, a 503 (Redis down) or a 429 (the key holds AOTC_MAX_STREAMS_PER_KEY
        streams already) is retried with backoff (from `poll_s` up to 5 s), resuming after the last event seen.
        Returns the artifact; raises JobFailed if the job failed or was cancelled, TimeoutError after `timeout`
        seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        view: dict[str, Any] = {"id": job_id, "state": "queued", "stage": "queued", "attempts": 0}
        last_id: str | None = None
        delay = poll_s
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"job {job_id} still {view['state']} after {timeout} s")
            headers = {"Last-Event-ID": last_id} if last_id else {}
            read_s = 30.0 if left is None else max(0.1, min(30.0, left))  # the server sends a keepalive every 10 s
            try:
                with connect_sse(self.http, "GET", f"/v1/jobs/{job_id}/events", headers=headers,
                                 timeout=httpx.Timeout(10.0, read=read_s)) as events:
                    resp = events.response
                    if resp.status_code not in (429, 502, 503, 504):
                        if not resp.is_success:
                            resp.read()
                        _raise_for(resp)
                        for sse in events.iter_sse():
                            last_id = sse.id or last_id
                            delay = poll_s
                            event, data = sse.event, sse.data
                            if event == "state":
                                ev = json.loads(data)
                                view.update(state=ev.get("state", view["state"]), stage=ev.get("stage", view["stage"]),
                                            reason=ev.get("reason"), not_before=ev.get("not_before"))
                                if ev.get("attempt"):
                                    view["attempts"] = int(ev["attempt"])
                                if progress:
                                    progress(dict(view))
                            elif event == "end":
                                job = json.loads(data)
                                if job is None:
                                    raise ClientError(404, f"job {job_id} is gone")
                                if progress:
                                    progress(job)
                                if job["state"] == "succeeded":
                                    return self.artifact(job["artifact"])
                                raise JobFailed(job)
                            elif event == "unavailable":
                                break  # the API is shutting down, or lost Redis: reconnect
            except httpx.TransportError:
                pass  # a dropped stream or an API restart: reconnect and resume
            time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic())))
            delay = min(delay * 2, 5.0)

    # -- artifacts ----------------------------------------------------------------------------------------------

    def artifact(self, key: str) -> Artifact:
        return Artifact(key, self._json("GET", f"/v1/artifacts/{key}/meta"))

    # -- the registry: names, versions, tags --------------------------------------------------------------------

    def names(self) -> list[dict[str, Any]]:
        return list(self._json("GET", "/v1/names")["names"])

    def versions(self, name: str) -> list[dict[str, Any]]:
        """Every version of a name, newest first, with its tags and what is built per target."""
        return list(self._json("GET", f"/v1/names/{_path(name)}")["versions"])

    def add_version(self, name: str, model_id: str, tags: Sequence[str] = ()) -> dict[str, Any]:
        """A new version of `name` pointing at an uploaded model, with `tags` moved to it."""
        return dict(self._json("POST", f"/v1/names/{_path(name)}/versions",
                               json={"model_id": model_id, "tags": list(tags)}))

    def resolve(self, ref: str) -> dict[str, Any]:
        """The version a reference names: 'bert-base:prod', 'bert-base@3', 'bert-base' (its latest)."""
        return dict(self._json("GET", f"/v1/refs/{_path(ref)}"))

    def tag(self, ref: str, tag: str) -> dict[str, Any]:
        """Move `tag` to the version `ref` names ('bert-base@3', or another tag: 'bert-base:canary')."""
        version = self.resolve(ref)
        return dict(self._json("PUT", f"/v1/names/{_path(version['name'])}/tags/{_path(tag)}",
                               json={"version": version["version"]}))

    def untag(self, name: str, tag: str) -> dict[str, Any]:
        return dict(self._json("DELETE", f"/v1/names/{_path(name)}/tags/{_path(tag)}"))

    def delete_version(self, name: str, version: int) -> dict[str, Any]:
        return dict(self._json("DELETE", f"/v1/names/{_path(name)}/versions/{int(version)}"))

    def tag_history(self, name: str) -> list[dict[str, Any]]:
        return list(self._json("GET", f"/v1/names/{_path(name)}/history")["moves"])

    def pick(self, ref: str, shapes: Mapping[str, Any] | None = None, *, device: str | None = None,
             target: str | None = None, training: bool = False) -> dict[str, Any]:
        """The artifact of `ref` for this machine: the exact target first, then a compatible one; the answer says
        why, and why every other candidate lost. `target` (a concrete one) overrides detection for `device`.
        `training`: a train step (mode=training) rather than an inference package."""
        host = Target.parse(target) if target else detect_target(device or "auto")
        params: list[tuple[str, str | int | float | bool | None]] = [("host", str(host))]
        if self.verifier.allow_unverified:
            params.append(("allow_unverified", "true"))
        if training:
            params.append(("training", "true"))
        torch_version = _torch_version()
        if torch_version:
            params.append(("torch", torch_version))
        for name, shape in (shapes or {}).items():
            params.append(("shape", f"{name}={format_shape(_shape_of(shape))}"))
        answer = dict(self._json("GET", f"/v1/refs/{_path(ref)}/pick", params=params))
        log.info("%s: picked %s (%s) for %s: %s", ref, answer["key"], answer["target"], answer["host"],
                 answer["reason"])
        return answer

    def _picked(self, ref: str, shapes: Mapping[str, Any] | None, device: str | None, target: str | None, *,
                training: bool) -> Artifact:
        """The artifact `pick` answers for a reference, with what was asked, which its signed manifest must answer
        (the version's model, a target this host runs, the shapes, inference or a train step)."""
        answer = self.pick(ref, shapes, device=device or "auto", target=target, training=training)
        return replace(self.artifact(answer["key"]), asked=asked_by_pick(ref, answer, shapes, training=training))

    def lookup(self, model_id: str, shapes: Mapping[str, Any], target: str = "cpu", *,
               graphs: bool = False) -> Artifact | None:
        """The artifact serving (model, shapes, target), or None. For inference servers at deploy time. `graphs`:
        you will load it with cuda_graphs=True, so of equally specialised artifacts the one whose CUDA-graph replay
        the check timed fastest."""
        # The value type httpx asks for (a list is invariant, so list[tuple[str, str]] would not do).
        params: list[tuple[str, str | int | float | bool | None]] = [("model_id", model_id), ("target", target)]
        if graphs:
            params.append(("graphs", "true"))
        if self.verifier.allow_unverified:
            params.append(("allow_unverified", "true"))
        for name, shape in shapes.items():
            params.append(("shape", f"{name}={format_shape(_shape_of(shape))}"))
        resp = self.http.get("/v1/artifacts/lookup", params=params)
        if resp.status_code == 404:
            return None
        _raise_for(resp)
        meta = resp.json()
        asked = Asked(model_id=model_id, target=target, training=False,
                      shapes={name: format_shape(_shape_of(shape)) for name, shape in shapes.items()})
        return Artifact(meta["key"], meta, asked)

    def self_contained(self, artifact: Artifact | str, *, progress: Callable[[dict[str, Any]], None] | None = None,
                       timeout: float | None = None) -> Artifact:
        """The artifact's self-contained build (weights inside the package, for tools that cannot bind a weights
        blob: torch's own `aoti_load_package` runs it as it is): POST /v1/artifacts/{key}/self-contained, then, if
        the service queued its build, wait for it (`progress` and `timeout` as in `wait`). An artifact that carries
        its weights already is its own self-contained build. Needs a key of scope compile."""
        key = artifact.key if isinstance(artifact, Artifact) else artifact
        answer = self._json("POST", f"/v1/artifacts/{key}/self-contained")
        if answer["status"] == "cached":
            return Artifact(answer["key"], answer["artifact"])
        return self.wait(answer["job"]["id"], progress=progress, timeout=timeout)

    def pull(self, artifact: Artifact | str, dest: str | Path | None = None, *, attempts: int = 3,
             rehash: bool = False, timings: dict[str, float] | None = None, self_contained: bool = False) -> Path:
        """Download a package into the local cache (or `dest`), verified against its signed manifest.

        `self_contained=True` pulls the artifact's self-contained build instead (`self_contained()`: built on
        request, then signed and verified like any artifact), a package that needs no weights blob.

        Before a byte is written, the manifest's signature must verify with a trusted key that is not revoked, name
        this artifact, and agree with the service's record (client/verify.py); the download must then have the
        signed digest (BLAKE3 where the manifest signs one, else sha256: compiler/digests.py) and size, computed
        while the bytes stream in (client/transfer.py). Any refusal raises
        compiler.errors.BadSignature and leaves nothing behind.

        A verified copy is recorded beside it (`<key>.pt2.verified`: its sha256, size, inode, mtime and ctime), so
        a later pull or load of the same artifact checks the signature and that record, not every byte again; a
        copy whose file changed since (another size, inode, mtime or ctime) is hashed again in full, as is every
        copy with `rehash=True`. The bytes land in `<key>.pt2.part` and are renamed only once verified. A pull that
        is cut off (a dropped connection, a killed process) resumes from what that file holds with a `Range`
        request: within this call up to `attempts` times, and in any later pull. With an S3 blob store the service
        redirects to a presigned URL and the bytes come straight from object storage. `dest` is a hard link to the
        cached copy where the file system allows (a copy, hashed again, where it does not).

        `timings`, if given, gets `verify_s` (manifest and signature, and the cached copy's check) and `pull_s`
        (the download, hashed on the way; 0 when the cache had it)."""
        return self._pull(artifact, dest, attempts=attempts, rehash=rehash, timings=timings,
                          self_contained=self_contained)[0]

    def _pull(self, artifact: Artifact | str, dest: str | Path | None = None, *, attempts: int = 3,
              rehash: bool = False, timings: dict[str, float] | None = None, self_contained: bool = False,
              fetched: Fetched | None = None) -> tuple[Path, Manifest]:
        """`pull`, and the signed manifest it verified (`load` binds the weights it names without asking again).
        `fetched`: the manifest already asked for, beside the record (`_artifact_fetched`)."""
        if self_contained:  # built from the same model for the same target and shapes: it answers the same question
            asked = artifact.asked if isinstance(artifact, Artifact) else None
            artifact = replace(self.self_contained(artifact), asked=asked)
            fetched = None
        t0 = time.perf_counter()
        if isinstance(artifact, Artifact):
            art = artifact
        else:
            art, fetched = self._artifact_fetched(artifact)
        # The record agrees with the signed manifest: its sha256 is signed.
        signed = self.verifier.manifest(art.key, art.meta, art.asked, fetched)
        cached = self.cache_dir / "artifacts" / f"{art.key}.pt2"
        want = signed.want
        hit = _verified(cached, want, rehash)
        t1 = time.perf_counter()
        if not hit:
            cached.parent.mkdir(parents=True, exist_ok=True)
            part = cached.with_name(cached.name + ".part")
            with open(part, "ab") as f, _locked(f):  # one writer per file, across processes
                if _verified(cached, want, rehash=False, record_only=True):  # another pull
                    # finished meanwhile (and recorded what it verified); a copy found wrong above is not hashed twice
                    _drop_if_empty(part, f)
                else:
                    digest = self._download(art, part, f, attempts, want)
                    try:
                        check_digest(signed, digest, os.fstat(f.fileno()).st_size, want)
                    except BadSignature:
                        part.unlink(missing_ok=True)  # not a prefix worth resuming from
                        raise
                    os.chmod(part, 0o444)  # an edit in place would fail, not go unseen until the next rehash
                    os.replace(part, cached)
                    _record(cached, signed.sha256)
        t2 = time.perf_counter()
        if timings is not None:
            timings["verify_s"] = t1 - t0
            timings["pull_s"] = t2 - t1
        if dest is None:
            return cached, signed
        dest = Path(dest)
        if dest.resolve() != cached.resolve():
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + ".part")
            tmp.unlink(missing_ok=True)
            try:
                os.link(cached, tmp)  # the verified inode itself: no bytes copied, none to hash again
            except OSError:
                shutil.copyfile(cached, tmp)
                try:
                    check_file(signed, tmp, want)  # what was copied, not what the cache held a moment before
                except BadSignature:
                    tmp.unlink(missing_ok=True)
                    raise
            os.replace(tmp, dest)
        return dest, signed

    def _artifact_fetched(self, key: str) -> tuple[Artifact, Fetched]:
        """Artifact `key`'s record, and its manifest with the keys trusted now (`Verifier.fetch`), asked for at once:
        the round trips before a pull's first byte, which a pull by key made one after the other."""
        pending = verify_pool().submit(self.verifier.fetch, key)
        art = self.artifact(key)  # its refusal (a 404) first, as before
        return art, pending.result()

    def _download(self, art: Artifact, part: Path, f: BinaryIO, attempts: int, want: Want, *,
                  what: str = "") -> str:
        """Complete `part` (open for appending as `f`) from its current size to `want.size`; returns the digest of
        the whole by `want.algorithm`. `what`: a sub-resource of the artifact (`weights`); `want.sha256` is the
        ETag."""
        size, etag = want.size, want.sha256
        url = f"/v1/artifacts/{art.key}" + (f"/{what}" if what else "")
        direct = self.http is self._own_http and transfer.direct_ok(self.url)
        for attempt in range(1, attempts + 1):
            f.flush()  # what an attempt that was cut off still buffers belongs to the prefix
            transfer.recover(part, f)  # a pull in ranges that died midway: back to the prefix it began from
            have = os.fstat(f.fileno()).st_size
            if have > size:
                f.truncate(0)
                have = 0
            streams = pull_streams(size - have) if direct else 1
            if streams > 1:
                try:
                    self._fetch_ranges(url, part, f, have, size, streams, etag)
                    return digests.file_digest(part, want.algorithm)  # BLAKE3 on every core: no range was hashed
                except transfer.NotRanged as e:  # a server that does not serve these ranges: one stream, below
                    log.info("artifact %s: pulled in one stream, not %d: %s", art.key, streams, e)
                except transfer.Cutoff:
                    if attempt == attempts:
                        raise
                    continue
                have = os.fstat(f.fileno()).st_size
            digest = digests.prefix(part, have, want.algorithm)
            if have == size:
                return digest.hexdigest()
            # If-Range: a copy of other bytes (the artifact was evicted and built again) comes back whole (200).
            headers = {"Range": f"bytes={have}-", "If-Range": f'"{etag}"'} if have else {}
            try:
                if direct:
                    self._fetch(url, headers, f, digest, have, size - have)
                else:
                    self._fetch_httpx(url, headers, f, digest, have, size - have)
                return digest.hexdigest()
            except transfer.Restart:
                f.truncate(0)
            except (httpx.TransportError, transfer.Cutoff):  # cut off midway: resume from what arrived
                if attempt == attempts:
                    raise
        raise ClientError(502, f"artifact {art.key}: the service never sent the bytes asked for")

    def _fetch(self, url: str, headers: dict[str, str], f: BinaryIO, digest: Any, have: int, limit: int) -> None:
        """The fast path (client/transfer.py): http.client into a few reused buffers, hashed as they are written."""
        with self._direct_refusals():
            transfer.fetch(self.url + url, {**self._direct_headers(), **headers}, f, digest, have,
                           timeout=self.http.timeout.read, limit=limit,
                           redirect_headers={"Range": headers["Range"]} if have else {}, allowed=self.redirect_hosts)

    def _fetch_ranges(self, url: str, part: Path, f: BinaryIO, have: int, size: int, streams: int,
                      etag: str) -> None:
        """The rest of a large body in `streams` ranges at once (client/transfer.py `fetch_ranges`)."""
        with self._direct_refusals():
            transfer.fetch_ranges(self.url + url, self._direct_headers(), part, f, have, size, streams, etag=etag,
                                  timeout=self.http.timeout.read, redirect=True, allowed=self.redirect_hosts)

    def _direct_headers(self) -> dict[str, str]:
        """What the fast path sends of this client's headers: its key and its user agent."""
        return {k: v for k, v in self.http.headers.items() if k.lower() in ("authorization", "user-agent")}

    @contextmanager
    def _direct_refusals(self) -> Iterator[None]:
        """The fast path's refusals (transfer.Refused) as the service's errors, as httpx's path raises them."""
        try:
            yield
        except transfer.Refused as e:
            _raise_for(httpx.Response(e.status, content=e.body, headers={"content-type": "application/json"}))
            raise ClientError(e.status, e.body[:500].decode(errors="replace")) from None

    def _fetch_httpx(self, url: str, headers: dict[str, str], f: BinaryIO, digest: Any, have: int,
                     limit: int) -> None:
        try:
            self._stream_httpx(url, headers, f, digest, have, limit)
        except transfer.Refused as e:  # more bytes than the signed size: as the fast path says it (ClientError)
            raise ClientError(e.status, e.body[:500].decode(errors="replace")) from None

    def _stream_httpx(self, url: str, headers: dict[str, str], f: BinaryIO, digest: Any, have: int,
                      limit: int) -> None:
        with self.http.stream("GET", url, headers=headers) as resp:
            if resp.status_code == 307:  # S3: the bytes come from the presigned URL (S3 has its own ETag)
                why = transfer.refuse_redirect(resp.headers.get("location", ""), self.url, self.redirect_hosts)
                if why:
                    raise ClientError(502, why)
                with self.direct.stream("GET", resp.headers["location"],
                                      headers={"Range": headers["Range"]} if have else {}) as direct:
                    self._append(direct, f, digest, have, limit)
            else:
                self._append(resp, f, digest, have, limit)

    @staticmethod
    def _append(resp: httpx.Response, f: BinaryIO, digest: Any, have: int, limit: int) -> None:
        if resp.status_code == 416:
            raise transfer.Restart  # what we hold is not a prefix of this artifact
        if not resp.is_success:
            resp.read()
        _raise_for(resp)
        if have and resp.status_code == 200:  # the whole body after all (If-Range did not match)
            raise transfer.Restart
        if resp.status_code == 206 and not resp.headers.get("content-range", "").startswith(f"bytes {have}-"):
            raise transfer.Restart
        transfer.within(resp.headers.get("content-length"), limit)
        try:
            for piece in resp.iter_bytes(1 << 20):
                limit -= len(piece)
                transfer.within(None, limit)
                digest.update(piece)
                f.write(piece)
        finally:  # what arrived is kept, in order, even when the stream was cut off: a resume starts after it
            f.flush()

    def pin(self, key: str) -> dict[str, Any]:
        """Keep an artifact: a pinned artifact is never evicted from the service's bounded store."""
        return dict(self._json("POST", f"/v1/artifacts/{key}/pin"))

    def unpin(self, key: str) -> dict[str, Any]:
        """Let an artifact be evicted again (least recently pulled first) when the store is full."""
        return dict(self._json("DELETE", f"/v1/artifacts/{key}/pin"))

    def report(self, key: str) -> dict[str, Any]:
        """The artifact's stage report (GET /v1/artifacts/{key}/report)."""
        return dict(self._json("GET", f"/v1/artifacts/{key}/report"))

    def sources(self, key: str) -> list[dict[str, Any]]:
        """The generated code and stage graphs of an artifact: [{'path', 'kind', 'bytes', 'url'}]."""
        return list(self._json("GET", f"/v1/artifacts/{key}/source")["files"])

    def source(self, key: str, path: str) -> str:
        resp = self.http.get(f"/v1/artifacts/{key}/source/{path}")
        _raise_for(resp)
        return resp.text

    def load(self, artifact: Artifact | Bundle | str, device: str | None = None, *,
             pad: bool = True, cuda_graphs: bool = False, rehash: bool = False,
             timings: dict[str, float] | None = None, shapes: Mapping[str, Any] | None = None,
             target: str | None = None) -> Callable[..., Any]:
        """Pull an artifact and load it with AOTInductor; returns a callable taking the model's inputs.
        `artifact` is an Artifact, a Bundle, a key, or a registry reference ('bert-base:prod', 'bert-base@3'):
        a reference resolves to a version and its artifact for this machine (`pick`: `shapes` it must serve, and
        `target` to override the target detected for `device`), with the reason logged. The pull
        verifies the signed manifest and the file before anything is loaded (a cached copy by its verified record,
        or every byte with `rehash=True`: see `pull`). A Bundle loads every artifact in it, and the callable picks
        the smallest bucket that fits each call (padding the batch, dim 0, unless `pad=False`), else the main
        artifact. `cuda_graphs=True` replays a CUDA graph per static shape (each bucket's), and runs plainly, with
        a logged reason, where it cannot (client/graphs.py).

        `timings`, if given (a dict; not for a Bundle), gets the time to first inference split into seconds:
        `verify_s` (manifest, signature, the cached copy's check), `pull_s` (the download, hashed as it streams),
        `bind_s` (the device: the target check, which initialises CUDA on a GPU), `weights_s` (a weightless
        package's weights blob: pulled and verified, or found, and put on the device; of it, `weights_pull_s` the
        pull and its check, `weights_load_s` the mapping and the copy to the device: on a GPU, what of the copy was
        left once the pull ended, the blob going onto the device as it arrives), `load_s` (the package opened
        and its weights bound) and, once the callable has run, `first_call_s` (the first call, synchronised on a
        GPU; with graphs, its capture)."""
        if isinstance(artifact, Bundle):
            if timings is not None:
                raise ValueError("timings are per artifact: load a Bundle's artifacts one by one to time them")
            main = ((artifact.main, self.load(artifact.main, device, cuda_graphs=cuda_graphs, rehash=rehash))
                    if artifact.main.meta.get("package", True) else None)
            return BucketedModel(main, [(b, self.load(b, device, cuda_graphs=cuda_graphs, rehash=rehash))
                                        for b in artifact.buckets], pad=pad)
        fetched = None
        if isinstance(artifact, Artifact):
            art = artifact
        elif _KEY.fullmatch(artifact):
            art, fetched = self._artifact_fetched(artifact)
        else:
            art = self._picked(artifact, shapes, device, target, training=False)
        path, signed = self._pull(art, rehash=rehash, timings=timings, fetched=fetched)
        from compiler.compat.aoti import aoti_load_package  # imports torch: only to load

        t0 = time.perf_counter()
        built = Target.parse(str(art.meta.get("target", "")))
        device = device or ("cuda:0" if built.kind == "cuda" else "cpu")
        _check_target(built, device, art.meta)
        t1 = time.perf_counter()
        # A weightless package binds the model's weights blob: pulled and verified once, one copy per device in
        # this process, shared by every bucket and version that names the same blob.
        weights = self._device_weights(art, signed, device, rehash, timings) if art.meta.get("weights") else None
        t2 = time.perf_counter()
        fn: Callable[..., Any]
        if cuda_graphs:
            from client.graphs import load_graphed  # imports torch: only to load

            fn = load_graphed(str(path), {"key": art.key, **art.meta}, device, weights=weights)
        else:
            fn = aoti_load_package(str(path), device, weights=weights, expect=art.meta.get("spec"))
        if timings is None:
            return fn
        timings["bind_s"] = t1 - t0
        timings["weights_s"] = t2 - t1
        timings["load_s"] = time.perf_counter() - t2
        return _FirstCallTimed(fn, timings, device)

    def load_training(self, artifact: Artifact | str, model: Any, device: str | None = None, *,
                      rehash: bool = False, shapes: Mapping[str, Any] | None = None,
                      target: str | None = None) -> Any:
        """Pull a train-step package (mode=training) and bind it to `model`'s LIVE parameters and buffers (a
        torch.nn.Module, or a mapping FQN -> the tensors it holds); returns a `client.training.TrainStep`:
        `loss, outputs = step(*batch)` runs forward and backward, accumulates each gradient into `.grad` as
        `loss.backward()` does, and updates mutated buffers in place, so any torch optimizer works unchanged.
        `artifact` is resolved and its package verified as `load` does; the output roles are read from its signed
        manifest, and each bound tensor is checked against the signed constants (name, shape, dtype). The weights
        blob is not downloaded: the caller's tensors are the weights."""
        if isinstance(artifact, Artifact):
            art = artifact
        elif _KEY.fullmatch(artifact):
            art = self.artifact(artifact)
        else:
            art = self._picked(artifact, shapes, device, target, training=True)
        signed = self.verifier.manifest(art.key, art.meta, art.asked)
        train = (signed.predicate.get("check") or {}).get("training")
        if not isinstance(train, Mapping):
            raise ValueError(f"artifact {art.key} is not a train-step package (compile with mode=training); load it "
                             "with Client.load")
        path = self.pull(art, rehash=rehash)
        built = Target.parse(str(art.meta.get("target", "")))
        device = device or ("cuda:0" if built.kind == "cuda" else "cpu")
        _check_target(built, device, art.meta)
        from client.training import TrainStep  # imports torch: only to load

        return TrainStep(str(path), train, (signed.weights or {}).get("constants") or [], model, device,
                         expect=art.meta.get("spec"))

    def pull_weights(self, artifact: Artifact | str, dest: str | Path | None = None, *,
                     attempts: int = 3, rehash: bool = False) -> Path | None:
        """The weights blob a weightless artifact binds, into the local cache by its sha256 (or to `dest`), verified
        against the artifact's signed manifest: its digest (as `pull`'s) and size, and every constant's name, shape,
        dtype and stride as its header says them (read strictly, without torch). None for a package that carries its own
        weights. A blob verified once in this process is not hashed again; another bucket of the model that names
        the same blob downloads nothing more."""
        art = artifact if isinstance(artifact, Artifact) else self.artifact(artifact)
        return self._pull_weights(art, dest, attempts, rehash)

    def _pull_weights(self, art: Artifact, dest: str | Path | None = None, attempts: int = 3, rehash: bool = False,
                      follow: Callable[[Path, Want, Mapping[str, Any]], Any] | None = None,
                      signed: Manifest | None = None) -> Path | None:
        """`pull_weights`; `follow(part, want, signed weights)`, where the blob is downloaded, may return a
        compiler.weights.Follower to put it on a device as it arrives, told `pulled()` once the download ends.
        `signed`: the artifact's manifest, verified by this call's caller a moment ago (`load`), else verified
        here."""
        if not art.meta.get("weights"):
            return None
        if signed is None:
            signed = self.verifier.manifest(art.key, art.meta)
        w = signed.weights
        if w is None:
            raise BadSignature("mismatch", f"artifact {art.key}: the record names a weights blob, its signed manifest "
                                           "none", kid=signed.kid)
        want = signed.weights_want
        assert want is not None
        cached = self.cache_dir / "weights" / f"{want.sha256}.safetensors"
        if not _weights_verified(cached, want, w, rehash):
            cached.parent.mkdir(parents=True, exist_ok=True)
            part = cached.with_name(cached.name + ".part")
            with open(part, "ab") as f, _locked(f):
                if _weights_verified(cached, want, w):
                    _drop_if_empty(part, f)
                else:
                    follower = follow(part, want, w) if follow is not None else None
                    try:
                        digest = self._download(art, part, f, attempts, want, what="weights")
                    finally:
                        if follower is not None:
                            follower.pulled()
                    got = os.fstat(f.fileno()).st_size
                    if not want.matches(digest, got):
                        part.unlink(missing_ok=True)
                        raise BadSignature("mismatch", f"the weights of artifact {art.key} arrived corrupt or "
                                           f"tampered with: {want.algorithm} {digest} ({got} bytes), but its signed "
                                           f"manifest says {want.hexdigest} ({want.size} bytes)", kid=signed.kid)
                    os.chmod(part, 0o444)
                    os.replace(part, cached)
                    # Hashed as it streamed in: the check below reads the record, not the bytes.
                    _record(cached, want.sha256)
            if not _weights_verified(cached, want, w):
                cached.unlink(missing_ok=True)
                raise BadSignature("mismatch", f"the weights of artifact {art.key}: their header does not list the "
                                               "constants its signed manifest lists", kid=signed.kid)
        if dest is None:
            return cached
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        tmp.unlink(missing_ok=True)
        try:
            os.link(cached, tmp)  # the verified inode itself: no bytes copied, none to hash a second time
            copied = False
        except OSError:
            shutil.copyfile(cached, tmp)
            copied = True
        # What was copied, not what the cache held a moment before.
        if copied and _file_digest(tmp, want.algorithm) != want.hexdigest:
            tmp.unlink(missing_ok=True)
            raise BadSignature("mismatch", f"the weights of artifact {art.key} changed while copied", kid=signed.kid)
        os.replace(tmp, dest)
        return dest

    def _device_weights(self, art: Artifact, signed: Manifest, device: str, rehash: bool = False,
                        timings: dict[str, float] | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        follower: Any = None

        def follow(part: Path, want: Want, signed: Mapping[str, Any]) -> Any:
            # On a GPU, a blob being downloaded goes onto the device as it arrives (compiler.weights.Follower),
            # its copy checked by its own digest of what it copied; not for a pull in ranges (holes, then bytes).
            nonlocal follower
            if not device.startswith("cuda") or pull_streams(want.size) > 1 or (want.sha256, device) in _LOADED:
                return None
            from compiler.weights import Follower, chunked  # imports torch: only to load

            if chunked():
                follower = Follower(part, device, size=want.size, algorithm=want.algorithm, digest=want.hexdigest,
                                    constants=signed.get("constants"))
            return follower

        path = self._pull_weights(art, rehash=rehash, follow=follow, signed=signed)
        assert path is not None
        t1 = time.perf_counter()
        # The signed digest (the cached file's name), never the record's: a record cannot point this artifact at
        # tensors another artifact loaded.
        sha = path.name.removesuffix(".safetensors")
        with _LOADED_LOCK:
            found = _LOADED.get((sha, device))
            if found is None and follower is not None:
                found = follower.result()  # the verified blob's bytes, hashed as they were copied
                if found is None:
                    log.info("weights blob %s: put on %s from the verified file: %s", sha[:16], device,
                             follower.reason)
                else:
                    log.debug("weights blob %s: put on %s as it arrived", sha[:16], device)
                    _LOADED[(sha, device)] = found
            if found is None:
                from compiler.weights import load  # imports torch: only to load

                found = _LOADED[(sha, device)] = load(path, device)
        if follower is not None:  # one that another thread's load made needless still ends here
            follower.result()
        if timings is not None:
            timings["weights_pull_s"] = t1 - t0
            timings["weights_load_s"] = time.perf_counter() - t1
            if follower is not None:  # within the pull: where the copy as it arrived spent its time
                timings.update({f"follow_{k}": v for k, v in follower.seconds.items()})
        return found

    def workers(self) -> list[dict[str, Any]]:
        return list(self._json("GET", "/v1/workers")["workers"])

    def caches(self) -> dict[str, Any]:
        """GET /v1/caches: the compile caches workers share (max-autotune timings, Inductor remote entries)."""
        return dict(self._json("GET", "/v1/caches"))

    def clear_caches(self) -> dict[str, int]:
        return dict(self._json("DELETE", "/v1/caches")["removed"])

    # -- keys and namespaces ------------------------------------------------------------------------------------

    def me(self) -> dict[str, Any]:
        """The key this client sends: its scope, namespace, and the namespace's usage against its quotas."""
        return dict(self._json("GET", "/v1/me"))

    def create_key(self, scope: str, namespace: str = "default", name: str = "") -> dict[str, Any]:
        """A new API key (admin). The answer's `key` is the only copy of the key: the service keeps its hash."""
        return dict(self._json("POST", "/v1/keys", json={"scope": scope, "namespace": namespace, "name": name}))

    def keys(self) -> list[dict[str, Any]]:
        return list(self._json("GET", "/v1/keys")["keys"])

    def revoke_key(self, key_id: str) -> dict[str, Any]:
        return dict(self._json("DELETE", f"/v1/keys/{key_id}"))

    def namespaces(self) -> list[dict[str, Any]]:
        return list(self._json("GET", "/v1/namespaces")["namespaces"])

    def set_quota(self, namespace: str, *, max_jobs: int | None = None,
                  max_stored_gb: float | None = None) -> dict[str, Any]:
        body = {k: v for k, v in (("max_jobs", max_jobs), ("max_stored_gb", max_stored_gb)) if v is not None}
        return dict(self._json("PUT", f"/v1/namespaces/{namespace}/quota", json=body))


def _tls_for(url: str) -> ssl.SSLContext | bool:
    """What `Client.http` verifies TLS with. For an https service, httpx's default: the CA bundle, which it loads when
    the client is made (about 25 ms on 2 cores). For a plain-HTTP service, a context that trusts no certificate, so
    a client starts without loading the bundle, and a TLS request through `http` (an absolute https URL) fails its
    handshake instead of going unverified."""
    if urlsplit(url).scheme.lower() != "http":
        return True
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, hostnames checked, no CA loaded


def detect_target(device: str) -> Target:
    """This machine's concrete target for `device` ('cpu', 'cuda:0', 'auto'): what a pull by name asks the service
    for. A CPU: its x86-64 level from /proc/cpuinfo (compiler.targets.detect_cpu_target, torch-free); a GPU, or
    'auto': torch's view of the device (compiler.device), the cuda-smXX that `load` checks."""
    from compiler.targets import detect_cpu_target

    if device.split(":")[0] == "cpu":
        return Target.parse(detect_cpu_target())
    try:
        from compiler.device import host_target  # imports torch: to ask it what the device is
    except ImportError:
        raise ClientError(422, "cannot detect this machine's target without torch installed; name it instead "
                          "(--target, or target=), e.g. cpu-x86_64-avx2 or cuda-sm90") from None
    try:
        return host_target(device)
    except RuntimeError as e:
        raise ClientError(409, str(e)) from None


def _torch_version() -> str | None:
    """The torch this machine would load with (what workers record as `torch.__version__`), without importing it
    when it is not imported yet."""
    loaded = sys.modules.get("torch")
    if loaded is not None and isinstance(getattr(loaded, "__version__", None), str):
        return str(loaded.__version__)
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _path(part: str) -> str:
    """A name, tag or reference as one URL path segment (':' and '@' are allowed there)."""
    return quote(part, safe=":@")


class _FirstCallTimed:
    """A loaded artifact that writes its first call's seconds into `timings["first_call_s"]` (on a GPU, until the
    device is idle: a launch alone is not an inference). Other attributes are the artifact's own."""

    def __init__(self, fn: Callable[..., Any], timings: dict[str, float], device: str) -> None:
        self._fn, self._timings, self._device = fn, timings, device
        self._first = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._first:
            return self._fn(*args, **kwargs)
        t0 = time.perf_counter()
        out = self._fn(*args, **kwargs)
        if self._device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(self._device)
        self._timings["first_call_s"] = time.perf_counter() - t0
        self._first = False
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)


# Weights blobs loaded in this process, by (sha256, device): every package that binds one shares these tensors
# (user-managed), so three buckets of a model hold one copy. They stay for the life of the process.
_LOADED: dict[tuple[str, str], dict[str, Any]] = {}
_LOADED_LOCK = threading.Lock()
# Blob files verified in this process (path -> (sha256, size, and the file's identity: inode, device, mtime and
# ctime in ns, as the pull's `.verified` record keeps them)): a second bucket skips hashing them again. ctime, which
# no one can set, tells a file rewritten in place under the same size and a restored mtime.
_VERIFIED: dict[Path, tuple[str, int, tuple[int, ...]]] = {}


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns)


def _weights_verified(path: Path, want: Want, signed: Mapping[str, Any], rehash: bool = False) -> bool:
    """Whether `path` holds the signed weights blob (`want`: its digest and size), and a header (read strictly)
    listing the signed constants. Remembered per process while the file is unchanged."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    if not rehash and _VERIFIED.get(path) == (want.sha256, want.size, _identity(st)):
        return True
    if not _verified(path, want, rehash):  # by its record where it has one: a new process hashes no
        return False                                  # blob a pull already verified
    from compiler.weightsfile import FormatError, describe, read_header_file

    try:
        if describe(read_header_file(path)) != signed.get("constants"):
            return False
    except FormatError:
        return False
    _VERIFIED[path] = (want.sha256, want.size, _identity(st))
    return True


def _check_target(target: Target, device: str, meta: dict[str, Any] | None = None) -> None:
    """Refuse to load an artifact built for another device than the one here: a clear error beats a crash. A CPU
    package from before x86-64 levels (an old label, no pin among its factors) was built with -march=native: it
    loads only on a CPU of the model that built it, since another may lack an extension it uses (SIGILL)."""
    from compiler.device import cpu_name, host_target  # imports torch: only to load

    try:
        host = host_target(device)
    except RuntimeError as e:
        raise ClientError(409, f"artifact was built for {target}; {e}") from None
    why = target.cannot_run_on(host)
    if why:
        raise ClientError(409, f"artifact {why}")
    factors = (meta or {}).get("factors")
    if target.level is not None and isinstance(factors, dict) and "isa" not in factors:
        built_on = str(((meta or {}).get("worker") or {}).get("device_name") or "an unknown CPU")
        if built_on != cpu_name():
            raise ClientError(409, f"artifact was built before x86-64 levels, with -march=native on {built_on}; "
                                   f"this CPU is {cpu_name()}, which may lack an extension it uses: compile it "
                                   f"again for {target}")


STREAMS_ENV = "AOTC_PULL_STREAMS"


def pull_streams(remaining: int) -> int:
    """How many ranged connections a pull of `remaining` bytes uses: AOTC_PULL_STREAMS (default 1: one stream,
    hashed as it arrives). With N > 1 a body comes in up to N ranges at once (at least 8 MiB each:
    transfer.RANGE_MIN), and the whole file is hashed once it has landed (BLAKE3 on every core). Not the default:
    on a 16-core GPU host, over loopback, it pulled 800 MB 1.2x faster than one stream at 3.6x the client's CPU,
    and a fresh process's time to first inference was no shorter (bench/README.md, "Verified pull by BLAKE3").
    It is for a link that one TCP stream cannot fill (object storage across a network)."""
    setting = os.environ.get(STREAMS_ENV, "").strip() or "1"
    try:
        n = int(setting)
    except ValueError:
        raise ClientError(400, f"{STREAMS_ENV}={setting!r}: give a number of streams (1: one)") from None
    return max(1, min(n, remaining // transfer.RANGE_MIN))


def _file_digest(path: Path, algorithm: str) -> str:
    return digests.file_digest(path, algorithm)


def _verified(cached: Path, want: Want, rehash: bool, record_only: bool = False) -> bool:
    """Whether `cached` holds the file `want` describes: by its record (`<file>.verified`, which names the signed
    sha256) while the file is the one recorded (inode, size, mtime, ctime), else (unless `record_only`) by hashing
    it (by `want.algorithm`), and recording it when it matches."""
    try:
        st = cached.stat()
    except FileNotFoundError:
        return False
    if st.st_size != want.size:
        return False
    if not rehash:
        try:
            record = json.loads(cached.with_name(cached.name + ".verified").read_text())
        except (OSError, ValueError):
            record = None
        if record == _stamp(st, want.sha256):
            return True
    if record_only:
        return False
    if _file_digest(cached, want.algorithm) != want.hexdigest:
        # Found wrong: the record vouches for it no more (a copy corrupted in place can keep its stat).
        cached.with_name(cached.name + ".verified").unlink(missing_ok=True)
        return False
    _record(cached, want.sha256)
    return True


def _stamp(st: os.stat_result, sha256: str) -> dict[str, Any]:
    # ctime too: a chmod (the copy is read-only) and every write move it, and a user cannot set it back.
    return {"sha256": sha256, "size": st.st_size, "ino": st.st_ino, "dev": st.st_dev, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns}


def _record(cached: Path, sha256: str) -> None:
    """Note that `cached`, as it is now, was verified to have `sha256` (write-then-rename: never half a record)."""
    record = cached.with_name(cached.name + ".verified")
    tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(_stamp(cached.stat(), sha256)))
    os.replace(tmp, record)


def _drop_if_empty(path: Path, f: BinaryIO) -> None:
    """Remove the empty file this process created at `path`, unless `path` is another process's by now."""
    try:
        mine, there = os.fstat(f.fileno()), os.stat(path)
    except FileNotFoundError:
        return
    if mine.st_size == 0 and (mine.st_ino, mine.st_dev) == (there.st_ino, there.st_dev):
        path.unlink(missing_ok=True)


@contextmanager
def _locked(f: BinaryIO) -> Iterator[None]:
    """An exclusive lock on an open file, where the platform has one (fcntl)."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; the sha256 check still catches a mix-up
        yield
        return
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
