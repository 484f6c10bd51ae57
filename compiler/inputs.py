"""Inputs of requested shapes: example inputs for re-export, random inputs for the artifact check, and the
adversarial inputs the check also tries (`adversarial_cases`): the integer inputs, the float inputs whose values
the program casts to an integer, and the bool inputs it indexes by (`index_inputs`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from compiler.compat import pytree

Spec = list[dict[str, Any]]


def points(spec: Spec) -> dict[str, list[list[int]]]:
    """Concrete shapes to check at: the one shape of a static spec; every range at its min and at its max."""
    shapes_min = [[d if isinstance(d, int) else d["min"] for d in i["shape"]] for i in spec]
    shapes_max = [[d if isinstance(d, int) else d["max"] for d in i["shape"]] for i in spec]
    return {"min": shapes_min} if shapes_min == shapes_max else {"min": shapes_min, "max": shapes_max}


def hint_shapes(spec: Spec, program_inputs: list[dict[str, Any]]) -> list[list[int]]:
    """A shape per input for re-export: ranges get a size inside them, distinct per symbol so torch's duck sizing
    does not merge dims the user declared independent, and never 0 or 1, which export would specialise."""
    hints: dict[str, int] = {}
    shapes: list[list[int]] = []
    for inp, prog in zip(spec, program_inputs):
        shape = []
        for j, d in enumerate(inp["shape"]):
            if isinstance(d, int):
                shape.append(d)
                continue
            exported = prog["shape"][j]
            sym = exported.get("symbol") if isinstance(exported, dict) else None
            key = sym or f"{inp['name']}.{j}"
            if key not in hints:
                taken = set(hints.values())
                v = max(d["min"], 2)
                while v in taken and v < d["max"]:
                    v += 1
                hints[key] = min(v, d["max"])
            shape.append(hints[key])
        shapes.append(shape)
    return shapes


def int_ranges(ep: torch.export.ExportedProgram) -> list[tuple[int, int] | None]:
    """Per user input, the [low, high) of the sample integer values the archive carries (token ids and the like),
    so random integer inputs stay in a range the model accepts."""
    try:
        flat, _ = pytree.tree_flatten(ep.example_inputs)
    except Exception:
        return []
    out: list[tuple[int, int] | None] = []
    for t in flat:
        if isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() and t.numel():
            out.append((int(t.min()), int(t.max()) + 1))
        else:
            out.append(None)
    return out


# Of an integer input whose sample holds negative and non-negative values, the share of elements given the sample's
# lowest value (see random_inputs).
SENTINEL_SHARE = 8


def random_inputs(
    spec: Spec, shapes: list[list[int]], device: str, ranges: list[tuple[int, int] | None], seed: int = 0
) -> list[torch.Tensor]:
    """Random inputs at `shapes`: floats from a normal distribution, bools fair, integers uniform in their sample's
    [low, high) (`ranges`, from int_ranges; [0, 2) where the archive has no sample). Where that range spans zero from
    below, as labels padded with an ignore index do (-100 beside class ids 0..C-1), values are drawn from [0, high),
    and one element in SENTINEL_SHARE, at random, holds the sample's low value. Drawn from the whole range, a label
    of -84 failed a classifier's check with eager's own IndexError."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k, (inp, shape) in enumerate(zip(spec, shapes)):
        dtype = getattr(torch, inp["dtype"])
        if dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=gen).bool()
        elif dtype.is_floating_point:
            t = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
        elif dtype.is_complex:
            t = torch.randn(shape, generator=gen, dtype=dtype)
        else:
            lo, hi = (ranges[k] if k < len(ranges) else None) or (0, 2)
            if lo < 0 < hi:  # a sentinel below the values proper: drawn apart (see above)
                t = torch.randint(0, hi, shape, generator=gen, dtype=dtype)
                t[torch.randint(0, SENTINEL_SHARE, shape, generator=gen) == 0] = lo
            else:
                t = torch.randint(lo, max(hi, lo + 1), shape, generator=gen, dtype=dtype)
        out.append(t.to(device))
    return out


