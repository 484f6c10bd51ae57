"""Models: their inputs and dynamic dims, and each model's artifacts with a speed-up-per-target plot.

From GET /v1/models and GET /v1/models/{id} (the key's namespace, and its names for the models); a model's
artifacts are those GET /v1/artifacts lists for it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from service.api.deps import _model as model_visible_to
from service.api.routes import models as models_route
from service.api.schemas import MODEL_ID
from service.store import Store
from service.ui.session import Viewer, needs
from service.ui.web import UiRoute, render, spec_text

router = APIRouter(prefix="/ui/models", route_class=UiRoute, include_in_schema=False)
ModelIdPath = Annotated[str, Path(pattern=MODEL_ID, max_length=64)]
LIST_LIMIT = 500


def _store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


def dynamic_dims(model: dict[str, Any]) -> list[str]:
    """`x dim 0: 1..64` for every dim the exported program leaves dynamic."""
    out = []
    for i in model.get("inputs") or []:
        for n, d in enumerate(i.get("shape") or []):
            if isinstance(d, dict):
                out.append(f"{i.get('name')} dim {n}: {d.get('min')}..{d.get('max')}")
    return out


@router.get("")
async def models_page(request: Request, who: Viewer) -> Response:
    needs(who, "pull", "the model list")
    models = (await run_in_threadpool(models_route.list_models, _store(request), who, LIST_LIMIT))["models"]
    return render(request, "models.html", nav="models", models=models, dynamic=dynamic_dims)


def speedups(artifacts: list[dict[str, Any]]) -> dict[str, Any]:
    """Per artifact, the check's speed-up over eager at the smallest and the largest shapes it was checked at,
    grouped by target (the plot's bars and the table under it)."""
    rows = []
    for a in sorted(artifacts, key=lambda a: (str(a.get("target")), -float(a.get("created") or 0))):
        points = {p.get("point"): p for p in ((a.get("check") or {}).get("points") or [])}
        lo, hi = points.get("min") or {}, points.get("max") or {}
        rows.append({"key": a["key"], "target": a.get("target"), "spec": spec_text(a.get("spec")),
                     "mode": (a.get("options") or {}).get("mode"), "min": lo.get("speedup"), "max": hi.get("speedup"),
                     "graph": lo.get("graph_speedup"), "eager_ms": lo.get("eager_ms"),
                     "compiled_ms": lo.get("compiled_ms"), "created": a.get("created"),
                     "passed": (a.get("check") or {}).get("passed")})
    plot = {"labels": [f"{r['target']} · {r['spec']}" for r in rows],
            "series": {"smallest shapes": [r["min"] for r in rows], "largest shapes": [r["max"] for r in rows]}}
    return {"rows": rows, "plot": json.dumps(plot)}


@router.get("/{model_id}")
async def model_page(request: Request, model_id: ModelIdPath, who: Viewer) -> Response:
    needs(who, "pull", "a model")
    model = await model_visible_to(request, model_id, who)  # GET /v1/models/{id}'s own check and view
    store = _store(request)
    artifacts = await run_in_threadpool(store.artifacts.for_model, model["id"])
    return render(request, "model.html", nav="models", model=model, dynamic=dynamic_dims(model),
                  **speedups(artifacts))
