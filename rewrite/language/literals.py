"""Which literals an op's parameter can take (the check behind E206).

The canonical signatures of the op vocabulary (``rewrite.ops``) name parameters and
mark tensors (``input: T``), but do not type the others (``dim``, ``dtype``). Their
types are in the aten schemas of the op's forms: ``softmax``'s ``dim`` is
``aten.softmax.int``'s ``int dim``, ``to``'s ``dtype`` is ``aten.to.dtype``'s
``ScalarType dtype``. A parameter's type is the union over every form that calls an
aten overload directly (``aten.softmax.int``, ``getitem(aten.max.dim(...), 0)``);
forms without a schema (Python functions, ``nn`` modules, methods) add nothing, and a
form that converts the parameter on the way (``convert=``) or packs it into varargs
makes its type unknown. An unknown type accepts every literal.

The check is deliberately conservative: a literal is refused only when no typed
form can take it, and only for the kinds of values torch's own argument parser
always refuses there: a string where a number, a dtype or a list is expected, a
number where a dtype or a string is expected, a float where an int is expected, a
dtype anywhere but a dtype, None where nothing is optional. Ints are valid floats,
bools valid ints and ints valid bools (aten accepts them), a single value is valid
for a list parameter (``int[2] stride=1``), and a tensor parameter takes any number.

Example::

    >>> from rewrite.ops import lookup_op
    >>> from rewrite.language import ast
    >>> types = param_types(lookup_op("softmax"))
    >>> refusal(types["dim"], ast.Literal("a"), optional=False)
    (Literal(value='a'), 'an int')
"""

from __future__ import annotations

import types
from typing import Any

from rewrite.language import ast

__all__ = ["param_types", "refusal", "describe"]

# (id(opdef)) -> (opdef, types): holding the OpDef keeps its id from being reused
_CACHE: dict = {}

_SCALARS = {
    "Tensor": "tensor", "int": "int", "SymInt": "int", "float": "float", "bool": "bool", "str": "str",
    "number": "number", "Scalar": "number", "ScalarType": "dtype",
}


def param_types(opdef: Any) -> dict:
    """Canonical parameter name -> a tuple of types (one per typed form), or None
    when the type is unknown (some form cannot be read, or no form has a schema)."""
    hit = _CACHE.get(id(opdef))
    if hit is not None and hit[0] is opdef:
        return hit[1]
    types = _compute(opdef)
    if len(_CACHE) > 4096:
        _CACHE.clear()
    _CACHE[id(opdef)] = (opdef, types)
    return types


def _compute(opdef: Any) -> dict:
    import torch

    builtin = _builtin_types(opdef)
    if builtin is not None:
        return builtin
    found: dict = {p.name: [] for p in opdef.params}
    unknown: set = set()
    for form in opdef.forms:
        target = getattr(form, "target", None) or getattr(form, "inner_target", None)
        if not isinstance(target, torch._ops.OpOverload):
            continue
        arguments = [a for a in target._schema.arguments if not a.is_out]
        signature = tuple(getattr(form, "signature", ()))
        if len(arguments) != len(signature):
            continue
        convert = getattr(form, "convert", {}) or {}
        varargs = getattr(form, "varargs", None)
        ignore = set(getattr(form, "ignore", ())) | set(getattr(form, "guards", {}))
        rename, fixed = getattr(form, "rename", {}) or {}, getattr(form, "fixed", {}) or {}
        for name, arg in zip(signature, arguments):
            if name in ignore:
                continue
            canonical = rename.get(name, name)
            if canonical not in found or canonical in fixed:
                continue
            typ = _parse(str(getattr(arg, "real_type", arg.type)))
            if typ is not None and not _numbers_as_tensors(target):
                typ = _strict_tensor(typ)
            if typ is None or canonical in convert or name == varargs:
                unknown.add(canonical)
            else:
                found[canonical].append(typ)
    return _table(found, unknown)


#: what a C-bound torch function or Tensor method is (``torch.zeros_like``, ``Tensor.to``)
_C_BOUND = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)


def _builtin_types(opdef: Any) -> dict | None:
    """The types of an op from outside the vocabulary whose every form is a C-bound
    torch function or Tensor method (``torch.zeros_like``, ``Tensor.new_zeros``): its
    signature was read from one aten schema of its name, and torch's argument parser
    takes what any overload of that name takes, so a parameter takes a literal some
    overload takes at its name or at its position (``x.to("cpu")`` is ``to.device``).
    Numbers pass for tensors (the parser wraps them). None for any other op."""
    from rewrite.ops.forms import FunctionForm, MethodForm
    from rewrite.ops.resolve import aten_packet

    names = set()
    for form in opdef.forms:
        if isinstance(form, MethodForm):
            names.add(form.method)
        elif isinstance(form, FunctionForm) and isinstance(form.target, _C_BOUND):
            names.add(form.target.__name__)
        else:
            return None
    packet = aten_packet(next(iter(names))) if len(names) == 1 else None
    if packet is None:
        return None
    params = [p.name for p in opdef.params]
    found: dict = {name: [] for name in params}
    unknown: set = set()
    for overload in packet.overloads():
        schema = getattr(packet, overload)._schema
        if any(a.is_out for a in schema.arguments):
            continue
        arguments = list(schema.arguments)
        for position, name in enumerate(params):
            at = [a for a in arguments if a.name == name]
            if position < len(arguments) and not arguments[position].kwarg_only:
                at.append(arguments[position])
            for arg in at:
                typ = _parse(str(getattr(arg, "real_type", arg.type)))
                if typ is None:
                    unknown.add(name)
                else:
                    found[name].append(typ)
    return _table(found, unknown)


