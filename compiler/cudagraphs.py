"""CUDA graphs over an AOTInductor package's run: capture one run per input signature, then replay it.

A package loaded single-threaded (compiler.compat.aoti.load_for_graphs) launches its kernels on the current stream
and allocates through torch's caching allocator, so `torch.cuda.graph` can capture one run. Per signature (each
input's shape and dtype):

- static input buffers are allocated on the device; every call copies its inputs into them;
- the package runs twice first (lazy kernel loads, cuBLAS handles and workspaces), on the current stream: once a
  process has run one kernel on a second stream, every CUDA graph it replays is slower on an H200, its own and
  `torch.compile`'s alike (BERT-base at batch 1: 589 against 547 us a call after a single small kernel on a
  stream of its own; the warm-up on a side stream was aotc's 9 % behind `reduce-overhead`; bench/README.md);
- one run is captured into a private memory pool; the tensors it returns are the static outputs;
- a call copies in, replays, and returns clones of the static outputs (or the static outputs themselves with
  `clone_outputs=False`: views that the next replay of the same signature overwrites).

Whatever fails in capture leaves that signature on the plain run, with the reason; so does a signature that
`allow` refuses (a dynamic spec without buckets, say) and any signature past `max_graphs`. The memory each graph
holds (its pool, and the static inputs) is measured with torch.cuda's allocator statistics around the capture.

This module uses torch's public APIs, and compiler.compat's for the rest: the loader (compiler.compat.aoti) and
the copies of a replay (`copy_all`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from compiler.compat import copy_all

log = logging.getLogger("aotc.cudagraphs")

Signature = tuple[tuple[tuple[int, ...], str], ...]
RunFlat = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def signature(flat: Sequence[torch.Tensor]) -> Signature:
    return tuple((tuple(int(d) for d in t.shape), str(t.dtype).removeprefix("torch.")) for t in flat)


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    memory: dict[str, int]
    capture_s: float
    replays: int = 0


@dataclass
class Plain:
    reason: str
    calls: int = 0


@dataclass
class GraphRunner:
    """Runs `run_flat` (flat input tensors -> flat output tensors) through a CUDA graph per input signature.

    `allow(sig)` returns None to allow capturing that signature, or the reason to run it plainly. `last` says how
    the latest call ran: "graph" or "plain"."""

    run_flat: RunFlat
    device: torch.device
    allow: Callable[[Signature], str | None] | None = None
    clone_outputs: bool = True
    max_graphs: int = 16
    warmup_runs: int = 2
    entries: dict[Signature, Captured | Plain] = field(default_factory=dict)
    last: str | None = None

    def __call__(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        sig = signature(flat)
        entry = self.entries.get(sig)
        if entry is None:
            entry = self.entries[sig] = self._capture(sig, flat)
        if isinstance(entry, Plain):
            entry.calls += 1
            self.last = "plain"
            return self.run_flat(list(flat))
        pairs = [(dst, src) for dst, src in zip(entry.inputs, flat, strict=True) if dst is not src]
        copy_all([d for d, _ in pairs], [s for _, s in pairs])  # one launch for all of them, not one each
        entry.graph.replay()
        entry.replays += 1
        self.last = "graph"
        if not self.clone_outputs:
            return list(entry.outputs)
        if len(entry.outputs) == 1:
            return [entry.outputs[0].clone()]
        clones = [torch.empty_like(o) for o in entry.outputs]  # clone()'s layout: a dense one kept, else contiguous
        copy_all(clones, entry.outputs)
        return clones

    def _capture(self, sig: Signature, flat: Sequence[torch.Tensor]) -> Captured | Plain:
        why = self.allow(sig) if self.allow is not None else None
        if why is None and sum(isinstance(e, Captured) for e in self.entries.values()) >= self.max_graphs:
            why = f"{self.max_graphs} graphs captured already (max_graphs)"
        if why is None:
            try:
                return self._capture_now(flat)
            except Exception as e:  # noqa: BLE001 - any capture failure means: run this shape plainly
                why = f"capture failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e) else ''}"
                _recover(self.device)
        log.warning("CUDA graph not used for inputs %s: %s; running the package plainly", _fmt(sig), why)
        return Plain(why)

    def _capture_now(self, flat: Sequence[torch.Tensor]) -> Captured:
        import time

        dev = self.device
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        alloc0 = torch.cuda.memory_allocated(dev)
        inputs = [torch.empty_like(t, device=dev) for t in flat]
        for dst, src in zip(inputs, flat, strict=True):
            dst.copy_(src)
        for _ in range(self.warmup_runs):
            out = self.run_flat(list(inputs))
        del out
        torch.cuda.synchronize(dev)
        # torch.cuda.graph empties the allocator's cache as it starts; empty it first, so that the difference in
        # reserved memory across the capture is the graph's own pool, not the cache it released.
        torch.cuda.empty_cache()
        alloc1, reserved1 = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a server's) do not break this capture, and vice versa.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outputs = self.run_flat(list(inputs))
        torch.cuda.synchronize(dev)
        alloc2, reserved2 = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
        memory = {
            "static_inputs_bytes": alloc1 - alloc0,
            "static_outputs_bytes": alloc2 - alloc1,  # live in the pool after capture
            "pool_reserved_bytes": reserved2 - reserved1,  # the graph's private pool: outputs and intermediates
        }
        memory["total_bytes"] = memory["static_inputs_bytes"] + memory["pool_reserved_bytes"]
        return Captured(graph, inputs, list(outputs), memory, round(time.perf_counter() - t0, 4))

    def stats(self) -> list[dict[str, Any]]:
        """Per signature: whether it runs as a graph, why not, its memory and how often it ran."""
        return [self.stat(sig) for sig in self.entries]

    def stat(self, sig: Signature) -> dict[str, Any]:
        e = self.entries[sig]
        row: dict[str, Any] = {"shapes": [list(s) for s, _ in sig], "dtypes": [d for _, d in sig]}
        if isinstance(e, Captured):
            row.update(graph=True, memory=dict(e.memory), capture_s=e.capture_s, replays=e.replays)
        else:
            row.update(graph=False, reason=e.reason, calls=e.calls)
        return row

    def release(self) -> None:
        """Drop every graph and its buffers (their pools go back to the allocator's cache)."""
        self.entries.clear()


def _recover(dev: torch.device) -> None:
    """After a failed capture: wait for what was queued and surface nothing more (a capture error is not sticky)."""
    try:
        torch.cuda.synchronize(dev)
    except Exception as e:  # noqa: BLE001 - reported by the caller's reason already
        log.debug("synchronize after a failed capture: %s", e)


def _fmt(sig: Signature) -> str:
    return ", ".join("x".join(map(str, s)) + f" {d}" for s, d in sig)
