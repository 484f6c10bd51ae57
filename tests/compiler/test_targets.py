"""CPU targets as x86-64 psABI levels: parsing and the old labels, this machine's level from /proc/cpuinfo, what a
worker serves and which worker a request goes to, what runs where, and the level in the cache key and in lookup.
Pure logic: no compile, no Redis."""

from __future__ import annotations

import pytest

from compiler import cachekey
from compiler.errors import Unprocessable
from compiler.options import CompileOptions
from compiler.targets import (
    LEVELS,
    PINS,
    Target,
    cpu_level,
    cpuinfo_flags,
    detect_cpu_target,
    pick_worker,
    served_targets,
)
from service.api.lookup import rank

BASE = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 syscall nx lm"
# QEMU's default CPU model: SSE3, CX16 and LAHF but no SSSE3, SSE4 or POPCNT.
QEMU64 = f"{BASE} rep_good nopl cpuid pni cx16 hypervisor lahf_lm svm"
V2 = f"{BASE} pni ssse3 cx16 sse4_1 sse4_2 popcnt lahf_lm"  # e.g. Silvermont, Nehalem
# An AVX2 part without AVX-512 (AMD EPYC 7763's flags, trimmed).
ZEN3 = f"{V2} pclmulqdq fma movbe xsave avx f16c rdrand abm sse4a bmi1 avx2 bmi2 erms sha_ni vaes vpclmulqdq"
# This project's CI box: a Sapphire Rapids with AMX, AVX-512 BF16 and FP16.
SPR = (f"{ZEN3} avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vnni "
       "amx_bf16 avx512_fp16 amx_tile amx_int8")


def cpuinfo(flags: str) -> str:
    return (f"processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Test CPU\nflags\t\t: {flags}\n\n"
            f"processor\t: 1\nflags\t\t: {flags}\n")


@pytest.mark.parametrize(("flags", "level"), [(QEMU64, "v1"), (V2, "v2"), (ZEN3, "v3"), (SPR, "v4")])
def test_the_level_of_a_cpu_is_the_highest_whose_flags_it_has_all_of(flags, level):
    assert cpu_level(cpuinfo_flags(cpuinfo(flags))) == level
    assert detect_cpu_target(cpuinfo(flags), "x86_64") == f"cpu-x86_64-{level}"


def test_one_missing_flag_drops_a_level_and_no_baseline_is_no_level():
    assert cpu_level(set(SPR.split()) - {"avx512cd"}) == "v3"  # AVX-512 without CD (Xeon Phi's BW/DQ/VL gap too)
    assert cpu_level(set(ZEN3.split()) - {"movbe"}) == "v2"
    assert cpu_level(set(ZEN3.split()) - {"popcnt"}) == "v1"  # a level needs every level below it
    assert cpu_level({"sse", "sse2"}) is None
    assert detect_cpu_target(cpuinfo("sse sse2"), "x86_64") == "cpu-x86_64-v1"


def test_other_machines_are_named_but_not_pinned():
    assert detect_cpu_target("", "aarch64") == "cpu-aarch64"
    assert detect_cpu_target(cpuinfo(SPR), "AMD64") == "cpu-x86_64-v4"  # Windows' name for x86-64
    assert Target.parse("cpu-aarch64-sve256").pin is None


def test_this_machine_detects_without_torch():
    import subprocess
    import sys

    code = "import sys; from compiler.targets import detect_cpu_target as d; print(d(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[1] == "False"
    assert Target.parse(out[0]).kind == "cpu"


@pytest.mark.parametrize(("old", "level"), [("default", "v1"), ("avx2", "v3"), ("avx512", "v4")])
def test_the_old_labels_read_as_their_level(old, level):
    assert str(Target.parse(f"cpu-x86_64-{old}")) == f"cpu-x86_64-{level}"
    assert str(Target.parse(f" CPU-X86_64-{old.upper()} ")) == f"cpu-x86_64-{level}"
    assert Target.parse(f"cpu-x86_64-{old}").matches("cpu-x86_64-" + level)


def test_an_unknown_level_is_refused_naming_the_levels_and_aliases():
    with pytest.raises(Unprocessable) as e:
        Target.parse("cpu-x86_64-v5")
    assert "v1, v2, v3, v4" in e.value.message and "avx512 = v4" in e.value.message


def test_each_level_pins_march_and_a_vector_isa_within_it():
    assert [(p.march, p.vec_isa, p.simdlen) for p in PINS.values()] == [
        ("x86-64", None, None), ("x86-64-v2", None, None), ("x86-64-v3", "avx2", 256), ("x86-64-v4", "avx512", 512)]
    # Inductor's flags for each vector ISA are within the level that picks it.
    assert {"avx2", "fma", "f16c"} <= PINS["v3"].allowed_m
    assert {"avx512f", "avx512dq", "avx512vl", "avx512bw", "fma"} <= PINS["v4"].allowed_m
    assert not {"avx512bf16", "avx512vnni", "amx-tile"} & PINS["v4"].allowed_m
    configs = CompileOptions().inductor_configs(PINS["v3"])
    assert configs["cpp.march"] == "x86-64-v3" and configs["cpp.simdlen"] == 256
    assert "cpp.march" not in CompileOptions().inductor_configs()


