"""The one place aotc touches torch APIs that are private or moved between versions.

aotc runs on torch 2.13 (the CPU build in CI) and torch 2.11 (the GPU workers). Anything here may need a
version check; code elsewhere in compiler/ and worker/ uses only these wrappers and torch's public API.
"""

from __future__ import annotations

import torch

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]
