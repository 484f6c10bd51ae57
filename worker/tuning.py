"""Share max-autotune's matmul/conv timings between workers through the service's Redis.

With mode=max-autotune Inductor benchmarks every candidate kernel of every matmul and convolution, most of
such a compile's time, and keeps the timings in a local file only (compiler.compat.caches explains the layout).
A worker with a fresh disk, or a second worker, would time them all again. Around each such compile the worker,
never the sandboxed child (which has no route to Redis):

- seed: merges the timings other workers published for this target and system into the child's own timings file,
  in its fresh cache dir, so Inductor's lookup finds them and benchmarks only what nobody has measured yet;
- collect: reads the file the child left (worker.sandbox.read_untrusted: no link followed, size-capped) and
  publishes the timings the compile added (HSETNX: the first measurement of a choice stands), but only entries of
  the shape Inductor writes: an op name, the inputs' (device, dtype, sizes, strides, offset) tuples, a matmul
  precision, a choice name of the expected length, a finite positive time, at most MAX_PUBLISH of them. Anything
  else the compile wrote is refused and counted; a file that does not parse publishes nothing.

The share is per namespace: a compile seeds from, and publishes to, the table of the namespace whose request
created its job (`Jobs.namespace_of`), never another's. What the checks leave: a compile whose child runs code of
the upload's making (what the sandbox is for) can write well-formed timings with made-up values, for any shapes,
not only its own; a later compile of those shapes may then pick a slower, still correct, kernel. The namespace
bounds that to the uploader's own compiles: before it, one tenant could slow every other tenant's max-autotune
builds of, say, BERT's matmuls, for good (HSETNX keeps the first value). It cannot make another compile run
anything: a choice is a name that Inductor looks up among the candidates it generated itself. A job that another
namespace joins is built once, with its creator's table; the artifact is as shared as it always was.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import redis

from service.store import keys
from worker.sandbox import read_untrusted

log = logging.getLogger("aotc.worker.tuning")

Entry = tuple[str, str, str, str]
MAX_ENTRIES = 200_000  # a shared hash this large is not pulled (it would cost more than it saves)
MAX_PUBLISH = 10_000  # a compile that claims more new timings than this publishes none
MAX_FILE_BYTES = 64 * 2**20
MAX_MS = 1e7

_OP = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_TUPLE = r"\('[a-z]{2,8}(?::\d{1,3})?', 'torch\.[a-z0-9_]{2,32}'(?:, -?\d{1,15}){0,24}\)"
_INPUTS = re.compile(rf"\[{_TUPLE}(?:, {_TUPLE}){{0,15}}\]")
_PRECISION = re.compile(r"[a-z0-9_]{1,16}")
_CHOICE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=+\-]{0,255}")


def valid(entry: tuple[Any, ...], ms: Any) -> bool:
    """An (op, inputs, precision, choice) -> ms timing of the shape Inductor writes."""
    if len(entry) != 4 or not all(isinstance(p, str) for p in entry):
        return False
    op, inputs, precision, choice = entry
    return (isinstance(ms, float) and math.isfinite(ms) and 0 < ms < MAX_MS and bool(_OP.fullmatch(op))
            and len(inputs) <= 4096 and bool(_INPUTS.fullmatch(inputs)) and bool(_PRECISION.fullmatch(precision))
            and bool(_CHOICE.fullmatch(choice)))


def _decode(field: bytes | str, value: bytes | str) -> tuple[Entry, float] | None:
    try:
        parts = json.loads(field)
        ms = float(value)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(parts, list) or not valid(tuple(parts), ms):
        return None
    return (parts[0], parts[1], parts[2], parts[3]), ms


class GemmTimingShare:
    """One max-autotune compile's share: seed() before it, collect() after; `stats` for the artifact record."""

    def __init__(self, r: redis.Redis, namespace: str, target: str) -> None:
        self.r = r
        self.namespace = namespace
        self.target = target
        self.stats: dict[str, Any] = {"shared": 0, "measured": 0, "published": 0, "refused": 0}
        self._seeded: set[Entry] = set()
        self._rel: str | None = None  # the timings file, relative to the child's dir
        self.key: str | None = None

    def seed(self, childdir: Path) -> None:
        """Write what others measured into the child's timings file (the child's dir is fresh and not yet its).
        Never fails a compile: Redis trouble is noted."""
        from compiler.compat import caches

        cache_dir = childdir / "cache"
        where = caches.gemm_timings_location(str(cache_dir))
        if where is None:
            self.stats["note"] = "this torch keeps max-autotune timings differently: not shared"
            return
        path, system = where
        self._rel = str(Path(path).relative_to(childdir))
        self.key = keys.gemm_tuning(self.namespace, self.target, system)
        remote: dict[Entry, float] = {}
        try:
            size = int(self.r.hlen(self.key))
            if size <= MAX_ENTRIES:
                for f, v in self.r.hgetall(self.key).items():
                    if (d := _decode(f, v)) is not None:
                        remote[d[0]] = d[1]
            else:
                self.stats["note"] = f"{size} shared timings exceed {MAX_ENTRIES}: not pulled"
        except redis.RedisError as e:
            self.stats["note"] = f"pull failed: {type(e).__name__}: {e}"
        if remote:
            self.stats["shared"] = caches.merge_gemm_timings(path, remote)
        self._seeded = set(remote)

    def files(self) -> list[str]:
        """The timings file, relative to the child's dir, once seeded: what the worker keeps of the child's dir."""
        return [self._rel] if self._rel is not None else []

    def collect(self, childdir: Path) -> None:
        """Publish the well-formed timings the compile added to its file; count the rest as refused."""
        from compiler.compat import caches

        if self._rel is None or self.key is None:
            return
        data = read_untrusted(childdir, self._rel, MAX_FILE_BYTES + 1)
        if data is None:
            return
        if len(data) > MAX_FILE_BYTES:
            self.stats["note"] = f"the compile's timings file is over {MAX_FILE_BYTES} bytes: nothing published"
            return
        found = caches.parse_gemm_timings(data, numbers_only=False)
        new = {e: ms for e, ms in found.items() if e not in self._seeded}
        good = {e: ms for e, ms in new.items() if valid(e, ms)}
        self.stats["measured"] = len(good)
        self.stats["refused"] = len(new) - len(good)
        if self.stats["refused"]:
            log.warning("max-autotune timings: refused %d entries of an unexpected shape", self.stats["refused"])
        if not good:
            return
        if len(good) > MAX_PUBLISH:
            self.stats["note"] = f"{len(good)} new timings exceed {MAX_PUBLISH}: none published"
            return
        try:
            pipe = self.r.pipeline(transaction=False)
            for e, ms in good.items():
                pipe.hsetnx(self.key, json.dumps(list(e)), repr(ms))
            self.stats["published"] = sum(1 for added in pipe.execute() if added)
        except redis.RedisError as e:
            self.stats["note"] = f"push failed: {type(e).__name__}: {e}"