def call_args(ep: torch.export.ExportedProgram, flat: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Rebuild (args, kwargs) in the structure the program was exported with from the flat user inputs."""
    args, kwargs = pytree.tree_unflatten(flat, ep.call_spec.in_spec)
    return tuple(args), dict(kwargs)


# -- adversarial integer inputs ---------------------------------------------------------------------------------

# Far past any small tensor, yet near enough to land in mapped memory: an index of +-400000 read back a tensor
# its consumer held elsewhere in its process (issue 18).
FAR = 400_000
MAX_DIM_SIZES = 6  # the largest distinct dim sizes of the program tried as values (n and -n-1)


@dataclass(frozen=True)
class Poison:
    """One adversarial case: integer input (or float input cast to an integer, or bool mask) `input`, its position in
    the spec, holding `value`, either as one element among in-range values (`whole=False`) or as every element."""

    input: int
    name: str
    value: int | float | bool
    whole: bool
    why: str  # where the value comes from: "int64 max", "dim size 16", "sample range low", ...

    def describe(self, numel: int | None = None) -> str:
        where = "every element" if self.whole else (f"one element of {numel}" if numel else "one element")
        return f"input {self.name!r} = {self.value} ({where}; {self.why})"


def integer_inputs(spec: Spec) -> list[int]:
    """Positions of the integer inputs (bool excluded: it has no out-of-range value)."""
    out = []
    for k, inp in enumerate(spec):
        dtype = getattr(torch, inp["dtype"], None)
        if isinstance(dtype, torch.dtype) and dtype != torch.bool and not dtype.is_floating_point \
                and not dtype.is_complex:
            out.append(k)
    return out


# Casts to a dtype of the op's choosing: where one turns a float from an input into an integer, that input drives
# indices (or counts, offsets, lengths) as an integer input does (2026-11-30: select, embedding_bag and segment_reduce
# took indices from `.long()` of a float input, which the check never varied).
CASTS = frozenset({"aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device",
                   "aten.to.other", "prims.convert_element_type.default", "aten.type_as.default",
                   "aten.view.dtype"})  # the last a bitcast: the float's bits, read as an integer
# A Python number from a tensor, made an integer: int() and its like on `x.item()` of a float.
SYM_CASTS = frozenset({"sym_int", "floor", "ceil", "trunc"})
# Ops whose reads or output size follow how many elements of a bool mask are set: a mask input that reaches one is
# tried all set and all clear (masked_scatter with every element set reads past a short source).
MASK_OPS = frozenset({"aten.index.Tensor", "aten._unsafe_index.Tensor", "aten.index_put.default",
                      "aten.index_put_.default", "aten._unsafe_index_put.default", "aten.masked_scatter.default",
                      "aten.masked_scatter_.default", "aten.masked_select.default", "aten.nonzero.default",
                      "aten.nonzero_static.default", "aten.argwhere.default", "aten._unsafe_masked_index.default",
                      "aten._unsafe_masked_index_put_accumulate.default"})


def _integer_value(val: Any) -> bool:
    if isinstance(val, torch.Tensor):
        return not val.is_floating_point() and not val.is_complex() and val.dtype != torch.bool
    return isinstance(val, torch.SymInt)


def _float_value(val: Any) -> bool:
    return (isinstance(val, torch.Tensor) and val.is_floating_point()) or isinstance(val, torch.SymFloat)


def _bool_value(val: Any) -> bool:
    return (isinstance(val, torch.Tensor) and val.dtype == torch.bool) or isinstance(val, torch.SymBool)


def _op_name(target: Any) -> str:
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", "")


def _operands(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The operands through which `node` turns values into indices, counts or sizes: a cast to an integer's float or
    bool operand; a mask op's bool operands (MASK_OPS); none for any other node."""
    name = _op_name(node.target)
    if (name in CASTS or name in SYM_CASTS) and _integer_value(node.meta.get("val")):
        return [i for i in node.all_input_nodes if _float_value(i.meta.get("val")) or _bool_value(i.meta.get("val"))]
    if name in MASK_OPS:
        return [i for i in node.all_input_nodes if _bool_value(i.meta.get("val"))]
    return []


def _index_sources(gm: torch.fx.GraphModule, memo: dict[int, set[torch.fx.Node]]) -> set[torch.fx.Node]:
    """The placeholders of `gm` whose values reach an operand `_operands` names, walking back from those operands
    once (linear in the graph, however many inputs it has). A higher-order op whose subgraph has such a placeholder
    counts as reaching one through all its operands. `memo`: each subgraph's answer, by id."""
    if id(gm) in memo:
        return memo[id(gm)]
    todo: list[torch.fx.Node] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            subs = [getattr(gm, str(a.target), None) for a in node.all_input_nodes if a.op == "get_attr"]
            if any(isinstance(sub, torch.fx.GraphModule) and _index_sources(sub, memo) for sub in subs):
                todo += node.all_input_nodes
        else:
            todo += _operands(node)
    seen: set[torch.fx.Node] = set()
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo += node.all_input_nodes
    memo[id(gm)] = found = {n for n in seen if n.op == "placeholder"}
    return found


def index_inputs(ep: torch.export.ExportedProgram, spec: Spec) -> tuple[list[int], list[int]]:
    """(floats, masks): the positions (in `spec`, the user inputs' order) of the float inputs whose values the
    program casts to an integer, and of the bool inputs whose values reach an op that indexes by a mask (MASK_OPS)
    or a cast; from one walk (`_index_sources`). The check tries the floats with the values an attacker would send
    (`adversarial_floats`), the masks all set and all clear."""
    names = list(ep.graph_signature.user_inputs)
    reached = {n.name for n in _index_sources(ep.graph_module, {})}
    floats: list[int] = []
    masks: list[int] = []
    for k, inp in enumerate(spec):
        dtype = getattr(torch, inp["dtype"], None)
        if isinstance(dtype, torch.dtype) and k < len(names) and names[k] in reached:
            if dtype.is_floating_point:
                floats.append(k)
            elif dtype == torch.bool:
                masks.append(k)
    return floats, masks


def dim_sizes(ep: torch.export.ExportedProgram, shapes: list[list[int]]) -> list[int]:
    """The distinct dim sizes of the program at these input shapes, largest first: the inputs' own, every weight's
    and constant's, and every static dim of the graph's values (an index into any of them is bounded by one)."""
    sizes: set[int] = {d for shape in shapes for d in shape}
    tensors = [*ep.state_dict.values(), *ep.constants.values()]
    sizes.update(int(d) for t in tensors if isinstance(t, torch.Tensor) for d in t.shape)
    for gm in ep.graph_module.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            for d in getattr(val, "shape", ()):
                if isinstance(d, int):
                    sizes.add(d)
    return sorted((n for n in sizes if n > 1), reverse=True)


def adversarial_values(dtype: torch.dtype, sample: tuple[int, int] | None, sizes: list[int]) -> list[tuple[int, str]]:
    """Values an attacker would feed an integer input, most dangerous first, each once and only if the dtype holds
    it: the dtype's extremes, +-FAR, -1, each dim size n and -n-1 (the first index past either end), the sample
    range's ends and the value just past it, 0."""
    info = torch.iinfo(dtype)
    name = str(dtype).removeprefix("torch.")
    values: list[tuple[int, str]] = [(info.max, f"{name} max"), (info.min, f"{name} min"), (FAR, "far past the end"),
                                     (-FAR, "far before the start"), (-1, "-1")]
    for n in sizes[:MAX_DIM_SIZES]:
        values += [(n, f"dim size {n}"), (-n - 1, f"-(dim size {n})-1")]
    if sample is not None:
        lo, hi = sample
        values += [(lo, "sample range low"), (hi - 1, "sample range high"), (hi, "just past the sample range")]
    values.append((0, "0"))
    out: list[tuple[int, str]] = []
    seen: set[int] = set()
    for v, why in values:
        if info.min <= v <= info.max and v not in seen:
            seen.add(v)
            out.append((v, why))
    return out


# The largest magnitude a float case takes: 2**40 (exact in every float dtype that holds it) keeps a value scaled by
# up to 2**22 before its cast inside int64, where the cast is defined; past it the result is the platform's (x86's
# 0x8000..., PTX's saturation), which eager on a CPU and a CUDA package need not share. NaN and infinity are not
# tried for the same reason: what they cast to is undefined, and whatever comes out still meets the bounds.
FLOAT_HUGE = 2.0**40


def adversarial_floats(dtype: torch.dtype, sizes: list[int]) -> list[tuple[float, str]]:
    """Values an attacker would feed a float input that the program casts to an integer: +-FLOAT_HUGE, +-FAR, -1,
    each dim size n and -n-1, 0, each only if the dtype holds it."""
    biggest = torch.finfo(dtype).max
    values: list[tuple[float, str]] = [(FLOAT_HUGE, "2**40"), (-FLOAT_HUGE, "-2**40"), (float(FAR), "far past the end"),
                                       (float(-FAR), "far before the start"), (-1.0, "-1")]
    values += [v for n in sizes[:MAX_DIM_SIZES] for v in ((float(n), f"dim size {n}"),
                                                          (float(-n - 1), f"-(dim size {n})-1"))]
    values.append((0.0, "0"))
    out: list[tuple[float, str]] = []
    for v, why in values:
        if abs(v) <= biggest and v not in {seen for seen, _ in out}:
            out.append((v, why))
    return out


MASK_VALUES: list[tuple[bool, str]] = [(True, "set"), (False, "clear")]


def adversarial_cases(spec: Spec, shapes: list[list[int]], ranges: list[tuple[int, int] | None], sizes: list[int],
                      limit: int, floats: list[int] | None = None, masks: list[int] | None = None) -> list[Poison]:
    """At most `limit` cases over the integer inputs, the float inputs `floats` and the bool inputs `masks`
    (index_inputs), taken in turn from each input's values (most dangerous first), each value as one element
    and as the whole tensor (once for a tensor of one element)."""
    per_input: list[list[Poison]] = []
    for k in sorted({*integer_inputs(spec), *(floats or []), *(masks or [])}):
        numel = 1
        for d in shapes[k]:
            numel *= d
        if numel == 0:
            continue
        dtype = getattr(torch, spec[k]["dtype"])
        sample = ranges[k] if k < len(ranges) else None
        cases = []
        values: list[tuple[int, str]] | list[tuple[float, str]] | list[tuple[bool, str]] = (
            MASK_VALUES if dtype == torch.bool else adversarial_floats(dtype, sizes) if dtype.is_floating_point
            else adversarial_values(dtype, sample, sizes))
        for value, why in values:
            cases.append(Poison(k, spec[k]["name"], value, numel == 1, why))
            if numel > 1:
                cases.append(Poison(k, spec[k]["name"], value, True, why))
        per_input.append(cases)
    out: list[Poison] = []
    depth = 0
    while len(out) < limit and any(depth < len(c) for c in per_input):
        out += [c[depth] for c in per_input if depth < len(c)]
        depth += 1
    return out[:limit]


def poisoned(flat: list[torch.Tensor], case: Poison) -> list[torch.Tensor]:
    """The flat inputs with `case` applied: a copy of its input, one element (the middle one) or all set."""
    out = list(flat)
    t = flat[case.input].clone()
    if case.whole:
        t.fill_(case.value)
    else:
        t.view(-1)[t.numel() // 2] = case.value
    out[case.input] = t
    return out
