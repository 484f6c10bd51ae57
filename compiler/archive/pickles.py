"""Static pickle scanner: decides whether a pickle from an upload may be handed to an unpickler at all.

Nothing here unpickles or imports torch. Opcodes are walked with `pickletools.genops`; every global the pickle
would import (GLOBAL, INST, STACK_GLOBAL) is collected and checked against an allow-list of what `torch.save`
writes for tensors, parameters, state dicts and tuples/lists/dicts of tensors. Anything the scanner cannot
account for - a STACK_GLOBAL whose operands are not plain strings, extension-registry opcodes, malformed or
truncated pickles, trailing bytes, legacy (non-zip) `torch.save` files - counts as unsafe: the cost of a false
refusal is an error message, the cost of a false acceptance is code execution.
"""

from __future__ import annotations

import io
import pickletools
import re
import zipfile
from collections.abc import Iterator
from typing import IO

from compiler.errors import UnsafeArchive

# A torch.save zip nests its pickle as `<archive name>/data.pkl`, its one `.pkl`: one with another is refused.
ZIP_MAGIC = b"PK\x03\x04"
MAX_PICKLE_BYTES = 256 * 2**20  # one pickle stream, where no Budget applies
# All the pickle streams of one upload, together. The scan walks each opcode in Python (about 0.8 s of CPU a MiB):
# a 25 MB upload of ten 256 MiB streams of one-byte opcodes once cost hours. An export's pickles (its sample inputs,
# a pickled constant) hold a few kB: tensors' bytes live outside them.
MAX_PICKLE_TOTAL = 4 * 2**20
MAX_NESTED_ENTRIES = 100_000
MAX_NESTED_RATIO = 100  # a nested entry inflating more than this, past 1 MiB, is a bomb (the outer zip's default)


class Budget:
    """What is left of MAX_PICKLE_TOTAL for one upload's pickle streams."""

    def __init__(self, total: int = MAX_PICKLE_TOTAL) -> None:
        self.left = total

_DTYPES = (
    "uint8 int8 int16 int32 int64 uint16 uint32 uint64 float16 float32 float64 bfloat16 bool "
    "complex32 complex64 complex128 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz float8_e8m0fnu "
    "float4_e2m1fn_x2"
).split()
_STORAGES = (
    "Float Double Half BFloat16 Long Int Short Char Byte Bool ComplexFloat ComplexDouble"
).split()

# (module, name) pairs exactly as they appear in the pickle. Derived from what torch.save emits (protocols 2
# and 4) for plain, strided, non-contiguous, bool/bf16/complex/float8 tensors, Parameters (with and without
# grad, with python attributes), state dicts and ((args), {kwargs}) sample inputs, cross-checked against
# torch/_weights_only_unpickler.py. Left out on purpose: quantized/sparse/nested/meta/numpy rebuilds, tensor
# subclasses (_rebuild_wrapper_subclass), torch.serialization._get_layout, _codecs.encode (bytes objects),
# cuda storages - none is needed for a plain exported program, and each widens what a pickle can construct.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "complex"),
        ("torch._utils", "_rebuild_tensor"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_tensor_v3"),
        ("torch._utils", "_rebuild_parameter"),
        ("torch._utils", "_rebuild_parameter_with_state"),
        ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch", "Tensor"),
        ("torch.nn.parameter", "Parameter"),
        ("torch", "Size"),
        ("torch", "device"),
        ("torch.storage", "UntypedStorage"),
        *(("torch", f"{s}Storage") for s in _STORAGES),
        *(("torch", d) for d in _DTYPES),
    }
)

