"""Load an uploaded torch.export archive without letting it run code.

Three layers, each enough on its own for the attacks it covers:
1. the API's static checks again (compiler.archive: pickles against the allow-list, expression strings and
   guards against a whitelist grammar, no custom-object constants, no AOTInductor code) - the archive on the
   worker is the same bytes, but the worker must not trust that the API looked;
2. every pickled entry is loaded with torch.load(weights_only=True) before torch.export.load sees it;
3. torch.export.load runs inside compiler.compat.safe_load.guarded_export_load, which forces weights_only=True,
   blocks pickle.loads / torchbind / AOTInductor loading in torch's reader and re-checks each expression string.
After loading, guards_code (exec'd by torch when the program runs) is checked once more on the loaded object.
"""

from __future__ import annotations

import io
import traceback
import zipfile

import torch

from compiler.archive.exprs import check_guard, check_sym_expr
from compiler.archive.inspect import inspect_archive
from compiler.compat.safe_load import DeserializationRefused, guarded_export_load
from compiler.errors import AotcError, BadModel, UnsafeArchive, UnsafeModel

STAGE = "load"
MAX_PICKLE_ENTRY_BYTES = 64 * 2**30


def _validate(path: str) -> list[str]:
    """The API's inspection, mapped to compiler errors; returns the pickled entries to pre-load."""
    try:
        info = inspect_archive(path)
    except UnsafeArchive as e:
        raise UnsafeModel(e.message, stage=STAGE) from None
    except AotcError as e:
        raise BadModel(e.message, stage=STAGE) from None
    return list(info["pickles"])


def _preload_pickles(path: str, entries: list[str]) -> None:
    """torch.load(weights_only=True) each pickled entry: a pickle that only loads unrestricted is refused."""
    try:
        with zipfile.ZipFile(path) as zf:
            for entry in entries:
                info = zf.getinfo(entry)
                if info.file_size > MAX_PICKLE_ENTRY_BYTES:
                    raise BadModel(f"{entry} is {info.file_size} bytes; too large to load", stage=STAGE)
                data = zf.read(info)
                try:
                    torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
                except Exception as e:
                    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    raise UnsafeModel(
                        f"{entry} does not load with torch.load(weights_only=True): {first[:300]}",
                        stage=STAGE,
                        excerpt=str(e)[:2000],
                    ) from None
    except (UnsafeModel, BadModel):
        raise
    except Exception as e:
        raise BadModel(f"cannot read the archive: {type(e).__name__}: {e}", stage=STAGE) from None


def _check_loaded(ep: torch.export.ExportedProgram) -> None:
    for guard in getattr(ep, "_guards_code", None) or []:
        try:
            check_guard(guard)
        except AotcError as e:
            raise UnsafeModel(e.message, stage=STAGE) from None


def load_program(path: str) -> torch.export.ExportedProgram:
    """Load the exported program at `path` (an untrusted upload) safely.

    Raises UnsafeModel when any part would need unrestricted unpickling or code execution to load, BadModel when
    the file is not an exported program torch can read.
    """
    entries = _validate(path)
    _preload_pickles(path, entries)
    try:
        with guarded_export_load(check_sym_expr) as events:
            try:
                ep = torch.export.load(path)
            except DeserializationRefused as e:
                raise UnsafeModel(str(e), stage=STAGE, excerpt="\n".join(events)) from None
    except (UnsafeModel, BadModel):
        raise
    except Exception as e:
        if any(ev.startswith("refused") for ev in events):
            raise UnsafeModel(
                f"loading needed a refused operation: {next(ev for ev in events if ev.startswith('refused'))}",
                stage=STAGE,
                excerpt="\n".join(events),
            ) from None
        raise BadModel(
            f"torch.export.load cannot read the archive: {type(e).__name__}: {str(e)[:500]}",
            stage=STAGE,
            excerpt=traceback.format_exc()[-4000:],
        ) from None
    refused = [ev for ev in events if ev.startswith("refused")]
    if refused:  # torch caught a refusal and carried on: the program is still not one we load
        raise UnsafeModel(f"loading needed a refused operation: {refused[0]}", stage=STAGE, excerpt="\n".join(events))
    if not isinstance(ep, torch.export.ExportedProgram):
        raise BadModel(f"the archive holds a {type(ep).__name__}, not an ExportedProgram", stage=STAGE)
    _check_loaded(ep)
    return ep
