"""The export schema as a table: every type torch.export's serializer writes into models/model.json and the weight and
constant configs, each field with the check its value gets. No torch: the API reads it.

The table follows torch/_export/serde/schema.py, as a union over the torch versions the service runs (2.11 writes
schema 8.17, 2.13 writes 8.20; `ONLY_SOME_VERSIONS` lists what one of them lacks).
tests/compiler/archive/test_schema.py compares it with the installed torch's dataclasses, so a field that a new torch
adds fails that test before it reaches an upload. compiler.archive.program walks a document with it: a key the table
does not know, a value of another type, a missing required field or a union with other than one member is refused,
naming the path. So every field is either checked or refused; nothing passes unread.

Types, as text:

    int, float, bool      JSON numbers and booleans (an int is never a bool; a float may be written as an int)
    str:GRAMMAR           a string, checked by GRAMMAR (below)
    enum:NAME             an int among ENUMS[NAME]
    list[T]               a JSON array of T
    dict[GRAMMAR, T]      a JSON object whose keys fit GRAMMAR and whose values are T
    T?                    T or null
    NAME                  STRUCTS[NAME] (an object of those fields) or UNIONS[NAME] (an object of exactly one member)

A field is `"TYPE"` when torch's dataclass has no default (the field must be there) and `"TYPE = DEFAULT"` when it
has one (it may be left out). Grammars:

    ident, fqn, text, token    compiler.archive.strings (codegen pastes these strings into C++ and Python source)
    ident0, fqn0               the same, or '' (a higher-order op's positional arguments; the root module's path)
    expr                       a sympy srepr, compiler.archive.exprs.check_sym_expr (torch sympifies it)
    guard                      a shape guard, compiler.archive.exprs.check_guard (torch execs it)
    treespec                   a pytree spec, compiler.archive.exprs.check_treespec (FX pastes it into code)
    target                     a node's target: the operator list (compiler.archive.ops)
    operator                   an operator-valued argument: refused, since no allowed op takes one
    free                       free text that torch never resolves for the worker: node metadata, which the
                               worker's loader neither reads nor keeps (compiler.compat.safe_load)

Two members of Argument are refused or confined by where they stand rather than by their type: `as_operator`
everywhere, and `as_graph` anywhere but at the positions a higher-order op calls (compiler.archive.ops.HOPS).
`REFUSED` names the types no upload may hold at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

GRAMMARS = frozenset({"ident", "ident0", "fqn", "fqn0", "text", "token", "expr", "guard", "treespec", "target",
                      "operator", "free"})

ENUMS: dict[str, frozenset[int]] = {
    "ScalarType": frozenset({*range(0, 14), *range(28, 36)}),
    "Layout": frozenset(range(0, 8)),
    "MemoryFormat": frozenset(range(0, 5)),
    "ArgumentKind": frozenset(range(0, 3)),
}

STRUCTS: dict[str, dict[str, str]] = {
    "Device": {"type": "str:token", "index": "int? = None"},
    "SymExpr": {"expr_str": "str:expr", "hint": "SymExprHint? = None"},
    "TensorMeta": {"dtype": "enum:ScalarType", "sizes": "list[SymInt]", "requires_grad": "bool", "device": "Device",
                   "strides": "list[SymInt]", "storage_offset": "SymInt", "layout": "enum:Layout"},
    "TensorArgument": {"name": "str:ident"},
    "TokenArgument": {"name": "str:ident"},
    "GraphArgument": {"name": "str:ident", "graph": "Graph"},
    "CustomObjArgument": {"name": "str:ident", "class_fqn": "str:fqn"},
    "ComplexValue": {"real": "float", "imag": "float"},
    "NamedArgument": {"name": "str:ident0", "arg": "Argument", "kind": "enum:ArgumentKind? = None"},
    "Node": {"target": "str:target", "inputs": "list[NamedArgument]", "outputs": "list[Argument]",
             "metadata": "dict[token, str:free]", "is_hop_single_tensor_return": "bool? = None",
             "name": "str:ident? = None"},
    "Graph": {"inputs": "list[Argument]", "outputs": "list[Argument]", "nodes": "list[Node]",
              "tensor_values": "dict[ident, TensorMeta]", "sym_int_values": "dict[ident, SymInt]",
              "sym_bool_values": "dict[ident, SymBool]", "is_single_tensor_return": "bool = False",
              "custom_obj_values": "dict[ident, CustomObjArgument] = {}",
              "sym_float_values": "dict[ident, SymFloat] = {}"},
    "UserInputSpec": {"arg": "Argument"},
    "InputToConstantInputSpec": {"name": "str:ident", "value": "ConstantValue"},
    "InputToParameterSpec": {"arg": "TensorArgument", "parameter_name": "str:fqn"},
    "InputToBufferSpec": {"arg": "TensorArgument", "buffer_name": "str:fqn", "persistent": "bool"},
    "InputToTensorConstantSpec": {"arg": "TensorArgument", "tensor_constant_name": "str:fqn"},
    "InputToCustomObjSpec": {"arg": "CustomObjArgument", "custom_obj_name": "str:fqn"},
    "InputTokenSpec": {"arg": "TokenArgument"},
    "UserOutputSpec": {"arg": "Argument"},
    "LossOutputSpec": {"arg": "TensorArgument"},
    "BufferMutationSpec": {"arg": "TensorArgument", "buffer_name": "str:fqn"},
    "ParameterMutationSpec": {"arg": "TensorArgument", "parameter_name": "str:fqn"},
    "GradientToParameterSpec": {"arg": "TensorArgument", "parameter_name": "str:fqn"},
    "GradientToUserInputSpec": {"arg": "TensorArgument", "user_input_name": "str:ident"},
    "UserInputMutationSpec": {"arg": "TensorArgument", "user_input_name": "str:ident"},
    "OutputTokenSpec": {"arg": "TokenArgument"},
    "GraphSignature": {"input_specs": "list[InputSpec]", "output_specs": "list[OutputSpec]"},
    "RangeConstraint": {"min_val": "int?", "max_val": "int?"},
    "ModuleCallSignature": {"inputs": "list[Argument]", "outputs": "list[Argument]", "in_spec": "str:treespec",
                            "out_spec": "str:treespec", "forward_arg_names": "list[str:ident]? = None"},
    "ModuleCallEntry": {"fqn": "str:fqn0", "signature": "ModuleCallSignature? = None"},
    "NamedTupleDef": {"field_names": "list[str:ident]"},
    "GraphModule": {"graph": "Graph", "signature": "GraphSignature", "module_call_graph": "list[ModuleCallEntry]",
                    "metadata": "dict[token, str:free] = {}",
                    "treespec_namedtuple_fields": "dict[token, NamedTupleDef] = {}"},
    "SchemaVersion": {"major": "int", "minor": "int"},
    # range_constraints keys are symbols or expressions ('2*s77'); torch only looks them up, never parses them
    "ExportedProgram": {"graph_module": "GraphModule", "opset_version": "dict[token, int]",
                        "range_constraints": "dict[text, RangeConstraint]", "schema_version": "SchemaVersion",
                        "verifiers": "list[str:token] = []", "torch_version": "str:token = '<=2.4'",
                        "guards_code": "list[str:guard] = []"},
    "PayloadMeta": {"path_name": "str:token", "is_param": "bool", "use_pickle": "bool",
                    "tensor_meta": "TensorMeta?"},
    "PayloadConfig": {"config": "dict[fqn, PayloadMeta]"},
}

UNIONS: dict[str, dict[str, str]] = {
    "SymExprHint": {"as_int": "int", "as_bool": "bool", "as_float": "float"},
    "SymInt": {"as_expr": "SymExpr", "as_int": "int"},
    "SymFloat": {"as_expr": "SymExpr", "as_float": "float"},
    "SymBool": {"as_expr": "SymExpr", "as_bool": "bool"},
    "SymIntArgument": {"as_name": "str:ident", "as_int": "int"},
    "SymFloatArgument": {"as_name": "str:ident", "as_float": "float"},
    "SymBoolArgument": {"as_name": "str:ident", "as_bool": "bool"},
    "OptionalTensorArgument": {"as_tensor": "TensorArgument", "as_none": "bool"},
    "Argument": {
        "as_none": "bool", "as_tensor": "TensorArgument", "as_tensors": "list[TensorArgument]", "as_int": "int",
        "as_ints": "list[int]", "as_float": "float", "as_floats": "list[float]", "as_string": "str:text",
        "as_strings": "list[str:text]", "as_sym_int": "SymIntArgument", "as_sym_ints": "list[SymIntArgument]",
        "as_scalar_type": "enum:ScalarType", "as_memory_format": "enum:MemoryFormat", "as_layout": "enum:Layout",
        "as_device": "Device", "as_bool": "bool", "as_bools": "list[bool]", "as_sym_bool": "SymBoolArgument",
        "as_sym_bools": "list[SymBoolArgument]", "as_graph": "GraphArgument",
        "as_optional_tensors": "list[OptionalTensorArgument]", "as_custom_obj": "CustomObjArgument",
        "as_operator": "str:operator", "as_sym_float": "SymFloatArgument", "as_sym_floats": "list[SymFloatArgument]",
        "as_optional_tensor": "OptionalTensorArgument", "as_complex": "ComplexValue",
        "as_nested_tensors": "list[list[TensorArgument]]", "as_int_lists": "list[list[int]]",
        "as_string_to_argument": "dict[text, Argument]", "as_float_lists": "list[list[float]]",
    },
    "ConstantValue": {"as_none": "bool", "as_int": "int", "as_float": "float", "as_string": "str:text",
                      "as_bool": "bool"},
    "InputSpec": {"user_input": "UserInputSpec", "parameter": "InputToParameterSpec", "buffer": "InputToBufferSpec",
                  "tensor_constant": "InputToTensorConstantSpec", "custom_obj": "InputToCustomObjSpec",
                  "token": "InputTokenSpec", "constant_input": "InputToConstantInputSpec"},
    "OutputSpec": {"user_output": "UserOutputSpec", "loss_output": "LossOutputSpec",
                   "buffer_mutation": "BufferMutationSpec", "gradient_to_parameter": "GradientToParameterSpec",
                   "gradient_to_user_input": "GradientToUserInputSpec",
                   "user_input_mutation": "UserInputMutationSpec", "token": "OutputTokenSpec",
                   "parameter_mutation": "ParameterMutationSpec"},
}

# Types no upload may hold, wherever they stand, and why.
REFUSED: dict[str, str] = {
    "CustomObjArgument": "custom objects (torchbind) are pickled Python objects, which this service does not load",
    "InputToCustomObjSpec": "custom objects (torchbind) are pickled Python objects, which this service does not load",
}

# What one supported torch writes and another lacks ("Type.member" and "Enum.value"): the table is their union.
ONLY_SOME_VERSIONS: dict[str, str] = {
    "Argument.as_float_lists": "torch 2.13 (schema 8.20); not 2.11 (8.17)",
    "ScalarType.33": "torch 2.13 (FLOAT8E8M0FNU); not 2.11",
    "ScalarType.34": "torch 2.13 (UINT32); not 2.11",
    "ScalarType.35": "torch 2.13 (UINT64); not 2.11",
}

ROOTS = ("ExportedProgram", "PayloadConfig")  # models/model.json; the weight and constant configs


@dataclass(frozen=True)
class Type:
    """A parsed type: kind is int, float, bool, str, enum, list, dict or ref; arg the grammar, enum or type name
    (for a dict, the keys' grammar); item the element type of a list or dict."""

    kind: str
    arg: str = ""
    item: Type | None = None
    nullable: bool = False
    text: str = ""


@dataclass(frozen=True)
class Field:
    type: Type
    required: bool


def parse(text: str) -> Type:
    """A type of the little language above."""
    t = text.strip()
    nullable = t.endswith("?")
    body = t[:-1] if nullable else t
    if body.startswith("list[") and body.endswith("]"):
        return Type("list", item=parse(body[5:-1]), nullable=nullable, text=t)
    if body.startswith("dict[") and body.endswith("]"):
        key, _, value = body[5:-1].partition(",")
        if key.strip() not in GRAMMARS:
            raise ValueError(f"unknown key grammar in {text!r}")
        return Type("dict", key.strip(), parse(value), nullable, t)
    if body.startswith("str:"):
        if body[4:] not in GRAMMARS:
            raise ValueError(f"unknown grammar in {text!r}")
        return Type("str", body[4:], None, nullable, t)
    if body.startswith("enum:"):
        if body[5:] not in ENUMS:
            raise ValueError(f"unknown enum in {text!r}")
        return Type("enum", body[5:], None, nullable, t)
    if body in ("int", "float", "bool"):
        return Type(body, "", None, nullable, t)
    if body in STRUCTS or body in UNIONS:
        return Type("ref", body, None, nullable, t)
    raise ValueError(f"unknown type {text!r}")


@lru_cache(maxsize=1)
def fields() -> dict[str, dict[str, Field]]:
    """Every struct's fields and every union's members, parsed (a union member is never required alone)."""
    out: dict[str, dict[str, Field]] = {}
    for name, table in STRUCTS.items():
        out[name] = {}
        for field, text in table.items():
            type_text, eq, _ = text.partition(" = ")
            out[name][field] = Field(parse(type_text), required=not eq)
    for name, members in UNIONS.items():
        out[name] = {member: Field(parse(text), required=False) for member, text in members.items()}
    return out
