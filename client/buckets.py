"""Shape buckets at run time: a bundle of artifacts (one per static bucket, plus the one for the main, usually
dynamic, spec) and the callable that picks among them.

The rule, per call: a bucket whose shapes equal the inputs' runs as is; else the smallest bucket that fits after
zero-padding dim 0 (the batch) of every input runs, and the outputs are cut back to the real batch; else the main
artifact runs if its spec covers the inputs. Padding assumes what batching always assumes: rows of the batch do not
affect one another (no batch statistics, no reductions over dim 0). Pass `pad=False` to only use exact buckets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from compiler.shapes import covers


@dataclass(frozen=True)
class Bundle:
    """What `Client.compile(..., buckets=[...])` returns: the main artifact and one per bucket, in request order."""

    main: Any  # Artifact
    buckets: list[Any] = field(default_factory=list)  # Artifact per bucket

    @property
    def keys(self) -> list[str]:
        return [self.main.key, *(b.key for b in self.buckets)]


Shapes = list[list[int]]


def _static(spec: list[dict[str, Any]]) -> Shapes | None:
    shapes = [[d for d in inp["shape"]] for inp in spec]
    return shapes if all(isinstance(d, int) for s in shapes for d in s) else None


def choose(buckets: Sequence[Shapes], shapes: Shapes, pad: bool = True) -> tuple[int, bool] | None:
    """(index of the bucket to run, whether the batch must be padded), or None when no bucket fits."""
    for i, b in enumerate(buckets):
        if b == shapes:
            return i, False
    if not pad or not shapes or any(len(s) == 0 for s in shapes):
        return None
    batch = {s[0] for s in shapes}
    if len(batch) != 1:  # inputs disagree on dim 0: there is no one batch to pad
        return None
    n = batch.pop()
    fits = []
    for i, b in enumerate(buckets):
        if len(b) != len(shapes) or any(len(bs) != len(s) for bs, s in zip(b, shapes, strict=True)):
            continue
        if {bs[0] for bs in b} != {b[0][0]} or b[0][0] < n:
            continue
        if all(bs[1:] == s[1:] for bs, s in zip(b, shapes, strict=True)):
            fits.append((b[0][0], i))
    return (min(fits)[1], True) if fits else None


class BucketedModel:
    """A callable over a bundle's loaded artifacts. `last` says what the latest call ran: ("bucket", key, padded)
    or ("main", key, False)."""

    def __init__(self, main: tuple[Any, Callable[..., Any]] | None, buckets: list[tuple[Any, Callable[..., Any]]],
                 *, pad: bool = True) -> None:
        self.main = main
        self.buckets = [(art, fn) for art, fn in buckets if _static(art.meta["spec"]) is not None]
        self.bucket_shapes = [_static(art.meta["spec"]) for art, _ in self.buckets]
        self.names = [i["name"] for i in (main or buckets[0])[0].meta["spec"]]
        self.pad = pad
        self.last: tuple[str, str, bool] | None = None

    def _flat(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        if kwargs:
            args = tuple(args) + tuple(kwargs[n] for n in self.names[len(args):])
        return list(args)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        from compiler.compat import pytree

        flat = self._flat(args, kwargs)
        shapes = [[int(d) for d in t.shape] for t in flat]
        pick = choose(self.bucket_shapes, shapes, self.pad)  # type: ignore[arg-type]
        if pick is not None:
            i, padded = pick
            art, fn = self.buckets[i]
            self.last = ("bucket", art.key, padded)
            if not padded:
                return fn(*flat)
            n, target = shapes[0][0], self.bucket_shapes[i][0][0]  # type: ignore[index]
            grown = [torch.cat([t, t.new_zeros((target - n, *t.shape[1:]))]) for t in flat]
            out = fn(*grown)
            return pytree.tree_map(lambda o: o[:n] if isinstance(o, torch.Tensor) and o.dim() and o.shape[0] == target
                                   else o, out)
        if self.main is not None and covers(self.main[0].meta["spec"], shapes):
            self.last = ("main", self.main[0].key, False)
            return self.main[1](*flat)
        have = [b for b in self.bucket_shapes] + ([self.main[0].meta["spec"]] if self.main else [])
        raise ValueError(f"no artifact in the bundle takes inputs of shapes {shapes}; the bundle has {have}")
