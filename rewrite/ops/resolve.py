"""Qualified names to torch objects, and call signatures from schemas.

The vocabulary table names every surface by the string a rule author would write
(``"F.conv2d"``, ``"aten.conv2d.default"``, ``"Tensor.view"``, ``"nn.Conv2d"``), so
the table doubles as the index of qualified names. This module turns such a string
into the object (``resolve``), spells user input one way (``normalize_qualname``:
``torch.nn.functional.relu`` -> ``F.relu``), and reads a target's parameter names,
defaults and keyword-only set (``signature_of``): from the aten schema for
``OpOverload``s and for C-bound torch functions and ``Tensor`` methods (which take
their Python signature from the aten schema of the same name), from ``inspect`` for
Python functions in ``torch.nn.functional``, or from a written signature string.

``resolve`` trusts its input (table strings only). Names from rule files go through
``rewrite.ops.generic``, which checks them against an allowlist first.
"""

from __future__ import annotations

import ast
import inspect
import operator
import re
from typing import Any

import attrs
import torch
import torch.nn.functional as F

__all__ = ["Sig", "ROOTS", "normalize_qualname", "resolve", "signature_of", "parse_sig", "aten_overload", "aten_packet"]

_ROOTS = {
    "aten": lambda: torch.ops.aten,
    "F": lambda: F,
    "nn": lambda: torch.nn,
    "torch": lambda: torch,
    "Tensor": lambda: torch.Tensor,
    "operator": lambda: operator,
    "quantized_decomposed": lambda: _decomposed_ops(),
}


#: the roots of qualified names the vocabulary knows; any other root names a
#: ``torch.library`` namespace (``rewrite.ops.custom``)
ROOTS = frozenset(_ROOTS)


