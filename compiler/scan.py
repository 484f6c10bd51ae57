"""A second line after codegen: scan the generated sources for calls a kernel never makes, before anything runs them.

The upload checks (compiler/archive, compiler/loading.py) keep hostile programs out; this scan catches what got
through anyway, in what Inductor wrote, on every backend: the package's C++ (wrapper and kernels); on GPUs the
Triton kernels, from three places that each see them all (every source the compile handed `async_compile.triton`,
recorded as it happened; the `/* ... */` copy of each kernel that AOTInductor writes into the GPU wrapper .cpp,
which a C++ lexer would skip as a comment; the Python wrapper and autotune code of the first codegen pass, where
this torch shows them). A hit fails the compile (`UnsafeCode`, final) and the package is never checked or
published.

C++ is lexed the way the compiler reads it: backslash-newlines spliced first (so a `//` comment ending in `\\`
swallows the next line, as it does for g++), then comments, string, character and raw-string literals skipped,
then every identifier outside them checked. Python is parsed with `ast`, so comments and strings never count;
the kernel sources a Python wrapper hands to `async_compile.triton(...)` / `.cpp(...)` are scanned in turn.

What counts as a hit:
  any     inline assembly in the raw text, comments and literals included: `asm volatile`/`__asm__ (`,
          `inline_asm_elementwise` or any `inline_asm*` name, PTX directives (`.version`, `.target sm_`,
          `.entry`) at the start of a line
  C++     a call of an AOTInductor C shim (`aoti_torch_*`) as a statement of its own, so that its error code is
          dropped (the package would return where eager raises; compiler.compat.shims makes torch's own
          fallbacks check it); a block comment holding Triton source, scanned as Python;
          a forbidden name anywhere except as a member (`x.clone()`): `system`, `std::system`, `::popen`,
          `&dlopen` alike; inline asm; an `#include` outside the allow-list or not of a plain <...>/"..." header;
          token pasting (`##`, which can assemble a name this scan never sees); a backslash outside a literal
          (universal character names); a `//` comment continued onto the next line; an unterminated comment or
          raw string
  Python  an import outside the allow-list (a Triton kernel's module: torch, triton, math); inline assembly
          (`tl.inline_asm_elementwise`, any `inline_asm*` name); a forbidden builtin (`eval`, `exec`, `open`,
          `__import__`, ...); a forbidden attribute (`os.system`, `subprocess.Popen`, `ctypes.CDLL`, ...) or
          dunder, also when looked up by name (`getattr(os, "system")`, `globals()["exec"]`, a computed getattr);
          source that does not parse
Torch-free: it reads text and zip entries only.
"""

from __future__ import annotations

import ast
import bisect
import re
import textwrap
import time
import zipfile
from dataclasses import dataclass, field
from typing import Any

# -- what counts -------------------------------------------------------------------------------------------------

# Names generated C++ never refers to: process creation, dynamic loading, sockets, raw system calls.
CPP_FORBIDDEN = frozenset({
    # processes
    "system", "popen", "fork", "vfork", "clone", "clone3", "execl", "execle", "execlp", "execv", "execve",
    "execvp", "execvpe", "execveat", "fexecve", "posix_spawn", "posix_spawnp", "wordexp", "kill",
    # dynamic loading
    "dlopen", "dlmopen", "dlsym", "dlvsym",
    # network
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4",
    # below libc
    "ptrace", "syscall", "prctl", "mprotect",
})
CPP_ASM = frozenset({"asm", "__asm", "__asm__"})
# The C shims that run an ATen op, which raises on bad data (an index out of range): a call of one must check the
# error code it returns (AOTI_TORCH_ERROR_CODE_CHECK), or the package returns where eager raises. Handle and
# bookkeeping shims (aoti_torch_clone, aoti_torch_new_tensor_handle, ...) are written bare by torch itself.
SHIM_OP_CALL = re.compile(
    r"aoti_torch_(?:cpu|cuda|mps|xpu)_\w+|aoti_torch_index_put_out|aoti_torch_call_dispatcher"
    r"|aoti_torch_proxy_executor_call_function")  # fullmatch
_STATEMENT_START = frozenset({";", "{", "}", ")", "else", ""})

