"""The API's read path for deploy-time traffic: async Redis reads, and an in-process memo of the work they lead to.

Every answer is built from what Redis holds at the time of the request: each request reads the record (or, for a
lookup, the model's artifact records, in one round trip: `FIND_MODEL` in service/store/scripts.py), and the memo
only saves the Python work that follows: parsing the JSON, ranking, validating and rendering the answer. A memo
entry is used only when the raw value it was made from is what Redis just returned, byte for byte, so there is
nothing to invalidate: a record deleted (eviction), added (a publish) or rewritten shows in the very next answer,
in every API process, with no TTL and no message between processes.

What it costs is one round trip per request, with the records' bytes (a few KB); what it saves is most of the
API's CPU per request. The memos are LRU-bounded by entry count and hold only bytes: each rendered answer and a
digest of the raw values it was made from (BLAKE2b, 16 bytes), so the garbage collector never walks them and a
full memo holds about one answer's size per entry.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, NoReturn, TypeVar, cast

import redis.asyncio as aioredis
from pydantic import BaseModel

from service.api.schemas import ArtifactRecord
from service.store import keys, scripts

V = TypeVar("V")
MEMO_ENTRIES = 16384  # per memo and process: a few KB each


class Memo(Generic[V]):
    """A bounded LRU map from a key to a value derived from `raw` (what Redis held): `get` answers only when the
    raw value is the same."""

    def __init__(self, maxsize: int = MEMO_ENTRIES) -> None:
        self.maxsize = maxsize
        self._d: OrderedDict[Hashable, tuple[object, V]] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: Hashable, raw: object) -> V | None:
        hit = self._d.get(key)
        if hit is None or hit[0] != raw:
            self.misses += 1
            return None
        self.hits += 1
        self._d.move_to_end(key)
        return hit[1]

    def peek(self, key: Hashable) -> V | None:
        """The value whatever raw value it came from: only for what cannot change under its key."""
        hit = self._d.get(key)
        return None if hit is None else hit[1]

    def put(self, key: Hashable, raw: object, value: V) -> V:
        self._d[key] = (raw, value)
        self._d.move_to_end(key)
        while len(self._d) > self.maxsize:
            self._d.popitem(last=False)
        return value

    def drop(self, key: Hashable) -> None:
        self._d.pop(key, None)

    def __len__(self) -> int:
        return len(self._d)


def digest(*raw: str) -> bytes:
    """What a memo entry compares: a 16-byte BLAKE2b of the raw values (their count and lengths included)."""
    h = hashlib.blake2b(digest_size=16)
    for r in raw:
        b = r.encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.digest()


def render(schema: type[BaseModel], record: dict[str, Any]) -> bytes:
    """A record as FastAPI answers it with `response_model=schema, response_model_exclude_unset=True`."""
    return schema.model_validate(record).model_dump_json(exclude_unset=True, by_alias=True).encode()


@dataclass(frozen=True)
class Found:
    """What FIND_MODEL read: the model's full id and raw record, and its artifacts that still exist."""

    model_id: str
    raw_model: str
    artifacts: tuple[tuple[str, str], ...]  # (key, raw record), sorted by key

    @property
    def fingerprint(self) -> bytes:
        """What the lookup memo compares: the artifacts as Redis holds them now."""
        return digest(*(part for pair in self.artifacts for part in pair))

    @property
    def model(self) -> dict[str, Any]:
        record: dict[str, Any] = json.loads(self.raw_model)
        return record


class NoModel(Exception):
    pass


class Ambiguous(Exception):
    pass


class Reads:
    """Async reads of models and artifacts, and the memos built on them (one per API process)."""

    def __init__(self, aredis: aioredis.Redis, maxsize: int = MEMO_ENTRIES) -> None:
        self.r = aredis
        self.models: Memo[str] = Memo(maxsize)  # model id -> its raw record
        self.metas: Memo[bytes] = Memo(maxsize)  # artifact key -> its record rendered as ArtifactRecord
        self.answers: Memo[bytes] = Memo(maxsize)  # lookup answers, keyed by the query (lookup.py)
        self._ids: Memo[str] = Memo(maxsize)  # short id -> full id: a hint, checked by FIND_MODEL
        self._find = aredis.register_script(scripts.FIND_MODEL)
        self._models_of: dict[str, str] = {}  # artifact key -> model id

    async def artifact(self, key: str) -> str | None:
        """The raw artifact record stored under `key` now; None when there is none (never one from memory)."""
        raw = cast(str | None, await self.r.get(keys.artifact(key)))
        if raw is None:
            self.metas.drop(key)
        return raw

    def model_of(self, key: str, raw: str) -> str:
        """The model an artifact was built from. A key hashes its factors, the model among them, so the answer
        for a key never changes: it is kept once read."""
        if (model_id := self._models_of.get(key)) is None:
            model_id = str(json.loads(raw)["factors"]["model"])
            if len(self._models_of) >= MEMO_ENTRIES:
                self._models_of.clear()
            self._models_of[key] = model_id
        return model_id

    def meta(self, key: str, raw: str) -> bytes:
        """GET /v1/artifacts/{key}/meta's body for the record `raw` (also what a lookup that picks it answers)."""
        d = digest(raw)
        return self.metas.get(key, d) or self.metas.put(key, d, render(ArtifactRecord, json.loads(raw)))

    async def model(self, id_or_prefix: str, *, with_artifacts: bool = False, trust_id: bool = False) -> Found:
        """The model with this id or unique id prefix (NoModel, Ambiguous), and with `with_artifacts` its artifacts.

        `trust_id`: a model record is content-addressed, so for a model already in memory only its existence is
        checked (lookup needs just its inputs, which follow from its content); otherwise the record is read."""
        known = ""
        if trust_id:
            full = id_or_prefix if len(id_or_prefix) == 64 else self._ids.peek(id_or_prefix)
            if full and self.models.peek(full) is not None:
                known = full
        reply = cast(str, await self._find(args=[
            id_or_prefix, keys.MODEL_IDS, keys.model(""), keys.artifacts_by_model(""), keys.artifact(""), known,
            "1" if with_artifacts else "0"])).split("\0")
        if reply[0] == "ambiguous":
            raise Ambiguous(id_or_prefix)
        if reply[0] != "ok":
            self._gone(id_or_prefix)
        model_id, raw_model = reply[1], reply[2]
        if raw_model:
            self.models.put(model_id, None, raw_model)
        elif (held := self.models.peek(model_id)) is not None:  # still stored, and held here: FIND_MODEL checked
            raw_model = held
        else:  # dropped from memory meanwhile: read the record after all
            return await self.model(id_or_prefix, with_artifacts=with_artifacts)
        if len(id_or_prefix) != 64:
            self._ids.put(id_or_prefix, None, model_id)
        pairs = reply[3:]
        return Found(model_id, raw_model, tuple(sorted(zip(pairs[::2], pairs[1::2]))))

    def _gone(self, id_or_prefix: str) -> NoReturn:
        if len(id_or_prefix) == 64:
            self.models.drop(id_or_prefix)
        self._ids.drop(id_or_prefix)
        raise NoModel(id_or_prefix)
