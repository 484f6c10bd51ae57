"""The one place aotc touches torch APIs that are private or moved between versions.

aotc runs on torch 2.13 (the CPU build in CI) and torch 2.11 (the GPU workers). Anything here may need a
version check; code elsewhere in compiler/ and worker/ uses only these wrappers and torch's public API.
"""

from __future__ import annotations

import torch

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]


# -- AOTInductor --------------------------------------------------------------------------------------------
# aoti_compile_and_package / aoti_load_package live under torch._inductor (documented, but private by name).


def aoti_compile_and_package(ep: torch.export.ExportedProgram, package_path: str, inductor_configs: dict) -> str:
    from torch._inductor import aoti_compile_and_package as _compile

    return str(_compile(ep, package_path=package_path, inductor_configs=inductor_configs))


def aoti_load_package(package_path: str, device: str = "cpu"):  # type: ignore[no-untyped-def]
    """Load a package for `device`; device_index picks the GPU on multi-GPU hosts (argument since torch 2.7)."""
    from torch._inductor import aoti_load_package as _load

    index = torch.device(device).index
    if device.startswith("cuda") and index is not None:
        return _load(package_path, device_index=index)
    return _load(package_path)