# Inline assembly and PTX in any source, read as raw text: comments and literals are where a Triton kernel's copy
# (the GPU wrapper's comments) and a PTX payload (a string) would sit.
RAW_ASM = (
    (re.compile(r"\binline_asm\w*"), "inline assembly (Triton)"),
    (re.compile(r"\b(?:__)?asm(?:__)?\s+(?:volatile|__volatile__|goto|inline)\b|\b__asm__\s*\("), "inline assembly"),
    (re.compile(r"(?m)^[ \t]*(?:\.version[ \t]+\d|\.target[ \t]+sm_\d|\.address_size[ \t]+\d"
                r"|(?:\.visible[ \t]+|\.weak[ \t]+)?\.entry[ \t]+\w)"),
     "PTX text"),
)
# A block comment that holds Python source: AOTInductor's copy of a Triton kernel in the GPU wrapper.
_TRITON_IN_COMMENT = re.compile(r"async_compile\.triton\s*\(|@triton\.jit|\bimport\s+triton\b")

# Headers generated code includes: torch's own headers, and the C and C++ standard headers that Inductor's C++ and
# AOTInductor codegen write (torch 2.11-2.13, CPU and CUDA; read off torch/_inductor and off real packages). Anything
# else (sys/socket.h, unistd.h, dlfcn.h, a path, a macro, CUTLASS, which no allowed option reaches) is a hit.
INCLUDE_PREFIXES = ("torch/csrc/inductor/", "ATen/", "c10/")
INCLUDE_STANDARD = frozenset({
    "cerrno", "cmath", "cstdint", "cstdlib", "exception", "iostream", "memory", "mutex", "random", "sstream",
    "stdexcept", "stdint.h", "string", "unordered_map", "vector", "immintrin.h", "cuda.h",
})

# Python: what a wrapper and a Triton kernel import (Inductor's headers), nothing else. `os` and `tempfile` are in
# the wrapper's fixed header; ctypes only as its C type names (`from ctypes import c_void_p, c_long, c_int`).
PY_WRAPPER_IMPORTS = frozenset({"torch", "triton", "math", "cmath", "random", "os", "tempfile", "__future__"})
PY_KERNEL_IMPORTS = frozenset({"torch", "triton", "math", "__future__"})
PY_CTYPES_NAMES = re.compile(r"c_[a-z0-9_]+\Z")
PY_ASM = re.compile(r"inline_asm\w*|asm\Z")  # tl.inline_asm_elementwise, triton_helpers.inline_asm_pack, ...
PY_FORBIDDEN_NAMES = frozenset({
    "eval", "exec", "compile", "open", "__import__", "breakpoint", "vars", "__builtins__", "builtins",
    "subprocess", "socket", "ctypes", "importlib", "pickle", "marshal", "shutil",
})
PY_FORBIDDEN_ATTRS = frozenset({
    "system", "popen", "fork", "forkpty", "vfork", "execl", "execle", "execlp", "execlpe", "execv", "execve",
    "execvp", "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
    "posix_spawn", "posix_spawnp", "kill", "killpg", "Popen", "check_output", "check_call", "getoutput",
    "getstatusoutput", "CDLL", "PyDLL", "cdll", "pydll", "pythonapi", "LoadLibrary", "dlopen", "socket",
    "create_connection", "ptrace", "syscall", "import_module", "load_library", "load_inline", "cpp_extension",
    "open", "eval", "exec", "unlink", "remove", "rmdir", "rmtree", "putenv",
    "__import__", "__builtins__", "__globals__", "__subclasses__", "__code__", "__closure__", "__bases__",
    "__base__", "__mro__", "__loader__", "__spec__", "__getattribute__", "__dict__", "__class__", "__reduce__",
    "__reduce_ex__", "f_globals", "f_locals", "f_back", "gi_frame",
})
_PY_FORBIDDEN_ANY = PY_FORBIDDEN_NAMES | PY_FORBIDDEN_ATTRS
# A Python wrapper hands kernel sources to these `async_compile` methods: Triton is Python, cpp is C++.
PY_NESTED = {"triton": "python", "cpp": "cpp", "cpp_pybinding": "cpp"}

SOURCE_SUFFIXES = {".cpp": "cpp", ".cc": "cpp", ".cxx": "cpp", ".c": "cpp", ".h": "cpp", ".hpp": "cpp",
                   ".cu": "cpp", ".py": "python", ".ptx": "ptx", ".s": "ptx"}


