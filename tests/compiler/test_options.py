"""Compile options in the cache key: an option added later keeps the keys of requests that do not set it; the bounds
every compile applies (forced index asserts, compiler.bounds) are a factor of their own, and lookup serves no
artifact built without them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from compiler import cachekey
from compiler.options import FORCED_INDUCTOR_CONFIGS, CompileOptions, InductorSettings
from compiler.targets import Target
from service.api.lookup import rank

SPEC = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 8}, 16]}]


def key(options: CompileOptions) -> str:
    return cachekey.cache_key(cachekey.factors("ab" * 32, SPEC, "cpu-x86_64-avx2", {"torch": "2.13.0+cpu"},
                                               options.canonical()))


def test_keys_of_requests_that_do_not_set_allow_nonfinite_do_not_depend_on_it():
    assert "allow_nonfinite" not in CompileOptions().canonical()
    assert key(CompileOptions(allow_nonfinite=False)) == key(CompileOptions())
    # Pinned at key format 4 (weights), BOUNDS_REVISION 4 (the index-op review, the check's float and mask cases) and
    # WEIGHTS_REVISION 3 (0-d literals inlined, and weights only dead code reads, out of the blob), so that a change
    # to what a key covers is a decision, not an accident.
    assert key(CompileOptions()) == "6534166d80048da87fdc8c3fdbc11971"
    tuned = CompileOptions(mode="max-autotune", precision="bf16", freezing=True, inductor={"max_fusion_size": 32})
    assert key(tuned) == "ca88aa695c07754adfc5695a031837e9"


def test_allow_nonfinite_changes_the_key_and_round_trips_through_the_canonical_form():
    opted = CompileOptions(allow_nonfinite=True)
    assert opted.canonical()["allow_nonfinite"] is True
    assert key(opted) != key(CompileOptions())
    assert CompileOptions(**opted.canonical()) == opted  # the worker rebuilds options from the job's canonical form


def test_every_compile_forces_the_index_asserts_and_no_option_turns_them_off():
    for options in (CompileOptions(), CompileOptions(mode="max-autotune", freezing=True,
                                                     inductor={"split_reductions": False})):
        configs = options.inductor_configs()
        assert configs["assert_indirect_indexing"] is True and configs["debug_index_asserts"] is True
    with pytest.raises(ValidationError):
        InductorSettings(debug_index_asserts=False)  # type: ignore[call-arg]


def test_the_cache_key_changes_with_the_forced_assert_options(monkeypatch):
    before = key(CompileOptions())
    factors = cachekey.factors("ab" * 32, SPEC, "cpu-x86_64-avx2", {"torch": "2.13.0+cpu"},
                               CompileOptions().canonical())
    assert factors["format"] == 4
    assert factors["bounds"]["inductor"] == {"assert_indirect_indexing": True, "debug_index_asserts": True}
    monkeypatch.setitem(FORCED_INDUCTOR_CONFIGS, "debug_index_asserts", False)
    assert key(CompileOptions()) != before
    monkeypatch.undo()
    assert key(CompileOptions()) == before
    # new rewrite rules: new keys
    monkeypatch.setattr("compiler.cachekey.BOUNDS_REVISION", cachekey.BOUNDS_REVISION + 1)
    assert key(CompileOptions()) != before


def _record(factors: dict, created: float) -> dict:
    return {"key": cachekey.cache_key(factors), "factors": factors, "created": created}


def test_lookup_never_serves_an_artifact_built_before_the_bounds():
    spec = [{"name": "x", "dtype": "float32", "shape": [4, 16]}]
    options = CompileOptions().canonical()
    new = cachekey.factors("ab" * 32, spec, "cpu-x86_64-v3", {"torch": "2.13.0+cpu"}, options)
    old = {k: v for k, v in new.items() if k != "bounds"} | {"format": 2}  # what main's workers published
    assert cachekey.bounded(new) and not cachekey.bounded(old)
    assert cachekey.cache_key(old) != cachekey.cache_key(new)
    target = Target.parse("cpu")
    # The old one is newer, so it would win on recency: it is not a candidate at all.
    assert rank([_record(old, 2.0)], target, spec) is None
    assert rank([_record(new, 1.0), _record(old, 2.0)], target, spec)["factors"] == new
    assert rank([_record(old, 2.0)], target, spec, options) is None


def test_packages_are_weightless_unless_frozen_and_the_layout_is_a_key_factor():
    """freezing folds weights into constants of the package's own, which no blob of the program's FQNs could feed:
    a frozen package carries its weights (embedded); every other inference package binds the model's weights blob."""
    assert CompileOptions().weightless and CompileOptions(precision="bf16").weightless
    assert not CompileOptions(freezing=True).weightless and CompileOptions(mode="training").weightless
    plain = cachekey.factors("ab" * 32, SPEC, "cpu-x86_64-avx2", {"torch": "2.13.0+cpu"}, CompileOptions().canonical())
    frozen = cachekey.factors("ab" * 32, SPEC, "cpu-x86_64-avx2", {"torch": "2.13.0+cpu"},
                              CompileOptions(freezing=True).canonical())
    assert plain["weights"] == {"layout": "external", "revision": 3} and frozen["weights"]["layout"] == "embedded"
    assert cachekey.bounded(plain) and cachekey.bounded({**plain, "format": 3})  # lookup serves both kinds alike