_STRING_OPS = frozenset(
    {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING"}
)
_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_EXT_OPS = frozenset({"EXT1", "EXT2", "EXT4"})  # copyreg's extension registry: globals by number
_NO_STACK_EFFECT = frozenset({"PROTO", "FRAME"})  # framing: may fall between the two operands of STACK_GLOBAL
_UNKNOWN = object()  # a stack value the scanner does not track
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")


class PickleError(Exception):
    """A pickle the scanner cannot vouch for; the message says why."""


class _Bounded(io.RawIOBase):
    """Read at most `limit` bytes from `f`; reading past it is an error, not a truncation."""

    def __init__(self, f: IO[bytes], limit: int, why: str = "") -> None:
        self._f, self._left, self._pos = f, limit, 0
        self._why = why or f"pickle stream is over {MAX_PICKLE_BYTES} bytes"

    def readable(self) -> bool:
        return True

    def tell(self) -> int:  # genops asks for positions; BufferedReader.tell() asks us
        return self._pos

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(b)
        if self._left <= 0:
            if self._f.read(1):
                raise PickleError(self._why)
            return 0
        data = self._f.read(min(len(view), self._left))
        self._left -= len(data)
        self._pos += len(data)
        view[: len(data)] = data
        return len(data)


def _globals_in_stream(f: IO[bytes]) -> Iterator[tuple[str, str]]:
    """Yield (module, name) for every global one pickle in `f` names; stop at its STOP opcode."""
    memo: dict[int, object] = {}
    recent: list[object] = []  # values pushed by the latest non-memo opcodes, newest last; _UNKNOWN otherwise
    stopped = False
    for op, arg, _pos in pickletools.genops(f):
        name = op.name
        if name in ("GLOBAL", "INST"):
            parts = str(arg).split(" ")
            if len(parts) != 2:
                raise PickleError(f"cannot read global {arg!r}")
            yield parts[0], parts[1]
            recent = recent + [_UNKNOWN] if name == "GLOBAL" else [_UNKNOWN]  # INST also pops to a MARK
        elif name == "STACK_GLOBAL":
            if len(recent) < 2 or not all(isinstance(v, str) for v in recent[-2:]):
                raise PickleError("STACK_GLOBAL with operands that are not literal strings")
            yield str(recent[-2]), str(recent[-1])
            recent = [_UNKNOWN]
        elif name in _EXT_OPS:
            raise PickleError(f"{name} imports a global through the extension registry")
        elif name in _NO_STACK_EFFECT:
            if name == "PROTO" and not 2 <= int(arg) <= 5:  # type: ignore[arg-type]
                raise PickleError(f"pickle protocol {arg}")
            continue
        elif name == "MEMOIZE":
            memo[len(memo)] = recent[-1] if recent else _UNKNOWN
        elif name in _PUT_OPS:
            memo[int(arg)] = recent[-1] if recent else _UNKNOWN  # type: ignore[arg-type]
        elif name in _GET_OPS:
            recent.append(memo.get(int(arg), _UNKNOWN))  # type: ignore[arg-type]
        elif name in _STRING_OPS:
            recent.append(arg if isinstance(arg, str) else _UNKNOWN)
        elif name == "STOP":
            stopped = True
            break
        else:
            # Any other opcode may reshape the stack: nothing before it is known to be on top any more.
            recent = [_UNKNOWN]
        del recent[:-2]
    if not stopped:
        raise PickleError("pickle has no STOP opcode")


def _scan_raw(f: IO[bytes], budget: Budget | None = None) -> list[str]:
    """Globals of a byte stream that must be one or more complete pickles and nothing else."""
    found: list[str] = []
    if budget is None:
        raw = _Bounded(f, MAX_PICKLE_BYTES)
    else:
        raw = _Bounded(f, min(MAX_PICKLE_BYTES, budget.left),
                       f"the upload's pickles hold more than {MAX_PICKLE_TOTAL} bytes together; an exported "
                       "program's hold a few kB (the tensors' bytes live outside them)")
    bounded = io.BufferedReader(raw)
    try:
        while True:
            for module, name in _globals_in_stream(bounded):
                if not (_IDENT.match(module) and _IDENT.match(name)):
                    raise PickleError(f"global {module!r}.{name!r} is not a dotted identifier")
                found.append(f"{module}.{name}")
            if not bounded.peek(1)[:1]:
                return found  # a second pickle after the first is scanned too: pickle.load can be called again
    finally:
        if budget is not None:
            budget.left -= raw.tell()


def _scan_zip(f: IO[bytes], budget: Budget | None = None) -> list[str]:
    """Globals of the one `.pkl` member of a torch.save zip, `<name>/data.pkl`."""
    with zipfile.ZipFile(f) as z:
        infos = z.infolist()
        if len(infos) > MAX_NESTED_ENTRIES:
            raise PickleError(f"nested zip has {len(infos)} entries")
        names = [i.filename for i in infos]
        if len(set(names)) != len(names):
            raise PickleError("nested zip has duplicate entry names")
        pkls = [i for i in infos if i.filename.endswith(".pkl")]
        if len(pkls) != 1 or not pkls[0].filename.endswith("data.pkl"):
            raise PickleError(f"a torch.save zip holds one data.pkl; this one holds {[i.filename for i in pkls][:5]}")
        for info in infos:
            if info.file_size > 2**20 and info.file_size > MAX_NESTED_RATIO * max(info.compress_size, 1):
                raise PickleError(f"nested entry {info.filename} inflates {info.compress_size} bytes to "
                                  f"{info.file_size}, more than {MAX_NESTED_RATIO} times")
        with z.open(pkls[0]) as member:
            return _scan_raw(member, budget)


def scan_file(f: IO[bytes], budget: Budget | None = None) -> list[str]:
    """Like scan_pickle, for a seekable binary file (lets a caller scan a zip member without reading it whole).
    `budget`: what is left for all of one upload's pickle streams (MAX_PICKLE_TOTAL), spent here."""
    try:
        head = f.read(4)
        f.seek(0)
        if head == ZIP_MAGIC:
            return _scan_zip(f, budget)
        if not head or head[0] != 0x80:
            raise PickleError("neither a pickle (protocol 2+) nor a torch.save zip")
        return _scan_raw(f, budget)
    except PickleError:
        raise
    except Exception as e:  # hostile bytes: genops/zipfile raise ValueError, EOFError, BadZipFile, struct errors...
        raise PickleError(f"malformed: {type(e).__name__}: {e}") from None


def scan_pickle(data: bytes) -> list[str]:
    """Every global ("module.name") that `data` - a raw pickle or a torch.save zip - would import.

    Raises PickleError when the pickle cannot be scanned with certainty (it is then unsafe by definition).
    """
    return scan_file(io.BytesIO(data))


def disallowed(globals_: list[str]) -> list[str]:
    """The globals from `globals_` that are not on the allow-list, sorted and deduplicated."""
    allowed = {f"{m}.{n}" for m, n in ALLOWED_GLOBALS}
    return sorted(set(g for g in globals_ if g not in allowed))


def check_file(f: IO[bytes], entry: str, budget: Budget | None = None) -> list[str]:
    """Scan one archive entry; raise UnsafeArchive naming it unless every global is allow-listed."""
    try:
        found = scan_file(f, budget)
    except PickleError as e:
        raise UnsafeArchive(f"{entry}: the pickle cannot be verified as safe ({e})", entry=entry) from None
    bad = disallowed(found)
    if bad:
        raise UnsafeArchive(
            f"{entry}: the pickle imports {', '.join(bad)}, which is not allowed; only plain tensors, "
            "parameters and containers of them can be uploaded",
            entry=entry,
            globals=bad,
        )
    return found


def check_pickle(data: bytes, entry: str) -> None:
    """Raise UnsafeArchive (naming `entry` and the offending globals) unless `data` is a safe pickle."""
    check_file(io.BytesIO(data), entry)