def _table(found: dict, unknown: set) -> dict:
    """Parameter -> its types, deduplicated in order; None where one was unknown or none was found."""
    return {name: (tuple(dict.fromkeys(ts)) if ts and name not in unknown else None) for name, ts in found.items()}


def _numbers_as_tensors(target: Any) -> bool:
    """Whether torch's argument parser takes a number for a Tensor argument of this
    overload (it does for a few arithmetic ops: ``aten.add.Tensor(x, 2)``)."""
    import torch

    name = target._schema.name.split("::")[-1]
    return bool(torch._C._should_allow_numbers_as_tensors(name))


def _strict_tensor(typ: Any) -> Any:
    """``typ`` with each Tensor made one that refuses numbers."""
    if typ == "tensor":
        return "tensor_only"
    if isinstance(typ, tuple):
        return (typ[0], _strict_tensor(typ[1]))
    return typ


def _parse(text: str) -> Any:
    """``"Optional[List[int]]"`` -> ``("opt", ("list", "int"))``; None when unknown."""
    text = text.strip()
    for wrap, tag in (("Optional[", "opt"), ("List[", "list")):
        if text.startswith(wrap) and text.endswith("]"):
            inner = _parse(text[len(wrap):-1])
            return None if inner is None else (tag, inner)
    return _SCALARS.get(text)


def _is_literal(e: object) -> bool:
    return isinstance(e, (ast.Literal, ast.DTypeLit, ast.TupleLit, ast.ListLit))


def _fits(typ: Any, e: object) -> object | None:
    """None when literal ``e`` may be a value of ``typ``; else the offending
    literal (``e`` or an item of it)."""
    if not _is_literal(e) or typ is None:
        return None
    if isinstance(typ, tuple) and typ[0] == "opt":
        if isinstance(e, ast.Literal) and e.value is None:
            return None
        return _fits(typ[1], e)
    if isinstance(typ, tuple):  # a list: a sequence of items, or one item (int[2] stride=1)
        if isinstance(e, (ast.TupleLit, ast.ListLit)):
            for item in e.items:
                bad = _fits(typ[1], item)
                if bad is not None:
                    return bad
            return None
        return _fits(typ[1], e)
    if isinstance(e, (ast.TupleLit, ast.ListLit)):
        return None if typ in ("tensor", "tensor_only") else e
    if isinstance(e, ast.DTypeLit):
        return None if typ == "dtype" else e
    v = e.value
    if v is None:
        return e
    if isinstance(v, str):
        return None if typ == "str" else e
    if isinstance(v, (bool, int)):
        return None if typ in ("tensor", "number", "int", "float", "bool") else e
    if isinstance(v, float):
        return None if typ in ("tensor", "number", "float") else e
    return None


def refusal(types: Any, e: object, optional: bool) -> tuple | None:
    """``(offending literal, what the parameter takes)`` when literal ``e`` can be no
    value of a parameter of ``types`` (from ``param_types``); None when it may be.
    ``optional``: the canonical parameter defaults to None, so None is valid."""
    if types is None or not _is_literal(e):
        return None
    if optional and isinstance(e, ast.Literal) and e.value is None:
        return None
    bad = None
    for typ in types:
        bad = _fits(typ, e)
        if bad is None:
            return None
    return bad, _expected(types, optional)


_NAMES = {"tensor": "a tensor", "tensor_only": "a tensor", "number": "a number", "int": "an int", "float": "a float",
          "bool": "True or False", "str": "a string", "dtype": "a dtype"}
_PLURALS = {"tensor": "tensors", "tensor_only": "tensors", "number": "numbers", "int": "ints", "float": "floats",
            "bool": "bools", "str": "strings", "dtype": "dtypes"}


def _expected(types: tuple, optional: bool) -> str:
    parts: list = []
    for typ in types:
        if isinstance(typ, tuple) and typ[0] == "opt":
            optional = True
            typ = typ[1]
        if isinstance(typ, tuple):
            inner = typ[1][1] if isinstance(typ[1], tuple) else typ[1]
            text = f"a list of {_PLURALS.get(inner, 'values')}"
        else:
            text = _NAMES[typ]
        if text not in parts:
            parts.append(text)
    if "a tensor" in parts and "a number" in parts:
        parts.remove("a number")
        parts[parts.index("a tensor")] = "a tensor or a number"
    if optional:
        parts.append("None")
    return " or ".join(parts) if len(parts) < 3 else ", ".join(parts[:-1]) + " or " + parts[-1]


def describe(e: object) -> str:
    """A literal in words: ``the string "a"``, ``the int 3``, ``torch.float16``."""
    from rewrite.language.printer import format_expr

    if isinstance(e, ast.DTypeLit):
        return f"the dtype {format_expr(e)}"
    if isinstance(e, ast.TupleLit):
        return "a tuple"
    if isinstance(e, ast.ListLit):
        return "a list"
    v = e.value
    if v is None:
        return "None"
    if isinstance(v, bool):
        return f"{v}"
    kind = {str: "string", int: "int", float: "float"}.get(type(v), type(v).__name__)
    return f"the {kind} {format_expr(e)}"