def test_embed_weights_builds_a_self_contained_package_under_a_key_of_its_own():
    """`embed_weights` (what POST /v1/artifacts/{key}/self-contained asks for): the layout embedded, a key of its own,
    and the keys of requests that do not set it unchanged (the key pinned above)."""
    assert "embed_weights" not in CompileOptions().canonical()
    assert key(CompileOptions(embed_weights=False)) == key(CompileOptions())
    embedded = CompileOptions(embed_weights=True)
    assert not embedded.weightless and CompileOptions(**embedded.canonical()) == embedded
    assert key(embedded) != key(CompileOptions())
    factors = cachekey.factors("ab" * 32, SPEC, "cpu-x86_64-avx2", {"torch": "2.13.0+cpu"}, embedded.canonical())
    assert factors["weights"]["layout"] == "embedded"
    with pytest.raises(ValidationError, match="embed_weights are for inference"):
        CompileOptions(mode="training", embed_weights=True)


def test_lookup_serves_weightless_and_pre_weights_artifacts_alike_and_self_contained_builds_last():
    """Artifacts of key format 3 (published before weights were stored once: embedded, no `weights` factor) and
    weightless ones of the same spec are candidates alike: with no figures the newest wins, with figures from one
    kind of device the fastest, whatever its weights layout. A self-contained build (embed_weights, made on request
    for tools that cannot bind a blob) serves only where none of them fits, however new or fast."""
    spec = [{"name": "x", "dtype": "float32", "shape": [4, 16]}]
    make = lambda o: cachekey.factors("ab" * 32, spec, "cpu-x86_64-v3", {"torch": "2.13.0+cpu"}, o)  # noqa: E731
    weightless = make(CompileOptions().canonical())
    embedded = make(CompileOptions(embed_weights=True).canonical())
    pre_weights = {k: v for k, v in weightless.items() if k != "weights"} | {"format": 3}
    kinds = {"weightless": weightless, "self-contained": embedded, "pre-weights": pre_weights}
    assert len({cachekey.cache_key(f) for f in kinds.values()}) == 3
    target = Target.parse("cpu-x86_64-v3")
    served = [name for name in kinds if name != "self-contained"]

    def timed(factors: dict, ms: float, created: float) -> dict:
        check = {"latency": {"compiled": {"median_ms": ms, "method": "wall"}}, "device_info": {"name": "Xeon"}}
        return {**_record(factors, created), "check": check}

    for best in served:
        newest = [_record(f, 3.0 if name == "self-contained" else 2.0 if name == best else 1.0)
                  for name, f in kinds.items()]
        assert rank(newest, target, spec)["factors"] is kinds[best]
        fastest = [timed(f, 0.5 if name == "self-contained" else 1.0 if name == best else 2.0,
                         3.0 if name != best else 1.0) for name, f in kinds.items()]
        assert rank(fastest, target, spec)["factors"] is kinds[best]
    alone = [_record(embedded, 1.0)]
    assert rank(alone, target, spec)["factors"] is embedded