@dataclass(frozen=True)
class Finding:
    file: str
    line: int
    call: str  # the name, header or construct found
    why: str
    source: str  # the line it is on, trimmed

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.call} ({self.why}): {self.source}"


@dataclass
class ScanResult:
    files: list[dict[str, Any]] = field(default_factory=list)  # {"file", "language", "bytes"}
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0

    def facts(self) -> dict[str, Any]:
        return {"files": len(self.files), "bytes": sum(f["bytes"] for f in self.files),
                "seconds": round(self.seconds, 4), "findings": [str(f) for f in self.findings[:50]],
                "scanned": self.files}


def _line_text(lines: list[str], n: int) -> str:
    text = lines[n - 1].strip() if 0 < n <= len(lines) else ""
    return text if len(text) <= 200 else text[:197] + "..."


def scan_raw(text: str, file: str, line_offset: int = 0) -> list[Finding]:
    """Inline assembly and PTX anywhere in a source's text, comments and literals included."""
    lines = text.split("\n")
    found: list[Finding] = []
    for pattern, why in RAW_ASM:
        for m in pattern.finditer(text):
            n = text.count("\n", 0, m.start()) + 1
            found.append(Finding(file, n + line_offset, m.group().strip(), why, _line_text(lines, n)))
    return found


# -- C++ ---------------------------------------------------------------------------------------------------------

_SPLICE = re.compile(r"\\[ \t]*\n")  # g++ splices a backslash, trailing blanks and a newline
_CPP_TOKEN = re.compile(
    r"""
      (?P<ws>[ \t\f\v\r]+)
    | (?P<nl>\n)
    | (?P<block>/\*)
    | (?P<line>//[^\n]*)
    | (?P<raw>(?:u8|u|U|L)?R"(?P<delim>[^ ()\\\t\v\f\n"]{0,16})\()
    | (?P<str>(?:u8|u|U|L)?"(?:[^"\\\n]|\\.)*")
    | (?P<chr>(?:u8|u|U|L)?'(?:[^'\\\n]|\\.)*')
    | (?P<num>\.?[0-9](?:[eEpP][+-]|'[0-9A-Za-z_]|[0-9A-Za-z_.])*)
    | (?P<id>[A-Za-z_$][A-Za-z0-9_$]*)
    | (?P<paste>\#\#|%:%:)
    | (?P<hash>\#|%:)
    | (?P<bs>\\)
    | (?P<arrow>->)
    | (?P<punct>.)
    """,
    re.X | re.S,
)
_HEADER = re.compile(r"[ \t]*(<[^>\n]*>|\"[^\"\n]*\")")
_DIRECTIVE_NAME = re.compile(r"[ \t]*([A-Za-z_]+)")


def _include_allowed(header: str) -> bool:
    name = header[1:-1].strip()
    if ".." in name.split("/") or name.startswith("/"):
        return False
    return name.startswith(INCLUDE_PREFIXES) or name in INCLUDE_STANDARD


