"""Deploy-time lookup: the stored artifact that serves (model, shapes, target), without knowing its key."""

from __future__ import annotations

from typing import Any

from service import specs, targets
from service.store import Store


def _width(spec: list[dict[str, Any]]) -> int:
    """How much a spec's ranges span; 0 for a static spec. Narrower artifacts are more specialised."""
    return sum(d["max"] - d["min"] for inp in spec for d in inp["shape"] if isinstance(d, dict))


def find_artifact(
    store: Store, model_id: str, target: str, spec: list[dict[str, Any]], options: dict[str, Any] | None = None,
    *, mode: str | None = None,
) -> dict[str, Any] | None:
    """The best artifact of `model_id` for `target` whose spec covers `spec`: static before dynamic, then the
    narrowest range, then the newest. `options`, when given, must match exactly; without them, report-only records
    (mode=training, no package) are never picked. `mode`, when given, must be the artifact's compile mode."""
    fits = [
        a
        for a in store.artifacts_for_model(model_id)
        if targets.matches(target, a["factors"]["target"])
        and specs.covers(a["factors"]["spec"], spec)
        and (a["factors"]["options"] == options if options is not None else a.get("package", True))
        and (mode is None or a["factors"]["options"].get("mode") == mode)
    ]
    if not fits:
        return None
    return min(fits, key=lambda a: (_width(a["factors"]["spec"]), -a["created"]))
