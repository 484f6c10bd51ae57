"""compiler.check: what the artifact check accepts, refuses and warns about; a real compile of a model whose
output holds NaN fails the check unless the request allows non-finite outputs; and the adversarial integer inputs:
a package that returns where eager raises fails, naming the input and the value, and the ops that once diverged
from eager on out-of-range input now raise where eager raises."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from compiler import report as rep
from compiler.check import check_artifact, compare
from compiler.errors import CheckFailed
from compiler.options import CompileOptions
from compiler.pipeline import compile_model
from modelzoo import FLOAT_SPEC, MASK_SPEC, FloatInputIndex, MaskedGather, export, seeded


def test_a_bf16_result_within_tolerance_passes_and_reports_its_error():
    torch.manual_seed(0)
    e = torch.randn(64, 32).bfloat16()
    a = (e.float() * 1.02).bfloat16()
    r = compare(e, a)
    assert r["ok"] and 0 < r["max_rel_err"] < r["tolerance"]


def test_a_wrong_result_fails_naming_the_output():
    e = (torch.ones(4), torch.arange(4.0))
    r = compare(e, (torch.ones(4), torch.arange(4.0) + 1))
    assert not r["ok"] and r["why"].startswith("output 1")


def test_all_zero_eager_outputs_pass_with_a_note_saying_the_comparison_shows_little():
    # A classifier head initialised to zeros answers zeros for any input: the check compares nothing.
    r = compare(torch.zeros(8, 10), torch.zeros(8, 10))
    assert r["ok"] and r["max_rel_err"] == 0.0
    assert r["notes"] == ["output 0 is all zeros in eager at these inputs, so this comparison shows little "
                          "(a model with zero-initialised weights?)"]
    assert "notes" not in compare(torch.ones(3), torch.ones(3))


def test_nan_or_inf_in_an_output_fails_naming_the_output_the_counts_and_the_opt_in():
    e = (torch.ones(4), torch.tensor([1.0, float("nan"), float("inf"), -float("inf")]))
    r = compare(e, (torch.ones(4), e[1].clone()))
    assert not r["ok"]
    assert r["why"] == ("output 1 (torch.float32, 4 values) holds 3 non-finite values (1 NaN, 1 +inf, 1 -inf) in the "
                        "compiled result and 3 non-finite values (1 NaN, 1 +inf, 1 -inf) in eager; a non-finite "
                        "result is refused: set the compile option allow_nonfinite=true (aotc compile "
                        "--allow-nonfinite) if this model's outputs are meant to hold NaN or inf")
    # Only the compiled result non-finite: refused too.
    assert not compare(torch.ones(3), torch.tensor([1.0, float("nan"), 1.0]))["ok"]


def test_allow_nonfinite_passes_the_same_nonfinite_values_in_the_same_places_and_records_them():
    e = torch.tensor([2.0, float("nan"), float("inf"), 0.0])
    r = compare(e, torch.tensor([2.0 + 1e-6, float("nan"), float("inf"), 0.0]), allow_nonfinite=True)
    assert r["ok"] and 0 < r["max_rel_err"] < 1e-4
    assert r["nonfinite"] == [{"output": 0, "numel": 4, "eager": {"nan": 1, "posinf": 1, "neginf": 0},
                               "compiled": {"nan": 1, "posinf": 1, "neginf": 0}}]
    assert r["notes"] == ["output 0 holds 2 non-finite values (1 NaN, 1 +inf, 0 -inf) in eager and compiled alike "
                          "at these inputs; accepted because allow_nonfinite is set (the finite values are compared)"]
    # Opting in does not excuse disagreement: inf where eager has NaN, or a wrong finite value.
    assert not compare(e, torch.tensor([2.0, float("inf"), float("inf"), 0.0]), allow_nonfinite=True)["ok"]
    assert not compare(e, torch.tensor([3.0, float("nan"), float("inf"), 0.0]), allow_nonfinite=True)["ok"]


class LogOfLinear(torch.nn.Module):
    """Two outputs: a Linear, and its log, which is NaN wherever the Linear is negative."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        return y, torch.log(y)


SPEC = [{"name": "x", "dtype": "float32", "shape": [4, 8]}]


@pytest.fixture(scope="module")
def log_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("nan")
    path = export(seeded(LogOfLinear, 0), (torch.randn(4, 8),), d / "m.pt2")
    # allow_nonfinite changes what is published, not the code: one compile serves both checks.
    result = compile_model(str(path), SPEC, SPEC, CompileOptions(), "cpu", str(d / "a.pt2"))
    return str(path), result["package"]


@pytest.mark.slow
def test_a_model_returning_nan_fails_the_check_unless_the_request_allows_it(log_model):
    path, package = log_model
    with pytest.raises(CheckFailed) as info:
        check_artifact(path, package, SPEC, "cpu")
    message = info.value.message
    assert message.startswith("artifact disagrees with eager at min shapes: output 1 (torch.float32, 32 values) "
                              "holds ")
    assert " NaN, 0 +inf, 0 -inf) in the compiled result and " in message
    assert "allow_nonfinite=true (aotc compile --allow-nonfinite)" in message

    check = check_artifact(path, package, SPEC, "cpu", allow_nonfinite=True)
    assert check["passed"] and check["allow_nonfinite"] and check["max_rel_err"] < 1e-4
    (entry,) = check["nonfinite"]
    assert entry["point"] == "min" and entry["output"] == 1 and entry["numel"] == 32
    assert entry["eager"] == entry["compiled"] and 0 < entry["eager"]["nan"] < 32
    assert any("accepted because allow_nonfinite is set" in n for n in check["notes"])
    report = rep.attach_check({"stages": {}}, check)
    assert report["stages"]["package"]["check"]["nonfinite"] == check["nonfinite"]


def test_measure_on_a_cpu_takes_the_median_and_spread_of_wall_clock_calls():
    import time

    from compiler.check import measure

    t = measure(lambda: time.sleep(0.002), "cpu", rep_ms=60.0)
    assert t["method"] == "wall-clock" and t["reps"] >= 10 and t["warmup_reps"] >= 3
    assert t["min_ms"] <= t["p25_ms"] <= t["median_ms"] <= t["p75_ms"] <= t["max_ms"]
    assert 2.0 <= t["median_ms"] < 10.0 and t["iqr_ms"] == pytest.approx(t["p75_ms"] - t["p25_ms"], abs=1e-4)
    slow = measure(lambda: time.sleep(0.05), "cpu", budget_s=0.2)  # a budget that holds few calls: at least 3
    assert slow["reps"] == 3 and slow["median_ms"] >= 50.0


