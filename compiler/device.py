"""The concrete target and toolchain of the machine a worker runs on."""

from __future__ import annotations

import importlib.metadata
import platform
import socket
from collections.abc import Iterable
from typing import Any

import torch

from compiler.targets import X86, Target, detect_cpu_target, served_targets


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def toolchain(device_kind: str) -> dict[str, Any]:
    """Versions that change generated code. Triton and CUDA only matter to GPU code, so CPU targets leave them out
    and a CPU artifact stays valid across a triton upgrade."""
    tc: dict[str, Any] = {"torch": torch.__version__}
    if device_kind == "cuda":
        tc["cuda"] = torch.version.cuda
        tc["triton"] = _version("triton") or _version("pytorch-triton")
    return tc


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda:0' when a GPU is visible, else 'cpu'; 'cuda' -> 'cuda:0'."""
    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return "cuda:0"
    return device


def host_target(device: str) -> Target:
    """The concrete target of `device` on this machine: cuda-sm90; cpu-x86_64-v4 (its psABI level, from
    compiler.targets.detect_cpu_target); on other machines the CPU and ATen's capability, cpu-aarch64-sve256."""
    device = resolve_device(device)
    kind = device.split(":")[0]
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} requested but torch sees no CUDA GPU")
        major, minor = torch.cuda.get_device_capability(torch.device(device).index or 0)
        return Target("cuda", (f"sm{major}{minor}",))
    if kind == "cpu":
        detected = Target.parse(detect_cpu_target())
        if detected.level is not None or platform.machine().lower() in (X86, "amd64"):
            return detected
        isa = torch.backends.cpu.get_cpu_capability().lower()
        return Target("cpu", (platform.machine().lower(), isa))
    raise RuntimeError(f"unsupported device {device!r}: use cpu or cuda[:N]")


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` says."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        return name


def detect(device: str, targets: Iterable[str] = ()) -> dict[str, Any]:
    """Describe the worker's device: concrete target, the targets it serves, device name and toolchain. A CPU
    worker serves every x86-64 level at or below its host's, or those of them `targets` (AOTC_WORKER_TARGETS)
    names; ValueError for one above the host's."""
    device = resolve_device(device)
    kind = device.split(":")[0]
    served = served_targets(str(host_target(device)), targets if kind == "cpu" else ())
    name = torch.cuda.get_device_name(torch.device(device).index or 0) if kind == "cuda" else cpu_name()
    return {
        "target": served[0],  # the highest it serves: what a plain 'cpu' request gets (compiler.targets.pick_worker)
        "targets": served,
        "device": device,
        "device_name": name,
        "host": socket.gethostname(),
        "toolchain": toolchain(kind),
    }
