"""Reading FX graphs: op names, node counts and histograms, in-place ops, and the provenance of re-traced nodes.

Plain data comes out (dicts, lists, strings), so the report keeps no torch objects. OpOverloads are told apart by
their private `_schema`, and provenance is the `from_node` metadata torch.fx records.
"""

from __future__ import annotations

import collections
from typing import Any

import torch


def graph_facts(graph: torch.fx.Graph) -> dict[str, Any]:
    """Node count (calls only), op histogram, Python code and placeholder shapes of an FX graph."""
    hist: collections.Counter[str] = collections.Counter()
    placeholders = []
    for n in graph.nodes:
        if n.op in ("call_function", "call_method", "call_module"):
            hist[op_name(n.target)] += 1
        elif n.op == "placeholder":
            val = n.meta.get("val")
            shape = [d if isinstance(d, int) else str(d) for d in val.shape] if hasattr(val, "shape") else None
            placeholders.append({"name": n.name, "shape": shape})
    try:
        code = graph.python_code(root_module="self").src
    except Exception as e:  # a graph whose code cannot be printed still has counts
        code = f"# code unavailable: {type(e).__name__}: {e}"
    return {"nodes": sum(hist.values()), "histogram": dict(hist.most_common()), "code": code,
            "placeholders": placeholders}


def op_name(target: Any) -> str:
    """'aten.add_.Tensor' for OpOverloads, 'operator.getitem' and the like for Python callables."""
    if isinstance(target, str):
        return target
    if hasattr(target, "_schema"):  # OpOverload
        return str(target)
    mod = getattr(target, "__module__", None) or ""
    qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    mod = "operator" if mod == "_operator" else mod
    return qual if mod in ("", "builtins") else f"{mod}.{qual}"


def is_inplace_op(target: Any) -> bool:
    """An op that mutates one of its arguments (add_, copy_, index_put_, ...), by its schema."""
    schema = getattr(target, "_schema", None)
    return bool(schema is not None and getattr(schema, "is_mutable", False))


def node_sources(node: torch.fx.Node) -> list[str]:
    """Names of the nodes `node` was traced from, nearest first, from the `from_node` provenance that torch.fx
    records when a graph is re-traced (run_decompositions, ep.module()); [] when this torch records none."""
    names: list[str] = []
    src = (node.meta.get("from_node") or [None])[0]
    while src is not None and len(names) < 64:
        name = getattr(src, "name", None)
        if name:
            names.append(str(name))
        parents = getattr(src, "from_node", None) or []
        src = parents[0] if parents else None
    return names