@pytest.mark.slow
def test_on_a_cpu_the_check_records_timings_with_their_spread_the_device_and_why_no_graph(log_model):
    path, package = log_model
    check = check_artifact(path, package, SPEC, "cpu", allow_nonfinite=True)
    assert check["device_info"]["kind"] == "cpu" and check["device_info"]["name"]
    lat = check["latency"]
    assert lat["method"] == "wall-clock" and lat["compiled"]["median_ms"] == pytest.approx(check["compiled_ms"],
                                                                                             abs=1e-4)
    assert lat["eager"]["min_ms"] <= lat["eager"]["median_ms"] <= lat["eager"]["max_ms"] and "graph" not in lat
    assert check["graph_ms"] is None
    assert check["graphs"] == {"impl": None, "captured": False, "reason": "CUDA graphs need a CUDA device"}
    pkg = rep.attach_check({"stages": {}}, check)["stages"]["package"]["check"]
    assert pkg["latency"] == lat and pkg["graphs"] == check["graphs"] and pkg["device_info"] == check["device_info"]


@pytest.mark.slow
def test_loading_for_cuda_graphs_on_a_cpu_runs_the_package_plainly_and_says_why(log_model, caplog):
    from client.graphs import GraphedArtifact

    _, package = log_model
    fn = GraphedArtifact(package, {"key": "k", "spec": SPEC}, "cpu")
    assert fn.reason == "device cpu: CUDA graphs need a CUDA device" and fn.stats() == []
    assert "artifact k runs without CUDA graphs: device cpu" in caplog.text
    x = torch.randn(4, 8)
    y, log_y = fn(x)
    assert fn.last == "plain"
    ref = seeded(LogOfLinear, 0)(x)
    torch.testing.assert_close(y, ref[0], rtol=1e-4, atol=1e-5)


# -- what an attacker would feed the package -------------------------------------------------------------------

