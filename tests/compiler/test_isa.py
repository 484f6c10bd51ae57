"""compiler.isa reads a package against its x86-64 level: the vector ISA it records, the g++ flags it was built
with, and its code. Packages made here by hand (a zip as AOTInductor lays it out, with a shared object gcc builds
in a fraction of a second), so no torch compile runs."""

from __future__ import annotations

import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from compiler.errors import IsaMismatch
from compiler.isa import audit, flag_violations
from compiler.targets import PINS

# What a package built on main's workers on this project's Sapphire Rapids box recorded (-march=native and the
# AMX, VNNI and BF16 flags of Inductor's VecAMX), and what a v3 package records now.
NATIVE = ("g++ k.cpp -D CPU_CAPABILITY_AVX512 -O3 -march=native -fPIC -mavx512f -mavx512dq -mavx512vl -mavx512bw "
          "-mfma -mavx512vnni -mamx-tile -mamx-bf16 -mamx-int8 -mavx512bf16 -c -o k.o")
V3 = "g++ k.cpp -D CPU_CAPABILITY_AVX2 -O3 -DNDEBUG -march=x86-64-v3 -fPIC -m64 -mtune=generic -mavx2 -mfma -mf16c -c"

AVX512_C = "#include <immintrin.h>\nvoid f(float *a) { _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), " \
           "_mm512_loadu_ps(a + 16))); }\n"
AVX2_C = "#include <immintrin.h>\nvoid f(float *a) { _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_loadu_ps(a), " \
         "_mm256_loadu_ps(a + 8), _mm256_loadu_ps(a + 16))); }\n"


def test_flags_above_the_level_are_named():
    assert flag_violations(V3.split(), PINS["v3"]) == []
    assert flag_violations(V3.split(), PINS["v2"]) == ["-march=x86-64-v3", "-mavx2", "-mfma", "-mf16c"]
    assert flag_violations(NATIVE.split(), PINS["v4"]) == [
        "-march=native", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8", "-mavx512bf16"]
    assert flag_violations(["-mno-avx512f", "-mtune=native", "-march=x86-64-v4"], PINS["v4"]) == []


def _package(tmp: Path, isa: str, flags: str, so: Path | None = None) -> Path:
    path = tmp / "artifact.pt2"
    with zipfile.ZipFile(path, "w") as zf:
        model = "artifact/data/aotinductor/model/"
        zf.writestr(f"{model}abc.wrapper_metadata.json", json.dumps({"AOTI_DEVICE_KEY": "cpu", "AOTI_CPU_ISA": isa}))
        zf.writestr(f"{model}abc.kernel.cpp", f"extern \"C\" void k() {{}}\n\n// Compile cmd\n// {flags}\n")
        if so is not None:
            zf.write(so, f"{model}abc.wrapper.so")
    return path


def test_a_package_of_its_level_passes_with_its_evidence(tmp_path):
    facts = audit(_package(tmp_path, "AVX2", V3), PINS["v3"], objdump="")
    assert facts["metadata"] == ["AVX2"] and facts["compile_lines"] == 1 and facts["code"] is None


def test_main_s_march_native_package_is_refused_for_the_level_it_was_labelled(tmp_path):
    package = _package(tmp_path, "AVX512 AVX512_VNNI AMX_TILE", NATIVE)
    with pytest.raises(IsaMismatch) as e:
        audit(package, PINS["v4"], objdump="")
    assert "-march=native" in e.value.message and "-mamx-tile" in e.value.message
    assert "AOTI_CPU_ISA=AVX512 AVX512_VNNI AMX_TILE, not AVX512" in e.value.message
    assert e.value.stage == "package"


def _shared_object(tmp: Path, source: str, march: str) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    (tmp / "f.c").write_text(source)
    out = tmp / f"f-{march}.so"
    subprocess.run([cc, "-O2", f"-march={march}", "-shared", "-fPIC", "-o", str(out), str(tmp / "f.c")], check=True)
    return out


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump (binutils)")
def test_the_code_is_read_for_registers_and_instructions_above_the_level(tmp_path):
    # The flags say v3, the code says AVX-512: the disassembly catches what the flags would not.
    zmm = _shared_object(tmp_path, AVX512_C, "x86-64-v4")
    with pytest.raises(IsaMismatch, match=r"holds code above v3: .*%zmm"):
        audit(_package(tmp_path, "AVX2", V3, zmm), PINS["v3"])
    ymm = _shared_object(tmp_path, AVX2_C, "x86-64-v3")
    facts = audit(_package(tmp_path, "AVX2", V3, ymm), PINS["v3"])
    assert facts["code"][0]["findings"] == [] and facts["code"][0]["complete"]
    with pytest.raises(IsaMismatch, match=r"holds code above v2: .*(vfmadd|%ymm)"):
        audit(_package(tmp_path, "INVALID_VEC_ISA", "g++ k.cpp -march=x86-64-v2 -c", ymm), PINS["v2"])
