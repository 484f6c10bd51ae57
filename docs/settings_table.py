"""Print the AOTC_* settings table of docs/configuration.md from the API's and the worker's settings models.

    .venv/bin/python docs/settings_table.py      # from the repository root; paste the output into the doc
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydantic.fields import FieldInfo  # noqa: E402
from pydantic_core import PydanticUndefined  # noqa: E402

from service.api.settings import Settings  # noqa: E402
from worker.settings import WorkerSettings  # noqa: E402


def _default(f: FieldInfo) -> str:
    d: Any = f.default
    if d is PydanticUndefined:
        d = f.default_factory() if f.default_factory else None  # type: ignore[call-arg]
    if d is None:
        return "unset"
    if d == "":
        return "empty"
    return f"`{str(d).lower() if isinstance(d, bool) else d}`"


def _bounds(f: FieldInfo) -> str:
    out = []
    for m in f.metadata:
        for attr, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(m, attr, None) is not None:
                out.append(f"{sym} {getattr(m, attr)}")
    return ", ".join(out)


def _type(f: FieldInfo) -> str:
    text = getattr(f.annotation, "__name__", None) or str(f.annotation)
    return text.replace("pathlib.", "").replace("pydantic.types.", "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def main() -> None:
    rows: dict[str, list[tuple[str, FieldInfo]]] = {}
    for who, model in (("API", Settings), ("worker", WorkerSettings)):
        prefix = str(model.model_config.get("env_prefix", ""))
        for name, f in model.model_fields.items():
            rows.setdefault(f"{prefix}{name}".upper(), []).append((who, f))
    print("| variable | read by | type | default | allowed | meaning |")
    print("|---|---|---|---|---|---|")
    for var in sorted(rows):
        entries = rows[var]
        defaults = [_default(f) for _, f in entries]
        per_process = (f"{w}: {d}" for (w, _), d in zip(entries, defaults, strict=True))
        default = defaults[0] if len(set(defaults)) == 1 else "; ".join(per_process)
        descs = {f.description or "": w for w, f in reversed(entries) if f.description}
        meaning = next(iter(descs)) if len(descs) == 1 else " ".join(f"{w}: {d}" for d, w in reversed(descs.items()))
        who = " and ".join(w for w, _ in entries)
        f0 = entries[0][1]
        print(f"| `{var}` | {who} | {_cell(_type(f0))} | {_cell(default)} | {_bounds(f0)} | {_cell(meaning)} |")


if __name__ == "__main__":
    main()