class UnsafeIndex(torch.nn.Module):
    """Issue 18's upload: one node, aten._unsafe_index, which Inductor compiles with no bounds check."""

    def forward(self, x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._unsafe_index.Tensor(x, [i])


INDEX_SPEC = [{"name": "x", "dtype": "float32", "shape": [16, 4]}, {"name": "i", "dtype": "int64", "shape": [8]}]
FAR_INDICES = torch.linspace(-400000, 400000, 8).long()  # what read back a tensor held elsewhere in the process


@pytest.fixture(scope="module")
def unsafe_index(tmp_path_factory):
    """The one-node program exported with an all-zero sample index, compiled twice: through the pipeline, and as
    main did (the program as uploaded, Inductor's defaults: no rewrite, no forced asserts)."""
    from compiler.compat.aoti import aoti_compile_and_package
    from compiler.loading import load_program

    d = tmp_path_factory.mktemp("unsafe-index")
    path = export(UnsafeIndex(), (torch.randn(16, 4), torch.zeros(8, dtype=torch.long)), d / "m.pt2")
    result = compile_model(str(path), INDEX_SPEC, INDEX_SPEC, CompileOptions(), "cpu", str(d / "bounded.pt2"))
    unbounded = aoti_compile_and_package(load_program(str(path)), str(d / "unbounded.pt2"), {})
    return {"path": str(path), "result": result, "unbounded": unbounded,
            "report": json.loads(Path(result["report"]).read_text())}


@pytest.mark.slow
def test_a_package_that_returns_where_eager_raises_fails_the_check_naming_the_input_and_value(unsafe_index):
    with pytest.raises(CheckFailed) as info:
        check_artifact(unsafe_index["path"], unsafe_index["unbounded"], INDEX_SPEC, "cpu")
    message = info.value.message
    # The sample's own range (all zeros) agrees; the adversarial cases do not.
    assert message.startswith("artifact fails the adversarial check at min shapes: input 'i' = "
                              "9223372036854775807 (one element of 8; int64 max): eager raises IndexError: index "
                              "9223372036854775807 is out of bounds for dimension 0 with size 16, the package "
                              "returned; and ")
    assert "input 'i' = -400000 (every element; far before the start): eager raises IndexError" in info.value.excerpt
    assert "input 'i' = 16 (one element of 8; dim size 16): eager raises IndexError" in info.value.excerpt


@pytest.mark.slow
def test_the_bounded_package_raises_where_eager_raises_and_the_check_records_what_it_tried(unsafe_index):
    from compiler.compat.aoti import aoti_load_package

    capture = unsafe_index["report"]["stages"]["capture"]
    assert capture["bounds"]["ops"] == {"aten._unsafe_index.Tensor": 1}
    row = next(r for r in rep.summary_rows(unsafe_index["report"]) if r["stage"] == "capture")
    assert row["detail"] == "static shapes; 1 unchecked op(s) rewritten to checked forms"
    assert unsafe_index["report"]["stages"]["package"]["scan"]["findings"] == []
    package = aoti_load_package(unsafe_index["result"]["package"], "cpu")
    x = torch.randn(16, 4)
    for bad in (FAR_INDICES, torch.tensor([0, 1, 2, 3, 4, 5, 6, 16]), torch.full((8,), -17)):
        with pytest.raises(RuntimeError, match="index out of bounds"):
            package(x, bad)
    ok = torch.tensor([0, 15, -1, -16, 3, 2, 1, 0])
    assert torch.equal(package(x, ok), x[ok])

    check = check_artifact(unsafe_index["path"], unsafe_index["result"]["package"], INDEX_SPEC, "cpu")
    adv = check["adversarial"]
    assert adv["point"] == "min" and adv["failures"] == [] and adv["cases"] == 26
    assert adv["inputs"] == {"i": [-2**63, -400000, -17, -9, -5, -1, 0, 1, 4, 8, 16, 400000, 2**63 - 1]}
    assert adv["dim_sizes"] == [16, 8, 4]
    assert adv["outcomes"] == {"refused": 12, "agreed": 14}  # -16..15 index; the rest is out of range
    refused = {(r["value"], r["whole"]) for r in adv["results"] if r["outcome"] == "refused"}
    assert (-400000, True) in refused and (16, False) in refused and (-17, False) in refused
    assert all(r["eager"].startswith("IndexError") for r in adv["results"] if r["outcome"] == "refused")
    assert rep.attach_check({"stages": {}}, check)["stages"]["package"]["check"]["adversarial"] == adv


@pytest.mark.slow
def test_a_float_input_cast_to_an_index_gets_the_adversarial_cases_an_integer_input_gets(tmp_path):
    from compiler.compat.aoti import aoti_compile_and_package
    from compiler.loading import load_program

    path = export(FloatInputIndex(), (torch.randn(16, 4), torch.rand(8)), tmp_path / "m.pt2")
    unbounded = aoti_compile_and_package(load_program(str(path)), str(tmp_path / "unbounded.pt2"), {})
    with pytest.raises(CheckFailed) as info:
        check_artifact(str(path), unbounded, FLOAT_SPEC, "cpu")
    assert info.value.message.startswith("artifact fails the adversarial check at min shapes: input 'f' = "
                                         "1099511627776.0 (one element of 8; 2**40): eager raises IndexError"), \
        info.value.message
    assert "input 'f' = 16.0 (one element of 8; dim size 16): eager raises IndexError" in info.value.excerpt

    result = compile_model(str(path), FLOAT_SPEC, FLOAT_SPEC, CompileOptions(), "cpu", str(tmp_path / "b.pt2"))
    adv = check_artifact(str(path), result["package"], FLOAT_SPEC, "cpu")["adversarial"]
    assert adv["failures"] == [] and set(adv["inputs"]) == {"f"}
    assert adv["inputs"]["f"] == [-2.0**40, -400000.0, -17.0, -9.0, -5.0, -1.0, 0.0, 4.0, 8.0, 16.0, 400000.0,
                                  2.0**40]
    # |f| indexes 16 rows: 0, 4, 8, -1 (1), -5 (5), -9 (9) agree; 16, 17 and the far values are refused
    assert adv["outcomes"]["refused"] >= 10 and adv["outcomes"]["agreed"] >= 10, adv["outcomes"]


@pytest.mark.slow
def test_a_bool_mask_that_indexes_is_tried_all_set_and_all_clear(tmp_path):
    from compiler.compat.aoti import aoti_compile_and_package
    from compiler.loading import load_program

    mask = torch.zeros(16, dtype=torch.bool)
    mask[:4] = True
    path = export(MaskedGather(), (torch.randn(16), mask), tmp_path / "m.pt2")
    unbounded = aoti_compile_and_package(load_program(str(path)), str(tmp_path / "unbounded.pt2"), {})
    with pytest.raises(CheckFailed) as info:
        check_artifact(str(path), unbounded, MASK_SPEC, "cpu")
    assert info.value.message.startswith("artifact fails the adversarial check at min shapes: input 'mask' = True "
                                         "(every element; set): eager raises IndexError"), info.value.message

    result = compile_model(str(path), MASK_SPEC, MASK_SPEC, CompileOptions(), "cpu", str(tmp_path / "b.pt2"))
    adv = check_artifact(str(path), result["package"], MASK_SPEC, "cpu")["adversarial"]
    assert adv["failures"] == [] and adv["inputs"] == {"mask": [False, True]}
    refused = [(r["value"], r["whole"]) for r in adv["results"] if r["outcome"] == "refused"]
    assert refused == [(True, True)], adv["results"]  # 16 rows of 12; the random mask with one more set fits


class Divergent(torch.nn.Module):
    """Ops whose compiled form diverged from eager on out-of-range input: max_unpool2d (Inductor's decomposition
    bounds an index by the batch's buffer, not by its plane), scatter_add (an ATen fallback whose error code the
    C++ wrapper dropped), masked_scatter with a short source, and _unsafe_masked_index (eager clamps, Inductor's
    lowering reads wherever the index points)."""

    def forward(self, x: torch.Tensor, ind: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                src: torch.Tensor, idx: torch.Tensor, j: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (torch.nn.functional.max_unpool2d(x, ind, 2),
                torch.scatter_add(y, 0, idx, torch.ones(idx.shape)),
                y.masked_scatter(mask, src),
                torch.ops.aten._unsafe_masked_index(y, mask, [j], -1.0))


def divergent_inputs() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(3)
    _, ind = torch.nn.functional.max_pool2d(torch.randn(1, 2, 8, 8), 2, return_indices=True)
    mask = torch.zeros(16, dtype=torch.bool)
    mask[:4] = True
    return (torch.randn(1, 2, 4, 4), ind, torch.randn(16), mask, torch.randn(12),
            torch.zeros(4, dtype=torch.long), torch.zeros(16, dtype=torch.long))


DIVERGENT_SPEC = [
    {"name": "x", "dtype": "float32", "shape": [1, 2, 4, 4]}, {"name": "ind", "dtype": "int64", "shape": [1, 2, 4, 4]},
    {"name": "y", "dtype": "float32", "shape": [16]}, {"name": "mask", "dtype": "bool", "shape": [16]},
    # 12 sources: the check's random mask (seed 0) has 10 ones, which fit; a mask of 16 ones does not.
    {"name": "src", "dtype": "float32", "shape": [12]}, {"name": "idx", "dtype": "int64", "shape": [4]},
    {"name": "j", "dtype": "int64", "shape": [16]},
]


@pytest.fixture(scope="module")
def divergent(tmp_path_factory):
    d = tmp_path_factory.mktemp("divergent")
    path = export(Divergent(), divergent_inputs(), d / "m.pt2")
    result = compile_model(str(path), DIVERGENT_SPEC, DIVERGENT_SPEC, CompileOptions(), "cpu", str(d / "a.pt2"))
    return {"path": str(path), "result": result, "report": json.loads(Path(result["report"]).read_text())}


def _poisoned(name: str, value: Any) -> list[torch.Tensor]:
    args = list(divergent_inputs())
    k = [i["name"] for i in DIVERGENT_SPEC].index(name)
    args[k] = value(args[k]) if callable(value) else value
    return args


@pytest.mark.slow
def test_compiled_max_unpool_scatter_add_and_masked_scatter_raise_where_eager_raises(divergent):
    from compiler.compat.aoti import aoti_load_package

    package = aoti_load_package(divergent["result"]["package"], "cpu")
    eager = Divergent()
    cases = {
        # -1 and 64 (an 8x8 plane) fall in the other plane of the batch's buffer; 400000 past the end of it.
        "ind = -1 in one element": _poisoned("ind", lambda t: t.index_put_((torch.tensor([0]),) * 4, torch.tensor(-1))),
        "ind = 64 (the plane's size)": _poisoned("ind", lambda t: t.index_put_((torch.tensor([0]),) * 4,
                                                                               torch.tensor(64))),
        "ind = 400000": _poisoned("ind", lambda t: torch.full_like(t, 400000)),
        "idx = 16 (scatter_add)": _poisoned("idx", torch.tensor([0, 1, 16, 2])),
        "idx = -1 (scatter_add)": _poisoned("idx", torch.tensor([0, -1, 2, 3])),
        "masked_scatter with 16 ones and 12 sources": _poisoned("mask", torch.ones(16, dtype=torch.bool)),
    }
    for what, args in cases.items():
        with pytest.raises((RuntimeError, IndexError)):
            eager(*args)
            pytest.fail(f"eager returned for {what}")
        with pytest.raises(RuntimeError):
            package(*args)
            pytest.fail(f"the package returned for {what}")
    # _unsafe_masked_index: eager clamps a masked-in index, so the package must return the same values.
    for j in (torch.full((16,), 400000), torch.full((16,), -400000), torch.arange(16) - 8):
        args = _poisoned("j", j)
        for got, want in zip(package(*args), eager(*args), strict=True):
            torch.testing.assert_close(got, want)
    capture = divergent["report"]["stages"]["capture"]["bounds"]["ops"]
    assert capture == {"aten.max_unpool2d.default": 1, "aten._unsafe_masked_index.default": 1}
    assert divergent["report"]["hooks"]["checked_fallbacks"].startswith("CppWrapperCpu._generate_scatter_fallback")
    assert divergent["report"]["stages"]["package"]["scan"]["findings"] == []


@pytest.mark.slow
def test_the_adversarial_check_passes_the_bounded_divergent_ops(divergent):
    check = check_artifact(divergent["path"], divergent["result"]["package"], DIVERGENT_SPEC, "cpu")
    adv = check["adversarial"]
    assert adv["failures"] == [] and adv["cases"] == 48  # three integer inputs, capped at MAX_CASES
    assert set(adv["inputs"]) == {"ind", "idx", "j", "mask"}  # the mask since 2026-11-30: masked_scatter reads by it
    assert adv["inputs"]["mask"] == [False, True]
    assert adv["outcomes"]["refused"] > 0 and adv["outcomes"]["agreed"] > 0
    assert set(adv["outcomes"]) <= {"refused", "agreed"}


@pytest.mark.slow
def test_probes_are_forked_from_a_zygote_and_are_processes_of_their_own_where_it_cannot_start(unsafe_index,
                                                                                             monkeypatch):
    from compiler import adversarial

    summary = check_artifact(unsafe_index["path"], unsafe_index["result"]["package"], INDEX_SPEC, "cpu")
    forked = summary["adversarial"]
    assert forked["probes"] == forked["forked"] == 1 and forked["outcomes"] == {"refused": 12, "agreed": 14}
    # What the probe cost, and where the check's time went, in the record: the one probe's wall time holds its
    # package's and program's loads (a CPU probe has no context to make); the phases are in the order they ran (a
    # weightless package's perturbed weights; no CUDA graphs on a CPU).
    cost = forked["probe_cost"]
    assert set(cost) == {"median_s", "max_s", "package_s", "program_s", "cases_s"}, cost
    assert cost["cases_s"]["eager returned"] > 0 and cost["cases_s"]["eager refused"] > 0, cost
    assert 0 < cost["package_s"] + cost["program_s"] < cost["median_s"] == cost["max_s"], cost
    assert list(summary["phases"]) == ["program", "eager", "eager_timed", "load", "plain", "follows",
                                       "adversarial"], summary["phases"]
    assert summary["phases"]["adversarial"] >= forked["probe_seconds"] >= cost["median_s"], summary["phases"]
    monkeypatch.setattr(adversarial, "ZYGOTE_START_S", 0.0)  # no answer in time: each probe starts python itself
    own = check_artifact(unsafe_index["path"], unsafe_index["result"]["package"], INDEX_SPEC, "cpu")["adversarial"]
    assert own["probes"] == 1 and own["forked"] == 0
    assert own["results"] == forked["results"] and own["failures"] == forked["failures"] == []


@pytest.mark.slow
def test_a_check_prepared_ahead_of_its_package_gives_the_same_verdicts_and_says_how_long_it_waited(unsafe_index):
    """The worker's early check (worker/earlycheck.py): the program, eager's outputs and eager's verdict on every
    adversarial case made before the package exists, then the package checked. The same cases end the same way as
    in a check run at once; eager's figure is taken only once the package has come (after the wait)."""
    from compiler.check import prepare_check

    at_once = check_artifact(unsafe_index["path"], unsafe_index["result"]["package"], INDEX_SPEC, "cpu")
    prepared = prepare_check(unsafe_index["path"], INDEX_SPEC, "cpu", oracle=True)
    assert list(prepared.clock.phases) == ["program", "eager", "oracle"], prepared.clock.phases
    assert prepared.decided is not None and len(prepared.decided.poisons) == 26
    time.sleep(1.0)  # the compile, meanwhile
    ahead = check_artifact(unsafe_index["path"], unsafe_index["result"]["package"], INDEX_SPEC, "cpu",
                           prepared=prepared)
    assert ahead["early"]["idle_s"] >= 1.0
    assert list(ahead["phases"]) == ["program", "eager", "oracle", "eager_timed", "load", "plain", "follows",
                                     "adversarial"], ahead["phases"]
    assert ahead["phases"]["eager_timed"] < 1.0  # the wait is no phase of the check
    adv, adv0 = ahead["adversarial"], at_once["adversarial"]
    assert adv["results"] == adv0["results"] and adv["outcomes"] == adv0["outcomes"] == {"refused": 12, "agreed": 14}
    assert adv["failures"] == adv0["failures"] == []
    assert adv["oracle_s"] > 0 and "oracle_s" not in adv0  # decided ahead, and said so
    assert ahead["points"][0]["latency"]["eager"]["method"] == "wall-clock"
    with pytest.raises(AssertionError, match="runs once"):  # its eager module was let go for the probes
        check_artifact(unsafe_index["path"], unsafe_index["result"]["package"], INDEX_SPEC, "cpu", prepared=prepared)


@pytest.mark.slow
def test_refused_cases_split_between_lanes_of_probes_give_one_lanes_verdicts(unsafe_index, monkeypatch):
    from compiler import adversarial

    one = check_artifact(unsafe_index["path"], unsafe_index["result"]["package"], INDEX_SPEC, "cpu")["adversarial"]
    assert one["probe_lanes"] == 1 and one["probes"] == 1
    monkeypatch.setattr(adversarial, "CPU_LANES", 3)  # as on CUDA, where each refused case costs a probe
    three = check_artifact(unsafe_index["path"], unsafe_index["result"]["package"], INDEX_SPEC, "cpu")["adversarial"]
    # The cases eager returns on in one probe; then each refused case in a probe of its own, in whichever lane is
    # free (on CUDA each ends its probe's context), all forked from the lanes' zygotes.
    refused = one["outcomes"]["refused"]
    assert three["probe_lanes"] == 3 and three["probes"] == three["forked"] == 1 + refused, three
    assert three["probe_cost"]["max_s"] >= three["probe_cost"]["median_s"] > 0  # the three lanes' probes, together
    assert len(three["probe_cost"]["lanes_s"]) == 3 and max(three["probe_cost"]["lanes_s"]) <= three["probe_seconds"]
    assert three["results"] == one["results"] and three["failures"] == [] and three["outcomes"] == one["outcomes"]

    # The package that returns where eager raises is refused whichever lane meets the case: every refused case of
    # each lane is named.
    with pytest.raises(CheckFailed) as info:
        check_artifact(unsafe_index["path"], unsafe_index["unbounded"], INDEX_SPEC, "cpu")
    assert info.value.message.endswith(f"; and {one['outcomes']['refused'] - 1} more case(s), in the excerpt")
    monkeypatch.setattr(adversarial, "LANE_BYTES", 1)  # a package larger than the lanes' memory: one lane
    assert adversarial.probe_lanes("cuda", unsafe_index["unbounded"], 12) == 1
    monkeypatch.setattr(adversarial, "LANE_BYTES", 4 << 30)
    assert adversarial.probe_lanes("cuda", unsafe_index["unbounded"], 12) == adversarial.CUDA_LANES
    assert adversarial.probe_lanes("cuda", unsafe_index["unbounded"], 2) == 2


@pytest.mark.slow
def test_the_zygote_kills_a_probe_that_overruns_and_reports_one_that_raises(unsafe_index, tmp_path):
    from compiler.adversarial import Zygote

    fifo = tmp_path / "cases.pt"
    os.mkfifo(fifo)  # the probe's first read blocks here for ever
    zygote = Zygote(tmp_path / "zygote.log")
    try:
        assert zygote.ready
        argv = [unsafe_index["path"], unsafe_index["result"]["package"], "cpu", str(fifo), str(tmp_path / "out"),
                "0", "0.01", "none"]
        t0 = time.perf_counter()
        assert zygote.run(argv, tmp_path / "hung.log", timeout=1.0) == (True, None)
        assert time.perf_counter() - t0 < 30
        argv[3] = str(tmp_path / "missing.pt")
        assert zygote.run(argv, tmp_path / "raised.log", timeout=60.0) == (True, 1)  # the zygote outlived both
        assert "FileNotFoundError" in (tmp_path / "raised.log").read_text()
        # A probe that ends at once: its two answers come together, and the second must not be waited for.
        assert zygote.proc.stdin is not None
        zygote.proc.stdin.write(json.dumps({"argv": ["too", "few"], "log": str(tmp_path / "quick.log")}).encode()
                                + b"\n")
        zygote.proc.stdin.flush()
        time.sleep(3)  # both answers are in the pipe by now
        forked = zygote._line(5.0)
        assert forked is not None and zygote._line(1.0) == {"pid": forked["pid"], "rc": 1}
    finally:
        zygote.close()
    assert zygote.proc.returncode == 0


class Classifier(torch.nn.Module):
    """A network whose labels meet it only at the loss, as a train-step program's do."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                        torch.nn.Conv2d(8, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                        torch.nn.Flatten(), torch.nn.Linear(8, 10))
        self.emb = torch.nn.Embedding(20, 10)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.body(x) + self.emb(ids).mean(1)
        return torch.nn.functional.cross_entropy(logits, labels)


def _poisoned_cases(path: str, spec: list[dict[str, Any]]) -> tuple[Any, list[torch.Tensor], list[Any], list[int]]:
    """The program at `path`, its in-range base inputs at the spec's first shape point, and the adversarial cases
    there (each case's inputs and the input it poisons), as check_adversarial builds them."""
    from compiler import adversarial
    from compiler import inputs as inputs_mod
    from compiler.loading import load_program

    ep = load_program(path)
    shapes, ranges = next(iter(inputs_mod.points(spec).values())), inputs_mod.int_ranges(ep)
    base = inputs_mod.random_inputs(spec, shapes, "cpu", ranges, 0)
    poisons = adversarial.cases_at(ep, spec, shapes, ranges)[0]
    return ep, base, [inputs_mod.poisoned(base, p) for p in poisons], [p.input for p in poisons]


def _verdicts_both_ways(path: str, spec: list[dict[str, Any]]) -> tuple[list[Any], tuple[list[Any], int], int]:
    from compiler import adversarial

    ep, base, flats, which = _poisoned_cases(path, spec)
    whole = adversarial.eager_verdicts(ep, ep.module(), flats)
    partial = adversarial.partial_verdicts(ep, ep.module(), base, flats, which)
    assert partial is not None
    return whole, partial, len(ep.module().graph.nodes) * (len(flats) + 1)


@pytest.mark.slow
def test_eager_verdicts_run_again_only_what_the_poisoned_input_reaches_and_agree_with_whole_runs(divergent,
                                                                                                tmp_path):
    whole, (partial, ran), every = _verdicts_both_ways(divergent["path"], DIVERGENT_SPEC)
    assert partial == whole and any(whole) and not all(whole)
    assert 0 < ran < every

    spec = [{"name": "x", "dtype": "float32", "shape": [4, 3, 12, 12]},
            {"name": "ids", "dtype": "int64", "shape": [4, 5]}, {"name": "labels", "dtype": "int64", "shape": [4]}]
    path = export(Classifier().train(), (torch.randn(4, 3, 12, 12), torch.zeros(4, 5, dtype=torch.long),
                                         torch.zeros(4, dtype=torch.long)), tmp_path / "c.pt2")
    whole, (partial, ran), every = _verdicts_both_ways(str(path), spec)
    assert partial == whole
    labels = [w for w, p in zip(whole, adversarial_inputs(str(path), spec), strict=True) if p == 2]
    assert any(labels) and any(v is None for v in labels)  # out-of-range labels refused, boundaries not
    assert ran < every / 3  # the network ran once; each case, the embedding's or the loss's few nodes


class TextLike(torch.nn.Module):
    """A text encoder's shape: token ids through an embedding, positions counted from the ids' padding mask (as
    RoBERTa's are), a padding mask into attention, layers of float arithmetic, a loss at labels."""

    def __init__(self, vocab: int = 50, d: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(12, d)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))
        self.head = torch.nn.Linear(d, 10)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = (ids != 0).long().cumsum(1) * (ids != 0).long() + 1
        h = self.tok(ids) + self.pos(positions)
        keep = (mask != 0)[:, None, None, :]
        for layer in self.layers:
            h = h + torch.nn.functional.scaled_dot_product_attention(h[:, None], h[:, None], h[:, None],
                                                                     attn_mask=keep)[:, 0]
            h = torch.nn.functional.gelu(layer(h))
        return torch.nn.functional.cross_entropy(self.head(h.mean(1)), labels)


class FloatIndex(torch.nn.Module):
    """Hostile: an index computed from float activations of the token ids, so whether eager raises depends on
    float arithmetic downstream of the ids."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(50, 4)
        self.table = torch.nn.Parameter(torch.randn(8))
        with torch.no_grad():
            self.tok.weight.copy_((torch.arange(50.0) + 1)[:, None].expand(50, 4) / 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.relu(self.tok(ids))
        return self.table[h.sum(-1).long()].sum()  # id + 1: id 7 is past the table's 8, though the embedding's 50


def _verdicts_three_ways(model: torch.nn.Module, args: tuple[torch.Tensor, ...], spec: list[dict[str, Any]],
                         path: Path) -> tuple[list[Any], tuple[list[Any], int], tuple[list[Any], int]]:
    from compiler import adversarial

    ep, base, flats, which = _poisoned_cases(str(export(model, args, path)), spec)
    whole = adversarial.eager_verdicts(ep, ep.module(), flats)
    reached = adversarial.partial_verdicts(ep, ep.module(), base, flats, which, may_raise_only=False)
    cone = adversarial.partial_verdicts(ep, ep.module(), base, flats, which)
    assert reached is not None and cone is not None
    return whole, reached, cone


def test_poisoned_token_ids_run_the_ops_that_can_raise_not_the_layers_after_them(tmp_path):
    spec = [{"name": "ids", "dtype": "int64", "shape": [2, 6]}, {"name": "mask", "dtype": "int64", "shape": [2, 6]},
            {"name": "labels", "dtype": "int64", "shape": [2]}]
    args = (torch.randint(0, 50, (2, 6)), torch.ones(2, 6, dtype=torch.long), torch.randint(0, 10, (2,)))
    whole, (reached, ran_reached), (cone, ran_cone) = _verdicts_three_ways(TextLike(), args, spec,
                                                                          tmp_path / "text.pt2")
    assert cone == reached == whole
    assert any(whole) and not all(whole)  # out-of-range ids and labels refused, boundaries returned
    assert ran_cone < ran_reached / 2  # ids and mask no longer run the four layers and the head per case

    # An index computed from the float activations of the ids: the float work before it runs, and the verdicts are
    # eager's, the out-of-range ones included.
    spec = [{"name": "ids", "dtype": "int64", "shape": [3]}]
    whole, (reached, _), (cone, _) = _verdicts_three_ways(FloatIndex(), (torch.tensor([0, 3, 6]),), spec,
                                                         tmp_path / "float-index.pt2")
    assert cone == reached == whole
    assert any(v and "out of bounds for dimension 0 with size 8" in v for v in whole)  # the table's, at id 7


class KeywordIds(torch.nn.Module):
    """Token ids passed by keyword, as `model(input_ids=..., attention_mask=...)` exports them."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(10, 4)

    def forward(self, x: torch.Tensor, *, ids: torch.Tensor) -> torch.Tensor:
        return x + self.tok(ids).sum(0)


def test_a_program_with_keyword_inputs_is_decided_node_by_node_too():
    """The interpreter that decides the cases takes the graph's flat inputs: given keywords it raised (TypeError), and
    the check took that for eager refusing its in-range inputs, so each case ran whole (on CUDA: eager on the device,
    an assert ending a context per refused case)."""
    from compiler import adversarial

    ep = torch.export.export(KeywordIds(), (torch.randn(4),), {"ids": torch.zeros(3, dtype=torch.long)})
    base = [torch.randn(4), torch.tensor([0, 1, 2])]
    flats = [[base[0], torch.tensor([0, 1, v])] for v in (9, 10, -11, -1)]
    decided = adversarial.partial_verdicts(ep, ep.module(), base, flats, [1] * len(flats))
    assert decided is not None
    assert decided[0] == adversarial.eager_verdicts(ep, ep.module(), flats)
    assert decided[0][0] is None and decided[0][1] and decided[0][2]  # id 9 fits the table of 10; 10 and -11 do not


def test_op_names_that_can_raise_on_floats_are_matched_by_word():
    from compiler.adversarial import _may_raise_on_floats

    aten = torch.ops.aten
    assert all(map(_may_raise_on_floats, (aten._linalg_check_errors.default, aten.bernoulli.p,
                                          aten._assert_async.msg, aten.linalg_lu_factor_ex.default)))
    assert not any(map(_may_raise_on_floats, (aten.relu.default, aten.gelu.default, aten.silu.default,
                                              aten.addmm.default)))


def adversarial_inputs(path: str, spec: list[dict[str, Any]]) -> list[int]:
    return _poisoned_cases(path, spec)[3]


# Planted in the probes (a sitecustomize on their PYTHONPATH, as tests/worker plants faults in the children):
# - while the file AOTC_TEST_FAULT_COUNT names holds a count above 0, a package call that raises (a clean refusal)
#   raises AOTC_TEST_FAULT_WORDS instead, and the count goes down by one. On a shared GPU the driver answers
#   "unspecified launch failure" to a context it reset while the package trapped on its own assert (Xid 109);
# - a package call whose flat input number AOTC_TEST_NAN_INPUT holds a value of int64's extremes (magnitude 2**62 or
#   more) returns NaN as its first output element, as DeBERTa-v3's CUDA package held NaN where eager held none at an
#   int64-max attention mask (its float32 attention scores a tenth of float32's largest).
PLANTED = """
import os
_count = os.environ.get("AOTC_TEST_FAULT_COUNT")
_which = os.environ.get("AOTC_TEST_NAN_INPUT")
if _count or _which:
    import torch
    from torch.utils import _pytree
    from compiler.compat import aoti as _aoti

    _load = _aoti.aoti_load_package

    def _planted(*args, **kwargs):
        package = _load(*args, **kwargs)

        class Planted:
            def __getattr__(self, name):
                return getattr(package, name)

            def __call__(self, *a, **kw):
                try:
                    out = package(*a, **kw)
                except Exception:
                    if not _count:
                        raise
                    with open(_count) as f:
                        n = int(f.read())
                    if n <= 0:
                        raise
                    with open(_count, "w") as f:
                        f.write(str(n - 1))
                    raise RuntimeError(os.environ["AOTC_TEST_FAULT_WORDS"]) from None
                flat = [t for t in _pytree.tree_leaves((a, kw)) if isinstance(t, torch.Tensor)]
                if _which and float(flat[int(_which)].double().abs().max()) >= 2.0 ** 62:  # int64 min's abs is itself
                    out = out.clone()
                    out.view(-1)[0] = float("nan")
                return out

        return Planted()

    _aoti.aoti_load_package = _planted
"""
LAUNCH_FAILURE = "CUDA error: unspecified launch failure (planted by test_check)"


def _plant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "planted"
    d.mkdir()
    (d / "sitecustomize.py").write_text(PLANTED)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(d), os.environ.get("PYTHONPATH")])))
    return d


