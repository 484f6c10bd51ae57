"""compiler.scan, the second line after codegen: what it finds and ignores in C++, Python and Triton sources
(synthetic GPU sources: this machine cannot compile Triton), on a real package (none on a clean one; one call added
to its wrapper), and through a real compile whose generated wrapper calls `std::system`: UnsafeCode, the package
removed, and nothing run."""

from __future__ import annotations

import json
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from compiler import stages
from compiler.compat.observe import InductorObservation, observe_inductor
from compiler.errors import Failure, UnsafeCode
from compiler.options import CompileOptions
from compiler.pipeline import compile_model
from compiler.scan import scan_cpp, scan_package, scan_python, scan_sources
from compiler.weightsfile import sidecar
from modelzoo import InplaceReduce, export, seeded

sys.path.insert(0, str(Path(__file__).parent / "hostileops"))
from aotc_hostileops import SignOfLinear, hostile_sign_lowering  # noqa: E402


def calls(findings: list) -> list[tuple[int, str]]:
    return [(f.line, f.call) for f in findings]


# -- C++ -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("src, expected", [
    ('void f() { system("id"); }', [(1, "system")]),
    ('void f() {\n  std::system("id");\n}', [(2, "system")]),
    ('void f() { ::popen("id", "r"); }', [(1, "popen")]),
    ("long f() { return syscall(59, 0, 0, 0); }", [(1, "syscall")]),
    ('void f() { execve("/bin/sh", 0, 0); execvp("sh", 0); }', [(1, "execve"), (1, "execvp")]),
    ("void* p = (void*)&dlopen;", [(1, "dlopen")]),  # no call, still a reference
    ("int s = socket(2, 1, 0); connect(s, 0, 0);", [(1, "socket"), (1, "connect")]),
    ('void f() { __asm__ volatile("syscall"); asm("nop"); }', [(1, "__asm__"), (1, "asm")]),
    # Comment markers inside string literals are not comments: the call between them is code.
    ('const char* a = "/*"; system("id"); const char* b = "*/";', [(1, "system")]),
    ("int x = 1'000'000; fork();", [(1, "fork")]),  # a digit separator is not a character literal
    ("#include <sys/socket.h>\n#include <unistd.h>\n#include \"../x.h\"\n",
     [(1, "#include <sys/socket.h>"), (2, "#include <unistd.h>"), (3, '#include "../x.h"')]),
    ("%:include <dlfcn.h>\n", [(1, "#include <dlfcn.h>")]),  # a digraph is a #
    ("#define H <unistd.h>\n#include H\n", [(2, "#include")]),
    ('#define C(a, b) a##b\nint x = C(sys, tem)("id");', [(1, "##")]),
    ('void f() { \\u0073ystem("id"); }', [(1, "\\")]),
    ('// harmless \\\nsystem("id");', [(1, "//...\\")]),  # g++ reads line 2 as comment; another reader might not
    ('auto s = R"x( never closed', [(1, 'R"x(')]),
    ("int a; /* never closed", [(1, "/*")]),
])
def test_cpp_calls_a_kernel_never_makes_are_found(src, expected):
    assert calls(scan_cpp(src, "k.cpp")) == expected


@pytest.mark.parametrize("src", [
    '// system("id"); popen("x")\nint x = 1;',
    '/* execve(...)\n   dlopen(...) */ int y = 2;',
    'const char* s = "system(\\"id\\") popen( socket(";',
    "char c = 's'; char d = '\\'';",
    'const char* r = R"xx(system("id") )" fork( )xx"; int z;',
    'auto y = x.clone(); auto z = p->bind(q);',  # members, not the libc functions
    "#include <torch/csrc/inductor/cpp_prefix.h>\n#include <vector>\n#include <cmath>\n",
    '#pragma omp parallel for\n#define CHECK(x) if (!(x)) throw std::runtime_error("system " #x)\n',
    "void my_system_kernel(float* socket_buf) { float execve_ = 0; }",  # names that only contain a forbidden one
])
def test_cpp_comments_literals_members_and_allowed_headers_are_ignored(src):
    assert scan_cpp(src, "k.cpp") == []