def scan_cpp(text: str, file: str) -> list[Finding]:
    """Forbidden names, asm, includes and constructs in one C++ source (see the module docstring)."""
    lines = text.split("\n")
    # Splice first, as the compiler does, and keep where each splice was to map offsets back to source lines.
    splices: list[int] = []  # offsets in the spliced text where a backslash-newline was removed
    parts: list[str] = []
    last = 0
    for sp in _SPLICE.finditer(text):
        parts.append(text[last:sp.start()])
        splices.append(sum(len(p) for p in parts))
        last = sp.end()
    parts.append(text[last:])
    src = "".join(parts) if splices else text
    newlines = [m.start() for m in re.finditer("\n", src)]

    def line_of(pos: int) -> int:
        return bisect.bisect_left(newlines, pos) + bisect.bisect_right(splices, pos) + 1

    found: list[Finding] = []

    def hit(pos: int, call: str, why: str) -> None:
        n = line_of(pos)
        found.append(Finding(file, n, call, why, _line_text(lines, n)))

    pos, end = 0, len(src)
    line_start = True  # only blanks since the last newline: a `#` here starts a directive
    prev = ""  # the last significant token, to tell `x.clone()` (a member) from `clone(...)`
    while pos < end:
        m = _CPP_TOKEN.match(src, pos)
        assert m is not None  # the last alternative matches any character
        kind = m.lastgroup
        tok = m.group()
        if kind == "ws":
            pos = m.end()
            continue
        if kind == "nl":
            line_start, pos = True, m.end()
            continue
        if kind == "block":
            close = src.find("*/", m.end())
            if close < 0:
                hit(pos, "/*", "unterminated comment")
                break
            body = src[m.end():close]
            if _TRITON_IN_COMMENT.search(body):
                # AOTInductor's copy of a Triton kernel (cpp_wrapper_gpu: "Emit the original Triton kernel"): the
                # kernel that was compiled into the package's cubin, read here as the Python it is.
                first = line_of(m.end()) - 1
                found += [Finding(f.file, f.line + first, f.call, f.why, f.source)
                          for f in scan_python(textwrap.dedent(body), f"{file} > Triton kernel in a comment")]
            pos = close + 2
            continue
        if kind == "line":
            # g++ splices the next line into this comment; another reader might not. Generated code never does it.
            if bisect.bisect_left(splices, m.start()) < bisect.bisect_right(splices, m.end()):
                hit(pos, "//...\\", "a line comment continued onto the next line by a backslash")
            pos = m.end()
            continue
        if kind == "raw":
            closing = ")" + (m.group("delim") or "") + '"'
            close = src.find(closing, m.end())
            if close < 0:
                hit(pos, tok, "unterminated raw string")
                break
            pos, prev, line_start = close + len(closing), '""', False
            continue
        if kind == "hash" and line_start:
            name_m = _DIRECTIVE_NAME.match(src, m.end())
            directive = name_m.group(1) if name_m else ""
            if directive in ("include", "include_next", "import"):
                assert name_m is not None
                header_m = _HEADER.match(src, name_m.end())
                if header_m is None:
                    hit(pos, f"#{directive}", "an include that is not a plain <header> or \"header\"")
                    pos = name_m.end()
                else:
                    header = header_m.group(1)
                    if directive != "include" or not _include_allowed(header):
                        hit(pos, f"#{directive} {header}", "a header outside the allow-list")
                    pos = header_m.end()
                line_start = False
                continue
        elif kind == "paste":
            hit(pos, tok, "token pasting can assemble a name this scan never sees")
        elif kind == "bs":
            hit(pos, "\\", "a backslash outside a literal (a universal character name?)")
        elif kind == "id":
            if tok in CPP_ASM:
                hit(pos, tok, "inline assembly")
            elif tok in CPP_FORBIDDEN and prev not in (".", "->"):
                hit(pos, tok, "a call no generated kernel makes")
            elif (prev in _STATEMENT_START and SHIM_OP_CALL.fullmatch(tok)
                  and src[m.end():m.end() + 64].lstrip().startswith("(")):
                hit(pos, tok, "an ATen fallback whose error code is dropped: the package would return where "
                              "eager raises")
        line_start = False
        prev = tok
        pos = m.end()
    return found


# -- Python ------------------------------------------------------------------------------------------------------


def _import_allowed(module: str, role: str) -> bool:
    allowed = PY_KERNEL_IMPORTS if role == "kernel" else PY_WRAPPER_IMPORTS
    return module.split(".")[0] in allowed


