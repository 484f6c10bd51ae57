"""Compile options in the cache key: an option added later keeps the keys of requests that do not set it."""

from __future__ import annotations

from compiler import cachekey
from compiler.options import CompileOptions

SPEC = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 8}, 16]}]


def key(options: CompileOptions) -> str:
    return cachekey.cache_key(cachekey.factors("ab" * 32, SPEC, "cpu-x86_64-avx2", {"torch": "2.13.0+cpu"},
                                               options.canonical()))


def test_keys_of_requests_that_do_not_set_allow_nonfinite_are_those_from_before_it_existed():
    # Pinned before allow_nonfinite was added (key format 2).
    assert "allow_nonfinite" not in CompileOptions().canonical()
    assert key(CompileOptions()) == "a9029e9f94250e2d1994ba313ef3b2d6"
    assert key(CompileOptions(allow_nonfinite=False)) == "a9029e9f94250e2d1994ba313ef3b2d6"
    tuned = CompileOptions(mode="max-autotune", precision="bf16", freezing=True, inductor={"max_fusion_size": 32})
    assert key(tuned) == "4acc57365d94f5f5b5b59a1c5ca368eb"


def test_allow_nonfinite_changes_the_key_and_round_trips_through_the_canonical_form():
    opted = CompileOptions(allow_nonfinite=True)
    assert opted.canonical()["allow_nonfinite"] is True
    assert key(opted) != key(CompileOptions())
    assert CompileOptions(**opted.canonical()) == opted  # the worker rebuilds options from the job's canonical form
