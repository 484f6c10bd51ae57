"""The registry: names, versions and tags in the caller's namespace (service/store/names.py), and resolving a
reference (`bert-base:prod`) to a version and to the artifact that fits a host.

Reading needs a pull key, so an inference server can resolve a tag and pick its artifact and nothing more;
changing versions and tags needs a compile key. A name resolves only inside the caller's namespace (an admin's: its
own namespace too), so another namespace's name answers exactly as a missing one.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, cast

from fastapi import APIRouter, Path, Query, Request, Response
from pydantic import StringConstraints
from starlette.types import Scope

from compiler import refs
from compiler import shapes as specs
from compiler.errors import NotFound
from compiler.refs import Ref
from compiler.targets import Target
from service.api.auth import Compile, Principal, Pull, needs
from service.api.cache import Found, Reads, digest, render
from service.api.deps import SettingsDep, StoreDep, find_model, resolve_model
from service.api.lookup import BOOLS, PlainGet, query_params
from service.api.pick import pick
from service.api.schemas import (
    CONCRETE_TARGET,
    MAX_SHAPE_ARG,
    MAX_SHAPE_ARGS,
    MAX_TARGET,
    REF,
    REG_WORD,
    REG_WORD_MAX,
    SHAPE_ARG,
    V1_ERRORS,
    Limit,
    NameList,
    NameVersions,
    NewVersion,
    Pick,
    TagAnswer,
    TagHistory,
    TagRequest,
    VersionDeleted,
    VersionRecord,
    errors,
)
from service.api.settings import Settings
from service.store import Store, keys, scripts
from service.store.names import Version

router = APIRouter(prefix="/v1", tags=["names"], responses=V1_ERRORS, dependencies=needs("pull"))

NamePath = Annotated[str, Path(max_length=REG_WORD_MAX, pattern=REG_WORD, description="A registry name: lowercase "
                               "letters, digits, '.', '_', '-' (at most AOTC_MAX_REGISTRY_NAME_CHARS).")]
TagPath = Annotated[str, Path(max_length=REG_WORD_MAX, pattern=REG_WORD, description="A tag: the same grammar as a "
                              "name; 'latest' is never set (409).")]
VersionPath = Annotated[str, Path(pattern=r"^[1-9][0-9]{0,8}$", max_length=9, description="The version number "
                                  "(from 1).")]
RefPath = Annotated[str, Path(max_length=2 * REG_WORD_MAX + 1, pattern=REF, description="NAME, NAME:TAG or "
                              "NAME@VERSION (NAME is NAME:latest).")]
_SETTING = "AOTC_MAX_REGISTRY_NAME_CHARS"
TORCH_VERSION = r"^[0-9A-Za-z.+_-]+$"  # a host's torch version, as the pick reads it
MAX_REF_HINTS = 100_000  # (namespace, reference) -> model id hints kept per API process; then they start over


def _name(settings: Settings, name: str) -> str:
    return refs.check_word("name", name, settings.max_registry_name_chars, _SETTING)


def _tag(settings: Settings, tag: str) -> str:
    return refs.check_tag(tag, settings.max_registry_name_chars, _SETTING)


def _ref(settings: Settings, text: str) -> Ref:
    ref = Ref.parse(text)
    _name(settings, ref.name)
    if ref.tag is not None and ref.tag != refs.LATEST:
        refs.check_word("tag", ref.tag, settings.max_registry_name_chars, _SETTING)
    return ref


def _targets(store: Store, version: Version) -> list[dict[str, Any]]:
    """Per target: the model's artifacts (built), then what its compile request asked for that is not built yet,
    with its job's state."""
    out: list[dict[str, Any]] = []
    built: set[str] = set()
    for a in sorted(store.artifacts.for_model(version.model_id), key=lambda a: (a["target"], a["created"])):
        built.add(a["key"])
        out.append({"target": a["target"], "status": "built", "key": a["key"], "job": a.get("job_id"),
                    "spec": a["spec"]})
    for b in version.builds:
        if b.get("key") in built:
            continue
        job = store.jobs.get(b["job"]) if b.get("job") else None
        state = job["state"] if job else b.get("status", "unknown")
        # A succeeded job whose artifact is gone was evicted (only what no version holds is).
        out.append({"target": b["target"], "status": "evicted" if state == "succeeded" else state,
                    "key": b.get("key"), "job": b.get("job")})
    return out


