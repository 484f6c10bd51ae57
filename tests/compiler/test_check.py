"""compiler.check: what the artifact check accepts, refuses and warns about; a real compile of a model whose
output holds NaN fails the check unless the request allows non-finite outputs."""

from __future__ import annotations

import pytest
import torch

from compiler import report as rep
from compiler.check import check_artifact, compare
from compiler.errors import CheckFailed
from compiler.options import CompileOptions
from compiler.pipeline import compile_model
from modelzoo import export, seeded


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
