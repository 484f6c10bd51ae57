"""The registry: names, their versions and tags, inside one namespace.

    ns:{ns}:reg                  zset  names -> when first used
    ns:{ns}:reg:{name}:seq       int   the last version number given (not reused until a gone name is forgotten)
    ns:{ns}:reg:{name}:versions  hash  version -> record (JSON): model_id, created, by, builds
    ns:{ns}:reg:{name}:tags      hash  tag -> version
    ns:{ns}:reg:{name}:history   list  tag moves, newest first, capped per name and over the namespace
    ns:{ns}:reg-history          int   how many tag moves all the namespace's histories keep
    ns:{ns}:reg-gone             zset  names whose last version was deleted -> when: their history and last version
                                       number are kept until newer gone names or the history's budget push them out
    pins:model:{model}           set   '{ns}/{name}@{v}' of every version that holds the model

A version points at a model the namespace holds; `latest` is always the highest version that still exists. While
any version (of any namespace) holds a model, the bounded artifact cache evicts none of that model's artifacts (the
EVICT script reads pins:model); deleting a version drops its hold, and what no other version holds is evicted as any
other artifact. Every change is one Lua script (scripts.py: VERSION_ADD, TAG_MOVE, UNTAG, VERSION_DELETE), so a tag
move is atomic and recorded with who made it and when. Names and tags are checked by compiler.refs before they reach
a key.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from compiler.cachekey import canonical_json
from compiler.errors import NotFound, Unprocessable
from compiler.refs import LATEST, Ref
from service.store import keys, scripts


@dataclass(frozen=True)
class Limits:
    """The registry's bounds, each an API setting (the errors name them)."""

    max_names: int = 10_000  # AOTC_MAX_REGISTRY_NAMES: names per namespace
    max_versions: int = 1_000  # AOTC_MAX_VERSIONS_PER_NAME: versions a name holds at once
    max_tags: int = 100  # AOTC_MAX_TAGS_PER_NAME
    history: int = 1_000  # AOTC_TAG_HISTORY_LEN: tag moves kept per name
    max_ns_versions: int = 50_000  # AOTC_MAX_REGISTRY_VERSIONS: versions in all of a namespace's names
    max_ns_history: int = 100_000  # AOTC_MAX_TAG_HISTORY: tag moves kept in all of a namespace's histories
    max_gone: int = 10_000  # AOTC_MAX_GONE_NAMES: deleted names whose history and version numbers are kept


_SETTING = {"names": ("AOTC_MAX_REGISTRY_NAMES", "names in namespace"),
            "versions": ("AOTC_MAX_VERSIONS_PER_NAME", "versions of"),
            "tags": ("AOTC_MAX_TAGS_PER_NAME", "tags on"),
            "ns_versions": ("AOTC_MAX_REGISTRY_VERSIONS", "versions in namespace")}


@dataclass(frozen=True)
class Version:
    """One version of a name: the model it points at, who made it and when, the builds its compile request asked
    for (target, key, job), and its tags."""

    name: str
    version: int
    model_id: str
    created: float
    by: str
    builds: list[dict[str, Any]] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)

    @classmethod
    def from_raw(cls, name: str, version: str | int, raw: str, tags: list[str] | None = None) -> Version:
        rec = json.loads(raw)
        return cls(name, int(version), rec["model_id"], float(rec["created"]), str(rec.get("by", "")),
                   list(rec.get("builds") or []), sorted(tags or []))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "ref": f"{self.name}@{self.version}",
                "model_id": self.model_id, "created": self.created, "by": self.by, "builds": self.builds,
                "tags": self.tags}


def _refused(what: str, limit: str, ns: str, name: str) -> Unprocessable:
    setting, words = _SETTING[what]
    where = f"namespace {ns!r}" if what in ("names", "ns_versions") else f"{name!r}"
    return Unprocessable(f"{words} {where} would pass the limit of {limit} ({setting}); delete some first",
                         setting=setting)


def _history_keys(ns: str) -> list[str]:
    """The keys every registry script takes last, for the history's bounds (scripts.py, _HISTORY_SETUP)."""
    return [keys.ns(ns, "reg-history"), keys.ns(ns, "reg"), keys.ns(ns, "reg-gone")]


def _history_args(ns: str, limits: Limits) -> list[Any]:
    return [keys.ns(ns, "reg:"), limits.max_ns_history, limits.max_gone]