# -- Python ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("src, expected", [
    ("import os\nimport subprocess\nimport socket\nimport ctypes\n",
     [(2, "import subprocess"), (3, "import socket"), (4, "import ctypes")]),
    ("from ctypes import c_void_p, CDLL\n", [(1, "from ctypes import CDLL")]),
    ("from os import system\n", [(1, "from os import system")]),
    ("x = eval('1')\nexec('1')\nopen('/etc/passwd')\n__import__('os')\n",
     [(1, "eval"), (2, "exec"), (3, "open"), (4, "__import__")]),
    ("import os\nos.system('id')\nf = os.popen\n", [(2, ".system"), (3, ".popen")]),
    ("getattr(os, 'sys' + 'tem')('id')\ngetattr(os, 'system')\n",
     [(1, "getattr"), (2, "getattr(..., 'system')")]),
    ("().__class__.__bases__[0].__subclasses__()\n", [(1, ".__subclasses__"), (1, ".__bases__"), (1, ".__class__")]),
    ("globals()['__builtins__']['exec']('1')\n", [(1, "['__builtins__']"), (1, "['exec']")]),
    ("def f(:\n", [(1, "(unparsable)")]),
])
def test_python_imports_builtins_and_attributes_off_the_lists_are_found(src, expected):
    assert sorted(calls(scan_python(src, "w.py"))) == sorted(expected)


def test_kernel_sources_handed_to_async_compile_are_scanned_at_their_own_lines():
    src = ("k = async_compile.triton('k', '''\nimport triton\nimport os\nos.system('id')\n''', device_str='cuda')\n"
           "c = async_compile.cpp_pybinding([], r'''\n#include <unistd.h>\nvoid f() { system(\"id\"); }\n''')\n")
    found = scan_python(src, "w.py")
    # A Triton kernel's module imports less than a wrapper: os is refused there.
    assert calls(found) == [(3, "import os"), (4, ".system"), (7, "#include <unistd.h>"), (8, "system")]
    assert found[0].file == "w.py > async_compile.triton source"


def test_python_comments_strings_and_inductors_own_header_are_ignored():
    src = ("from ctypes import c_void_p, c_long, c_int\nimport torch\nimport math\nimport random\nimport os\n"
           "import tempfile\nfrom math import inf, nan\nfrom cmath import nanj\n"
           "from torch._inductor.async_compile import AsyncCompile\n"
           "# os.system('id'); eval(x)\ns = 'exec( open( __import__('\nasync_compile = AsyncCompile()\n"
           "async_compile.wait(globals())\nbuf0 = getattr(torch.ops.aten, 'mm')\n")
    assert scan_python(src, "w.py") == []


# -- Triton and inline assembly (every backend) ------------------------------------------------------------------

# A Triton kernel module as Inductor writes one (torch 2.11/2.13 header, heuristics decorator, the index assert
# that assert_indirect_indexing keeps); the tests below add one line to it.
TRITON_KERNEL = """
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.pointwise(
    size_hints={'x': 32}, filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*i64', 'in_ptr1': '*fp32', 'out_ptr0': '*fp32', 'xnumel': 'i32',
                 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, cc=90, major=9,
                 regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, multi_processor_count=132,
                 warp_size=32), 'constants': {}},
    inductor_meta={'kernel_name': 'triton_poi_fused_index_0', 'mutated_arg_names': [], 'no_x_dim': False,
                   'assert_indirect_indexing': True, 'autotune_local_cache': True},
    min_elem_per_thread=0
)
@triton.jit
def triton_poi_fused_index_0(in_ptr0, in_ptr1, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xnumel = 32
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    xmask = xindex < xnumel
    x1 = xindex // 4
    x0 = (xindex % 4)
    tmp0 = tl.load(in_ptr0 + (x1), xmask, eviction_policy='evict_last')
    tmp1 = tl.full([XBLOCK], 16, tl.int32)
    tmp2 = tmp0 + tmp1
    tmp3 = tmp0 < 0
    tmp4 = tl.where(tmp3, tmp2, tmp0)
    tl.device_assert(((0 <= tmp4) & (tmp4 < 16)) | ~(xmask), "index out of bounds: 0 <= tmp4 < 16")
    tmp6 = tl.load(in_ptr1 + (x0 + 4*tmp4), xmask)
    tl.store(out_ptr0 + (x0 + 4*x1), tmp6, xmask)
"""
ASM = ('    tmp7 = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [tmp6], dtype=tl.float32, is_pure=True, '
       'pack=1)\n')


