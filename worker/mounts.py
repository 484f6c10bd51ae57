"""What a compile or check child may see of the host: an allow-list, bound read-only, in place of the whole root.

Found by tracing a real CPU compile and check (strace -f -e trace=%file over worker.child's work, 2026-11-25, torch
2.13, g++ 12): the system dirs, the loader's cache, nsswitch.conf, passwd, localtime, /proc/cpuinfo and the CPU
topology under /sys/devices/system/cpu. Nothing else of /etc, /sys or /proc's host-wide files was read.

- SYSTEM: /usr and the top-level links or dirs into it (/bin, /sbin, /lib*); ETC: the loader's files, nsswitch,
  localtime and the alternatives links (cc, c++ resolve through them); /etc/passwd and /etc/group are synthetic
  (root, nobody and the child's own uid), so no host user names show;
- SYS_CPU: CPU and NUMA topology (torch, OpenMP and glibc read the CPU count and caches there);
- PROC_SYNTHETIC: /proc/loadavg and /proc/meminfo as files of the worker's own, lxcfs-style: no load, and the
  sandbox's own memory bound as its total and free memory (nothing the host's other tenants do shows);
- for CUDA children (not traced here: no GPU; the lead checks them on the GPU machine): /usr/local/cuda*,
  every /dev/nvidia*, each NVIDIA PCI device's dir under /sys/devices (found by its vendor id, 0x10de) with its
  /sys/bus/pci/devices link, and /sys/module/nvidia*. /proc/driver/nvidia comes with the sandbox's own /proc. The
  driver's user-space libraries (libcuda.so) sit under /usr on Debian and Ubuntu, and in images made by the NVIDIA
  container toolkit.

AOTC_SANDBOX_MOUNT adds paths (a toolkit elsewhere, say). Python's prefix, the venv, this checkout and PYTHONPATH
are bound by worker.isolation.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "nsswitch.conf", "localtime", "alternatives")
SYS_CPU = ("/sys/devices/system/cpu", "/sys/devices/system/node")
NVIDIA_VENDOR = "0x10de"
LOADAVG = "0.00 0.00 0.00 1/1 1\n"


def system_ops() -> list[str]:
    """bwrap arguments for the system dirs: a link where the host has one (merged /usr), else a read-only bind."""
    out: list[str] = []
    for p in SYSTEM:
        if os.path.islink(p):
            out += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            out += ["--ro-bind", p, p]
    return out


def etc_files() -> list[Path]:
    return [Path("/etc", name) for name in ETC if os.path.lexists(Path("/etc", name))]


def cuda_paths() -> tuple[list[Path], list[tuple[Path, Path]]]:
    """(dirs to bind read-only, (link, target) pairs to recreate) for a CUDA child."""
    dirs = [Path(p) for p in sorted(glob.glob("/usr/local/cuda*")) if os.path.isdir(p)]
    dirs += [Path(p) for p in sorted(glob.glob("/sys/module/nvidia*")) if os.path.isdir(p)]
    links = []
    for dev in sorted(glob.glob("/sys/bus/pci/devices/*")):
        try:
            vendor = Path(dev, "vendor").read_text().strip()
        except OSError:
            continue
        if vendor == NVIDIA_VENDOR:
            real = Path(os.path.realpath(dev))
            dirs.append(real)
            links.append((Path(dev), real))
    return dirs, links


def synthetic(files_dir: Path, name: str, content: str) -> Path:
    """A file of the worker's with `content` under `files_dir`, written once (atomically: workers share the dir)."""
    path = files_dir / name
    try:
        if path.read_text() == content:
            return path
    except OSError:
        pass
    files_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    tmp = files_dir / f".{name}.{os.getpid()}"
    tmp.write_text(content)
    os.chmod(tmp, 0o644)
    tmp.rename(path)
    return path


def passwd(uid: int, gid: int, user: str) -> str:
    lines = ["root:x:0:0:root:/root:/usr/sbin/nologin", "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin"]
    if uid not in (0, 65534):
        lines.append(f"{user}:x:{uid}:{gid}:{user}:/nonexistent:/usr/sbin/nologin")
    return "\n".join(lines) + "\n"


def group(gid: int, user: str) -> str:
    lines = ["root:x:0:", "nogroup:x:65534:"]
    if gid not in (0, 65534):
        lines.append(f"{user}:x:{gid}:")
    return "\n".join(lines) + "\n"


def meminfo(memory_bytes: int | None) -> str:
    """What /proc/meminfo says in a sandbox: its own bound as total, free and available memory; no swap. Empty
    where the sandbox has no memory bound (nothing to state that is not the host's)."""
    if memory_bytes is None:
        return ""
    kb = memory_bytes // 1024
    rows = [("MemTotal", kb), ("MemFree", kb), ("MemAvailable", kb), ("Buffers", 0), ("Cached", 0),
            ("SwapCached", 0), ("SwapTotal", 0), ("SwapFree", 0), ("Shmem", 0)]
    return "".join(f"{k + ':':<16}{v:>8} kB\n" for k, v in rows)
