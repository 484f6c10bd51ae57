"""CUDA graphs for a pulled artifact: `Client.load(..., cuda_graphs=True)` and `aotc run --cuda-graphs`.

Most served models are limited by kernel launches: the package's C++ wrapper still launches every kernel from the
CPU. Replaying a CUDA graph of one run launches them all at once. The rule, per call:

- a static artifact (and each bucket of a Bundle) is captured once for its shapes, then replayed: the inputs are
  copied into static buffers and the outputs come back as clones (`clone_outputs=False` returns the static output
  tensors instead, which the next call of that shape overwrites);
- a dynamic artifact without buckets runs plainly: a graph is one shape, and capturing every shape a dynamic range
  allows would hold memory per shape without bound (compile buckets for the shapes you serve);
- on a CPU, where torch lacks the loader's single-threaded mode, or when a capture fails, the package runs plainly.

Every fallback is logged once (logger `aotc.client.graphs`, and `aotc.cudagraphs` per shape) and kept in
`reason` / `stats()`. torch 2.11-2.13 have no CUDA-graph support of their own for AOTInductor packages
(compiler.compat.aoti.native_graph_support), so `impl` is "aotc": this module's capture of the single-threaded run.
This module imports torch: only the load path (client/sdk.py `load`) imports it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from compiler.compat.aoti import aoti_load_package, load_for_graphs, native_graph_support
from compiler.cudagraphs import GraphRunner, Signature
from compiler.shapes import is_dynamic

log = logging.getLogger("aotc.client.graphs")


class GraphedArtifact:
    """A loaded artifact, callable like the model, that replays a CUDA graph per captured shape.

    `last` is how the latest call ran ("graph" or "plain"), `reason` why the whole artifact runs plainly (None when
    graphs are in use), `impl` which implementation captures, and `stats()` one row per shape seen: captured or not
    (and why), bytes held, replays."""

    def __init__(self, package_path: str, meta: dict[str, Any], device: str, *, clone_outputs: bool = True,
                 max_graphs: int = 16, weights: dict[str, torch.Tensor] | None = None) -> None:
        self.device = device
        self.spec: list[dict[str, Any]] = list(meta.get("spec") or [])
        self.impl = native_graph_support() or "aotc"
        self.last: str | None = None
        self._runner: GraphRunner | None = None
        self._plain: Callable[..., Any] | None = None
        self.reason = self._why_plain()
        if self.reason is None:
            try:
                self._pkg = load_for_graphs(package_path, device, weights, expect=self.spec)
                self._runner = GraphRunner(self._pkg.run_flat, torch.device(device), allow=self._allow,
                                           clone_outputs=clone_outputs, max_graphs=max_graphs)
            except RuntimeError as e:
                self.reason = str(e)
        if self.reason is not None:
            log.warning("artifact %s runs without CUDA graphs: %s", meta.get("key", package_path), self.reason)
            self._plain = aoti_load_package(package_path, device, weights=weights, expect=self.spec)

    def _why_plain(self) -> str | None:
        if not self.device.startswith("cuda"):
            return f"device {self.device}: CUDA graphs need a CUDA device"
        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
        if self.spec and is_dynamic(self.spec):
            return ("the artifact's spec is dynamic and this load has no buckets; compile buckets for the shapes "
                    "served (Client.compile(..., buckets=[...])) to replay graphs")
        return None

    def _allow(self, sig: Signature) -> str | None:
        want = [list(inp["shape"]) for inp in self.spec]
        got = [list(s) for s, _ in sig]
        if want and want != got:
            return f"inputs {got} are not the artifact's static shapes {want}"
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._runner is None:
            assert self._plain is not None
            self.last = "plain"
            return self._plain(*args, **kwargs)
        out = self._runner(self._pkg.flat_inputs(args, kwargs))
        self.last = self._runner.last
        return self._pkg.unflatten(out)

    def stats(self) -> list[dict[str, Any]]:
        return self._runner.stats() if self._runner is not None else []

    def release(self) -> None:
        """Free every captured graph's memory; later calls capture again."""
        if self._runner is not None:
            self._runner.release()


def load_graphed(package_path: str, meta: dict[str, Any], device: str, **options: Any) -> Callable[..., Any]:
    """`Client.load`'s hook: the artifact at `package_path` (whose record is `meta`) loaded for CUDA graphs."""
    return GraphedArtifact(package_path, meta, device, **options)


def run_once_and_time(fn: Callable[..., Any], spec: list[dict[str, Any]], shapes: dict[str, list[Any]] | None,
                      device: str, repeat: int = 20) -> list[str]:
    """`aotc run`: call a loaded artifact on example inputs (floats random, integers and booleans ones, fit for ids
    and masks) at `shapes` (default: the spec's, which must then be static), then `repeat` more times; what ran, the
    output shapes, the first call and the median of the others (wall clock, synchronised), as lines to print."""
    import statistics
    import time

    from compiler.compat import pytree

    args = []
    for inp in spec:
        dims = (shapes or {}).get(inp["name"], inp["shape"])
        if not all(isinstance(d, int) for d in dims):
            raise ValueError(f"input {inp['name']!r} has a dynamic shape {dims}: pass --shape {inp['name']}=...")
        dtype = getattr(torch, str(inp.get("dtype", "float32")))
        args.append(torch.randn(*dims, device=device).to(dtype) if dtype.is_floating_point
                    else torch.ones(*dims, dtype=dtype, device=device))

    def call() -> Any:
        out = fn(*args)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        return out

    with torch.inference_mode():
        t0 = time.perf_counter()
        out = call()
        first_ms = (time.perf_counter() - t0) * 1e3
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
    outs = [f"{'x'.join(map(str, t.shape))} {str(t.dtype).removeprefix('torch.')}"
            for t in pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    how = getattr(fn, "last", None) or "plain"
    why = getattr(fn, "reason", None)
    lines = [f"ran on {device}: {how}" + (f" ({why})" if why else ""),
             f"outputs: {', '.join(outs)}",
             f"first call {first_ms:.2f} ms; median {statistics.median(times):.3f} ms of {repeat} calls"
             if times else f"first call {first_ms:.2f} ms"]
    for row in (fn.stats() if isinstance(fn, GraphedArtifact) else []):
        if row["graph"]:
            m = row["memory"]
            lines.append(f"graph {row['shapes']}: {m['total_bytes'] / 2**20:.1f} MiB (inputs "
                         f"{m['static_inputs_bytes'] / 2**20:.1f}, pool {m['pool_reserved_bytes'] / 2**20:.1f}), "
                         f"captured in {row['capture_s']:.3f} s, {row['replays']} replays")
        else:
            lines.append(f"no graph for {row['shapes']}: {row['reason']}")
    return lines
