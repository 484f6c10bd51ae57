"""Pin one compile to an x86-64 psABI level: gcc's `-march`, and the vector ISA Inductor generates code for.

Left alone, Inductor builds CPU code for the machine it runs on, twice over:

- `-march=native` on every g++ line (torch/_inductor/cpp_builder.py). torch 2.13 has `cpp.march`
  (TORCHINDUCTOR_CPP_MARCH; pytorch#184297) to name another; torch 2.11 hard-codes `march=native` in
  `_get_optimization_cflags`, so there the function is wrapped for the compile and its `march=` entry replaced.
- the vector ISA (torch/_inductor/cpu_vec_isa.py `pick_vec_isa`): the first of `valid_vec_isa_list()`, which on an
  AVX-512 host is VecAMX or VecAVX512VNNI when the CPU has them, and whose flags add `-mavx512bf16` where the CPU
  has that. `cpp.simdlen` only picks a width (512 still picks AMX). So for the compile `valid_vec_isa_list` answers
  only the ISAs of the level: none for v1 and v2 (Inductor writes scalar C++ that gcc may vectorise within the
  level), VecAVX2 for v3, and for v4 an AVX-512 ISA with exactly AVX-512 F/BW/DQ/VL and FMA's flags, no bf16, no
  VNNI, no AMX. `pick_vec_isa` looks the list up in its module at every call, so every caller (codegen,
  cpp_micro_gemm, codecache) sees the pinned one. Both names and their behaviour are the same in torch 2.11 and
  2.13.

compiler.isa then reads the built package and refuses one that went above its level anyway.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from compiler.targets import IsaPin


def has_march_config() -> bool:
    """Whether this torch's Inductor has `cpp.march` (torch 2.13 does; 2.11 does not)."""
    from torch._inductor import config

    return hasattr(config.cpp, "march")


def _march_flag(cflags: list[str], march: str) -> list[str]:
    """`cflags` (Inductor's spelling, no leading dash) with every `march=`/`mcpu=` entry replaced by `march`'s."""
    out = [f for f in cflags if not (isinstance(f, str) and f.startswith(("march=", "mcpu=")))]
    return [*out, f"march={march}"]


@contextlib.contextmanager
def _wrapped_cflags(march: str) -> Iterator[None]:
    """torch without `cpp.march`: every `_get_optimization_cflags` answer carries `march` instead of native."""
    from torch._inductor import cpp_builder

    original = getattr(cpp_builder, "_get_optimization_cflags", None)
    if original is None:
        raise RuntimeError("this torch has neither Inductor's cpp.march nor cpp_builder._get_optimization_cflags: "
                           "aotc cannot pin -march, and builds no CPU package rather than one for this host alone")

    @functools.wraps(original)
    def pinned(*args: Any, **kwargs: Any) -> Any:
        got = original(*args, **kwargs)
        if isinstance(got, tuple) and got and isinstance(got[0], list):
            return (_march_flag(got[0], march), *got[1:])
        if isinstance(got, list):
            return _march_flag(got, march)
        raise RuntimeError(f"cpp_builder._get_optimization_cflags answered {type(got).__name__}; aotc knows lists "
                           "and (cflags, ldflags)")

    cpp_builder._get_optimization_cflags = pinned
    try:
        yield
    finally:
        cpp_builder._get_optimization_cflags = original


def _level_isas(pin: IsaPin) -> list[Any]:
    """The vector ISAs a compile for `pin` may use, best first. Only those are built and probed: torch's own list
    would build and load a test program for each ISA above the level too (AMX, VNNI), for nothing."""
    from torch._inductor import cpu_vec_isa

    v: Any = cpu_vec_isa  # its classes are subclassed and overridden here, which their typing does not foresee
    if pin.vec_isa is None:
        return []
    host = v.x86_isa_checker()  # what this CPU has (torch's cpuinfo), as torch's own list filters by
    avx2 = [isa for isa in (v.VecAVX2(),) if "avx2" in host and isa]
    if not avx2 or (pin.vec_isa == "avx512" and "avx512" not in host):
        # The worker serves no level above its host's (compiler.targets.served_targets): its check could not run.
        raise RuntimeError(f"this host cannot build for x86-64 {pin.level}: Inductor finds no working "
                           f"{pin.vec_isa} here (this CPU has: {', '.join(host) or 'none'})")
    if pin.vec_isa == "avx2":
        return avx2

    class AVX512Level4(v.VecAVX512):
        """AVX-512 with the psABI v4 flags only: VecAVX512's own flags (F, DQ, VL, BW, FMA), never its bf16."""

        __hash__ = v.VecISA.__hash__

        def __bool__(self) -> bool:
            return v.VecISA.__bool__(self)  # the build check of these flags; not VecAVX512's bf16 probe

        def build_arch_flags(self) -> str:
            return str(v.VecAVX512._arch_flags)

        def is_avx512_bf16_supported(self) -> bool:
            return False

    plain = AVX512Level4()
    if not plain:
        raise RuntimeError(f"this host cannot build for x86-64 {pin.level}: g++ could not build and load AVX-512 "
                           f"code with {v.VecAVX512._arch_flags}")
    return [plain, *avx2]


@contextlib.contextmanager
def pinned_isa(pin: IsaPin | None, configs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """For the duration of one compile, hold Inductor to `pin`'s level; yields the `inductor_configs` to pass
    (`configs` without `cpp.march` where this torch lacks it: the wrapped cflags carry it instead). `pin` None
    (a GPU, or a CPU target that names no level) changes nothing."""
    if pin is None:
        yield {k: v for k, v in configs.items() if k not in ("cpp.march", "cpp.simdlen")}
        return
    from torch._inductor import cpu_vec_isa

    original = cpu_vec_isa.valid_vec_isa_list
    allowed = _level_isas(pin)

    def level_only() -> list[Any]:
        return list(allowed)

    level_only.cache_clear = lambda: None  # type: ignore[attr-defined]  # callers may clear torch's cached original
    with contextlib.ExitStack() as stack:
        if has_march_config():
            out = dict(configs)
        else:
            out = {k: v for k, v in configs.items() if k != "cpp.march"}
            stack.enter_context(_wrapped_cflags(pin.march))
        setattr(cpu_vec_isa, "valid_vec_isa_list", level_only)  # noqa: B010  (read by pick_vec_isa at each call)
        try:
            yield out
        finally:
            setattr(cpu_vec_isa, "valid_vec_isa_list", original)  # noqa: B010


def picked_vec_isa() -> str:
    """The vector ISA Inductor picks now (inside `pinned_isa`, the pinned one), as torch names it."""
    from torch._inductor import cpu_vec_isa

    return str(cpu_vec_isa.pick_vec_isa())
