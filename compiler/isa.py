"""Read a built CPU package and say whether it keeps to its x86-64 level.

The compile pins `-march` and Inductor's vector ISA (compiler.compat.isa); this module checks what came out, from
three kinds of evidence in the package:

- metadata: each `*_metadata.json` records `AOTI_CPU_ISA`, the vector ISA Inductor generated code for (AVX2,
  AVX512, or INVALID_VEC_ISA for scalar code);
- flags: the g++ command lines, from the `// Compile cmd` comment AOTInductor leaves in its .cpp files and from the
  DWARF producer strings of the shared objects (`GNU C++20 12.2.0 -march=x86-64-v3 -mavx2 ...`, present where
  Inductor builds with line tables, as torch 2.13 does). Every `-march` must be the level's, and every `-m` flag
  that enables an instruction set must be one of the level's (`IsaPin.allowed_m`);
- code: `objdump -d` of each shared object, where binutils is installed (it is wherever g++ builds): no register
  or instruction of a set above the level (`FORBIDDEN`). This is a tripwire for what `-march=native` would let
  gcc emit, not a proof: it knows the registers and the instruction families listed there.

Torch-free: the test suite and the worker's compile child both use it. `audit` returns the facts for the report;
`IsaMismatch` (a CompileError) fails a compile whose package went above its level, before it is checked or
published.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from compiler.errors import IsaMismatch
from compiler.targets import IsaPin

# What Inductor records as AOTI_CPU_ISA for each vector ISA a level allows.
METADATA_ISA = {None: "INVALID_VEC_ISA", "avx2": "AVX2", "avx512": "AVX512"}
# -m flags that select no instruction set: tuning, the ABI, code model, and turning a set off.
_NEUTRAL_M = re.compile(r"^-m(64|tune=.*|no-.*|fpmath=.*|cmodel=.*|abi=.*|stackrealign|red-zone|"
                        r"indirect-branch.*|function-return.*|arch=.*)$")
_FLAGS_LINE = re.compile(r"^//\s*(?:g\+\+|c\+\+|clang\+\+|\S*/(?:g|c|clang)\+\+(?:-\d+)?)\s.*$", re.M)
_PRODUCER = re.compile(rb"GNU C(?:\+\+)?[0-9]* [0-9][0-9.]* ([^\x00]{1,8192})")
_MAX_MEMBER_BYTES = 1 << 30  # a package member is read whole for its strings; nothing Inductor writes is near it

# objdump's AT&T spelling. Registers first: EVEX-only registers and masks (AVX-512), ymm (AVX), AMX tiles.
_AVX512_REGS = r"%zmm\d+|%k[0-7]\b|%[xy]mm(?:1[6-9]|2\d|3[01])\b|\{1to\d+\}"
_ABOVE_V4 = (r"%tmm\d|\b(?:ldtilecfg|sttilecfg|tilezero|tileload\w*|tilestore\w*|tdp\w+|tilerelease)\b|"
             r"\bv(?:dpbf16ps|cvtne2ps2bf16|cvtneps2bf16)\b|\bvp(?:dpbusds?|dpwssds?)\b|"
             r"\bv(?:permb|permi2b|permt2b|pmultishiftqb|pcompress[bw]|pexpand[bw]|pshl?d\w*|pshrd\w*)\b|"
             r"\bvp(?:popcnt[bwdq]|shufbitqmb|madd52[lh]uq|2intersect\w*)\b|\bgf2p8\w+|"
             r"\bv(?!cvtph2ps\b|cvtps2ph\b)\w+ph\b|\b(?:v?aes\w+|v?pclmul\w+|sha1\w+|sha256\w+)\b")
_ABOVE_V2 = r"%ymm\d+\b|\bv(?:broadcast|perm2|fmadd|fnmadd|fmsub|fnmsub|fmaddsub|fmsubadd)\w*\b|" + \
    r"\b(?:andn|bextr|blsi|blsmsk|blsr|bzhi|mulx|pdep|pext|rorx|sarx|shlx|shrx|lzcnt|tzcnt|movbe)\b"
_ABOVE_V1 = r"\b(?:popcnt|p?shufb|ptest|pmulld|pcmp[ei]str[im]|crc32|lddqu|phadd\w+|phsub\w+|palignr|pminu[dw]|" + \
    r"pmaxu[dw]|pmins[bd]|pmaxs[bd]|roundp[sd]|rounds[sd]|blendv?p[sd]|dpp[sd]|insertps|pextr[bdq]|pinsr[bdq]|" + \
    r"pmov[sz]x\w+|packusdw|movntdqa|mpsadbw|phminposuw)\b"
# Any VEX-encoded instruction (AVX); not the VMX instructions, which also begin with v.
_ANY_AVX = r"^v(?!err\b|erw\b|mcall|mlaunch|mresume|mptr|mclear|mread|mwrite|mxo|mfunc|mrun|mload|msave)[a-z]"
FORBIDDEN = {
    "v4": re.compile(_ABOVE_V4),
    "v3": re.compile(f"{_AVX512_REGS}|{_ABOVE_V4}"),
    "v2": re.compile(f"{_AVX512_REGS}|{_ABOVE_V4}|{_ABOVE_V2}|{_ANY_AVX}"),
    "v1": re.compile(f"{_AVX512_REGS}|{_ABOVE_V4}|{_ABOVE_V2}|{_ANY_AVX}|{_ABOVE_V1}"),
}


def flag_violations(flags: list[str], pin: IsaPin) -> list[str]:
    """The flags of one compile line that go above `pin`'s level: a `-march` other than the level's, or an `-m`
    flag of an instruction set the level does not have."""
    bad = []
    for flag in flags:
        if flag.startswith("-march="):
            if flag != f"-march={pin.march}":
                bad.append(flag)
        elif flag.startswith("-m") and not _NEUTRAL_M.match(flag) and flag[2:] not in pin.allowed_m:
            bad.append(flag)
    return bad


def _compile_lines(text: str) -> list[list[str]]:
    return [m.group(0)[2:].split() for m in _FLAGS_LINE.finditer(text)]


def _producers(blob: bytes) -> list[list[str]]:
    return [m.group(1).decode("utf-8", "replace").split() for m in _PRODUCER.finditer(blob)]


def scan_code(so_path: Path, pin: IsaPin, objdump: str, timeout_s: float, max_findings: int = 5) -> dict[str, Any]:
    """Disassemble one shared object and collect lines with a register or instruction above the level. Stops at
    `max_findings`, or at `timeout_s` (then `complete` is false)."""
    pattern = FORBIDDEN[pin.level]
    findings: list[str] = []
    lines = 0
    deadline = time.monotonic() + timeout_s
    proc = subprocess.Popen([objdump, "-d", "--no-show-raw-insn", str(so_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, errors="replace")
    complete = True
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            lines += 1
            if "\t" in line and pattern.search(line.split("\t", 1)[1]):  # the instruction, not the address/label
                findings.append(" ".join(line.split())[:200])
                if len(findings) >= max_findings:
                    break
            if lines % 4096 == 0 and time.monotonic() > deadline:
                complete = False
                break
    finally:
        proc.kill()
        proc.wait()
    return {"file": so_path.name, "instructions": lines, "findings": findings, "complete": complete}


def audit(package: str | Path, pin: IsaPin, *, objdump: str | None = None, timeout_s: float = 120.0) -> dict[str, Any]:
    """The evidence that `package` keeps to `pin`'s level, as the report's `isa` entry. Raises IsaMismatch when
    any of it goes above the level. `objdump`: its path (default: found on PATH; none: the code is not read)."""
    objdump = objdump if objdump is not None else shutil.which("objdump")
    facts: dict[str, Any] = {"level": pin.level, "march": pin.march, "vec_isa": pin.vec_isa, "metadata": [],
                             "compile_lines": 0, "code": None}
    problems: list[str] = []
    with zipfile.ZipFile(package) as zf, tempfile.TemporaryDirectory(prefix="aotc-isa-") as tmp:
        sos: list[Path] = []
        for info in zf.infolist():
            name = info.filename
            if info.is_dir() or info.file_size > _MAX_MEMBER_BYTES:
                continue
            if name.endswith("_metadata.json"):
                try:
                    isa = json.loads(zf.read(info)).get("AOTI_CPU_ISA")
                except ValueError:
                    isa = None
                facts["metadata"].append(isa)
                if isa is not None and isa != METADATA_ISA[pin.vec_isa]:
                    problems.append(f"{Path(name).name} says AOTI_CPU_ISA={isa}, not {METADATA_ISA[pin.vec_isa]}")
            elif name.endswith((".cpp", ".so")):
                blob = zf.read(info)
                lines = (_compile_lines(blob.decode("utf-8", "replace")) if name.endswith(".cpp")
                         else _producers(blob))
                facts["compile_lines"] += len(lines)
                for flags in lines:
                    bad = flag_violations(flags, pin)
                    if bad:
                        problems.append(f"{Path(name).name} was built with {' '.join(sorted(set(bad)))}")
                if name.endswith(".so"):
                    out = Path(tmp) / f"{len(sos)}-{Path(name).name}"
                    out.write_bytes(blob)
                    sos.append(out)
        if objdump and sos:
            scans = [scan_code(so, pin, objdump, timeout_s / len(sos)) for so in sos]
            facts["code"] = scans
            for s in scans:
                if s["findings"]:
                    problems.append(f"{s['file']} holds code above {pin.level}: {'; '.join(s['findings'][:3])}")
    problems = list(dict.fromkeys(problems))  # a flag line appears in each .cpp and again in the .so
    if problems:
        raise IsaMismatch(f"the package for x86-64 {pin.level} (-march={pin.march}, vector ISA "
                          f"{pin.vec_isa or 'none'}) uses instruction sets above it: " + "; ".join(problems[:5]),
                          stage="package")
    return facts