def _plant_fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int, words: str = LAUNCH_FAILURE) -> Path:
    d = _plant(tmp_path, monkeypatch)
    (d / "count").write_text(str(count))
    monkeypatch.setenv("AOTC_TEST_FAULT_COUNT", str(d / "count"))
    monkeypatch.setenv("AOTC_TEST_FAULT_WORDS", words)
    return d / "count"


def test_only_a_launch_failure_without_words_of_a_touched_address_is_ambiguous():
    from compiler.adversarial import ambiguous

    def fault(words: str) -> dict[str, str]:
        return {"outcome": "package faulted", "package": f"AcceleratorError: CUDA error: {words}"}

    assert ambiguous(fault("unspecified launch failure"))
    assert not ambiguous(fault("an illegal memory access was encountered"))
    assert not ambiguous(fault("misaligned address"))
    assert not ambiguous(fault("unspecified launch failure after an illegal address"))  # positive words stand
    assert not ambiguous({"outcome": "refused", "package": "unspecified launch failure"})


@pytest.mark.slow
def test_a_launch_failure_runs_again_alone_and_a_clean_refusal_then_is_the_verdict(unsafe_index, tmp_path,
                                                                                  monkeypatch):
    clean = check_artifact(unsafe_index["path"], unsafe_index["result"]["package"], INDEX_SPEC, "cpu")["adversarial"]
    count = _plant_fault(tmp_path, monkeypatch, 1)  # the first refusal only: the device reset its context
    adv = check_artifact(unsafe_index["path"], unsafe_index["result"]["package"], INDEX_SPEC, "cpu")["adversarial"]
    assert count.read_text() == "0"  # the plant fired
    assert adv["failures"] == [] and adv["outcomes"] == clean["outcomes"] and adv["run_again"] == 1
    again = [r for r in adv["results"] if "earlier" in r]
    assert len(again) == 1 and again[0]["outcome"] == "refused"
    assert again[0]["earlier"] == [f"RuntimeError: {LAUNCH_FAILURE}"]
    assert adv["probes"] == clean["probes"] + 1  # one probe more, for the one case


