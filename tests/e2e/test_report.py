"""The stage report and the generated sources, end to end: a real worker compiles a model with an in-place op,
a reduction followed by pointwise ops and a dynamic batch dim, plus two static shape buckets; the report's counts
are checked against the graphs and code the service serves, counted here independently."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from modelzoo import InplaceReduce, export, seeded
from procs import api, wait_job

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ["fetch", "load", "capture", "autograd", "lowering", "fusion", "codegen", "package", "check", "timing",
            "publish"]


def fx_calls(code: str) -> list[tuple[str, str]]:
    """(node name, callee) for every call node in an FX graph's Python code: `name = torch.ops...(...)` and
    `name = tuple_node[i]` (operator.getitem prints as indexing). Attribute reads (weights) are not calls."""
    fn = next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef) and n.name == "forward")
    out = []
    for stmt in fn.body:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            continue
        v = stmt.value
        if isinstance(v, ast.Call) and ast.unparse(v.func).startswith(("torch.ops.", "operator.")):
            out.append((stmt.targets[0].id, ast.unparse(v.func)))
        elif isinstance(v, ast.Subscript):
            out.append((stmt.targets[0].id, "operator.getitem"))
    return out


def forward_args(code: str) -> list[str]:
    fn = next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef) and n.name == "forward")
    return [a.arg for a in fn.args.args[1:]]


@pytest.fixture(scope="module")
def bundle(api_url, worker, tmp_path_factory):
    """One request: batch 1..16 (dynamic) plus a bucket of batch 8: two artifacts, two compiles. (Which bucket is
    the smallest that fits is tested without compiling in tests/client/test_buckets.py.)"""
    model = seeded(InplaceReduce, 11)
    batch = torch.export.Dim("batch", min=1, max=64)
    path = export(model, (torch.randn(4, 16),), tmp_path_factory.mktemp("m") / "ir.pt2",
                  dynamic_shapes={"x": {0: batch}})
    rec = api.post(f"{api_url}/v1/models", content=path.read_bytes(), timeout=60).json()
    body = {"model_id": rec["id"], "shapes": {"x": "1..16x16"}, "buckets": [{"x": [8, 16]}]}
    r = api.post(f"{api_url}/v1/compilations", json=body, timeout=30)
    assert r.status_code == 202, r.text
    answer = r.json()
    jobs = [wait_job(api_url, a["job"]["id"]) for a in [answer, *answer["buckets"]]]
    for job in jobs:
        assert job["state"] == "succeeded", job.get("error")
    return {"model": model, "record": rec, "answer": answer, "jobs": jobs, "key": answer["key"], "body": body,
            "ep": torch.export.load(str(path))}


def _get(api_url: str, path: str) -> httpx.Response:
    r = api.get(api_url + path, timeout=30)
    assert r.status_code == 200, r.text
    return r


def test_buckets_get_their_own_keys_and_a_repeat_request_is_all_cached(api_url, bundle):
    keys = [bundle["answer"]["key"]] + [b["key"] for b in bundle["answer"]["buckets"]]
    assert len(set(keys)) == 2
    assert [b["spec"][0]["shape"] for b in bundle["answer"]["buckets"]] == [[8, 16]]
    again = api.post(f"{api_url}/v1/compilations", json=bundle["body"], timeout=30)
    assert again.status_code == 200 and again.json()["status"] == "cached"
    assert [b["status"] for b in again.json()["buckets"]] == ["cached"]
    bad = api.post(f"{api_url}/v1/compilations", json={**bundle["body"], "buckets": [{"x": "1..4x16"}]})
    assert bad.status_code == 422 and "bucket 0" in bad.json()["error"]["message"]


def test_job_progress_names_each_stage_in_order(store, bundle):
    seen = [ev["stage"] for _, ev in store.jobs.events(bundle["jobs"][0]["id"]) if ev.get("stage")]
    running = [s for s in seen if s in PIPELINE]
    assert running == sorted(set(running), key=PIPELINE.index), seen  # each once, in pipeline order
    assert set(PIPELINE) - {"timing"} <= set(running), seen  # a timing pass of its own only on a busy device
    assert set(bundle["jobs"][0]["timings"]) >= {"load", "capture", "autograd", "lowering", "fusion", "codegen",
                                                 "package", "check"}


def test_capture_and_autograd_counts_match_the_graphs(api_url, bundle):
    rep = _get(api_url, f"/v1/artifacts/{bundle['key']}/report").json()
    assert rep["schema"] == 1 and rep["torch"] == torch.__version__
    cap, ag = rep["stages"]["capture"], rep["stages"]["autograd"]
    captured = _get(api_url, f"/v1/artifacts/{bundle['key']}/source/graphs/capture.py").text
    functional = _get(api_url, f"/v1/artifacts/{bundle['key']}/source/graphs/functional.py").text
    assert cap["graph"]["nodes"] == len(fx_calls(captured))
    assert ag["graph"]["nodes"] == len(fx_calls(functional))
    # In-place ops: aten ops whose name ends in "_" (add_, mul_, ...), counted in the served code.
    inplace = [c for _, c in fx_calls(captured) if re.match(r"torch\.ops\.aten\.\w+_\.", c)]
    assert len(inplace) == 1 and inplace[0].startswith("torch.ops.aten.add_.")
    assert ag["inplace_removed"] == len(inplace)
    assert not [c for _, c in fx_calls(functional) if re.match(r"torch\.ops\.aten\.\w+_\.", c)]
    # The uploaded program, counted with torch here: the re-export keeps its ops.
    uploaded = [n for n in bundle["ep"].graph.nodes if n.op == "call_function"]
    assert len(uploaded) == cap["graph"]["nodes"]
    # Dynamic batch: requested 1..16, still symbolic in the capture and in Inductor's graph.
    (dyn,) = cap["dynamic_dims"]
    assert dyn["input"] == "x" and dyn["dim"] == 0 and dyn["stayed_dynamic"] and (dyn["min"], dyn["max"]) == (1, 16)
    assert rep["stages"]["package"]["dynamic_dims"][0]["dynamic_in_inductor"] is True
    assert cap["inputs"] == [{"name": "x", "dtype": "float32", "shape": [dyn["symbol"], 16]}]


def test_lowering_records_what_was_decomposed(api_url, bundle):
    rep = _get(api_url, f"/v1/artifacts/{bundle['key']}/report").json()
    low = rep["stages"]["lowering"]
    core = _get(api_url, f"/v1/artifacts/{bundle['key']}/source/graphs/core_aten.py").text
    calls = fx_calls(core)
    assert low["graph"]["nodes"] == len(calls)
    assert sum(low["graph"]["histogram"].values()) == len(calls)
    assert low["before"]["nodes"] == rep["stages"]["autograd"]["graph"]["nodes"]
    # Linear is not a core ATen op: it must show as decomposed (into permute + addmm), and be gone from the graph.
    linear = next(d for d in low["decomposed"] if d["op"] == "aten.linear.default")
    assert linear["count"] == 1 and "aten.addmm.default" in linear["into"]
    assert not any("aten.linear" in c for _, c in calls)
    assert low["prims"]["status"] == "skipped"


def test_fusion_shows_fewer_kernels_than_nodes_and_the_source_is_served(api_url, bundle):
    key = bundle["key"]
    rep = _get(api_url, f"/v1/artifacts/{key}/report").json()
    fu, cg = rep["stages"]["fusion"], rep["stages"]["codegen"]
    assert fu["status"] == "ok" and cg["status"] == "ok" and cg["language"] == "cpp"
    listing = {f["path"]: f for f in _get(api_url, f"/v1/artifacts/{key}/source").json()["files"]}
    assert {"code/kernel.cpp", "code/wrapper.cpp", "graphs/inductor_post_grad.py"} <= set(listing)
    kernel_cpp = _get(api_url, listing["code/kernel.cpp"]["url"]).text
    defined = re.findall(r'extern "C"\s+void\s+(cpp_fused_\w+)\(', kernel_cpp)
    assert defined and cg["kernel_count"] == len(defined) == fu["kernels"]
    assert sorted(cg["kernels"]) == sorted(defined)
    assert listing["code/kernel.cpp"]["bytes"] == len(kernel_cpp.encode())
    wrapper = _get(api_url, listing["code/wrapper.cpp"]["url"]).text
    assert all(k in wrapper for k in defined)  # the wrapper calls every kernel
    # Fewer kernels than the graph Inductor lowered has nodes, and fewer scheduler nodes after fusion than before.
    inductor_graph = fx_calls(_get(api_url, listing["graphs/inductor_post_grad.py"]["url"]).text)
    assert fu["inductor_graph"]["nodes"] == len(inductor_graph)
    assert fu["kernels"] < len(inductor_graph)
    assert fu["nodes_after"] < fu["nodes_before"]
    # The reduction and the pointwise ops after it ended up in one kernel.
    names = {n for n, _ in inductor_graph}
    reductions = [n for n, c in inductor_graph if c.startswith("torch.ops.aten.sum.")]
    (group,) = [g for g in fu["groups"] if set(reductions) & set(g["fx_nodes"])]
    assert set(group["fx_nodes"]) <= names
    assert any(c.startswith("torch.ops.aten.div.") and n in group["fx_nodes"] for n, c in inductor_graph)
    assert group["kernel"] in defined
    # The matmul stays a library call.
    assert fu["extern_calls"] == len(fu["externs"]) == 1 and "addmm" in fu["externs"][0]["kernel"]
    # The package stage carries the artifact check, with the worker's timings.
    check = rep["stages"]["package"]["check"]
    meta = _get(api_url, f"/v1/artifacts/{key}/meta").json()
    assert check["passed"] is True and check["compiled_ms"] == meta["check"]["compiled_ms"]
    assert rep["stages"]["package"]["bytes"] == meta["size"]
    assert api.get(f"{api_url}/v1/artifacts/{key}/source/code/nope.cpp").status_code == 404


def test_bundle_runs_the_bucket_that_fits_else_the_dynamic_artifact(api_url, client, bundle):
    from client import Bundle

    arts = [client.artifact(k) for k in [bundle["key"]] + [b["key"] for b in bundle["answer"]["buckets"]]]
    fn = client.load(Bundle(arts[0], arts[1:]))
    model = bundle["model"]
    with torch.no_grad():
        for n, expect in ((8, ("bucket", arts[1].key, False)), (5, ("bucket", arts[1].key, True)),
                          (12, ("main", arts[0].key, False))):
            x = torch.randn(n, 16)
            y = fn(x)
            assert fn.last == expect, (n, fn.last)
            assert y.shape == (n, 16)
            torch.testing.assert_close(y, model(x), rtol=1e-4, atol=1e-5)
        with pytest.raises(ValueError, match="no artifact in the bundle"):
            fn(torch.randn(40, 16))


def test_aotc_report_prints_the_stage_table(api_url, bundle):
    out = subprocess.run([sys.executable, "-m", "client.cli", "--url", api_url, "report", bundle["key"]],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert re.match(r"STAGE\s+STATUS\s+TIME\s+NODES IN\s+NODES OUT\s+DETAIL", lines[2])
    for stage in ("capture", "autograd", "lowering", "fusion", "codegen", "package"):
        assert any(re.match(rf"{stage}\s+ok\s+\d+\.\d\d s", ln) for ln in lines), (stage, out.stdout)
    assert "kernels generated: 1 (cpp)" in out.stdout and "speedup" in out.stdout
    assert "in-place ops removed by functionalisation: aten.add_.Tensor x1" in out.stdout


def test_training_mode_on_a_model_without_a_loss_fails_naming_the_output(api_url, client, bundle):
    """mode=training builds a train step (tests/e2e/test_train_steps.py has the joint graph's report): a model whose
    output 0 is no scalar loss fails at the autograd stage, before any compile, saying what the loss must be."""
    body = {**bundle["body"], "shapes": {"x": [4, 16]}, "options": {"mode": "training"}}
    body.pop("buckets")
    r = api.post(f"{api_url}/v1/compilations", json=body, timeout=30)
    assert r.status_code == 202, r.text
    job = wait_job(api_url, r.json()["job"]["id"])
    assert job["state"] == "failed", job
    assert job["error"]["stage"] == "autograd", job["error"]
    assert ("output 0 (options.loss_output) is the loss and must be a floating scalar; it is torch.float32 of "
            "shape [4, 16]") in job["error"]["message"]
    # Nothing was published: deploy-time lookup still finds the inference artifact.
    found = client.lookup(bundle["record"]["id"], {"x": [4, 16]}, target="cpu")
    assert found is not None and found.key == bundle["key"]