def test_layout_optimization_is_an_allowed_setting_that_keeps_old_keys_when_unset():
    # pinned keys above are unchanged by the new field; setting it is a new key and reaches Inductor's config
    assert "layout_optimization" not in CompileOptions().canonical()["inductor"]
    nchw = CompileOptions(inductor={"layout_optimization": False})
    assert nchw.canonical()["inductor"]["layout_optimization"] is False
    assert key(nchw) != key(CompileOptions())
    assert nchw.inductor_configs()["layout_optimization"] is False
    assert "layout_optimization" not in CompileOptions().inductor_configs()
    assert CompileOptions(**nchw.canonical()) == nchw
    with pytest.raises(ValidationError):
        CompileOptions(inductor={"layout_optimization": "false"})


def test_autotune_tunes_a_train_step_keeps_its_matmuls_off_cpp_and_keeps_old_keys_when_unset():
    """options.autotune (mode=training): max-autotune for the joint program, its GEMMs chosen among ATen and Triton
    only (CPP's templates pack a weight into a constant: a parameter frozen while the optimizer updates it)."""
    training = CompileOptions(mode="training")
    tuned = CompileOptions(mode="training", autotune=True)
    assert "autotune" not in training.canonical() and "autotune" not in CompileOptions().canonical()
    assert tuned.canonical()["autotune"] is True and CompileOptions(**tuned.canonical()) == tuned
    assert key(tuned) != key(training)
    assert tuned.weightless  # a train step binds the caller's parameters, tuned or not
    configs = tuned.inductor_configs()
    assert configs["max_autotune"] is True and configs["max_autotune_gemm_backends"] == "ATEN,TRITON"
    assert configs["joint_graph_constant_folding"] is False  # the training settings stay
    assert "max_autotune" not in training.inductor_configs()
    narrowed = CompileOptions(mode="training", autotune=True, inductor={"max_autotune_gemm_backends": "TRITON"})
    assert narrowed.inductor_configs()["max_autotune_gemm_backends"] == "TRITON"
    with pytest.raises(ValidationError, match="autotune tunes a train step"):
        CompileOptions(autotune=True)
    with pytest.raises(ValidationError, match="autotune tunes a train step"):
        CompileOptions(mode="max-autotune", autotune=True)
    with pytest.raises(ValidationError, match="would freeze parameters the step updates"):
        CompileOptions(mode="training", autotune=True, inductor={"max_autotune_gemm_backends": "ATEN,CPP"})
    with pytest.raises(ValidationError):
        CompileOptions(mode="training", autotune="true")


def rules_fingerprint() -> str:
    """What BOUNDS_REVISION stands for, as data: the refusals, the rewrites (with and without negative ids moved),
    the range checks (CPU and CUDA), the forced Inductor configs and what the adversarial check tries. Comments and
    refactors leave it alone; a change to what a compile does or what its check tries moves it."""
    import hashlib
    import json

    import torch

    from compiler import adversarial, bounds, inputs, ranges

    facts = {
        "refused": sorted(bounds.REFUSED),
        "rules": {str(neg): {k: r.becomes for k, r in sorted(bounds._rules(neg).items())} for neg in (False, True)},
        "checked": sorted(ranges.CHECKED), "checked_on_cuda": sorted(ranges.CHECKED_ON_CUDA),
        "forced": FORCED_INDUCTOR_CONFIGS,
        "casts": sorted(inputs.CASTS), "sym_casts": sorted(inputs.SYM_CASTS), "mask_ops": sorted(inputs.MASK_OPS),
        "int_values": inputs.adversarial_values(torch.int64, (0, 5), [16, 4]),
        "float_values": inputs.adversarial_floats(torch.float32, [16, 4]), "mask_values": inputs.MASK_VALUES,
        "max_cases": adversarial.MAX_CASES,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def test_bounds_revision_moves_with_the_rules_it_stands_for():
    """484940f changed the rewrites and refusals without bumping BOUNDS_REVISION, so a cached artifact built under
    the old rules was still served under the same key. A change to the rules now fails here until the revision is
    bumped and the fingerprint pinned again with it."""
    assert (cachekey.BOUNDS_REVISION, rules_fingerprint()) == (4, "6310f57e69318392"), \
        "the bounds rules changed: bump BOUNDS_REVISION (compiler/options.py) and pin the new fingerprint with it"
