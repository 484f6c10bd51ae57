"""The pipeline's stages on the CPU, without the service: options that change the compile (bf16, freezing, an
allow-listed Inductor setting, the prims view) in one real compile, checked against eager; and what a stage reports
when torch does not show it."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

from compiler import report as rep
from compiler import stages
from compiler.check import check_artifact
from compiler.compat.observe import InductorObservation
from compiler.options import CompileOptions
from compiler.pipeline import compile_model
from modelzoo import InplaceReduce, export, seeded

SPEC = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 8}, 16]}]


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    d = tmp_path_factory.mktemp("bf16")
    batch = torch.export.Dim("batch", min=1, max=64)
    path = export(seeded(InplaceReduce, 5), (torch.randn(4, 16),), d / "m.pt2", dynamic_shapes={"x": {0: batch}})
    program_inputs = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 64, "symbol": "s0"}, 16]}]
    options = CompileOptions(precision="bf16", freezing=True, prims_view=True, inductor={"max_fusion_size": 32})
    stages_seen: list[str] = []
    result = compile_model(str(path), SPEC, program_inputs, options, "cpu", str(d / "a.pt2"), stages_seen.append)
    return {"path": path, "result": result, "report": json.loads(Path(result["report"]).read_text()),
            "stages": stages_seen}


@pytest.mark.slow
def test_bf16_freezing_compile_keeps_the_interface_and_passes_the_check(bf16):
    assert bf16["stages"] == ["load", "capture", "autograd", "lowering", "fusion", "codegen", "package"]
    report = bf16["report"]
    assert report["options"]["precision"] == "bf16" and report["options"]["inductor"]["max_fusion_size"] == 32
    cap = report["stages"]["capture"]
    # Casts at the edges: the input goes to bf16, the output comes back as float32.
    assert cap["graph"]["histogram"]["aten._to_copy.default"] == 2
    assert cap["inputs"][0]["dtype"] == "float32" and cap["outputs"][0]["dtype"] == "float32"
    kernel_cpp = zipfile.ZipFile(bf16["result"]["sources"]).read("code/kernel.cpp").decode()
    assert "at::BFloat16" in kernel_cpp
    check = check_artifact(str(bf16["path"]), bf16["result"]["package"], SPEC, "cpu", precision="bf16")
    assert check["passed"] and 0 < check["max_rel_err"] <= 5e-2 and check["precision"] == "bf16"
    # Against the float32 tolerance the same artifact would not pass: the check really uses the bf16 one.
    assert check["max_rel_err"] > 1e-4


@pytest.mark.slow
def test_prims_view_is_recorded_on_request(bf16):
    prims = bf16["report"]["stages"]["lowering"]["prims"]
    code = zipfile.ZipFile(bf16["result"]["sources"]).read("graphs/prims.py").decode()
    assert prims["nodes"] == sum(prims["histogram"].values()) > 0
    assert sum(n for op, n in prims["histogram"].items() if op.startswith("prims.")) > 0
    assert code.count("torch.ops.prims.") >= sum(n for op, n in prims["histogram"].items() if op.startswith("prims."))


def _compiled(obs: InductorObservation) -> stages.Compiled:
    return stages.Compiled(package="", observation=obs, seconds=1.0,
                           phases={"fusion": 0.5, "codegen": 0.2, "package": 0.3}, device="cpu")


def test_fusion_without_scheduler_hooks_says_so_and_falls_back_to_provenance():
    obs = InductorObservation(hooks={"_post_fusion_custom_pass": "not in torch 2.x"})
    out = stages.fusion(_compiled(obs))
    assert out["status"] == "unavailable" and "neither" in out["note"]

    # Only the provenance map: the kernels and their FX nodes still show, and the report says where they came from.
    mapping = {"cppCodeToPost": {"cpp_fused_add_sum_0:2": ["add", "sum_1"], "aoti_torch_cpu_addmm_out:1": ["addmm"]},
               "postToPre": {"add": ["add_"], "sum_1": ["sum_1"], "addmm": ["linear"]}}
    obs.artifacts["inductor_provenance_tracking_node_mappings"] = [json.dumps(mapping)]
    out = stages.fusion(_compiled(obs))
    assert out["status"] == "ok" and "provenance" in out["observed_by"]
    assert out["kernels"] == 1 and out["extern_calls"] == 1
    (group,) = out["groups"]
    assert group["kernel"] == "cpp_fused_add_sum_0" and group["capture_nodes"] == ["add_", "sum_1"]


def test_summary_rows_cover_every_stage_in_order():
    report = {"stages": {name: rep.skipped("why") for name in rep.STAGES}}
    report["stages"]["capture"] = rep.stage(seconds=0.1, graph={"nodes": 3}, dynamic_dims=[])
    rows = rep.summary_rows(report)
    assert [r["stage"] for r in rows] == list(rep.STAGES)
    assert rows[0]["nodes_after"] == 3 and rows[1]["detail"] == "why"
    checked = rep.attach_check({"stages": {}}, {"passed": True, "speedup": 1.5, "points": [{"point": "min"}]})
    assert checked["stages"]["package"]["check"]["speedup"] == 1.5