@pytest.mark.slow
def test_a_launch_failure_in_every_run_fails_the_check_and_words_of_a_touched_address_are_not_run_again(
        unsafe_index, tmp_path, monkeypatch):
    from compiler import adversarial

    refused = 12  # of the 26 cases, those eager refuses (test_probes_are_forked_...)
    count = _plant_fault(tmp_path, monkeypatch, 1000)
    with pytest.raises(CheckFailed) as info:
        check_artifact(unsafe_index["path"], unsafe_index["result"]["package"], INDEX_SPEC, "cpu")
    failures = info.value.excerpt.splitlines()
    assert len(failures) == refused and all(LAUNCH_FAILURE in f for f in failures)
    # At most AMBIGUOUS_CASES cases run again, AMBIGUOUS_RETRIES times each; the others keep their first fault.
    runs = adversarial.AMBIGUOUS_RETRIES + 1
    again = [f for f in failures if f.endswith(f"; it ended so in {runs} runs, {runs - 1} of them after the "
                                               "check's other probes had ended)")]
    assert len(again) == adversarial.AMBIGUOUS_CASES
    assert int(count.read_text()) == 1000 - refused - adversarial.AMBIGUOUS_CASES * adversarial.AMBIGUOUS_RETRIES

    # An illegal address says memory was touched: the first run is the verdict.
    count.write_text("1")
    monkeypatch.setenv("AOTC_TEST_FAULT_WORDS", "CUDA error: an illegal memory access was encountered (planted)")
    with pytest.raises(CheckFailed) as info:
        check_artifact(unsafe_index["path"], unsafe_index["result"]["package"], INDEX_SPEC, "cpu")
    assert info.value.message.endswith("the package touched memory it does not own (RuntimeError: CUDA error: an "
                                       "illegal memory access was encountered (planted))")
    assert count.read_text() == "0" and len(info.value.excerpt.splitlines()) == 1

    # The runs again have a budget of their own (AMBIGUOUS_BUDGET_S, all rounds together): spent, the fault stands.
    count.write_text("1")
    monkeypatch.setenv("AOTC_TEST_FAULT_WORDS", LAUNCH_FAILURE)
    monkeypatch.setattr(adversarial, "AMBIGUOUS_BUDGET_S", 0.0)
    with pytest.raises(CheckFailed) as info:
        check_artifact(unsafe_index["path"], unsafe_index["result"]["package"], INDEX_SPEC, "cpu")
    assert info.value.message.endswith(f"the package touched memory it does not own (RuntimeError: {LAUNCH_FAILURE})")
    assert count.read_text() == "0"


