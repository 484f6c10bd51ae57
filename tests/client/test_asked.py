"""A signed manifest held to the question the service answered (client/verify.py `Asked`): the lookup's model,
target and shapes, a pick's host, inference or a train step. The service's answer is not signed, so a hostile one
could otherwise hand over another validly signed artifact. Torch-free; the e2e side is in
tests/e2e/test_signed_artifacts.py (a real service made to answer with the wrong artifact)."""

from __future__ import annotations

from typing import Any

import pytest

from client.verify import Asked
from compiler.errors import BadSignature
from compiler.signing import Manifest, statement

MODEL = "a" * 64
KEY = "0123456789abcdef0123456789abcdef"


def manifest(*, model: str = MODEL, target: str = "cpu-x86_64-v3", mode: str = "default",
             spec: list[dict[str, Any]] | None = None) -> Manifest:
    spec = spec if spec is not None else [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 8}, 16]}]
    factors = {"model": model, "target": target, "spec": spec, "options": {"mode": mode}}
    return Manifest(statement(artifact_key=KEY, package_sha256="0" * 64, package_size=1, model_sha256=model,
                              factors=factors, toolchain={}, target=target, check=None, worker={}), "kid0")


def refused(asked: Asked, signed: Manifest) -> str:
    with pytest.raises(BadSignature) as got:
        asked.expect(signed)
    assert got.value.reason == "mismatch"
    assert KEY in got.value.message and "another artifact than the one asked for" in got.value.message
    return got.value.message


def test_what_was_asked_and_signed_alike_passes() -> None:
    signed = manifest()
    Asked().expect(signed)  # nothing asked: nothing compared
    Asked(model_id=MODEL, target="cpu", shapes={"x": "4x16"}, training=False).expect(signed)
    Asked(model_id=MODEL, target="cpu-x86_64-v3", shapes={"x": "2..8x16"}).expect(signed)
    Asked(model_id=MODEL, host="cpu-x86_64-v4", shapes={"x": "8x16"}).expect(signed)  # v3 runs on a v4 host
    Asked(training=True).expect(manifest(mode="training"))


def test_another_models_artifact_is_refused() -> None:
    message = refused(Asked(model_id="b" * 64), manifest())
    assert "signed as built from model aaaaaaaaaaaa, not bbbbbbbbbbbb" in message


@pytest.mark.parametrize(("asked", "signed", "says"), [
    (Asked(target="cpu-x86_64-v4"), "cpu-x86_64-v3", "signed for target cpu-x86_64-v3, not cpu-x86_64-v4"),
    (Asked(target="cuda"), "cpu-x86_64-v3", "signed for target cpu-x86_64-v3, not cuda"),
    (Asked(target="cpu"), "cuda-sm90", "signed for target cuda-sm90, not cpu"),
    (Asked(host="cpu-x86_64-v3"), "cpu-x86_64-v4", "which cannot run on cpu-x86_64-v3"),
    (Asked(host="cuda-sm90"), "cuda-sm80", "which cannot run on cuda-sm90"),
    (Asked(target="cpu"), "not a target", "signed for target not a target"),
])
def test_an_artifact_for_another_target_is_refused(asked: Asked, signed: str, says: str) -> None:
    assert says in refused(asked, manifest(target=signed))


def test_a_train_step_for_an_inference_load_and_the_reverse_are_refused() -> None:
    assert "signed as a train step, not an inference package" in refused(Asked(training=False),
                                                                          manifest(mode="training"))
    assert "signed as an inference package, not a train step" in refused(Asked(training=True), manifest())


@pytest.mark.parametrize(("shapes", "says"), [
    ({"x": "9x16"}, "input 'x' is signed as 1..8x16, which does not take 9x16"),
    ({"x": "1..16x16"}, "which does not take 1..16x16"),  # a range wider than the signed one
    ({"x": "4x16x1"}, "which does not take 4x16x1"),  # another rank
    ({"x": "4x16", "y": "4"}, "input 'y' is signed as absent"),
])
def test_an_artifact_built_for_other_shapes_is_refused(shapes: dict[str, str], says: str) -> None:
    assert says in refused(Asked(shapes=shapes), manifest())


def test_a_manifest_without_factors_answers_nothing_asked() -> None:
    bare = manifest()
    del bare.statement["predicate"]["factors"]
    Asked().expect(bare)
    for asked in (Asked(model_id=MODEL), Asked(shapes={"x": "4x16"}), Asked(training=True)):
        refused(asked, bare)
