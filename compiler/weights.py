"""Weights stored once: a package built without its weights, and the one safetensors blob that feeds it.

A weightless package (compiler.compat.aoti.weightless_configs) carries kernels only; its constants are bound at
load from a weights blob: every tensor the exported graph reads (parameters, buffers, lifted constants), by FQN,
after the precision cast, in safetensors (compiler/weightsfile.py: nothing is unpickled). The blob is a function of
the model's content and the precision alone, so every shape bucket, target and toolchain of one model shares it,
and its sha256 is its id in the blob store.

Beside a package on disk the blob is a sidecar, `NAME.weights.safetensors` for `NAME.pt2`: the compile writes it
there, the check and its probes find it there, and `aoti_load_package` binds it when it is there.

What the check proves (`verify_blob`, `check_bound`, `follows`): the blob holds exactly the program's tensors;
the package reads every one of them from the blob (a constant Inductor inlined as a literal, or folded into a
derived constant, is named); and the package follows the blob: weights perturbed in place change its output as
they change eager's.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import io
import json
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from compiler import digests, fp64, weightsfile
from compiler.errors import CheckFailed
from compiler.specialize import is_literal
from compiler.weightsfile import sidecar

__all__ = ["sidecar", "program_weights", "save", "load", "copy_in", "Follower", "describe", "verify_blob",
           "check_bound", "follows"]

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def program_weights(ep: torch.export.ExportedProgram, precision: str = "keep") -> dict[str, torch.Tensor]:
    """The tensors the program's graph reads, by FQN: parameters, buffers (persistent or not) and lifted tensor
    constants that an output depends on (`live_nodes`: a weight only dead code reads, such as the pooler of an HF
    encoder whose hidden states alone are returned, is dropped by Inductor, so no package reads it), except 0-d ones
    of a literal's dtype (compiler.specialize.inline_literals makes those ops in the compiled program, so no package
    reads them). With a precision cast, floating parameters and buffers cast as compiler.specialize casts them."""
    sig = ep.graph_signature
    used = {n.name for n in live_nodes(ep.graph) if n.op == "placeholder"}
    # compiler.specialize casts with Module.to, which casts parameters and buffers, not lifted constants.
    castable = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    sources = {**castable, **sig.inputs_to_lifted_tensor_constants}
    out: dict[str, torch.Tensor] = {}
    for placeholder, fqn in sources.items():
        if placeholder not in used:
            continue
        t = ep.state_dict[fqn] if fqn in ep.state_dict else ep.constants[fqn]
        if not isinstance(t, torch.Tensor):
            continue
        if placeholder in sig.inputs_to_lifted_tensor_constants and is_literal(t):
            continue
        t = t.detach()
        if precision in PRECISIONS and t.is_floating_point() and placeholder in castable:
            t = t.to(PRECISIONS[precision])
        out[fqn] = t
    return out


def live_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes the graph's outputs, or an op with a side effect (an assert, an in-place copy), depend on: what
    dead-code elimination keeps. Walked backward from those roots, so the graph itself is not changed."""
    roots = [n for n in graph.nodes if n.op == "output" or (n.op == "call_function" and n.is_impure())]
    live: set[torch.fx.Node] = set()
    while roots:
        node = roots.pop()
        if node not in live:
            live.add(node)
            roots.extend(node.all_input_nodes)
    return live


def save(weights: Mapping[str, torch.Tensor], path: str | Path) -> None:
    """Write `weights` as safetensors, widest elements first (then by name), so that each tensor's offset is a
    multiple of its element size and a loader can view the mapped bytes in place."""
    order = sorted(weights, key=lambda k: (-weights[k].element_size(), k))
    tensors: list[tuple[str, str, tuple[int, ...], Any]] = []
    strides: dict[str, list[int]] = {}
    for name in order:
        t = weights[name].detach().cpu()
        strides[name] = list(t.stride())
        flat = t.contiguous().reshape(-1).view(torch.uint8)
        data: Any = flat.numpy()  # a buffer of the tensor's bytes: written without a copy
        tensors.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), data))
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        weightsfile.write(f, tensors, {"format": "pt", weightsfile.STRIDES: json.dumps(strides, sort_keys=True)})
    tmp.rename(path)


