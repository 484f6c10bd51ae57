"""The stage report on the GPU: the CPU suite's report model, compiled by the cuda:0 worker, yields Triton kernels,
and the report and the served sources show them."""

from __future__ import annotations

import torch


def test_report_shows_triton_kernels_and_buckets_run_on_gpu(gpu_worker, client, inplace_bundle):
    model, bundle = inplace_bundle
    key = bundle.main.key
    rep = client.report(key)
    assert rep["device"].startswith("cuda") and rep["torch"] == gpu_worker["toolchain"]["torch"]
    st = rep["stages"]
    assert all(st[s]["status"] == "ok" for s in ("capture", "autograd", "lowering", "fusion", "codegen", "package")), \
        {s: (v["status"], v["note"]) for s, v in st.items()}
    assert st["autograd"]["inplace_removed"] == 1
    assert st["capture"]["dynamic_dims"][0]["stayed_dynamic"] is True

    cg, fu = st["codegen"], st["fusion"]
    assert cg["language"] == "triton" and cg["triton_kernels"] >= 1
    files = {f["path"] for f in client.sources(key)}
    triton_files = sorted(p for p in files if p.startswith("code/triton/"))
    names = sorted(p.removeprefix("code/triton/").removesuffix(".py") for p in triton_files)
    assert len(triton_files) == cg["triton_kernels"] and names == sorted(k for k in cg["kernels"] if k in names)
    for p in triton_files:
        src = client.source(key, p)
        assert "@triton.jit" in src and "def triton_" in src, p
    wrapper = client.source(key, "code/wrapper.cpp")
    assert all(n in wrapper for n in names)  # the C++ wrapper launches every Triton kernel

    # Fusion: fewer kernels than the graph Inductor lowered has nodes; the matmul is a cuBLAS call.
    assert 1 <= fu["kernels"] < fu["inductor_graph"]["nodes"]
    assert any(e["library"] == "cuBLAS" for e in fu["externs"]), fu["externs"]
    for g in fu["groups"]:
        if isinstance(g.get("kernel"), str):
            assert g["kernel"] in cg["kernels"]
    check = st["package"]["check"]
    assert check["passed"] and check["device"].startswith("cuda") and check["compiled_ms"] > 0

    fn = client.load(bundle, device="cuda:0")
    with torch.no_grad():
        for n, which in ((32, "bucket"), (20, "bucket"), (50, "main")):
            x = torch.randn(n, 16, device="cuda")
            torch.testing.assert_close(fn(x), model(x), rtol=1e-3, atol=1e-3)
            assert fn.last[0] == which, (n, fn.last)