def scan_python(text: str, file: str, role: str = "wrapper", line_offset: int = 0) -> list[Finding]:
    """Imports, builtins and attributes in one Python source; `role` is "wrapper" or "kernel" (a Triton kernel's
    module, which imports less). Kernel sources the wrapper passes to async_compile are scanned too."""
    lines = text.split("\n")
    found: list[Finding] = []

    def hit(node: ast.AST | int, call: str, why: str) -> None:
        n = node if isinstance(node, int) else getattr(node, "lineno", 0)
        found.append(Finding(file, n + line_offset, call, why, _line_text(lines, n)))

    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError) as e:
        hit(getattr(e, "lineno", None) or 0, "(unparsable)", f"does not parse as Python, so it cannot be checked: {e}")
        return found
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if not _import_allowed(a.name, role):
                    hit(node, f"import {a.name}", "a module outside the allow-list")
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                hit(node, f"from {'.' * node.level}{mod} import", "a relative import")
            elif mod == "ctypes" and role == "wrapper":
                for a in node.names:
                    if not PY_CTYPES_NAMES.match(a.name):
                        hit(node, f"from ctypes import {a.name}", "ctypes beyond its C type names")
            elif not _import_allowed(mod, role):
                hit(node, f"from {mod} import ...", "a module outside the allow-list")
            else:
                for a in node.names:
                    if a.name in PY_FORBIDDEN_ATTRS or a.name in PY_FORBIDDEN_NAMES:
                        hit(node, f"from {mod} import {a.name}", "a forbidden name")
        elif isinstance(node, ast.Name) and PY_ASM.fullmatch(node.id):
            hit(node, node.id, "inline assembly")
        elif isinstance(node, ast.Attribute) and PY_ASM.fullmatch(node.attr):
            hit(node, f".{node.attr}", "inline assembly")
        elif isinstance(node, ast.Name) and node.id in PY_FORBIDDEN_NAMES:
            hit(node, node.id, "a builtin no generated code uses")
        elif isinstance(node, ast.Attribute) and node.attr in PY_FORBIDDEN_ATTRS:
            hit(node, f".{node.attr}", "an attribute no generated code uses")
        elif (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
              and node.slice.value in _PY_FORBIDDEN_ANY):
            hit(node, f"[{node.slice.value!r}]", "a forbidden name looked up by subscript")  # globals()["exec"]
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in ("getattr", "setattr", "delattr", "hasattr") and len(node.args) > 1:
                name = node.args[1]
                if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                    hit(node, f.id, "an attribute looked up by a computed name")
                elif name.value in PY_FORBIDDEN_ATTRS:
                    hit(node, f"{f.id}(..., {name.value!r})", "an attribute no generated code uses")
            if isinstance(f, ast.Attribute) and f.attr in PY_NESTED:
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and "\n" in arg.value:
                        where = f"{file} > async_compile.{f.attr} source"
                        offset = line_offset + arg.lineno - 1
                        if PY_NESTED[f.attr] == "python":
                            found += scan_python(textwrap.dedent(arg.value), where, "kernel", offset)
                        else:
                            found += [Finding(x.file, x.line + offset, x.call, x.why, x.source)
                                      for x in scan_cpp(arg.value, where)]
    return found


# -- a package ---------------------------------------------------------------------------------------------------


def language_of(name: str) -> str | None:
    dot = name.rfind(".")
    return SOURCE_SUFFIXES.get(name[dot:].lower()) if dot >= 0 else None


def scan_sources(sources: dict[str, tuple[str, str]], result: ScanResult | None = None) -> ScanResult:
    """Scan {name: (language, text)}; language "cpp", "python" (a wrapper), "kernel" (a Triton kernel's module) or
    "ptx". Every source's raw text is also read for inline assembly and PTX (`scan_raw`); a raw hit on a line the
    language's own scan already flagged is not counted twice."""
    result = result or ScanResult()
    t0 = time.perf_counter()
    for name, (language, text) in sources.items():
        result.files.append({"file": name, "language": language, "bytes": len(text.encode("utf-8", "replace"))})
        if language == "cpp":
            found = scan_cpp(text, name)
        elif language in ("python", "kernel"):
            found = scan_python(text, name, "kernel" if language == "kernel" else "wrapper")
        else:
            found = []
        flagged = {f.line for f in found}
        found += [f for f in scan_raw(text, name) if f.line not in flagged]
        result.findings += found
    result.seconds += time.perf_counter() - t0
    return result


def package_sources(package: str) -> dict[str, tuple[str, str]]:
    """Every generated source file in an AOTInductor package, by suffix. Binaries (.so, .cubin, weights) and
    metadata (.json) are not sources."""
    out: dict[str, tuple[str, str]] = {}
    with zipfile.ZipFile(package) as zf:
        for info in zf.infolist():
            language = language_of(info.filename)
            if language and not info.is_dir():
                out[info.filename] = (language, zf.read(info).decode("utf-8", "replace"))
    return out


def scan_package(package: str, python_sources: dict[str, str] | None = None,
                 kernel_sources: dict[str, str] | None = None) -> ScanResult:
    """Scan a package's generated sources plus the Python sources the compile produced outside it: the Python
    wrapper and autotune code of AOTInductor's first pass (`python_sources`), and each Triton kernel's module as
    the compile handed it to `async_compile.triton` (`kernel_sources`)."""
    t0 = time.perf_counter()
    sources = package_sources(package)
    for name, text in (python_sources or {}).items():
        sources[name] = ("python", text)
    for name, text in (kernel_sources or {}).items():
        sources[name] = ("kernel", text)
    read = time.perf_counter() - t0
    result = scan_sources(sources)
    result.seconds += read
    return result