def _decomposed_ops() -> Any:
    """``torch.ops.quantized_decomposed``: the PT2E quantize/dequantize ops, which
    torch registers when their module is imported."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the ops)

    return torch.ops.quantized_decomposed

# user spellings -> the one spelling the table uses (longest prefix first)
_PREFIXES = (
    ("torch.ops.aten.", "aten."),
    ("torch.ops.quantized_decomposed.", "quantized_decomposed."),
    ("torch.nn.functional.", "F."),
    ("nn.functional.", "F."),
    ("torch.nn.", "nn."),
    ("torch.Tensor.", "Tensor."),
    ("torch.ops.", ""),  # a torch.library namespace: torch.ops.mylib.f -> mylib.f
)

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def normalize_qualname(name: str) -> str | None:
    """One spelling per surface, or None if ``name`` is not a dotted identifier path
    or contains a dunder anywhere (``torch.__class__``, ``__import__``)."""
    name = name.strip()
    if not _NAME.match(name) or "__" in name:
        return None
    for long, short in _PREFIXES:
        if name.startswith(long):
            return short + name[len(long):]
    return name


def resolve(qualname: str) -> Any:
    """The object a (trusted, table) qualified name denotes; raises on failure. A
    root that is not one of the table's (``mylib.f``) is a ``torch.ops`` namespace:
    ``rewrite.ops.custom`` checks the registry before it resolves such a name."""
    root, *path = qualname.split(".")
    obj = _ROOTS[root]() if root in _ROOTS else getattr(torch.ops, root)
    for part in path:
        obj = getattr(obj, part)
    return obj


@attrs.frozen
class Sig:
    """A target's call signature: names in positional order, defaults, the names
    that are keyword-only, the names typed as tensors, the varargs name, and the
    ``int[N]`` parameters with their N (aten overloads take no bare int there)."""

    names: tuple
    defaults: dict = attrs.field(factory=dict)
    kwonly: frozenset = frozenset()
    tensors: frozenset = frozenset()
    varargs: str | None = None
    int_lists: dict = attrs.field(factory=dict)


def parse_sig(text: str) -> Sig:
    """A written signature: ``"self, *size"``, ``"input: T, p=0.5, *, inplace=False"``.

    Annotate a parameter ``: T`` to mark it a tensor. Defaults are Python literals.
    """
    fn = ast.parse(f"def _({text}): pass").body[0].args
    positional = list(fn.posonlyargs) + list(fn.args)
    names = [a.arg for a in positional]
    defaults = {
        a.arg: ast.literal_eval(d) for a, d in zip(positional[len(positional) - len(fn.defaults):], fn.defaults)
    }
    varargs = None
    if fn.vararg is not None:
        varargs = fn.vararg.arg
        names.append(varargs)
    kwonly = [a.arg for a in fn.kwonlyargs]
    names += kwonly
    defaults.update({a.arg: ast.literal_eval(d) for a, d in zip(fn.kwonlyargs, fn.kw_defaults) if d is not None})
    tensors = {
        a.arg for a in positional + list(fn.kwonlyargs)
        if isinstance(a.annotation, ast.Name) and a.annotation.id == "T"
    }
    return Sig(tuple(names), defaults, frozenset(kwonly), frozenset(tensors), varargs)


def _is_tensor_type(t: Any) -> bool:
    return "Tensor" in str(t)


def schema_sig(overload: Any, self_name: str = "self") -> Sig:
    """Signature of an ``OpOverload`` from its schema, without ``out`` arguments;
    ``self`` renamed to ``self_name`` (Python functions call it ``input``)."""
    names, defaults, kwonly, tensors, int_lists = [], {}, set(), set(), {}
    for a in overload._schema.arguments:
        if a.is_out:
            continue
        name = self_name if a.name == "self" else a.name
        names.append(name)
        if str(a.type) in ("List[int]", "Optional[List[int]]"):
            int_lists[name] = a.N or 1
        if a.has_default_value():
            defaults[name] = a.default_value
        if a.kwarg_only:
            kwonly.add(name)
        if _is_tensor_type(a.type):
            tensors.add(name)
    return Sig(tuple(names), defaults, frozenset(kwonly), frozenset(tensors), int_lists=int_lists)


_PREFERRED_OVERLOADS = ("default", "Tensor", "int", "input", "self", "using_ints", "dim")
#: ops whose ``default`` overload is not how Python calls them: ``torch.where(c, x, y)``
#: is ``where.self`` (``where.default`` is the one-argument ``nonzero`` form)
_PYTHON_OVERLOADS = {"where": "self"}


def aten_packet(name: str) -> Any | None:
    """``torch.ops.aten.<name>`` when aten has an op of that name, else None."""
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None
    return packet if isinstance(packet, torch._ops.OpOverloadPacket) else None


def aten_overload(name: str, overload: str | None = None) -> Any | None:
    """``torch.ops.aten.<name>.<overload>``; without ``overload`` the first of
    ``default``, ``Tensor``, ``int``, ... (else any without ``out``) whose first
    argument is a tensor."""
    packet = aten_packet(name)
    if packet is None:
        return None
    if name in _UNSAFE or name.lstrip("_") in _UNSAFE:
        return None
    names = packet.overloads()
    if overload is not None:
        ordered = [overload] if overload in names else []
    else:
        preferred = (_PYTHON_OVERLOADS[name],) if name in _PYTHON_OVERLOADS else _PREFERRED_OVERLOADS
        ordered = [n for n in preferred if n in names] + [n for n in names if "out" not in n]
    for ov in ordered:
        # Only ops that compute on a tensor they are given: this skips TorchScript
        # scalar overloads (add.default(int a, int b)) and, for safety, factories
        # and file readers (aten.from_file, aten.empty) whose first argument is not
        # a tensor, named with or without an explicit overload.
        op = getattr(packet, ov)
        args = op._schema.arguments
        if args and _is_tensor_type(args[0].type) and not any(a.is_out for a in args):
            return op
    return None


#: aten ops with effects outside the graph's values (I/O, printing, assertions
#: that abort, synchronizing): never nameable from a rule file.
_UNSAFE = frozenset({
    "from_file", "print", "save", "load", "assert_async", "assert_scalar", "assert_tensor_metadata",
    "functional_assert_async", "functional_assert_scalar", "local_scalar_dense",
})


def _inspect_sig(fn: Any) -> Sig | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    names, defaults, kwonly, tensors, varargs = [], {}, set(), set(), None
    for p in params:
        if p.kind is p.VAR_KEYWORD:
            return None  # a dispatcher (F.max_pool2d): write its signature out
        if p.kind is p.VAR_POSITIONAL:
            if varargs is not None or not names:
                return None
            varargs = p.name
        names.append(p.name)
        if p.default is not p.empty:
            defaults[p.name] = p.default
        if p.kind is p.KEYWORD_ONLY:
            kwonly.add(p.name)
        if "Tensor" in str(p.annotation) or p.name == "input":
            tensors.add(p.name)
    return Sig(tuple(names), defaults, frozenset(kwonly), frozenset(tensors), varargs)


def signature_of(qualname: str, target: Any, overload: str | None = None) -> Sig | None:
    """How ``target`` (reached by ``qualname``) is called, or None if unknown.

    ``Tensor.m`` keeps ``self`` first (the ``call_method`` receiver); C-bound torch
    functions call it ``input``, as their Python binding does.
    """
    if isinstance(target, torch._ops.OpOverload):
        return schema_sig(target)
    if isinstance(target, torch._ops.OpOverloadPacket):  # called as torch.ops.ns.f(...)
        return schema_sig(getattr(target, overload or "default"))
    if inspect.isfunction(target):
        return _inspect_sig(target)
    leaf = qualname.rsplit(".", 1)[-1]
    is_method = qualname.startswith("Tensor.")
    schema_target = aten_overload(leaf, overload)
    if schema_target is None:
        return None
    if is_method:
        return _spread_int_list(schema_sig(schema_target, "self"))
    return schema_sig(schema_target, "input")


def _spread_int_list(sig: Sig) -> Sig:
    """A method whose only positional parameter after ``self`` is an int list also
    takes it spread out: ``x.repeat(2, 1)`` is ``x.repeat([2, 1])`` (torch's Python
    binding allows it there, ``allow_varargs_intlist``), so its nodes spell it both
    ways and the forms must pack the spread spelling to match it."""
    positional = [n for n in sig.names[1:] if n not in sig.kwonly]
    if len(positional) == 1 and sig.int_lists.get(positional[0]) is not None:
        return attrs.evolve(sig, varargs=positional[0])
    return sig