def gpu_wrapper_cpp(kernel: str) -> str:
    """The shape of AOTInductor's GPU wrapper: each Triton kernel's launcher holds the kernel's source in a block
    comment (cpp_wrapper_gpu: "Emit the original Triton kernel for debugging purposes"), indented by the launcher."""
    body = f"async_compile.triton('triton_poi_fused_index_0', '''{kernel}''', device_str='cuda')"
    comment = "\n".join(("    " + ln) if ln else "" for ln in body.split("\n"))
    return ("#include <torch/csrc/inductor/aoti_runtime/interface.h>\n"
            "static inline void call_triton_poi_fused_index_0(const CUdeviceptr& in_ptr0, int32_t device_idx_) {\n"
            f"    /*\n{comment}\n    */\n"
            "    uint32_t grid_0 = ((xnumel + (32 - 1)) / (32));\n"
            "    if (kernels_.triton_poi_fused_index_0 == nullptr) {\n"
            '        kernels_.triton_poi_fused_index_0 = loadKernel("/tmp/k.cubin", "triton_poi_fused_index_0", 0);\n'
            "    }\n}\n")


def test_a_real_looking_triton_kernel_and_its_gpu_wrapper_scan_clean():
    assert scan_python(TRITON_KERNEL, "k.py", "kernel") == []
    assert scan_cpp(gpu_wrapper_cpp(TRITON_KERNEL), "model.wrapper.cpp") == []
    assert scan_sources({"k": ("kernel", TRITON_KERNEL),
                         "w.cpp": ("cpp", gpu_wrapper_cpp(TRITON_KERNEL))}).findings == []


def test_inline_assembly_in_a_triton_kernel_is_found_wherever_the_kernel_sits():
    hostile = TRITON_KERNEL + ASM
    line = hostile.count("\n")  # the added line is the last
    # The kernel module as the compile handed it to Triton.
    assert calls(scan_python(hostile, "k.py", "kernel")) == [(line, ".inline_asm_elementwise")]
    # Inside a Python wrapper's async_compile.triton(...) call.
    wrapper = f"async_compile = AsyncCompile()\nk = async_compile.triton('k', '''{hostile}''', device_str='cuda')\n"
    assert (line + 1, ".inline_asm_elementwise") in calls(scan_python(wrapper, "w.py"))
    # In the GPU wrapper .cpp, as the comment copy a C++ lexer would skip: found, at its line in the .cpp.
    cpp = gpu_wrapper_cpp(hostile)
    found = scan_cpp(cpp, "model.wrapper.cpp")
    assert [(f.call, f.why) for f in found] == [(".inline_asm_elementwise", "inline assembly")]
    assert cpp.split("\n")[found[0].line - 1].strip().startswith("tmp7 = tl.inline_asm_elementwise(")
    assert found[0].file == "model.wrapper.cpp > Triton kernel in a comment > async_compile.triton source"


def test_a_triton_kernel_that_imports_or_calls_what_no_kernel_needs_is_found_in_the_gpu_wrapper():
    kernel = TRITON_KERNEL.replace("import triton\n", "import triton\nimport os\n", 1)
    kernel += "    os.system('id')\n"
    assert sorted(f.call for f in scan_cpp(gpu_wrapper_cpp(kernel), "w.cpp")) == [".system", "import os"]


