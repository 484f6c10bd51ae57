"""What `aotc-server` keeps under AOTC_DATA_DIR is its own: the embedded Redis's append-only file (every record,
key hash and manifest), its password, uploads in progress, a file blob store, signing keys, locks.

`aotc-server` sets the umask of its whole process tree (the API processes, redis-server, its workers and their
children) to UMASK, so whatever they create is 0600 (files) or 0700 (dirs), and at start `tighten` takes group and
other bits off what an older version left there. The one exception is inside the workers' work dirs
(`work`, `work-N`): the sandboxed compile and check children run as another uid (AOTC_SANDBOX_UID) and read the
job dirs the worker prepares, so the worker sets those modes itself (worker/sandbox.py); the work dir above them is
0700 like the rest, so no other user reaches them (the sandbox binds a job dir past it: worker/isolation.py).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

UMASK = 0o077
_WORK_DIR = re.compile(r"work(-[0-9]+)?")


def tighten(data_dir: Path) -> int:
    """Make `data_dir` 0700 and everything under it private to its owner (group and other bits off), but for what
    is inside the workers' work dirs. Symlinks are left alone (never followed). Returns how many modes changed."""
    changed = 0
    if not data_dir.is_dir():
        return 0
    for dirpath, dirnames, filenames in os.walk(data_dir):
        here = Path(dirpath)
        changed += _private(here)
        if here == data_dir:
            work = [d for d in dirnames if _WORK_DIR.fullmatch(d)]
            changed += sum(_private(here / d) for d in work)  # the work dir itself, not what the worker keeps in it
            dirnames[:] = [d for d in dirnames if d not in work]
        changed += sum(_private(here / name) for name in filenames)
    return changed


def _private(path: Path) -> int:
    """Take group and other bits off `path` (not through a symlink); 1 if its mode changed."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    if stat.S_ISLNK(st.st_mode) or not st.st_mode & 0o077:
        return 0
    os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o077)
    return 1
