"""Surface forms with the extras real captured graphs need, and their emission.

``rewrite.ops.base`` binds a call whose target has a plain signature. Real graphs
need a little more, and each extra here exists because a capture level produces it:

* ``varargs``: ``x.view(2, -1)`` and ``x.view((2, -1))`` are the same call
  (``call_method`` keeps Python's varargs spelling; ``aten.view`` takes a list).
* ``check``: a predicate over the target's arguments that tells ops apart which
  share a target: ``x.to(torch.float16)`` is a cast, ``x.to("cuda")`` is not;
  ``x.view(torch.int32)`` reinterprets bits and is not ``view(x, shape)``.
* ``OneOf`` guards: ``clone`` with ``memory_format`` ``None`` or ``preserve_format``
  both mean a plain clone.
* ``convert``: value spellings that differ between levels (``aten.max_pool2d``
  writes "stride = kernel size" as ``[]`` where ``F.max_pool2d`` writes ``None``);
  a pair (to canonical, to target) so emission can undo it.
* emission metadata (``kwonly``, ``fill``, ``defaults``) so ``call_for`` can turn
  canonical arguments back into a valid call of exactly this target, dropping
  trailing arguments that equal the target's defaults.

The classes subclass the base forms, so ``isinstance(form, FunctionForm)`` and the
base ``bind`` keep working for code that only knows ``base``.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import attrs
import torch
import torch.fx as fx

from rewrite.ops.base import (
    REQUIRED, FunctionForm, GetitemForm, MethodForm, OpDef, bind_signature,
)

__all__ = ["OneOf", "Fn", "Method", "Item", "EmitError", "call_for", "same_value", "same_arg", "literal_expansion"]

_MISSING = object()


class EmitError(ValueError):
    """Canonical arguments that this target cannot express (e.g. ``Tensor.float``
    asked to cast to ``float16``)."""


class OneOf(tuple):
    """A guard value that accepts any of several spellings; emits the first."""

    def __new__(cls, *values: Any) -> "OneOf":
        return super().__new__(cls, values)

    def accepts(self, value: Any) -> bool:
        for v in self:
            if same_value(value, v):
                return True
        return False


#: literal types compared by ``==`` alone (exactly these classes: a subclass takes the long way)
_PLAIN_SCALARS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.memory_format, torch.layout,
                            torch.device})
_NUMBERS = frozenset({int, float})


def same_value(a: Any, b: Any) -> bool:
    """Literal equality that treats lists and tuples alike, never confuses a bool
    with an int, and never calls ``==`` on graph nodes or tensors."""
    ka, kb = a.__class__, b.__class__
    if ka in _PLAIN_SCALARS and kb in _PLAIN_SCALARS:  # the common case, without isinstance
        if ka is kb:
            return a == b
        return ka in _NUMBERS and kb in _NUMBERS and a == b  # 1 == 1.0; a bool is never an int
    if isinstance(a, (fx.Node, torch.Tensor)) or isinstance(b, (fx.Node, torch.Tensor)):
        return a is b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return False
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    numbers = isinstance(a, (int, float)) and isinstance(b, (int, float))
    try:
        return bool((type(a) is type(b) or numbers) and a == b)
    except Exception:  # exotic objects with odd __eq__
        return a is b


def same_arg(a: Any, b: Any, expand: str = "any") -> bool:
    """``same_value``, and an int equals a list of itself as ``expand`` says (what
    the parameter takes: ``literal_expansion``): ``"any"``, a per-dimension
    parameter, ``1``, ``(1, 1)`` and ``[1, 1]`` all say "stride 1" (nn modules, ``F``
    calls and aten spell it so); ``"one"``, a dim or a size, only the one-element
    list (``x.mean(0)`` is export's ``[0]``; ``2`` is not ``[2, 2]``); ``"none"``,
    never (``split(x, 2)`` is pieces of 2, ``split(x, [2])`` one piece of 2); ``"list"`` or
    ``"tuple"``, only a sequence of that kind (a getitem index)."""
    if expand in ("list", "tuple"):  # a getitem index as written: x[(0, 1)] is not x[[0, 1]]
        return (not isinstance(b, (list, tuple)) or isinstance(b, list) == (expand == "list")) and same_value(a, b)
    if same_value(a, b):
        return True
    if expand == "none":
        return False
    for one, many in ((a, b), (b, a)):
        if isinstance(one, int) and not isinstance(one, bool) and isinstance(many, (list, tuple)) and many:
            return (expand == "any" or len(many) == 1) and all(same_value(one, m) for m in many)
    return False


#: parameters torch expands from one int to one per spatial dimension
_PER_DIMENSION = frozenset({"stride", "padding", "dilation", "output_padding", "kernel_size", "output_size"})
_PER_DIMENSION_OF = frozenset({("interpolate", "size"), ("interpolate", "scale_factor")})
#: parameters where an int is the one-element list of it: dims and sizes
_ONE_ELEMENT = frozenset({"dim", "dims", "shape", "size", "normalized_shape", "shifts", "repeats"})


_STRICTNESS = {"none": 0, "one": 1, "any": 2}


def strictest_expansion(*modes: str) -> str:
    """The strictest of ``same_arg`` expansions (``"none"`` before ``"one"`` before
    ``"any"``): how a variable bound at several arguments equals an int."""
    return min(modes, key=_STRICTNESS.__getitem__)


def literal_expansion(op: str, param: str) -> str:
    """How an int literal at ``op``'s ``param`` compares with a list (``same_arg``'s
    ``expand``): ``"any"`` where torch takes one int for every spatial dimension
    (``stride=2`` is ``[2, 2]``), ``"one"`` at a dim or a size, ``"none"`` elsewhere
    (split sizes, sections, pads, and any parameter nothing here knows)."""
    if param in _PER_DIMENSION or (op, param) in _PER_DIMENSION_OF:
        return "any"
    return "one" if param in _ONE_ELEMENT else "none"


def _guard_ok(value: Any, expected: Any) -> bool:
    if expected.__class__ is OneOf:
        return expected.accepts(value)
    return same_value(value, expected)


def _pack_varargs(args: tuple, at: int) -> tuple:
    """``(x, 2, -1)`` -> ``(x, (2, -1))``; ``(x, (2, -1))`` and ``(x, [2, -1])`` ->
    ``(x, (2, -1))``. A lone node stays as it is (it may hold a whole ``Size``)."""
    if len(args) <= at:
        return args
    rest = args[at:]
    if len(rest) == 1:
        only = rest[0]
        if isinstance(only, (list, tuple)):
            return args[:at] + (tuple(only),)
        if isinstance(only, int) and not isinstance(only, bool):
            return args[:at] + ((only,),)
        return args
    return args[:at] + (tuple(rest),)


# (id(form), id(opdef)) -> (form, opdef, _Plan or False where the general path is
# needed); holding the pair keeps its ids from being reused by ops registered later
_PLANS: dict = {}


@attrs.frozen
class _Plan:
    """Where each canonical argument of a plain form comes from, worked out once:
    ``slots`` are ``(name, signature index or None, value when absent)`` in the
    op's parameter order; ``max_args`` bounds the positional arguments that map
    to a parameter (one more is an argument the op has no name for)."""

    slots: tuple
    max_args: int
    # when the first slots take positional arguments 0, 1, 2... in order and the
    # rest are fixed or defaulted: their names, and for each argument count n the
    # values of slots n.. (None: one is required)
    names: tuple | None = None
    tails: tuple = ()


def _plan_for(form: Any, opdef: OpDef) -> "_Plan | None":
    key = (id(form), id(opdef))
    entry = _PLANS.get(key)
    if entry is None:
        entry = _PLANS[key] = (form, opdef, binding_plan(form, opdef) or False)
    return entry[2] or None


def binding_plan(form: Any, opdef: OpDef) -> "_Plan | None":
    """The plan of a form without varargs, guards, checks or conversions (most
    forms), or None. Binding through it gives what the general path gives
    (``tests/test_ops.py`` compares them on every form)."""
    if form.varargs is not None or form.guards or form.check is not None or form.convert:
        return None
    names = set(opdef.param_names)
    if any(name not in names for name in form.fixed):
        return None
    position: dict = {}
    max_args = len(form.signature)
    for i, target_name in enumerate(form.signature):
        if target_name in form.ignore:
            continue
        name = form.rename.get(target_name, target_name)
        if name in position:
            return None  # two target parameters under one name: the general path decides
        position[name] = i
        if name not in names:
            max_args = min(max_args, i)
    slots = []
    for p in opdef.params:
        if p.name in form.fixed:
            slots.append((p.name, None, form.fixed[p.name]))
        else:
            slots.append((p.name, position.get(p.name), p.default))
    return _Plan(tuple(slots), max_args, *_in_order(slots, max_args))


def _in_order(slots: list, max_args: int) -> tuple:
    """``(names, tails)`` of a plan whose leading slots read arguments 0, 1, ...
    in order and whose other slots read none; ``(None, ())`` otherwise."""
    leading = 0
    while leading < len(slots) and slots[leading][1] == leading:
        leading += 1
    if max_args > leading or any(index is not None for _, index, _ in slots[leading:]):
        return None, ()
    tails = []
    for n in range(max_args + 1):
        rest = slots[n:]
        tails.append(None if any(absent is REQUIRED for _, _, absent in rest)
                     else {name: absent for name, _, absent in rest})
    return tuple(name for name, _, _ in slots[:leading]), tuple(tails)


def _normalize_ext(form: Any, args: tuple, kwargs: dict, opdef: OpDef) -> dict | None:
    """``_FormBase._normalize`` plus varargs, ``OneOf`` guards, checks, conversions."""
    if not kwargs:
        plan = _plan_for(form, opdef)
        if plan is not None:  # the common case, a few times faster
            if len(args) > plan.max_args:
                return None
            n = len(args)
            if plan.names is not None:  # positional arguments in parameter order: no loop
                tail = plan.tails[n]
                if tail is None:
                    return None
                out = dict(zip(plan.names, args))
                out.update(tail)
                return out
            out = {}
            for name, index, absent in plan.slots:
                if index is not None and index < n:
                    out[name] = args[index]
                elif absent is REQUIRED:
                    return None
                else:
                    out[name] = absent
            return out
    return normalize_general(form, args, kwargs, opdef)


def normalize_general(form: Any, args: tuple, kwargs: dict, opdef: OpDef) -> dict | None:
    """Binding without a plan: every feature of the extended forms, any call."""
    if form.varargs is not None:
        args = _pack_varargs(tuple(args), form.signature.index(form.varargs))
    raw = bind_signature(form.signature, tuple(args), dict(kwargs))
    if raw is None:
        return None
    for name, expected in form.guards.items():
        value = raw.get(name, form.defaults.get(name, _MISSING))
        if value is _MISSING or not _guard_ok(value, expected):
            return None
    if form.check is not None and not form.check({**form.defaults, **raw}):
        return None
    out = {}
    for k, v in raw.items():
        if k in form.guards or k in form.ignore:
            continue
        name = form.rename.get(k, k)
        conv = form.convert.get(name)
        out[name] = conv[0](v) if conv else v
    out.update(form.fixed)
    out = opdef.normalize_call((), out)
    return None if out is None else {name: out[name] for name in opdef.param_names}


def _ext(cls: type) -> type:
    """Give a base form class the extra fields and the extended ``_normalize``."""

    @attrs.frozen
    class Ext(cls):
        qualname: str = ""
        aliases: tuple = ()
        named: bool = True
        varargs: str | None = None
        check: Callable | None = None
        convert: dict = attrs.field(factory=dict)
        kwonly: frozenset = frozenset()
        int_lists: dict = attrs.field(factory=dict)
        fill: dict = attrs.field(factory=dict)

        def _normalize(self, args: tuple, kwargs: dict, opdef: OpDef) -> dict | None:
            return _normalize_ext(self, args, kwargs, opdef)

    return Ext


@attrs.frozen
class Fn(_ext(FunctionForm)):
    """``call_function`` of ``target`` (torch, ``F``, ``operator`` or aten)."""


@attrs.frozen
class Method(_ext(MethodForm)):
    """``call_method`` named ``method``; emitted as ``call_function`` of
    ``torch.Tensor.<method>``."""


@attrs.frozen
class Item(_ext(GetitemForm)):
    """``getitem(inner(...), index)`` of a multi-output aten op."""


def _target_of(form: Any) -> Any:
    if isinstance(form, MethodForm):
        return getattr(torch.Tensor, form.method)
    if isinstance(form, FunctionForm):
        return form.target
    raise EmitError(f"{form!r} cannot be emitted as a call_function")


def _is_default(form: Any, name: str, value: Any) -> bool:
    default = form.defaults.get(name, _MISSING)
    if default is _MISSING:
        return False
    if same_value(value, default):
        return True
    # ``int[2] stride=1`` is stored as [1, 1]; 1 means the same
    if isinstance(default, list) and default and not isinstance(value, (list, tuple)):
        return all(same_value(value, d) for d in default)
    return False


def _int_list(form: Any, name: str, value: Any) -> Any:
    n = getattr(form, "int_lists", {}).get(name)
    if n is None or not isinstance(value, int) or isinstance(value, bool):
        return value
    return [value] * n


def call_for(form: Any, args: dict, opdef: OpDef | None = None) -> tuple:
    """Canonical ``args`` -> ``(target, args_tuple, kwargs)`` calling ``form``'s target.

    Inverts binding: guard params get their guard value, ignored params their
    ``fill`` value (or are left to the target's default), renamed params take the
    canonical value back, converters run backwards. Trailing arguments equal to the
    target's defaults are dropped. Raises ``EmitError`` when the form fixes a value
    the arguments contradict, or (given ``opdef``) when an argument that differs from
    its canonical default has no place in this target (``mean(x, dim=1)`` cannot be
    ``aten.mean.default``).
    """
    if opdef is not None:
        placed = {form.rename.get(t, t) for t in form.signature if t not in form.guards and t not in form.ignore}
        for p in opdef.params:
            if p.name not in placed and p.name not in form.fixed and p.name in args:
                if p.default is REQUIRED or not same_value(args[p.name], p.default):
                    raise EmitError(f"{form.qualname or form!r} cannot express {p.name}={args[p.name]!r}")
    for name, value in getattr(form, "fixed", {}).items():
        if not same_value(args.get(name, value), value):
            raise EmitError(f"{form.qualname or form!r} fixes {name}={value!r}, got {args.get(name)!r}")
    convert = getattr(form, "convert", {})
    fill = getattr(form, "fill", {})
    kwonly = getattr(form, "kwonly", frozenset())
    # (target param name, value or _MISSING) in signature order
    values = []
    for tname in form.signature:
        if tname in form.guards:
            expected = form.guards[tname]
            values.append((tname, expected[0] if isinstance(expected, OneOf) else expected))
        elif tname in form.ignore:
            values.append((tname, fill.get(tname, _MISSING)))
        else:
            cname = form.rename.get(tname, tname)
            if cname in form.fixed or cname not in args:
                values.append((tname, _MISSING))
                continue
            value = args[cname]
            if cname in convert:
                value = convert[cname][1](value)
            values.append((tname, value))
    positional, kwargs = [], {}
    keyword_mode = False
    for tname, value in values:
        if value is _MISSING:
            keyword_mode = True
            continue
        if keyword_mode or tname in kwonly:
            kwargs[tname] = value
        else:
            positional.append((tname, value))
    while positional and _is_default(form, *positional[-1]):
        positional.pop()
    kwargs = {k: v for k, v in kwargs.items() if not _is_default(form, k, v)}
    target = _target_of(form)
    if isinstance(target, torch._ops.OpOverload):  # aten wants [1, 1] where Python takes 1
        positional = [(t, _int_list(form, t, v)) for t, v in positional]
        kwargs = {k: _int_list(form, k, v) for k, v in kwargs.items()}
    if target in _NO_KWARGS and kwargs:
        raise EmitError(f"{target} takes no keyword arguments")
    return target, tuple(v for _, v in positional), kwargs


_NO_KWARGS = {getattr(operator, n) for n in dir(operator) if not n.startswith("_")}