class ScaledByValue(torch.nn.Module):
    """An integer input used as a value in float arithmetic (`m`, scaled and squared: at int64's extremes the squares
    reach a tenth of float32's largest value, normalised back to [0, 1]), and one used only as a mask (`g`)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, m: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).sigmoid() * m.to(x.dtype)[:, None] * 0.5
        s = h * h
        return s / (s.amax(-1, keepdim=True) + 1) * (g != 0).to(x.dtype)[:, None]


SCALED_SPEC = [{"name": "x", "dtype": "float32", "shape": [4, 8]}, {"name": "m", "dtype": "int64", "shape": [4]},
               {"name": "g", "dtype": "int64", "shape": [4]}]


@pytest.mark.slow
def test_a_package_that_overflows_elsewhere_at_an_int64_extreme_is_beyond_range_and_a_mask_is_not(tmp_path,
                                                                                                   monkeypatch):
    _plant(tmp_path, monkeypatch)  # PLANTED: a NaN at int64's extremes of the input AOTC_TEST_NAN_INPUT names
    args = (torch.randn(4, 8), torch.ones(4, dtype=torch.long), torch.ones(4, dtype=torch.long))
    path = export(seeded(ScaledByValue, 0), args, tmp_path / "scaled.pt2")
    package = compile_model(str(path), SCALED_SPEC, SCALED_SPEC, CompileOptions(), "cpu",
                            str(tmp_path / "scaled-cpu.pt2"))["package"]
    clean = check_artifact(str(path), package, SCALED_SPEC, "cpu")["adversarial"]
    assert clean["failures"] == [] and "beyond range" not in clean["outcomes"]

    # The value input: each case at an int64 extreme returns a NaN eager has not, where the float64 run comes
    # within OVERFLOW_MARGIN of float32's largest value. Accepted, counted, and each row says why.
    monkeypatch.setenv("AOTC_TEST_NAN_INPUT", "1")
    adv = check_artifact(str(path), package, SCALED_SPEC, "cpu")["adversarial"]
    beyond = [r for r in adv["results"] if r["outcome"] == "beyond range"]
    extremes = [r for r in adv["results"] if r["name"] == "m" and abs(r["value"]) >= 2 ** 62]
    assert adv["failures"] == [] and len(beyond) == len(extremes) == adv["outcomes"]["beyond range"] == 4
    assert all(r["why"].startswith("beyond float32's range: eager and the package disagree on which of 1 values "
                                   "are finite") for r in beyond)

    # The mask input: at the same values the float arithmetic stays small, so the same NaN fails the check.
    monkeypatch.setenv("AOTC_TEST_NAN_INPUT", "2")
    with pytest.raises(CheckFailed) as info:
        check_artifact(str(path), package, SCALED_SPEC, "cpu")
    failures = info.value.excerpt.splitlines()
    assert failures and all(f.startswith("input 'g' = ") for f in failures)
    assert all("the package's result differs from eager: output 0 has NaN or inf where eager has none" in f
               for f in failures)


@pytest.mark.slow
def test_cases_left_when_the_adversarial_budget_is_spent_are_recorded_as_not_run(unsafe_index, monkeypatch):
    from compiler import adversarial

    monkeypatch.setattr(adversarial, "BUDGET_S", 0.0)  # spent before the first probe
    check = check_artifact(unsafe_index["path"], unsafe_index["result"]["package"], INDEX_SPEC, "cpu")
    adv = check["adversarial"]
    assert adv["outcomes"] == {"not run": 26} and adv["probes"] == 0 and adv["failures"] == []
    assert all(r["outcome"] == "not run" for r in adv["results"])
    monkeypatch.setattr(adversarial, "CPU_LANES", 3)  # lanes that take the refused cases as they come free
    lanes = check_artifact(unsafe_index["path"], unsafe_index["result"]["package"], INDEX_SPEC, "cpu")["adversarial"]
    assert lanes["probe_lanes"] == 3 and lanes["outcomes"] == {"not run": 26} and lanes["probes"] == 0, lanes
    assert all(r["outcome"] == "not run" for r in lanes["results"]), lanes
    assert _zygotes_left() == []  # the prestarted zygotes, none of them used, are gone with the check


def _zygotes_left() -> list[int]:
    """This process's children that are probe zygotes (`python -m compiler.adversarial --zygote`), still running."""
    left = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"--zygote" in cmd and stat.rsplit(")", 1)[1].split()[0] != "Z":
            left.append(int(proc.name))
    return left


