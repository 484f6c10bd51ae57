"""Deploy-time lookup: the stored artifact that serves (model, shapes, target), without knowing its key."""

from __future__ import annotations

from typing import Any

from compiler import shapes as specs
from compiler.targets import Target
from service.store import Store


def _width(spec: list[dict[str, Any]]) -> int:
    """How much a spec's ranges span; 0 for a static spec. Narrower artifacts are more specialised."""
    return sum(d["max"] - d["min"] for inp in spec for d in inp["shape"] if isinstance(d, dict))


def find_artifact(
    store: Store, model_id: str, target: Target, spec: list[dict[str, Any]], options: dict[str, Any] | None = None,
    *, mode: str | None = None,
) -> dict[str, Any] | None:
    """The best artifact of `model_id` for `target` whose spec covers `spec`: static before dynamic, then the
    narrowest range, then the fastest where the checks timed them all on one kind of device, else the newest.
    `options`, when given, must match exactly; without them, report-only records (mode=training, no package) are
    never picked. `mode`, when given, must be the artifact's compile mode."""
    fits = [
        a
        for a in store.artifacts.for_model(model_id)
        if target.matches(a["factors"]["target"])
        and specs.covers(a["factors"]["spec"], [i["shape"] for i in spec])
        and (a["factors"]["options"] == options if options is not None else a.get("package", True))
        and (mode is None or a["factors"]["options"].get("mode") == mode)
    ]
    if not fits:
        return None
    widths = [_width(a["factors"]["spec"]) for a in fits]
    best = [a for a, w in zip(fits, widths, strict=True) if w == min(widths)]
    timed = [(t, a) for a in best if (t := _measured(a)) is not None]
    if len(best) > 1 and len(timed) == len(best) and len({t[0] for t, _ in timed}) == 1:
        # Equally specialised artifacts (say default and max-autotune of the same shapes) whose checks ran on the
        # same kind of device: serve the one that ran fastest there. max-autotune wins on some models and loses
        # on others (bench/results/tuning-*), so the measured time, not the mode, decides.
        return min(timed, key=lambda ta: (ta[0][1], -ta[1]["created"]))[1]
    return max(best, key=lambda a: a["created"])


def _measured(a: dict[str, Any]) -> tuple[str, float] | None:
    """(device name, the check's median latency in ms at the spec's smallest point), if the check timed it."""
    ms = (a.get("check") or {}).get("compiled_ms")
    device = (a.get("worker") or {}).get("device_name")
    if not isinstance(ms, (int, float)) or ms <= 0 or not device:
        return None
    return str(device), float(ms)
