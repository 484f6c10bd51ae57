"""AOTInductor's precompiled headers: built once by a trusted compile, then bound read-only into every compile.

AOTInductor precompiles the big C++ headers that its wrapper and kernels include into
TMPDIR/torchinductor_USER/precompiled_headers/<hash>.h(.gch), and uses a header whose hash (header, flags,
compiler) is already there. Building them is about 13 s of a 27 s first CPU compile on 2 cores, about 60 s on the
GPU machine. A directory that every job's sandbox could write would let one hostile compile plant a header that
later compiles of other users include. So:

- at start the worker compiles a built-in model (worker.child, kind "warmup"; nothing uploaded is involved) in the
  sandbox, in a fresh dir. The .h and .gch files it leaves are moved into HEADERS/<key>/, owned by the worker and
  read-only; the key covers torch, Python, the C++ compiler and the target, so a toolchain upgrade builds anew;
- every compile child gets a private, writable header dir with each trusted file bound read-only into it
  (worker.isolation): Inductor finds its header already built and builds nothing. A compile whose flags differ
  (other options) builds its own in its private dir, which goes with the job.

HEADERS (AOTC_HEADERS_DIR, default AOTC_WORK_DIR/headers) keeps the set across restarts on a volume; one worker
builds it while the others wait (flock).

Building the set is off a fresh worker's critical path (AOTC_HEADERS_WARMUP=background, the default): a worker
whose set is not on disk yet starts the warm-up in a thread and takes jobs at once. Until the set is adopted, its
compiles run without precompiled headers (compiler.compat.caches.without_precompiled_headers): they build none and
read none, so no compile, of the warm-up's time or after, ever includes a header that a job's compile made. The
set is swapped in whole (rename) and a compile binds the files that were adopted when it started. A failed warm-up
only costs speed: compiles go on without precompiled headers. AOTC_HEADERS_WARMUP=before waits for the set
before the first job, as workers did before.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.isolation import USER

log = logging.getLogger("aotc.worker")

NAME = re.compile(r"[a-z0-9]{20,64}\.h(\.gch)?")  # Inductor's code hash, then .h or .h.gch
STAMP = "stamp.json"


def header_dir(tmpdir: Path) -> Path:
    """Where Inductor in a child whose TMPDIR is `tmpdir` looks for precompiled headers (USER is fixed)."""
    return tmpdir / f"torchinductor_{USER}" / "precompiled_headers"


def _compiler_version() -> str:
    cxx = os.environ.get("CXX") or "g++"
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.splitlines()[0] if out else ""


class Headers:
    """The trusted header set for this worker's toolchain and target."""

    def __init__(self, root: Path, info: dict[str, Any]) -> None:
        self.root = root
        self.factors = {"torch": info["toolchain"].get("torch"), "target": info["target"],
                        "python": sys.version.split()[0], "compiler": _compiler_version()}
        self.dir = root / hashlib.sha256(json.dumps(self.factors, sort_keys=True).encode()).hexdigest()[:16]
        self.files: list[Path] = []

    def binds(self, tmpdir: Path) -> list[tuple[Path, Path]]:
        """(trusted file, where a child with TMPDIR=tmpdir finds it) for each file of the set."""
        return [(f, header_dir(tmpdir) / f.name) for f in self.files]

    def link_into(self, tmpdir: Path) -> None:
        """Without a sandbox there is nothing to bind: symlink the files instead."""
        for src, dest in self.binds(tmpdir):
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.symlink_to(src)

    @property
    def ready(self) -> bool:
        """A trusted set is adopted: compiles bind it (files is only ever replaced by a whole new set)."""
        return bool(self.files)

    def found(self) -> bool:
        """The set is on disk already (an earlier start, another worker): adopt it without the lock. A set being
        swapped in meanwhile reads as absent, and ensure() then takes the lock and reads it again."""
        return self._load()

    def _load(self) -> bool:
        try:
            stamp = json.loads((self.dir / STAMP).read_text())
        except (OSError, ValueError):
            return False
        files = sorted(p for p in self.dir.iterdir() if NAME.fullmatch(p.name) and p.is_file())
        if stamp.get("factors") != self.factors or sorted(stamp.get("files", [])) != [p.name for p in files]:
            return False
        self.files = files
        return True

    def ensure(self, warm_up: Callable[[Callable[[Path], None]], bool]) -> None:
        """Use the set on disk, or build it: `warm_up(adopt)` runs the trusted compile and, if it worked, calls
        `adopt` with the header dir it left (while that still exists); it says whether it worked. Holds a lock
        meanwhile, so workers sharing the dir build it once."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self._load():
                log.info("precompiled headers: %d files in %s", len(self.files), self.dir)
                return
            t0 = time.monotonic()
            if not warm_up(self._adopt):
                log.warning("precompiled headers: the warm-up compile failed; each compile builds its own")
                return
            log.info("precompiled headers: built %d files in %.1f s into %s", len(self.files),
                     time.monotonic() - t0, self.dir)

    def _adopt(self, built: Path) -> None:
        """Move what the warm-up left into a fresh set dir, the worker's and read-only; then swap it in."""
        new = self.root / f".new-{os.getpid()}"
        shutil.rmtree(new, ignore_errors=True)
        new.mkdir(mode=0o755)
        names = []
        for entry in os.scandir(built):
            st = entry.stat(follow_symlinks=False)
            if not NAME.fullmatch(entry.name) or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                continue  # locks, temp files, anything odd
            dest = new / entry.name
            try:
                os.rename(entry.path, dest)
            except OSError:  # another file system (AOTC_HEADERS_DIR elsewhere): copy, never following a link
                with open(os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as src, open(dest, "wb") as out:
                    shutil.copyfileobj(src, out, 2**20)
            os.chown(dest, os.getuid(), os.getgid())
            os.chmod(dest, 0o444)
            names.append(entry.name)
        (new / STAMP).write_text(json.dumps({"factors": self.factors, "files": sorted(names)}))
        old = self.root / f".old-{os.getpid()}"
        if self.dir.exists():
            os.rename(self.dir, old)
        os.rename(new, self.dir)
        shutil.rmtree(old, ignore_errors=True)
        self._load()
