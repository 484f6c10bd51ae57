"""Short model ids resolve through `models:ids` (a lex range), and models stored before it get indexed."""

from __future__ import annotations

import pytest

from service.store import Store, keys
from service.store.embedded import EmbeddedRedis


@pytest.fixture
def fresh(tmp_path):
    with EmbeddedRedis(tmp_path / "redis", appendonly=False) as server:
        store = Store(server.url)
        yield store
        store.close()


def _put(store: Store, model_id: str) -> None:
    store.models.put({"id": model_id, "name": "m", "size": 1, "created": 1.0, "inputs": []})


def test_find_by_prefix(fresh):
    a, b, c = "ab12" + "0" * 60, "ab12" + "f" * 60, "ab13" + "0" * 60
    for m in (a, b, c):
        _put(fresh, m)
    assert fresh.models.find(a) == [a]  # a full id: just whether it exists
    assert fresh.models.find("ab12" + "0" * 8) == [a]
    assert fresh.models.find("ab12") == [a, b]  # at most two: enough to tell "ambiguous"
    assert fresh.models.find("ab13") == [c]
    assert fresh.models.find("ab14") == []
    assert fresh.models.find("ab1", limit=3) == [a, b, c]
    assert fresh.models.find("f" * 64) == []


def test_backfill_indexes_models_stored_before_the_index(fresh):
    old = ["cd" * 32, "ef" * 32]
    for m in old:  # what models.put wrote before models:ids existed
        fresh.r.set(keys.model(m), "{}")
        fresh.r.zadd(keys.MODELS_INDEX, {m: 1.0})
    _put(fresh, "12" * 32)
    assert fresh.models.find("cdcd") == []
    assert fresh.models.backfill_ids(batch=1) == 2
    assert fresh.models.find("cdcd") == ["cd" * 32] and fresh.models.find("efef") == ["ef" * 32]
    assert fresh.models.backfill_ids() == 0  # nothing left: two ZCARDs
