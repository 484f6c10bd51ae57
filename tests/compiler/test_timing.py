"""The timing pass's windows (compiler/timing.py, AOTC_TIMING_WINDOWS): each figure taken in N windows in turn, the
one with the smallest median kept and every window's median recorded; one window is the pass as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compiler.compat.aoti import aoti_compile_and_package
from compiler.options import CompileOptions
from compiler.timing import time_artifact
from modelzoo import MLP, export, seeded

SPEC = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 4}, 32]}]


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("timing")
    batch = torch.export.Dim("batch", min=1, max=4)
    path = export(seeded(MLP, 5), (torch.randn(2, 32),), d / "m.pt2", dynamic_shapes={"x": {0: batch}})
    package = str(d / "m-package.pt2")  # its weights inside: no blob to bind
    aoti_compile_and_package(torch.export.load(str(path)), package, CompileOptions().inductor_configs())
    return str(path), package


@pytest.mark.slow
def test_each_figure_is_the_smallest_of_its_windows_and_says_so(mlp: tuple[str, str]) -> None:
    timed = time_artifact(*mlp, SPEC, "cpu", windows=3)
    assert timed["windows"] == 3 and len(timed["points"]) == 2  # both ends of the batch's range
    for p in timed["points"]:
        for name, figure in (("eager", "eager_ms"), ("compiled", "compiled_ms")):
            t = p["latency"][name]
            assert len(t["windows_ms"]) == 3 and t["median_ms"] == min(t["windows_ms"]), t
            assert p[figure] == round(t["median_ms"], 4)
            assert t["method"].endswith("the smallest median of 3 windows taken in turn")
        lat = p["latency"]
        assert p["speedup"] == round(lat["eager"]["median_ms"] / lat["compiled"]["median_ms"], 3)


@pytest.mark.slow
def test_one_window_is_the_pass_as_it_was(mlp: tuple[str, str]) -> None:
    timed = time_artifact(*mlp, SPEC, "cpu")
    assert "windows" not in timed
    for p in timed["points"]:
        for name in ("eager", "compiled"):
            t = p["latency"][name]
            assert "windows_ms" not in t and "windows" not in t["method"] and t["reps"] >= 10


@pytest.mark.slow
def test_the_workers_timing_child_takes_the_windows_its_task_names(mlp: tuple[str, str], tmp_path: Path) -> None:
    """worker/child.py's `time` kind, as the worker runs it (a process of its own reading its task file), with the
    `windows` that worker.job puts in the task from AOTC_TIMING_WINDOWS."""
    import json
    import subprocess
    import sys

    from procs import ROOT

    out = tmp_path / "out"
    out.mkdir()
    task = {"dir": str(out), "device": "cpu", "model_path": mlp[0], "package_path": mlp[1], "spec": SPEC,
            "options": {}, "windows": 2}
    (tmp_path / "time-task.json").write_text(json.dumps(task))
    done = subprocess.run([sys.executable, "-m", "worker.child", str(tmp_path), "time"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert result["ok"], result
    assert result["result"]["windows"] == 2
    points = result["result"]["points"]
    assert all(len(p["latency"][n]["windows_ms"]) == 2 for p in points for n in ("eager", "compiled"))
