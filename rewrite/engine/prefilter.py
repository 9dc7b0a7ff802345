"""Operand prefilters: reject a rule at a node from its raw arguments, before binding.

A rule's root op may occur thousands of times (every ``add``, every ``relu``) while
the pattern asks for a particular producer in one argument (``relu(relu(_))``,
``add(x, neg(y))``) or a literal (``add(x, 0)``). Binding a node normalizes all of
its arguments; the prefilter looks only at those the pattern constrains, read
straight from ``node.args``/``node.kwargs`` at positions computed once per (rule,
root node key): the operand's node key must be one the nested call can bind, the
literal must be equal.

It is only ever a necessary condition. Whenever a position cannot be known from
the form alone (varargs, value conversions, ``getitem``, a module's settings; a
module call's forward input is known: every extractor of ``ops/modules.py`` reads
it from the same place) the filter lets the node through and the matcher decides,
so results never change; ``tests/test_differential.py`` compares against the interpreter, which runs
without prefilters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from torch import fx

from rewrite.engine.compile import CompiledRule, PAlt, PCall, PDefault, PLit
from rewrite.ops import forms_for_key
from rewrite.ops.base import FunctionForm, MethodForm, ModuleForm
from rewrite.ops.forms import same_arg
from rewrite.ops.modules import reads_forward_input

__all__ = ["build_prefilter"]

_NODE = fx.Node
_ABSENT = object()

#: ``check(matcher, node) -> bool``: False only if the rule cannot match at node.
Prefilter = Callable[[Any, fx.Node], bool]


@attrs.frozen
class _Need:
    """The argument at ``index`` (or keyword ``kwarg``) must be a node with a key in
    ``keys``, or (``keys`` None) equal ``literal`` when it is given."""

    index: int
    kwarg: str
    keys: frozenset | None
    literal: Any = None


def build_prefilter(rule: CompiledRule, key: Any) -> Prefilter | None:
    """A prefilter for ``rule`` at nodes with node key ``key``, or None when nothing
    can be checked cheaply (every node then goes to the matcher)."""
    root = rule.pattern
    if not isinstance(root, PCall):
        return None
    options: list = []  # any option's needs all holding lets the node through
    for alt in root.alts:
        for form in _forms_at(alt, key):
            if not isinstance(form, (FunctionForm, MethodForm, ModuleForm)):
                return None
            for order in _orders(alt):
                needs = _needs(form, order)
                if not needs:
                    return None  # this reading of the node constrains nothing
                options.append(needs)
    if not options:
        return None
    return _checker(tuple(options))


def _forms_at(alt: PAlt, key: Any) -> list:
    if alt.canonical:
        return [form for _, form in forms_for_key(key) if form.op == alt.opdef.name]
    return [form for form in alt.opdef.forms if form.key == key]


def _orders(alt: PAlt) -> list:
    """The argument orders the matcher tries: as written, and for commutative ops
    the first two tensor parameters swapped."""
    swapped = alt.opdef.commuted(alt.args)
    return [alt.args] if swapped is None else [alt.args, swapped]


def _needs(form: Any, order: tuple) -> tuple:
    needs = []
    for param, pat in order:
        if isinstance(pat, PCall):
            keys = _keys_of(pat)
            literal = None
        elif isinstance(pat, (PLit, PDefault)) and param not in getattr(form, "convert", {}):
            keys, literal = None, pat.value
        else:
            continue
        place = _position(form, param)
        if place is not None:
            needs.append(_Need(place[0], place[1], keys, literal))
    return tuple(needs)


def _position(form: Any, param: str) -> tuple | None:
    """(index in node.args, keyword name) of canonical ``param`` in ``form``'s
    target signature; None when the node spells it in a way only binding knows.
    A module call's only known position is its forward input (what the module's
    own extractor reads as ``input``: ``nn.ReLU()(x)``)."""
    if isinstance(form, ModuleForm):
        return (0, "input") if param == "input" and reads_forward_input(form.extract) else None
    if param in form.fixed:
        return None
    names = [t for t in form.signature if form.rename.get(t, t) == param
             and t not in form.guards and t not in form.ignore]
    if len(names) != 1:
        return None
    index = form.signature.index(names[0])
    varargs = getattr(form, "varargs", None)
    if varargs is not None and index >= form.signature.index(varargs):
        return None
    return index, names[0]


def _keys_of(pat: PCall) -> frozenset:
    keys: set = set()
    for alt in pat.alts:
        keys.update(form.key for form in alt.opdef.forms)
    return frozenset(keys)


def _producer_test(keys: frozenset) -> Callable[[Any, Any], bool]:
    """``test(matcher, value)``: value is a node with one of ``keys``. Function
    targets are compared by identity (what an OpOverload's equality is; hashing
    one runs Python code), other keys through the matcher's node key."""
    functions = frozenset(id(t) for op, t in keys if op == "call_function")
    others = frozenset(k for k in keys if k[0] != "call_function")

    def test(matcher: Any, value: Any) -> bool:
        if not isinstance(value, fx.Node):
            return False
        if value.op == "call_function":
            return id(value.target) in functions
        return bool(others) and matcher.key(value) in others

    return test


def _checker(options: tuple) -> Prefilter:
    # (index, keyword, producer test or None, literal) per need, per option
    compiled = tuple(tuple((need.index, need.kwarg, None if need.keys is None else _producer_test(need.keys),
                            need.literal) for need in needs) for needs in options)

    def check(matcher: Any, node: fx.Node) -> bool:
        args = node.args
        n = len(args)
        try:
            for needs in compiled:
                for index, kwarg, producer, literal in needs:
                    value = args[index] if index < n else node.kwargs.get(kwarg, _ABSENT)
                    if producer is not None:
                        if not producer(matcher, value):
                            break
                    elif value is not _ABSENT and (value.__class__ is _NODE or not same_arg(literal, value)):
                        break  # a literal is never a node
                else:
                    return True
        except TypeError:  # an unhashable target: let the matcher decide
            return True
        return False

    return check