@router.get("/names", response_model=NameList, responses=errors(422))
def list_names(store: StoreDep, who: Pull, limit: Limit = 100) -> dict[str, Any]:
    """The registry names of the caller's namespace, oldest first: how many versions each has, its latest and its
    tags."""
    out = []
    for name in store.names.names(who.namespace, limit):
        versions = store.names.versions(who.namespace, name)
        tags = {t: v.version for v in versions for t in v.tags if t != refs.LATEST}
        out.append({"name": name, "versions": len(versions),
                    "latest": versions[0].version if versions else None, "tags": tags})
    return {"names": out}


@router.get("/names/{name}", response_model=NameVersions, response_model_exclude_unset=True, responses=errors(
    404, 422, why={
    404: "No such name in the caller's namespace", 422: "Not a valid name"}))
def name_versions(name: NamePath, store: StoreDep, settings: SettingsDep, who: Pull) -> dict[str, Any]:
    """Every version of a name, newest first: its model, who made it and when, its tags, and per target what is
    built (the artifact's key) or still queued."""
    versions = store.names.versions(who.namespace, _name(settings, name))
    if not versions:
        raise NotFound(f"no name {name!r} in namespace {who.namespace!r}")
    return {"name": name, "versions": [{**v.to_json(), "artifacts": _targets(store, v)} for v in versions]}


@router.get("/names/{name}/history", response_model=TagHistory, responses=errors(422))
def tag_history(name: NamePath, store: StoreDep, settings: SettingsDep, who: Pull) -> dict[str, Any]:
    """Every tag move of a name, newest first: which tag, from and to which version, by which key, when."""
    return {"name": name, "moves": store.names.history(who.namespace, _name(settings, name),
                                                        settings.tag_history_len)}


@router.post("/names/{name}/versions", status_code=201, response_model=VersionRecord, responses=errors(
    400, 404, 409, 422, why={404: "No such model in the caller's namespace", 409: "A tag of 'latest'",
                        422: "A bad name or tag, or a limit reached"}))
def add_version(name: NamePath, body: NewVersion, store: StoreDep, settings: SettingsDep,
                who: Compile) -> dict[str, Any]:
    """Record a new version of a name pointing at a model the caller's namespace holds, and move `tags` to it
    (`aotc compile --name` does this with the compile request's builds)."""
    _name(settings, name)
    tags = [_tag(settings, t) for t in body.tags]
    model = resolve_model(store, body.model_id, who.ns)
    return store.names.add_version(who.namespace, name, model["id"], who.key_id, tags=tags,
                                   limits=settings.registry_limits()).to_json()


@router.delete("/names/{name}/versions/{version}", response_model=VersionDeleted, responses=errors(
    404, 422, why={404: "No such version"}))
def delete_version(name: NamePath, version: VersionPath, store: StoreDep, settings: SettingsDep,
                   who: Compile) -> dict[str, Any]:
    """Delete a version and the tags on it. Its model's artifacts stay pinned while another version (of any name
    or namespace) holds the model; otherwise the bounded cache may evict them again, least recently pulled first.
    The answer counts the versions of the caller's namespace that still hold it: another namespace's versions of a
    model are its own business (counting them told a tenant whether another registry held the same model)."""
    _name(settings, name)
    number = int(version)
    got = store.names.get(who.namespace, name, number)
    removed = store.names.delete_version(who.namespace, name, number, who.key_id, limits=settings.registry_limits())
    return {"ref": f"{name}@{version}", "tags_removed": removed,
            "model_still_held_by": len(store.names.holders(got.model_id, who.namespace)) if got else 0}