def load(path: str | Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The blob's tensors on `device`, checked by weightsfile.read_header first. On a CPU they are views of a
    private mapping of the file (copy-on-write: writing to them never changes the file). On a GPU each is its own
    allocation, filled by `copy_in` (AOTC_WEIGHTS_COPY=tensors: each tensor copied from the mapping, as before)."""
    header = weightsfile.read_header_file(path)
    dev = torch.device(device)
    if dev.type == "cuda" and chunked():
        return copy_in(path, header, dev)
    strides = _strides(header)
    buf = torch.from_file(str(path), shared=False, size=header.size, dtype=torch.uint8)
    out: dict[str, torch.Tensor] = {}
    for name, e in header.entries.items():
        dtype = getattr(torch, e.dtype)
        piece = buf[header.data_start + e.start: header.data_start + e.end]
        try:
            t = piece.view(dtype).reshape(e.shape)
        except RuntimeError:  # an offset not aligned to the element size (another writer's order): copy it
            t = piece.clone().view(dtype).reshape(e.shape)
        stride = weightsfile.dense_stride(e, strides.get(name))
        if stride is not None and stride != t.stride():
            t = torch.empty_strided(e.shape, stride, dtype=dtype).copy_(t)
        out[name] = t.to(device) if device != "cpu" else t
    return out


def _strides(header: weightsfile.Header) -> dict[str, Any]:
    try:
        strides = json.loads(header.metadata.get(weightsfile.STRIDES, "{}"))
    except ValueError:
        strides = {}
    return strides if isinstance(strides, dict) else {}


# -- onto a GPU in pinned chunks -------------------------------------------------------------------------------------

COPY_SETTING = "AOTC_WEIGHTS_COPY"  # "tensors": each tensor from the mapping by its own pageable copy (the old way)
COPY_CHUNK = 16 << 20  # bytes of the file one lane reads and copies at a time
COPY_LANES = 4  # lanes at once: each a thread, a pinned buffer and a CUDA stream


def chunked() -> bool:
    """Whether a blob goes onto a GPU in pinned chunks (and, downloading, as it arrives): unless COPY_SETTING says
    `tensors`."""
    return os.environ.get(COPY_SETTING, "").strip().lower() != "tensors"


def plan(header: weightsfile.Header, chunk: int) -> list[tuple[int, int, list[tuple[str, int, int, int]]]]:
    """The data region cut into chunks of `chunk` bytes: for each, (its offset in the file, its length, and the
    pieces it holds: (tensor, offset in the tensor's bytes, offset in the chunk, bytes)). Every byte of every
    tensor is in exactly one piece; a tensor may span chunks and a chunk may hold many tensors."""
    entries = sorted((e for e in header.entries.values() if e.end > e.start), key=lambda e: e.start)
    data = header.size - header.data_start
    out: list[tuple[int, int, list[tuple[str, int, int, int]]]] = []
    i = 0
    for a in range(0, data, chunk):
        b = min(data, a + chunk)
        pieces = []
        while i < len(entries) and entries[i].start < b:
            e = entries[i]
            lo, hi = max(a, e.start), min(b, e.end)
            pieces.append((e.name, lo - e.start, lo - a, hi - lo))
            if e.end > b:
                break  # the rest of it is in the next chunk
            i += 1
        out.append((header.data_start + a, b - a, pieces))
    return out


def copy_in(path: str | Path, header: weightsfile.Header, device: torch.device, *, lanes: int = COPY_LANES,
            chunk: int = COPY_CHUNK) -> dict[str, torch.Tensor]:
    """The blob's tensors on `device`, each its own allocation (AOTInductor binds them by pointer, aligned as the
    allocator leaves them), filled from the file in chunks: `lanes` threads each read (pread: no page faults on a
    mapping) a chunk into its own buffer, pinned on a GPU, and copy its pieces to the tensors on its own stream, so
    reading, copying and the next read overlap: 1.40x one pageable copy per tensor for 822 MB on an H200 host
    (bench/README.md, "Weights onto the GPU in pinned chunks"). Works on a CPU too (plain buffers), as the tests
    run it."""
    out, flat = _allocate(header, device)
    chunks = plan(header, chunk)
    lanes, size = _lanes(chunks, lanes, chunk)
    failed: list[BaseException] = []

    def lane(j: int, fd: int) -> None:
        try:
            stage = _Stage(size, device)
            for at, n, pieces in chunks[j::lanes]:
                if failed:
                    return
                stage.free()
                stage.read(fd, at, n, path)
                stage.send(pieces, flat)
            stage.drain()
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            failed.append(e)

    with open(path, "rb") as f:
        threads = [threading.Thread(target=lane, args=(j, f.fileno()), name=f"aotc-weights-{j}", daemon=True)
                   for j in range(lanes if chunks else 0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if failed:
        raise failed[0]
    return _restride(header, out, device)


def _lanes(chunks: list[tuple[int, int, list[tuple[str, int, int, int]]]], lanes: int, chunk: int) -> tuple[int, int]:
    """How many lanes `chunks` (`plan`'s) can use, at least one, and the buffer each needs: a chunk, or less where
    the whole blob is smaller."""
    return max(1, min(lanes, len(chunks))), min(chunk, max((n for _, n, _ in chunks), default=0))


def _allocate(header: weightsfile.Header, device: torch.device
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Each tensor of `header`, empty and contiguous on `device`, and the non-empty ones' bytes as flat uint8 views."""
    out = {name: torch.empty(e.shape, dtype=getattr(torch, e.dtype), device=device)
           for name, e in header.entries.items()}
    return out, {name: t.reshape(-1).view(torch.uint8) for name, t in out.items() if t.numel()}


def _restride(header: weightsfile.Header, out: dict[str, torch.Tensor], device: torch.device
              ) -> dict[str, torch.Tensor]:
    """The tensors the metadata gives another dense stride, laid out with it (what the package expects)."""
    strides = _strides(header)
    for name, e in header.entries.items():
        stride = weightsfile.dense_stride(e, strides.get(name))
        if stride is not None and stride != out[name].stride():
            out[name] = torch.empty_strided(e.shape, stride, dtype=out[name].dtype, device=device).copy_(out[name])
    return out


class _Stage:
    """One lane: a buffer (pinned on a GPU) the file is read into, the stream its copies go on, and the event that
    marks when they have left it."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda)
        # The buffer's bytes as a writable memoryview for preadv, without numpy (a client may lack it).
        self.view = memoryview((ctypes.c_char * size).from_address(self.buf.data_ptr())).cast("B")
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.done = torch.cuda.Event() if self.cuda else None

    def free(self) -> None:
        """Wait until the last copies out of the buffer are done."""
        if self.done is not None:
            self.done.synchronize()

    def read(self, fd: int, at: int, n: int, path: str | Path) -> memoryview:
        got = 0
        while got < n:
            k = os.preadv(fd, [self.view[got:n]], at + got)
            if not k:
                raise OSError(f"{path}: the file ended at {at + got} bytes, short of its header's size")
            got += k
        return self.view[:n]

    def send(self, pieces: list[tuple[str, int, int, int]], flat: dict[str, torch.Tensor]) -> None:
        """Copy the buffer's pieces to their tensors (on this lane's stream, without waiting on a GPU)."""
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            for name, dst, src, m in pieces:
                flat[name][dst:dst + m].copy_(self.buf[src:src + m], non_blocking=self.cuda)
        if self.done is not None:
            self.done.record(self.stream)

    def drain(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


# -- onto a GPU while the blob is still arriving ---------------------------------------------------------------------


class _GaveUp(Exception):
    pass


class Follower:
    """Puts a weights blob on `device` while a pull is still writing it to `part`, so that the copy ends about when
    the pull does, instead of starting after it (the blob's pull and its copy were 0.41 and 0.30 s of an 822 MB
    model's cold TTFI on an H200 host: bench/README.md).

    It reads the arriving file in order, hashes exactly the bytes it copies (by `algorithm`), and `result()`
    returns the tensors only where that digest is the signed `digest` of the signed `size` bytes; otherwise None,
    with `reason`, and the caller loads the verified file as `load` does (a pull that started the file over, one
    that failed, bytes changed under it). Nothing is allocated before the header, read from the arriving bytes,
    lists exactly the signed `constants` (compiler.weightsfile.describe): an unverified header cannot make it
    allocate more than the signature allows. Call `pulled()` once the pull has ended, whatever its outcome: it then
    reads what the file holds and waits no more."""

    POLL_S = 0.002  # how often it looks for more bytes while the pull writes them

    def __init__(self, part: str | Path, device: str | torch.device, *, size: int, algorithm: str, digest: str,
                 constants: Any, lanes: int = COPY_LANES, chunk: int = COPY_CHUNK) -> None:
        self.part, self.device, self.size = Path(part), torch.device(device), size
        self.algorithm, self.digest, self.constants = algorithm, digest, constants
        self.lanes, self.chunk = lanes, chunk
        self.reason: str | None = None
        self.copied = 0  # bytes read and on their way to the device so far (hashed: up to `lanes` chunks fewer)
        # Where its time went: until its buffers were ready (the header, the tensors and pinned buffers allocated: a
        # process's first CUDA call among them), waiting for bytes, reading them (and queuing their copies), and
        # waiting for a buffer to be free again (its hash done, its copies gone).
        self.seconds = {"setup_s": 0.0, "waiting_s": 0.0, "reading_s": 0.0, "buffers_s": 0.0}
        self._pulled = threading.Event()
        self._seen = 0
        self._out: dict[str, torch.Tensor] | None = None
        self._thread = threading.Thread(target=self._run, name="aotc-weights-follow", daemon=True)
        self._thread.start()

    def pulled(self) -> None:
        self._pulled.set()

    def result(self) -> dict[str, torch.Tensor] | None:
        """The tensors (once the pull has ended: `pulled`), or None (`reason` says why)."""
        self._pulled.set()
        self._thread.join()
        return self._out

    def _run(self) -> None:
        try:
            fd = self._open()
        except _GaveUp as e:
            self.reason = str(e)
            return
        try:
            self._out = self._follow(fd, digests.new(self.algorithm, threads=True))
        except _GaveUp as e:
            self.reason = str(e)
        except Exception as e:  # noqa: BLE001 - the verified file is loaded instead; the reason is kept
            self.reason = f"{type(e).__name__}: {e}"
        finally:
            os.close(fd)

    def _follow(self, fd: int, hasher: Any) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        head = self._pread(fd, 0, 8)
        n = int.from_bytes(head, "little")
        if n > weightsfile.header_cap() or 8 + n > self.size:
            raise _GaveUp(f"its header claims {n} bytes")
        raw = head + self._pread(fd, 8, n)
        header = weightsfile.read_header(io.BytesIO(raw), self.size)
        if weightsfile.describe(header) != self.constants:
            raise _GaveUp("its header does not list the signed constants")
        hasher.update(raw)
        self.copied = len(raw)
        out, flat = _allocate(header, self.device)
        chunks = plan(header, self.chunk)
        lanes, size = _lanes(chunks, self.lanes, self.chunk)
        stages = [_Stage(size, self.device) for _ in range(lanes)]
        # The hash trails the reads by up to `lanes` chunks on a thread of its own (in order: one worker), so that
        # reading the next chunk overlaps hashing this one; a buffer is read into again only once it is hashed and
        # its copies have left it.
        hashed: list[concurrent.futures.Future[Any] | None] = [None] * lanes
        seconds = self.seconds
        seconds["setup_s"] = (t1 := time.perf_counter()) - t0
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aotc-weights-hash") as hashing:
            for k, (at, m, pieces) in enumerate(chunks):
                stage, pending = stages[k % lanes], hashed[k % lanes]
                if pending is not None:
                    pending.result()
                stage.free()
                seconds["buffers_s"] += (t2 := time.perf_counter()) - t1
                self._wait(fd, at + m)
                seconds["waiting_s"] += (t3 := time.perf_counter()) - t2
                hashed[k % lanes] = hashing.submit(hasher.update, stage.read(fd, at, m, self.part))
                stage.send(pieces, flat)
                self.copied = at + m
                seconds["reading_s"] += (t1 := time.perf_counter()) - t3
            for pending in hashed:
                if pending is not None:
                    pending.result()
            seconds["buffers_s"] += time.perf_counter() - t1
        for stage in stages:
            stage.drain()
        if hasher.hexdigest() != self.digest:
            raise _GaveUp(f"the bytes it copied are not the signed blob ({self.algorithm})")
        return _restride(header, out, self.device)

    def _open(self) -> int:
        while True:
            try:
                return os.open(self.part, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                if self._pulled.is_set():
                    raise _GaveUp("no pull wrote the blob here") from None
                self._pulled.wait(self.POLL_S)

    def _wait(self, fd: int, end: int) -> None:
        """Until the file holds `end` bytes. _GaveUp where it shrank (the pull started it over) or the pull ended
        without writing them."""
        while True:
            have = os.fstat(fd).st_size
            if have < self._seen:
                raise _GaveUp("the pull started the file over")
            self._seen = have
            if have >= end:
                return
            if self._pulled.is_set():
                if os.fstat(fd).st_size >= end:  # its last bytes, written just before it said so
                    continue
                raise _GaveUp(f"the pull ended with {have} of the blob's {self.size} bytes")
            self._pulled.wait(self.POLL_S)

    def _pread(self, fd: int, at: int, n: int) -> bytes:
        self._wait(fd, at + n)
        data = b""
        while len(data) < n:
            piece = os.pread(fd, n - len(data), at + len(data))
            if not piece:
                raise _GaveUp(f"the file ended at {at + len(data)} bytes")
            data += piece
        return data


def describe(path: str | Path) -> list[dict[str, Any]]:
    """The manifest's list of constants (fqn, shape, dtype, stride), from the blob's header alone."""
    return weightsfile.describe(weightsfile.read_header_file(path))


# -- the check ---------------------------------------------------------------------------------------------------


def verify_blob(ep: torch.export.ExportedProgram, blob: Mapping[str, torch.Tensor], precision: str,
                only: Collection[str] | None = None) -> None:
    """CheckFailed unless the blob holds exactly the program's tensors (after the precision cast), bit for bit.
    `only`: of those, the ones with these names (a train step's joint program drops a parameter nothing reads)."""
    expected = program_weights(ep, precision)
    if only is not None:
        expected = {k: v for k, v in expected.items() if k in only}
    extra, missing = sorted(set(blob) - set(expected)), sorted(set(expected) - set(blob))
    if extra or missing:
        raise CheckFailed(f"the weights blob does not match the program: {len(missing)} missing "
                          f"{missing[:5]}, {len(extra)} not in the program {extra[:5]}", stage="check")
    for name, want in expected.items():
        got = blob[name]
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape) or not torch.equal(got.cpu(), want.cpu()):
            raise CheckFailed(f"the weights blob's {name!r} ({got.dtype}, {tuple(got.shape)}) is not the program's "
                              f"({want.dtype}, {tuple(want.shape)})", stage="check")


def check_bound(package_fqns: list[str], blob: Mapping[str, torch.Tensor]) -> None:
    """CheckFailed unless the package reads every tensor of the blob, and nothing else: a weight the package does not
    read was inlined into its code or folded into a constant of its own, and would not follow the blob."""
    frozen = sorted(set(blob) - set(package_fqns))
    unknown = sorted(set(package_fqns) - set(blob))
    if frozen:
        raise CheckFailed(
            f"the package does not read weight {frozen[0]!r} from its weights blob"
            + (f" (nor {len(frozen) - 1} more: {', '.join(frozen[1:6])})" if len(frozen) > 1 else "")
            + ": it was frozen into the generated code (inlined as a literal or folded), so the package would "
            "ignore the weights it is given", stage="check")
    if unknown:
        raise CheckFailed(f"the package needs constant(s) the weights blob lacks: {', '.join(unknown[:6])} "
                          "(derived constants: freezing or constant folding)", stage="check")


def module_tensor(module: torch.nn.Module, fqn: str) -> torch.Tensor | None:
    """The parameter or buffer `fqn` of `module`, or None."""
    prefix, _, attr = fqn.rpartition(".")
    try:
        t = getattr(module.get_submodule(prefix) if prefix else module, attr)
    except AttributeError:
        return None
    return t if isinstance(t, torch.Tensor) else None


def _perturb(t: torch.Tensor, gen: torch.Generator) -> None:
    """Scale by 0.75..1.25 and move by up to a quarter of the mean magnitude: every element moves, zeros included.
    The move has a random sign where the tensor's signs are mixed (a weight matrix), so that the tensor keeps its
    mean; a tensor of one sign (a variance, a norm's scale) moves away from zero and keeps its sign. A move of one
    sign for every element of a matrix would add a large rank-one part to its outputs, which the next norm subtracts
    again: in bf16 that cancellation alone put eager 10 % from float64 on GPT-2 (6 % on a ViT), past the 5 % the
    comparison allows.

    On the tensor's own device, by `gen` (a generator of that device): on a GPU the check's perturbation was 7-34 s
    of CPU random numbers a model (110 M weights) in a farm of six, against milliseconds there."""
    x = t.detach().float()  # t itself where it is float32: read, never written, until the last line
    scale = float(x.abs().mean()) or 1.0
    # In place, two float32 tensors of t's size beside it (a large embedding on a GPU that holds the model twice).
    out = torch.rand(x.shape, generator=gen, device=x.device).mul_(0.5).add_(0.75).mul_(x)
    # Uniform on (-1, 1): its sign is the move's direction and its magnitude, uniform on (0, 1), the move's size.
    v = torch.rand(x.shape, generator=gen, device=x.device).mul_(2).sub_(1)
    if not x.any():
        pass  # all zeros (a bias as initialised): no sign to keep
    elif bool((x >= 0).all()):
        v.abs_()
    elif bool((x <= 0).all()):
        v.abs_().neg_()
    t.detach().copy_(out.add_(v, alpha=0.25 * scale))


def follows(eager: torch.nn.Module, blob: Mapping[str, torch.Tensor], precision: str,
            run: Callable[[], tuple[Any, Any]], compare: Callable[[Any, Any], dict[str, Any]],
            reference: Callable[[torch.nn.Module], Any] | None = None, tolerance: float = 0.0) -> dict[str, Any]:
    """Perturb every floating weight in place, in eager's module and in the blob the package holds (user-managed, so
    the package sees the new values), and compare again; then put both back. `run` returns (eager output, package
    output). Where they disagree and `reference` is given (eager's module -> its output in float64 at the same
    inputs), compiler.fp64.second_opinion judges again. When they still disagree, halve the set of perturbed weights
    until one weight (or a few) is left to name. CheckFailed names it; otherwise a summary."""
    names = [n for n, t in blob.items() if t.is_floating_point() and t.numel()
             and (e := module_tensor(eager, n)) is not None and e.is_floating_point()]
    saved_eager = {n: module_tensor(eager, n).detach().clone() for n in names}  # type: ignore[union-attr]
    saved_blob = {n: blob[n].detach().clone() for n in names}
    # Where the phase's time goes (the check records it): perturbing and restoring, the two runs, float64's
    # second opinion where the first judgment failed.
    spent = {"perturb_s": 0.0, "run_s": 0.0, "float64_s": 0.0}

    def judge(expected: Any, actual: Any) -> dict[str, Any]:
        verdict = compare(expected, actual)
        if verdict["ok"] or reference is None:
            return verdict
        t0 = time.perf_counter()
        try:
            ref = reference(eager)
        except Exception:  # noqa: BLE001 - no float64 run (an op without a float64 kernel): the first judgment stands
            return verdict
        finally:
            spent["float64_s"] += time.perf_counter() - t0
        return fp64.second_opinion(verdict, expected, actual, ref, tolerance)

    def trial(subset: list[str]) -> dict[str, Any]:
        t0 = time.perf_counter()
        gens: dict[torch.device, torch.Generator] = {}  # one per device, seeded alike in every trial
        for n in subset:
            e = module_tensor(eager, n)
            assert e is not None
            if e.device not in gens:
                gens[e.device] = torch.Generator(e.device).manual_seed(1234)
            _perturb(e, gens[e.device])
            blob[n].detach().copy_(e.detach().to(blob[n].dtype))  # the same values, cast as the blob was
        t1 = time.perf_counter()
        spent["perturb_s"] += t1 - t0
        try:
            both = run()
            spent["run_s"] += time.perf_counter() - t1
            return judge(*both)
        finally:
            t2 = time.perf_counter()
            for n in subset:
                module_tensor(eager, n).detach().copy_(saved_eager[n])  # type: ignore[union-attr]
                blob[n].detach().copy_(saved_blob[n])
            spent["perturb_s"] += time.perf_counter() - t2

    with torch.inference_mode():
        first = trial(names)
        if first["ok"]:
            return {"perturbed": len(names), "ok": True, "max_rel_err": first.get("max_rel_err"),
                    **({"fp64": first["fp64"]} if "fp64" in first else {}),
                    "seconds": {k: round(v, 3) for k, v in spent.items()}}
        culprits, runs = names, 1
        while len(culprits) > 1 and runs < 64:
            half = culprits[: len(culprits) // 2]
            runs += 1
            if not trial(half)["ok"]:
                culprits = half
                continue
            rest = culprits[len(culprits) // 2:]
            runs += 1
            if trial(rest)["ok"]:
                break  # only perturbing both halves shows it: name them together
            culprits = rest
    shown = ", ".join(repr(c) for c in culprits[:6]) + (f" and {len(culprits) - 6} more" if len(culprits) > 6 else "")
    raise CheckFailed(f"the package does not follow its weights: after perturbing them in place it disagrees with "
                      f"eager ({first.get('why')}); weight(s) it ignores: {shown}", stage="check")