class Labelled(torch.nn.Module):
    """A classifier's loss over labels, as a training upload (or an evaluation program) takes them."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(x, y)


LABELLED_SPEC = [{"name": "x", "dtype": "float32", "shape": [4, 10]}, {"name": "y", "dtype": "int64", "shape": [4]}]


@pytest.mark.slow
def test_labels_padded_with_an_ignore_index_get_valid_random_labels(tmp_path):
    """Example labels padded with -100 (what HF's collators write) gave the sample range [-100, 10): the check drew
    labels such as -84 from it, and eager's own IndexError failed the job with no word of why."""
    path = export(Labelled(), (torch.randn(4, 10), torch.tensor([1, -100, 3, 9])), tmp_path / "m.pt2")
    result = compile_model(str(path), LABELLED_SPEC, LABELLED_SPEC, CompileOptions(), "cpu", str(tmp_path / "p.pt2"))
    check = check_artifact(str(path), result["package"], LABELLED_SPEC, "cpu")
    assert check["passed"] and check["adversarial"]["failures"] == [], check["adversarial"]["failures"]

    # Example labels past the classes (12 of 10): the check's labels reach them, and it fails, naming the input,
    # its range and the fix, before any package is loaded.
    labels = torch.arange(64) % 10
    labels[5] = 12
    spec = [{"name": "x", "dtype": "float32", "shape": [64, 10]}, {"name": "y", "dtype": "int64", "shape": [64]}]
    bad = export(Labelled(), (torch.randn(64, 10), labels), tmp_path / "bad.pt2")
    with pytest.raises(CheckFailed) as info:
        check_artifact(str(bad), str(tmp_path / "never-loaded.pt2"), spec, "cpu")
    message = info.value.message
    assert message.startswith("eager PyTorch raises at the check's own random inputs at min shapes, so nothing can "
                              "be compared: IndexError: Target 1"), message  # 10, 11 or 12
    assert "'y' in [0, 13)" in message and "export it with example inputs it accepts" in message, message
    assert _zygotes_left() == []  # the check's prestarted zygotes end with it, failed or not


def test_random_integers_keep_a_sentinel_below_zero_apart():
    from compiler.inputs import SENTINEL_SHARE, random_inputs

    spec = [{"name": "y", "dtype": "int64", "shape": [4096]}, {"name": "i", "dtype": "int32", "shape": [4096]}]
    y, i = random_inputs(spec, [[4096], [4096]], "cpu", [(-100, 10), (3, 7)], seed=1)
    assert set(y.unique().tolist()) == {-100, *range(10)}  # the labels proper, and the ignore index
    share = float((y == -100).float().mean())
    assert abs(share - 1 / SENTINEL_SHARE) < 0.03, share
    assert set(i.unique().tolist()) == {3, 4, 5, 6} and i.dtype == torch.int32  # a range above zero: as before