@router.put("/names/{name}/tags/{tag}", response_model=TagAnswer, responses=errors(
    400, 404, 409, 422, why={404: "No such version", 409: "'latest' cannot be set",
                        422: "A bad name or tag, or AOTC_MAX_TAGS_PER_NAME reached"}))
def move_tag(name: NamePath, tag: TagPath, body: TagRequest, store: StoreDep, settings: SettingsDep,
             who: Compile) -> dict[str, Any]:
    """Point a tag at a version, atomically; the move is recorded with the key that made it and when."""
    _name(settings, name)
    _tag(settings, tag)
    previous = store.names.move_tag(who.namespace, name, tag, body.version, who.key_id,
                                    limits=settings.registry_limits())
    return {"name": name, "tag": tag, "version": body.version, "previous": previous}


@router.delete("/names/{name}/tags/{tag}", response_model=TagAnswer, responses=errors(404, 409, 422))
def remove_tag(name: NamePath, tag: TagPath, store: StoreDep, settings: SettingsDep, who: Compile) -> dict[str, Any]:
    """Remove a tag (recorded in the history); the version stays."""
    _name(settings, name)
    _tag(settings, tag)
    previous = store.names.untag(who.namespace, name, tag, who.key_id, limits=settings.registry_limits())
    return {"name": name, "tag": tag, "version": None, "previous": previous}


async def _resolve_async(request: Request, who: Principal, ref: Ref) -> Version:
    """`_resolve` on the event loop (the deploy-time path): one EVALSHA, no thread-pool hop."""
    script = getattr(request.app.state, "resolve_ref", None)
    if script is None:
        script = request.app.state.resolve_ref = request.app.state.aredis.register_script(scripts.RESOLVE)
    kind, value = (("version", str(ref.version)) if ref.version is not None
                   else ("latest", "") if ref.tag == refs.LATEST else ("tag", ref.tag or ""))
    got = await script(keys=[keys.reg(who.namespace, ref.name, "versions"), keys.reg(who.namespace, ref.name, "tags")],
                       args=[kind, value])
    if not got:
        raise NotFound(f"no {ref} in namespace {who.namespace!r}; `aotc versions {ref.name}` lists its versions "
                       "and tags")
    v, raw, *tags = cast(list[str], got)
    return Version.from_raw(ref.name, v, raw, tags + ([refs.LATEST] if ref.tag == refs.LATEST else []))


async def _resolve_and_find(request: Request, who: Principal, ref: Ref) -> tuple[list[str], Found]:
    """`_resolve_async` and `find_model(..., with_artifacts=True)` in one round trip (RESOLVE_FIND): the version's
    raw parts (version, record, tags) and its model with its artifacts. 404 for either missing."""
    script = getattr(request.app.state, "resolve_find", None)
    if script is None:
        script = request.app.state.resolve_find = request.app.state.aredis.register_script(scripts.RESOLVE_FIND)
    reads: Reads = request.app.state.reads
    # The model this reference named last time, where its record is still held here: then the script only checks
    # that it exists (a hint: a tag moved meanwhile reads the new model's record).
    hints: dict[tuple[str, str], str] | None = getattr(request.app.state, "ref_models", None)
    if hints is None:
        hints = request.app.state.ref_models = {}
    hint = hints.get((who.namespace, str(ref)), "")
    kind, value = (("version", str(ref.version)) if ref.version is not None
                   else ("latest", "") if ref.tag == refs.LATEST else ("tag", ref.tag or ""))
    got = await script(keys=[keys.reg(who.namespace, ref.name, "versions"), keys.reg(who.namespace, ref.name, "tags")],
                       args=[kind, value, keys.model(""), keys.artifacts_by_model(""), keys.artifact(""),
                             hint if reads.models.peek(hint) is not None else ""])
    if not got:
        raise NotFound(f"no {ref} in namespace {who.namespace!r}; `aotc versions {ref.name}` lists its versions "
                       "and tags")
    parts = cast(str, got).split("\0")
    ntags = int(parts[2])
    raw_version = [parts[0], parts[1], *parts[3:3 + ntags]]
    rest = parts[3 + ntags:]
    if rest[0] == "none":
        raise NotFound(f"the model of {ref} ({json.loads(parts[1]).get('model_id', '')[:12]}) is gone")
    model_id, raw_model, pairs = rest[0], rest[1], rest[2:]
    if raw_model:
        reads.models.put(model_id, None, raw_model)
    elif (held := reads.models.peek(model_id)) is not None:
        raw_model = held
    else:  # dropped from this process's memory meanwhile: read the model after all
        return raw_version, await find_model(reads, model_id, with_artifacts=True)
    if len(hints) >= MAX_REF_HINTS:
        hints.clear()
    hints[(who.namespace, str(ref))] = model_id
    return raw_version, Found(model_id, raw_model, tuple(sorted(zip(pairs[::2], pairs[1::2]))))


