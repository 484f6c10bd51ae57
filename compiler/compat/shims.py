"""The C++ wrapper's calls into ATen fallbacks: make every one check its error code.

AOTInductor's C++ wrapper calls an op it does not generate a kernel for through a C shim (`aoti_torch_cpu_*`,
`aoti_torch_cuda_*`, `aoti_torch_index_put_out`), which catches ATen's exception and returns an error code. Most
calls are written as `AOTI_TORCH_ERROR_CODE_CHECK(shim(...))`, which throws in turn. Two are not, in torch 2.11 and
2.13 alike (torch/_inductor/codegen/cpp_wrapper_cpu.py): `_generate_scatter_fallback` (scatter with a reduction,
and scatter_add on a CPU with more than one thread, `cpp.fallback_scatter_reduce_sum`) and
`_generate_index_put_fallback` (index_put with a boolean index, in deterministic mode, or where atomics fall short).
Their error code is dropped, so where eager raises IndexError the package returns the input half-scattered.

The same holds for `InplaceBernoulliFallback.codegen` (an IR node's line, `x.bernoulli_(p)` in a train step).
`checked_fallbacks()` wraps those methods for the duration of one compile: each line they write that calls a
shim becomes `AOTI_TORCH_ERROR_CODE_CHECK(...)`. Nothing else changes, and the methods are restored on exit.
Where this torch lacks a method the patch skips it; compiler.scan refuses any shim call that still drops its code.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

# A statement that is one call of a C shim: `aoti_torch_<name>(...);`, nothing before or after it.
_BARE_SHIM_CALL = re.compile(r"\s*(aoti_torch_\w+\s*\(.*\))\s*;\s*\Z", re.S)
PATCHED_METHODS = ("_generate_scatter_fallback", "_generate_index_put_fallback")
_MISSING = object()


def error_checked(line: Any) -> Any:
    """`aoti_torch_x(...);` -> `AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_x(...));`; any other line as it was."""
    if isinstance(line, str):
        m = _BARE_SHIM_CALL.match(line)
        if m:
            return f"AOTI_TORCH_ERROR_CODE_CHECK({m.group(1)});"
    return line


@contextlib.contextmanager
def _checking(wrapper: Any) -> Iterator[None]:
    """While inside, every line `wrapper` writes that is one bare shim call checks its error code."""
    own = wrapper.__dict__.get("writeline", _MISSING)  # torch sets it on the instance at times: keep that one
    writeline = wrapper.writeline
    wrapper.writeline = lambda line, *a, **k: writeline(error_checked(line), *a, **k)
    try:
        yield
    finally:
        if own is _MISSING:
            del wrapper.writeline
        else:
            wrapper.writeline = own


def _wrapped(method: Callable[..., Any]) -> Callable[..., Any]:
    """A wrapper codegen method whose own lines are checked."""
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _checking(self):
            return method(self, *args, **kwargs)

    checked.__name__ = getattr(method, "__name__", "checked")
    checked.__aotc_checked__ = True  # type: ignore[attr-defined]
    return checked


def _wrapped_node(method: Callable[..., Any]) -> Callable[..., Any]:
    """An IR node's `codegen(self, wrapper)` whose lines into `wrapper` are checked."""
    def checked(self: Any, wrapper: Any, *args: Any, **kwargs: Any) -> Any:
        with _checking(wrapper):
            return method(self, wrapper, *args, **kwargs)

    checked.__name__ = getattr(method, "__name__", "checked")
    checked.__aotc_checked__ = True  # type: ignore[attr-defined]
    return checked


def wrapper_classes() -> list[type]:
    """The C++ wrapper codegen classes that define the patched methods themselves (the array-ref variant
    overrides them; the GPU wrapper inherits the CPU one's)."""
    out: list[type] = []
    for module, name in (("torch._inductor.codegen.cpp_wrapper_cpu", "CppWrapperCpu"),
                         ("torch._inductor.codegen.cpp_wrapper_cpu_array_ref", "CppWrapperCpuArrayRef")):
        try:
            cls = getattr(__import__(module, fromlist=[name]), name)
        except (ImportError, AttributeError):
            continue
        out.append(cls)
    return out


def node_classes() -> list[type]:
    """IR nodes whose C++ wrapper line is a bare shim call: `InplaceBernoulliFallback` (`x.bernoulli_(p)`, as
    torchvision's StochasticDepth draws its mask; a train step keeps it as an ATen call, fallback_random), whose
    `aoti_torch_cuda_bernoulli__float(...)` drops its code in torch 2.11 and 2.13 alike."""
    try:
        from torch._inductor import ir
    except ImportError:
        return []
    return [cls for cls in (getattr(ir, "InplaceBernoulliFallback", None),) if isinstance(cls, type)]


@contextlib.contextmanager
def checked_fallbacks() -> Iterator[list[str]]:
    """Within this context, the C++ wrapper checks the error code of every scatter, index_put and bernoulli_
    fallback. Yields the methods it patched ("Class.method"), for the report."""
    patched: list[tuple[type, str, Any]] = []
    try:
        targets = [(cls, name, _wrapped) for cls in wrapper_classes() for name in PATCHED_METHODS]
        targets += [(cls, "codegen", _wrapped_node) for cls in node_classes()]
        for cls, name, wrap in targets:
            original = cls.__dict__.get(name)
            if original is None or getattr(original, "__aotc_checked__", False):
                continue
            setattr(cls, name, wrap(original))
            patched.append((cls, name, original))
        yield [f"{cls.__name__}.{name}" for cls, name, _ in patched]
    finally:
        for cls, name, original in reversed(patched):
            setattr(cls, name, original)
