"""A small disk of its own for full-disk tests: a tmpfs of a fixed size mounted on a test's dir (root can mount one
here and in CI), filled with a filler file to leave exactly the room a test wants. Where no tmpfs can be mounted
(not root, no CAP_SYS_ADMIN), the test is skipped with the reason."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

MB = 2**20


class SmallDisk:
    def __init__(self, path: Path, size_mb: int) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        if shutil.which("mount") is None:
            pytest.skip("no mount(8) here: cannot make a small disk for a full-disk test")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a {size_mb} MB tmpfs for a full-disk test (needs root): "
                        f"{done.stderr.strip() or done.returncode}")
        self.filler = path / "filler"
        self.mounted = True

    def free(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def leave(self, free_bytes: int) -> None:
        """Grow or shrink the filler so that about `free_bytes` stay free (to the page)."""
        have = self.filler.stat().st_size if self.filler.exists() else 0
        target = max(0, have + self.free() - free_bytes)
        with open(self.filler, "ab") as f:
            f.truncate(min(target, have))  # shrinking first: fallocate only grows
            if target > have:
                try:
                    os.posix_fallocate(f.fileno(), 0, target)
                except OSError:  # asked for more than there is: take all of it
                    os.posix_fallocate(f.fileno(), 0, have + self.free())

    def fill(self) -> None:
        """Leave nothing free at all."""
        self.leave(0)

    def empty(self) -> None:
        """Give the filler's room back."""
        if self.filler.exists():
            self.filler.unlink()

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
            self.mounted = False


def leftovers(root: Path) -> list[str]:
    """Every file under `root` but the filler: what a refused upload must not leave behind."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != "filler")