def test_a_package_runs_at_its_level_and_above_never_below():
    v3, v4 = Target.parse("cpu-x86_64-v3"), Target.parse("cpu-x86_64-v4")
    assert v3.cannot_run_on(v4) is None
    assert v4.cannot_run_on(v3) == "it was built for cpu-x86_64-v4; this machine's CPU is cpu-x86_64-v3"
    assert Target.parse("cpu-x86_64-avx2").cannot_run_on(v4) is None
    assert Target.parse("cpu-aarch64-sve256").cannot_run_on(v4) is not None


def test_a_worker_serves_every_level_at_or_below_its_host():
    assert served_targets("cpu-x86_64-v4") == ["cpu-x86_64-v4", "cpu-x86_64-v3", "cpu-x86_64-v2", "cpu-x86_64-v1"]
    assert served_targets("cpu-x86_64-v2") == ["cpu-x86_64-v2", "cpu-x86_64-v1"]
    assert served_targets("cuda-sm90") == ["cuda-sm90"]
    # AOTC_WORKER_TARGETS narrows it, aliases allowed; above the host is an error that names the setting.
    assert served_targets("cpu-x86_64-v4", ["cpu-x86_64-avx2", "cpu-x86_64-v4"]) == ["cpu-x86_64-v4",
                                                                                     "cpu-x86_64-v3"]
    with pytest.raises(ValueError, match="AOTC_WORKER_TARGETS names cpu-x86_64-v4"):
        served_targets("cpu-x86_64-v3", ["cpu-x86_64-v4"])


def _w(name: str, target: str, started: float, targets: list[str] | None = None) -> dict:
    w = {"id": name, "target": target, "started": started, "toolchain": {"torch": name}}
    return w | ({"targets": targets} if targets is not None else {})


def test_a_request_goes_to_a_worker_that_serves_its_level_and_is_keyed_for_that_level():
    v4 = _w("v4", "cpu-x86_64-v4", 1, served_targets("cpu-x86_64-v4"))
    v3 = _w("v3", "cpu-x86_64-v3", 2, served_targets("cpu-x86_64-v3"))
    pick = pick_worker(Target.parse("cpu-x86_64-v2"), [v4, v3])
    assert pick is not None and pick["id"] == "v3" and pick["target"] == "cpu-x86_64-v2"  # the newest that serves v2
    pick = pick_worker(Target.parse("cpu-x86_64-avx512"), [v4, v3])
    assert pick is not None and pick["id"] == "v4" and pick["target"] == "cpu-x86_64-v4"
    # 'cpu' builds for the level most workers' hosts have: here two v3 hosts to one v4.
    v3b = _w("v3b", "cpu-x86_64-v3", 0, served_targets("cpu-x86_64-v3"))
    pick = pick_worker(Target.parse("cpu"), [v4, v3, v3b])
    assert pick is not None and pick["target"] == "cpu-x86_64-v3" and pick["id"] == "v3"
    # A worker from before levels (no `targets`, an old label) builds with -march=native: no level goes to it.
    old = _w("old", "cpu-x86_64-avx512", 3)
    assert pick_worker(Target.parse("cpu-x86_64-v4"), [old]) is None
    assert pick_worker(Target.parse("cpu-x86_64-v1"), [v4]) is not None


SPEC = [{"name": "x", "dtype": "float32", "shape": [4, 16]}]


def _record(target: str, created: float, drop: tuple[str, ...] = ()) -> dict:
    f = cachekey.factors("ab" * 32, SPEC, target, {"torch": "2.13.0+cpu"}, CompileOptions().canonical())
    f = {k: v for k, v in f.items() if k not in drop}
    return {"key": cachekey.cache_key(f), "factors": f, "created": created}


def test_the_level_and_its_pin_are_factors_of_the_key():
    v3, v4 = _record("cpu-x86_64-v3", 1), _record("cpu-x86_64-v4", 1)
    assert v3["factors"]["isa"] == {"level": "v3", "march": "x86-64-v3", "vec_isa": "avx2", "revision": 1}
    assert v3["key"] != v4["key"]
    assert cachekey.pinned(v3["factors"]) and cachekey.pinned(v4["factors"])
    # The old labels' keys are what they were (no request computes them again: it reads the label as its level).
    assert "isa" not in _record("cpu-x86_64-avx2", 1)["factors"]
    assert cachekey.pinned(_record("cuda-sm90", 1)["factors"])  # GPUs have no level to keep to


def test_lookup_never_serves_a_package_built_with_march_native_under_an_old_label():
    old = _record("cpu-x86_64-avx512", 2.0)  # what a worker before levels published: -march=native
    new = _record("cpu-x86_64-v4", 1.0)
    for asked in ("cpu-x86_64-avx512", "cpu-x86_64-v4", "cpu"):
        assert rank([old], Target.parse(asked), SPEC) is None
        picked = rank([old, new], Target.parse(asked), SPEC)
        assert picked is not None and picked["factors"]["target"] == "cpu-x86_64-v4"
    unpinned = _record("cpu-x86_64-v4", 3.0, drop=("isa",))  # a v4 record without its pin: not served either
    assert rank([unpinned], Target.parse("cpu-x86_64-v4"), SPEC) is None
    assert LEVELS == ("v1", "v2", "v3", "v4")