@pytest.mark.parametrize("src, language, expected", [
    # Inline assembly anywhere in the text: code, comments and literals alike.
    ('void f() { /* asm volatile("mov %0, %1") */ }', "cpp", ["asm volatile"]),
    ('const char* s = "__asm__ (\\"nop\\")";', "cpp", ["__asm__ ("]),
    ("x = 1\n# tl.inline_asm_elementwise('nop')\n", "python", ["inline_asm_elementwise"]),
    ("k = triton_helpers.inline_asm_pack(x, 2)\n", "kernel", [".inline_asm_pack"]),
    # PTX text, in a string or a file of its own.
    ('const char* ptx = R"(\n.version 8.4\n.target sm_90\n.address_size 64\n.visible .entry k()\n)";', "cpp",
     [".version 8", ".target sm_9", ".address_size 6", ".visible .entry k"]),
    (".version 8.4\n.target sm_90\n", "ptx", [".version 8", ".target sm_9"]),
])
def test_inline_assembly_and_ptx_text_are_found_in_any_source(src, language, expected):
    assert [f.call for f in scan_sources({"s": (language, src)}).findings] == expected


def test_an_aten_fallback_whose_error_code_is_dropped_is_found():
    dropped = "void run() {\n    aoti_torch_cpu_scatter_reduce_two_out(buf0, buf0,0,arg1_1,arg2_1, \"sum\",1);\n}\n"
    assert [(f.line, f.call) for f in scan_cpp(dropped, "w.cpp")] == [(2, "aoti_torch_cpu_scatter_reduce_two_out")]
    assert calls(scan_cpp("if (x) aoti_torch_index_put_out(a, b, 1, c, false);", "w.cpp")) == [
        (1, "aoti_torch_index_put_out")]
    checked = dropped.replace("    aoti_torch_cpu_scatter_reduce_two_out(", "    AOTI_TORCH_ERROR_CODE_CHECK("
                                                                       "aoti_torch_cpu_scatter_reduce_two_out(")
    checked = checked.replace('1);\n}', '1));\n}')
    assert scan_cpp(checked, "w.cpp") == []
    # Handle shims torch writes bare, and shims with no error code at all: not fallbacks.
    assert scan_cpp("aoti_torch_clone(buf0, &output_handles[0]);\naoti_torch_grad_mode_set_enabled(false);\n"
                    "auto e = aoti_torch_cpu_addmm_out(a, b, c, d, 1, 1);", "w.cpp") == []


def test_the_compile_records_every_triton_kernel_it_hands_to_triton():
    # The CPU build of torch has no Triton to compile with: the call fails after the hook has recorded it.
    from torch._inductor.async_compile import AsyncCompile

    original = AsyncCompile.__dict__["triton"]
    with observe_inductor() as obs:
        with pytest.raises(Exception):  # noqa: B017, PT011 - whatever this torch raises without Triton
            AsyncCompile().triton("triton_poi_fused_index_0", TRITON_KERNEL + ASM, "cuda")
    assert obs.kernel_sources == {"triton_poi_fused_index_0": TRITON_KERNEL + ASM}
    assert obs.hooks["async_compile.triton"] == "used"
    assert AsyncCompile.__dict__["triton"] is original  # restored on exit


# -- a real package --------------------------------------------------------------------------------------------

SPEC = [{"name": "x", "dtype": "float32", "shape": [4, 16]}]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    d = tmp_path_factory.mktemp("clean")
    path = export(seeded(InplaceReduce, 11), (torch.randn(4, 16),), d / "m.pt2")
    result = compile_model(str(path), SPEC, SPEC, CompileOptions(), "cpu", str(d / "a.pt2"))
    return {"dir": d, "result": result, "report": json.loads(Path(result["report"]).read_text())}


@pytest.mark.slow
def test_a_real_package_scans_clean_in_milliseconds_and_the_report_says_what_was_scanned(clean):
    scan = clean["report"]["stages"]["package"]["scan"]
    assert scan["findings"] == [] and scan["files"] >= 2 and scan["bytes"] > 10_000
    assert {f["file"].rsplit(".", 2)[-2] for f in scan["scanned"]} == {"wrapper", "kernel"}
    assert scan["seconds"] < 0.5  # tens of milliseconds at most, against a compile of tens of seconds
    assert "scan" in clean["report"]["timings"]