@router.get("/refs/{ref}", response_model=VersionRecord, responses=errors(404, 422))
async def resolve_ref(request: Request, ref: RefPath, settings: SettingsDep, who: Pull) -> dict[str, Any]:
    """The version a reference names in the caller's namespace: `bert-base:prod`, `bert-base@3`, `bert-base`. Its
    `tags` list the tags on it (`latest` only when the reference asked for it)."""
    return (await _resolve_async(request, who, _ref(settings, ref))).to_json()


@router.get("/refs/{ref}/pick", response_model=Pick, responses=errors(404, 422, why={
    404: "No such reference, or no artifact of its model fits the host: error.candidates says why each lost"}))
async def pick_artifact(
    request: Request, ref: RefPath, settings: SettingsDep, who: Pull,
    host: Annotated[str, Query(pattern=CONCRETE_TARGET, max_length=MAX_TARGET, description="The host's concrete "
                               "target, e.g. cpu-x86_64-avx2 or cuda-sm90 (the SDK detects it).")],
    shape: Annotated[list[Annotated[str, StringConstraints(max_length=MAX_SHAPE_ARG, pattern=SHAPE_ARG)]], Query(
        default_factory=list, max_length=MAX_SHAPE_ARGS, description="NAME=SHAPE per input, as in lookup; none: any "
        "shapes")],
    torch: Annotated[str | None, Query(max_length=64, pattern=TORCH_VERSION,
                                       description="The host's torch version: others are rejected")] = None,
    allow_unverified: Annotated[bool, Query(description="A package built for its target but not yet run on it "
                                            "(on_target.state unverified) may be picked, after any that ran on "
                                            "theirs.")] = False,
    training: Annotated[bool, Query(description="Pick a train step (mode=training, for Client.load_training); "
                                    "otherwise train steps are never picked")] = False,
) -> Response:
    """The artifact of a reference's model for this host: the exact target first, then a compatible one (a lower
    ISA level), with the reason, and why every other candidate lost (target, toolchain, shapes). 404 when none
    fits, listing each candidate and why."""
    # The fleet's hot path: FastPick below answers most of these requests without FastAPI's solving.
    body = await _pick_answer(request, settings, who, ref, host, shape, torch, allow_unverified, training)
    return Response(body, media_type="application/json")