class Names:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._add = r.register_script(scripts.VERSION_ADD)
        self._move = r.register_script(scripts.TAG_MOVE)
        self._untag = r.register_script(scripts.UNTAG)
        self._delete = r.register_script(scripts.VERSION_DELETE)
        self._resolve = r.register_script(scripts.RESOLVE)

    @staticmethod
    def holder(ns: str, name: str, version: int) -> str:
        return f"{ns}/{name}@{version}"

    def add_version(self, ns: str, name: str, model_id: str, by: str, *, tags: list[str] | tuple[str, ...] = (),
                    builds: list[dict[str, Any]] | None = None, limits: Limits = Limits()) -> Version:
        """A new version of `name` pointing at `model_id` (the caller checked the namespace holds it), with `tags`
        moved to it, atomically."""
        now = time.time()
        record = {"model_id": model_id, "created": now, "by": by, "builds": builds or []}
        raw = canonical_json(record)
        status, value = cast(list[Any], self._add(
            keys=[keys.ns(ns, "reg"), keys.reg(ns, name, "seq"), keys.reg(ns, name, "versions"),
                  keys.reg(ns, name, "tags"), keys.reg(ns, name, "history"), keys.model_pins(model_id),
                  keys.ns(ns, "reg-versions"), *_history_keys(ns)],
            args=[name, raw, now, by, f"{ns}/{name}@", limits.max_names, limits.max_versions, limits.max_tags,
                  limits.history, json.dumps(list(dict.fromkeys(tags))), limits.max_ns_versions,
                  keys.ns(ns, "reg:"), *_history_args(ns, limits)]))
        if status != "ok":
            raise _refused(str(status), str(value), ns, name)
        return Version.from_raw(name, int(value), raw, list(tags))

    def move_tag(self, ns: str, name: str, tag: str, version: int, by: str, *,
                 limits: Limits = Limits()) -> int | None:
        """Point `tag` at `version`; returns the version it named before (None: a new tag)."""
        status, value = cast(list[Any], self._move(
            keys=[keys.reg(ns, name, "versions"), keys.reg(ns, name, "tags"), keys.reg(ns, name, "history"),
                  *_history_keys(ns)],
            args=[tag, version, by, time.time(), limits.max_tags, limits.history, *_history_args(ns, limits)]))
        if status == "version":
            raise NotFound(f"no version {name}@{version}; `aotc versions {name}` lists them")
        if status == "tags":
            raise _refused("tags", str(value), ns, name)
        return int(value) if value else None

    def untag(self, ns: str, name: str, tag: str, by: str, *, limits: Limits = Limits()) -> int:
        """Remove a tag; returns the version it named."""
        old = self._untag(keys=[keys.reg(ns, name, "tags"), keys.reg(ns, name, "history"), *_history_keys(ns)],
                          args=[tag, by, time.time(), limits.history, *_history_args(ns, limits)])
        if old is None:
            raise NotFound(f"no tag {name}:{tag}")
        return int(cast(str, old))

    def delete_version(self, ns: str, name: str, version: int, by: str, *,
                       limits: Limits = Limits()) -> list[str]:
        """Delete a version and the tags on it (returned); its model's artifacts stay pinned only while another
        version holds that model."""
        got = self.get(ns, name, version)
        if got is None:
            raise NotFound(f"no version {name}@{version}")
        removed = self._delete(
            keys=[keys.ns(ns, "reg"), keys.reg(ns, name, "versions"), keys.reg(ns, name, "tags"),
                  keys.reg(ns, name, "history"), keys.model_pins(got.model_id), keys.ns(ns, "reg-versions"),
                  *_history_keys(ns)],
            args=[name, version, self.holder(ns, name, version), by, time.time(), limits.history,
                  *_history_args(ns, limits)])
        if removed is None:  # deleted by someone else meanwhile
            raise NotFound(f"no version {name}@{version}")
        return sorted(cast(list[str], removed))

    # -- reads --------------------------------------------------------------------------------------------------

    def resolve(self, ns: str, ref: Ref) -> Version | None:
        """The version a reference names in `ns`, in one round trip, with its tags (`latest` only when asked for
        by it: telling would cost reading every version)."""
        kind, value = (("version", str(ref.version)) if ref.version is not None
                       else ("latest", "") if ref.tag == LATEST else ("tag", ref.tag or ""))
        got = self._resolve(keys=[keys.reg(ns, ref.name, "versions"), keys.reg(ns, ref.name, "tags")],
                            args=[kind, value])
        if not got:
            return None
        v, raw, *tags = cast(list[str], got)
        return Version.from_raw(ref.name, v, raw, tags + ([LATEST] if ref.tag == LATEST else []))

    def get(self, ns: str, name: str, version: int) -> Version | None:
        raw = cast(str | None, self.r.hget(keys.reg(ns, name, "versions"), str(version)))
        return Version.from_raw(name, version, raw) if raw else None

    def versions(self, ns: str, name: str) -> list[Version]:
        """Every version of `name`, newest first, with its tags (`latest` on the newest)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(keys.reg(ns, name, "versions"))
        pipe.hgetall(keys.reg(ns, name, "tags"))
        raw_versions, tags = cast(tuple[dict[str, str], dict[str, str]], pipe.execute())
        by_version: dict[str, list[str]] = {}
        for tag, v in tags.items():
            by_version.setdefault(v, []).append(tag)
        if raw_versions:
            by_version.setdefault(str(max(int(v) for v in raw_versions)), []).append(LATEST)
        out = [Version.from_raw(name, v, raw, by_version.get(v)) for v, raw in raw_versions.items()]
        return sorted(out, key=lambda x: -x.version)

    def history(self, ns: str, name: str, limit: int = 100) -> list[dict[str, Any]]:
        """Tag moves, newest first: {tag, from, to, by, at}; `from` absent for a new tag, `to` for a removal."""
        return [json.loads(e) for e in cast(list[str], self.r.lrange(keys.reg(ns, name, "history"), 0, limit - 1))]

    def names(self, ns: str, limit: int = 100) -> list[str]:
        return cast(list[str], self.r.zrange(keys.ns(ns, "reg"), 0, limit - 1))

    def holders(self, model_id: str, ns: str | None = None) -> list[str]:
        """Every version that holds this model ('{ns}/{name}@{v}'): of any namespace, or of `ns` alone."""
        found = cast(set[str], self.r.smembers(keys.model_pins(model_id)))
        return sorted(h for h in found if ns is None or h.startswith(f"{ns}/"))