@pytest.mark.slow
def test_the_scan_stage_reads_the_triton_kernels_the_compile_handed_to_triton(clean, tmp_path):
    """What a GPU compile records (compiler.compat.observe), on a real package: a kernel with inline assembly fails
    the compile as UnsafeCode, named by its kernel, and the package is removed."""
    package = tmp_path / "copy.pt2"
    shutil.copy(clean["result"]["package"], package)
    obs = InductorObservation(kernel_sources={"triton_poi_fused_index_0": TRITON_KERNEL + ASM})
    compiled = stages.Compiled(str(package), obs, 1.0, {}, "cuda:0")
    with pytest.raises(UnsafeCode) as info:
        stages.scan(compiled)
    assert "<triton kernel triton_poi_fused_index_0> line " in info.value.message
    assert ": .inline_asm_elementwise (inline assembly)" in info.value.message
    assert not package.exists()
    shutil.copy(clean["result"]["package"], package)  # the same kernel without the asm line: clean
    clean_obs = InductorObservation(kernel_sources={"triton_poi_fused_index_0": TRITON_KERNEL})
    result = stages.scan(stages.Compiled(str(package), clean_obs, 1.0, {}, "cuda:0"))
    assert result.findings == []
    assert {"file": "<triton kernel triton_poi_fused_index_0>", "language": "kernel",
            "bytes": len(TRITON_KERNEL)} in result.files


@pytest.mark.slow
def test_a_call_added_to_a_real_wrapper_is_found_by_file_and_line(clean):
    package = clean["result"]["package"]
    hostile = clean["dir"] / "hostile.pt2"
    with zipfile.ZipFile(package) as src, zipfile.ZipFile(hostile, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith(".wrapper.cpp"):
                wrapper, text = info.filename, data.decode()
                lines = text.count("\n") + 1
                # In a comment: nothing. As a static initialiser (it would run when the package loads): found.
                data = (text + '\n// static int x = std::system("id");\n'
                        + 'static int aotc_hostile = std::system("id");\n').encode()
            dst.writestr(info, data)
    found = scan_package(str(hostile)).findings
    assert [(f.file, f.line, f.call) for f in found] == [(wrapper, lines + 2, "system")]
    assert found[0].source == 'static int aotc_hostile = std::system("id");'


@pytest.mark.slow
def test_a_compile_whose_generated_code_calls_system_fails_as_unsafe_code_and_runs_nothing(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    batch = torch.export.Dim("batch", min=1, max=64)
    path = export(seeded(SignOfLinear, 3), (torch.randn(4, 8),), tmp_path / "m.pt2", dynamic_shapes={"x": {0: batch}})
    spec = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 16}, 8]}]
    program_inputs = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 64, "symbol": "s0"}, 8]}]
    # Keep a copy of what the scan refuses, to show below that the refused code was live.
    aside = tmp_path / "aside.pt2"
    real_scan = stages.scan

    def scan_keeping_a_copy(compiled: stages.Compiled):
        shutil.copy(compiled.package, aside)
        if compiled.weights:  # its weights blob beside it, where the loader binds it
            shutil.copy(compiled.weights, sidecar(aside))
        return real_scan(compiled)

    monkeypatch.setattr(stages, "scan", scan_keeping_a_copy)
    seen: list[str] = []
    with hostile_sign_lowering(str(marker)), pytest.raises(UnsafeCode) as info:
        compile_model(str(path), spec, program_inputs, CompileOptions(), "cpu", str(tmp_path / "a.pt2"), seen.append)
    e = info.value
    assert e.stage == "package" and seen[-1] == "package"
    assert ".wrapper.cpp line " in e.message and ": system (a call no generated kernel makes)" in e.message
    assert f'std::system("touch {marker}")' in e.excerpt
    assert not (tmp_path / "a.pt2").exists() and not marker.exists()  # removed, never loaded, nothing ran
    assert not sidecar(tmp_path / "a.pt2").exists()  # and its weights blob with it
    failure = Failure.from_exception(e, "compile")
    assert failure.type == "UnsafeCode" and not failure.retryable and failure.stage == "package"

    # The refused package is real code: loaded and run past its assert, it runs the command.
    from compiler.compat.aoti import aoti_load_package

    refused = aoti_load_package(str(aside), "cpu")
    refused(torch.randn(2, 8))
    assert not marker.exists()  # 2 < 3: the assert holds and its message is never built
    with pytest.raises(RuntimeError):
        refused(torch.randn(4, 8))
    assert marker.exists()