async def _pick_answer(request: Request, settings: Settings, who: Principal, ref: str, host: str, shape: list[str],
                       torch: str | None, allow_unverified: bool, training: bool) -> bytes:
    """GET /v1/refs/{ref}/pick's JSON body (the route's and FastPick's); NotFound when nothing fits."""
    wanted = _ref(settings, ref)
    target = Target.parse(host)
    reads: Reads = request.app.state.reads
    raw_version, found = await _resolve_and_find(request, who, wanted)
    # Rendered once per (query, version, artifacts as Redis holds them now), as the lookup's answers are: a tag moved,
    # a version or an artifact published, deleted or rewritten picks afresh. The version is compared by its raw
    # record and tags: hashing them costs less than rendering it (the pick by tag is the fleet's hot path).
    query = ("pick", str(wanted), found.model_id, str(target), tuple(shape), torch, allow_unverified, training)
    fingerprint = digest(*raw_version, found.fingerprint.hex())
    if (body := reads.answers.get(query, fingerprint)) is not None:
        return body
    version = Version.from_raw(wanted.name, raw_version[0], raw_version[1],
                               raw_version[2:] + ([refs.LATEST] if wanted.tag == refs.LATEST else []))
    spec = specs.canonical_spec(found.model["inputs"], specs.parse_shape_args(shape)) if shape else None
    picked = pick([json.loads(raw) for _, raw in found.artifacts], target, torch=torch, spec=spec,
                  allow_unverified=allow_unverified, training=training)
    if picked.artifact is None:
        built = {key for key, _ in found.artifacts}
        pending = sorted({b["target"] for b in version.builds if b.get("job") and b.get("key") not in built})
        unserved = sorted({b["target"] for b in version.builds if b.get("status") in ("unserved", "refused")})
        lines = [f"{c['key'][:12]} ({c['target']}): {'; '.join(c['why'])}" for c in picked.rejected[:20]]
        more = f" (and {len(picked.rejected) - 20} more)" if len(picked.rejected) > 20 else ""
        queued = ((f"; not built yet: {', '.join(pending)}" if pending else "")
                  + (f"; no worker served {', '.join(unserved)} when it was compiled" if unserved else ""))
        raise NotFound(
            f"nothing of {wanted} ({version.name}@{version.version}, model {version.model_id[:12]}) fits this host "
            f"({target}{', torch ' + torch if torch else ''}"
            f"{', ' + specs.format_spec(spec) if spec is not None else ''}): "
            + ("; ".join(lines) + more if lines else "it has no artifacts yet") + queued,
            candidates=picked.rejected[:100])
    a = picked.artifact
    answer = {"ref": str(wanted), "version": version.to_json(), "host": str(target), "key": a["key"],
              "target": str(Target.parse(a["factors"]["target"])), "match": picked.match, "reason": picked.reason,
              "rejected": picked.rejected}
    return reads.answers.put(query, fingerprint, render(Pick, answer))


_PICK = re.compile(r"/v1/refs/([^/]+)/pick")
_REF = re.compile(REF)
_CONCRETE_TARGET = re.compile(CONCRETE_TARGET)
_TORCH = re.compile(TORCH_VERSION)
_PICK_SCALARS = frozenset({"host", "torch", "allow_unverified", "training"})
PickQuery = tuple[str, str, list[str], str | None, bool, bool]


class FastPick(PlainGet):
    """GET /v1/refs/{ref}/pick (a fleet's start-up and every deploy) as a PlainGet (service/api/lookup.py): the
    route's own `_pick_answer` for a request within its grammar from a key that may pull, and the FastAPI route
    for every other. A name or tag longer than this server's AOTC_MAX_REGISTRY_NAME_CHARS gets the route's 422 from
    `_ref`, as there."""

    def path_matches(self, path: str) -> bool:
        return _PICK.fullmatch(path) is not None

    def parse(self, scope: Scope) -> PickQuery | None:
        return _pick_query(scope["path"], scope["query_string"])

    async def answer(self, scope: Scope, who: Principal, parsed: PickQuery) -> bytes:
        request = Request(scope)
        return await _pick_answer(request, request.app.state.settings, who, *parsed)


def _pick_query(path: str, raw: bytes) -> PickQuery | None:
    """The pick's reference and parameters if every one is within the route's grammar, else None (the route
    answers)."""
    found = _PICK.fullmatch(path)
    ref = found.group(1) if found else ""
    if not ref.isascii() or len(ref) > 2 * REG_WORD_MAX + 1 or not _REF.fullmatch(ref):
        return None
    if (got := query_params(raw, _PICK_SCALARS)) is None:
        return None
    values, shape = got
    host, torch = values.get("host"), values.get("torch")
    unverified = BOOLS.get(values.get("allow_unverified", "false"))
    training = BOOLS.get(values.get("training", "false"))
    if (host is None or len(host) > MAX_TARGET or not _CONCRETE_TARGET.fullmatch(host)
            or (torch is not None and (len(torch) > 64 or not _TORCH.fullmatch(torch)))
            or unverified is None or training is None):
        return None
    return ref, host, shape, torch, unverified, training
