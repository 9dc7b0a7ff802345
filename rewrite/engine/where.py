"""Where clauses compiled to closures.

A rule's ``where`` clause is turned once, when the rule is compiled, into nested
Python closures ``f(env, facts) -> True | False | UNKNOWN``; matching calls them
instead of walking the AST on every candidate. Registered functions are looked up at
compile time too (the rule file was checked, so they exist).

Semantics (three-valued, as docs/language.md states): a query or predicate that
returns None is ``UNKNOWN``; ``not UNKNOWN`` and any comparison with an unknown side
are ``UNKNOWN``; ``and`` is False if any side is False, else UNKNOWN if any is; ``or``
dually. A rule fires only on True.
"""

from __future__ import annotations

import functools
import numbers
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from rewrite.engine.symbolic import decide
from rewrite.engine.dtypes import DTYPES
from rewrite.engine.facts import Value, showing_copies
from rewrite.functions.registry import is_builtin, lookup_function
from rewrite.language import ast
from rewrite.ops.base import ConstRef, by_identity
from rewrite.ops.forms import same_arg, strictest_expansion

__all__ = ["UNKNOWN", "PredicateError", "compile_where", "where_function", "plain"]


class PredicateError(Exception):
    """A function registered outside the library raised in a where clause: the
    clause does not hold (as for any undecidable constraint), and the matcher
    keeps the message so the rule's stats can show it."""


def _reporting(fn: Callable, name: str) -> Callable:
    """A user's ``fn`` whose exceptions become ``PredicateError``s naming it, and
    which reads copies of the model's constants (``showing_copies``)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            with showing_copies():
                return fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - reported, then the clause does not hold
            raise PredicateError(f"{name}() raised {type(err).__name__}: {err}") from err
    return call


def _answering(fn: Callable, name: str) -> Callable:
    """A user's predicate whose answer is a truth value: True, False or None
    (unknown), and the unambiguous spellings of one (``numpy.bool_``, an integer, a
    one-element tensor of real values: ``(w.abs() < 1e3).all()``). Anything else (a
    tensor of several values, a FakeTensor, a string) is a ``PredicateError`` the
    rule's stats show, not a clause that silently never holds."""
    def call(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        if result is None or result is True or result is False:
            return result
        if isinstance(result, torch.Tensor) and result.numel() == 1 and not _is_fake(result) \
                and not result.is_complex():
            return bool(result.item())
        if isinstance(result, numbers.Integral) or (type(result).__module__ == "numpy"
                                                    and type(result).__name__ in ("bool", "bool_")):
            return bool(result)
        raise PredicateError(f"{name}() returned {type(result).__name__}, not True, False or None")
    return call


def _is_fake(t: torch.Tensor) -> bool:
    """A tensor without values (a FakeTensor or a meta tensor): its truth is not known."""
    return t.is_meta or isinstance(t, FakeTensor)


class _Unknown:
    """The truth value of a fact nobody knows."""

    def __repr__(self) -> str:
        return "UNKNOWN"

    def __bool__(self) -> bool:  # never silently taken as True or False
        raise TypeError("an unknown fact has no truth value")


UNKNOWN: Any = _Unknown()

Compiled = Callable[[dict, Any], Any]


def plain(v: Any) -> Any:
    """A comparable Python value: literals unwrapped from Value; graph values stay."""
    if isinstance(v, Value):
        return v.operand if v.is_literal else v
    return v


def _same_operand(a: Any, b: Any) -> bool:
    import torch.fx as fx

    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        if a is b:
            return True
    return same_arg(a, b)


def _equal(a: Any, b: Any, expand: str = "any") -> bool:
    """``a == b`` in a where clause; ``expand`` as ``same_arg`` takes it: ``"any"``
    where a side is a pattern variable (``s == 1`` for a stride bound as
    ``[1, 1]``), ``"none"`` between computed values (``shape(x) == 8`` is no shape
    ``[8, 8]``)."""
    if isinstance(a, Value):
        return _same_operand(a.operand, getattr(b, "operand", b))
    if _symbolic(a) or _symbolic(b):
        return _symbolic_equal(a, b, expand)
    return same_arg(a, b, expand)


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _symbolic(v: Any) -> bool:
    """A symbolic size (``s17``), or a list of values holding one (a shape)."""
    if isinstance(v, (list, tuple)):
        return any(_symbolic(x) for x in v)
    return isinstance(v, _SYMBOLIC)


def _symbolic_equal(a: Any, b: Any, expand: str = "any") -> bool:
    """``same_arg`` where a side holds symbolic sizes: asked of the ShapeEnv (a
    where clause runs under ``rewrite.engine.symbolic.deciding``), so a size equal
    to a literal for some sizes only makes the clause unknown, never False (``!=``
    would then hold for the example's own size)."""
    sequences = isinstance(a, (list, tuple)), isinstance(b, (list, tuple))
    if all(sequences):
        return len(a) == len(b) and all(_symbolic_equal(x, y) for x, y in zip(a, b))
    if any(sequences) and expand == "none":
        return False
    if any(sequences):  # a per-dimension int equals its expansion (same_arg)
        one, many = (b, a) if sequences[0] else (a, b)
        return bool(many) and isinstance(one, (int, torch.SymInt)) and not isinstance(one, bool) \
            and all(_symbolic_equal(one, m) for m in many)
    if isinstance(a, (fx.Node, torch.Tensor)) or isinstance(b, (fx.Node, torch.Tensor)):
        return a is b
    if not (isinstance(a, _SYMBOLIC) or isinstance(b, _SYMBOLIC)):
        return same_arg(a, b)  # the static dims of a shape with a symbolic one
    if not (isinstance(a, _SIZES) and isinstance(b, _SIZES)):
        return False  # a size is no string, None or list
    return decide("==", a, b)


def _contains(items: Any, v: Any) -> bool:
    """``v in items``, each element compared as ``==`` compares (a symbolic size is
    in ``(0, 3)`` only if it is one of them for every size)."""
    try:
        return any(_equal(v, item) for item in items)
    except TypeError:  # not a collection: Python's own answer (an error)
        return v in items


_SIZES = (int, float, torch.SymInt, torch.SymFloat)


def _ordering(op: str, plain: Any) -> Any:
    """``<``, ``<=``, ``>``, ``>=``: for symbolic sizes, what holds for every size."""
    def compare(a: Any, b: Any) -> Any:
        if (isinstance(a, _SYMBOLIC) or isinstance(b, _SYMBOLIC)) and isinstance(a, _SIZES) \
                and isinstance(b, _SIZES):
            return decide(op, a, b)
        return plain(a, b)
    return compare


def _strictly_equal(a: Any, b: Any) -> bool:
    return _equal(a, b, "none")


def _strictly_unequal(a: Any, b: Any) -> bool:
    return not _equal(a, b, "none")


_COMPARE = {
    "==": _equal,
    "!=": lambda a, b: not _equal(a, b),
    "<": _ordering("<", operator.lt),
    "<=": _ordering("<=", operator.le),
    ">": _ordering(">", operator.gt),
    ">=": _ordering(">=", operator.ge),
    "in": lambda a, b: _contains(b, a) if _symbolic(a) or _symbolic(b) else a in b,
    "not in": lambda a, b: not _contains(b, a) if _symbolic(a) or _symbolic(b) else a not in b,
}


def _graph_value(v: Any) -> bool:
    """A value computed when the model runs (a node, a constant tensor): what it
    holds is not known when the rule is matched."""
    return (isinstance(v, Value) and not v.is_literal) or isinstance(v, (fx.Node, ConstRef))


def _holds_graph_value(v: Any) -> bool:
    """``v`` is a graph value or a sequence holding one, at any depth (``(c, 1)``;
    a size list whose dims are nodes in a dynamo graph)."""
    if isinstance(v, Value) and v.is_literal:
        v = v.operand
    return _graph_value(v) or (isinstance(v, (list, tuple)) and any(_holds_graph_value(i) for i in v))


def _about_graph_values(op: str, a: Any, b: Any) -> Any:
    """A comparison with a graph value on a side: a value is equal to itself (the
    same node bound twice), anything else about its contents is unknown (``c != 0``
    for a tensor ``c`` would hold whatever it holds when the model runs)."""
    if op in ("==", "!="):
        if _graph_value(a) and _graph_value(b) and _same_operand(_operand(a), _operand(b)):
            return op == "=="
        return UNKNOWN
    if op in ("in", "not in") and _graph_value(a) and isinstance(b, (list, tuple)) and any(
            _graph_value(i) and _same_operand(_operand(a), _operand(i)) for i in b):
        return op == "in"
    return UNKNOWN


def _operand(v: Any) -> Any:
    return v.operand if isinstance(v, Value) else v


def _truth(v: Any) -> Any:
    if v is UNKNOWN or isinstance(v, (fx.Node, torch.Tensor)):
        return UNKNOWN  # a graph value's (or a tensor's) truth is not known at rewrite time
    return bool(plain(v))


def _side(f: Compiled) -> Compiled:
    """A comparison operand as a plain value (a literal None stays None: only a fact
    nobody knows is UNKNOWN)."""

    def side(env: dict, facts: Any) -> Any:
        v = f(env, facts)
        return v if v is UNKNOWN else plain(v)
    return side


def _bool_op(op: str, items: list) -> Compiled:
    decisive = op != "and"  # and: False decides; or: True decides
    # `and` stops at the first False (a later conjunct that would raise makes the
    # clause not hold either way); `or` evaluates every side, so a side that raises
    # still makes the clause not hold, as it always has
    stop = op == "and"

    def bool_op(env: dict, facts: Any) -> Any:
        unknown = decided = False
        for item in items:
            v = _truth(item(env, facts))
            if v is UNKNOWN:
                unknown = True
            elif v is decisive:
                if stop:
                    return decisive
                decided = True
        if decided:
            return decisive
        return UNKNOWN if unknown else not decisive
    return bool_op


def _comparison(e: Any, expansions: dict) -> Callable[[Any, Any], bool]:
    """How ``e`` (a comparison) compares its sides: an int equals a list of itself
    only where a side is a pattern variable bound at an argument where torch reads
    it so (``expansions``: a stride, ``s == 1`` for ``[1, 1]``; a size or a dim only
    the one-element list; elsewhere never); computed values compare as Python does."""
    names = [side.name for side in (e.left, e.right) if isinstance(side, ast.Var)]
    if not names:
        return _strictly_equal if e.op == "==" else _strictly_unequal if e.op == "!=" else _COMPARE[e.op]
    expand = strictest_expansion(*(expansions.get(n, "any") for n in names))
    equal = functools.partial(_equal, expand=expand)
    if e.op == "==":
        return equal
    if e.op == "!=":
        return lambda a, b: not equal(a, b)
    if e.op in ("in", "not in") and isinstance(e.left, ast.Var):
        def contains(a: Any, b: Any) -> bool:
            try:
                found = any(equal(a, item) for item in b)
            except TypeError:  # not a collection: Python's own answer (an error)
                return _COMPARE[e.op](a, b)
            return found == (e.op == "in")
        return contains
    return _COMPARE[e.op]


def _eval(e: Any, expansions: dict) -> Compiled:
    """Compile a condition (a where clause or a part of it); ``expansions`` as
    ``compile_where`` takes them."""
    if isinstance(e, ast.BoolOp):
        return _bool_op(e.op, [_eval(i, expansions) for i in e.items])
    if isinstance(e, ast.Not):
        inner = _eval(e.expr, expansions)

        def negate(env: dict, facts: Any) -> Any:
            v = _truth(inner(env, facts))
            return v if v is UNKNOWN else not v
        return negate
    if isinstance(e, ast.Compare):
        left, right = _side(_eval(e.left, expansions)), _side(_eval(e.right, expansions))
        compare = _comparison(e, expansions)

        op = e.op

        def comparison(env: dict, facts: Any) -> Any:
            a, b = left(env, facts), right(env, facts)
            if a is UNKNOWN or b is UNKNOWN:
                return UNKNOWN
            if _holds_graph_value(a) or _holds_graph_value(b):
                return _about_graph_values(op, a, b)
            return bool(compare(a, b))
        return comparison
    if isinstance(e, ast.Call):
        spec = lookup_function(e.op.names[0])
        if spec is None:  # a checked rule names registered functions only
            raise ValueError(f"unknown function {e.op.names[0]!r} in a where clause")
        fn = spec.fn
        if not is_builtin(fn):
            fn = _reporting(fn, spec.name)  # a user's bug is shown, not taken for "unknown"
            if spec.kind == "predicate":
                fn = _answering(fn, spec.name)
        args = [_value(a, expansions) for a in e.args]
        kwargs = [(kw.name, _value(kw.value, expansions)) for kw in e.kwargs]

        if not kwargs and len(args) == 1:  # most predicates: no argument list to build
            only = args[0]

            def call_one(env: dict, facts: Any) -> Any:
                result = fn(only(env, facts))
                return UNKNOWN if result is None else result
            return call_one
        if not kwargs and len(args) == 2:
            first, second = args

            def call_two(env: dict, facts: Any) -> Any:
                result = fn(first(env, facts), second(env, facts))
                return UNKNOWN if result is None else result
            return call_two

        def call(env: dict, facts: Any) -> Any:
            result = fn(*[a(env, facts) for a in args], **{k: v(env, facts) for k, v in kwargs})
            return UNKNOWN if result is None else result
        return call
    if isinstance(e, ast.Index):
        base, index = _side(_eval(e.expr, expansions)), _side(_eval(e.index, expansions))

        def indexing(env: dict, facts: Any) -> Any:
            b, i = base(env, facts), index(env, facts)
            if b is UNKNOWN or i is UNKNOWN:
                return UNKNOWN
            return b[i]
        return indexing
    return _value(e, expansions)


def _value(e: Any, expansions: dict) -> Compiled:
    """Compile an argument: variables and literals become ``Value``s."""
    if isinstance(e, ast.Var):
        name = e.name
        return lambda env, facts: Value(env[name], facts)
    if isinstance(e, ast.Literal):
        literal = e.value
        return lambda env, facts: Value(literal, facts)
    if isinstance(e, ast.DTypeLit):
        dtype = DTYPES[e.name]
        return lambda env, facts: Value(dtype, facts)
    if isinstance(e, (ast.TupleLit, ast.ListLit)):
        items = [_side(_eval(i, expansions)) for i in e.items]

        def sequence(env: dict, facts: Any) -> Any:
            values = tuple(i(env, facts) for i in items)
            return UNKNOWN if any(v is UNKNOWN for v in values) else Value(values, facts)
        return sequence
    return _eval(e, expansions)


def compile_where(expr: Any, expansions: dict | None = None) -> Compiled:
    """``expr`` (a where clause's AST) as a closure ``f(env, facts)``. A clause that
    is a literal (``where True``) holds by its truth, as inside ``and``/``or``/``not``.
    ``expansions``: pattern variable -> how it equals an int, as a literal at the
    argument it was bound at would (``compile.variable_expansions``; a variable
    not named: as at a per-dimension argument)."""
    compiled = _eval(expr, expansions or {})
    if isinstance(expr, (ast.BoolOp, ast.Not, ast.Compare, ast.Call)):
        return compiled

    def truth(env: dict, facts: Any) -> Any:
        return _truth(compiled(env, facts))
    return truth


_CACHE: dict = {}


def where_function(expr: Any, expansions: dict | None = None) -> Compiled:
    """The compiled closure of ``expr``, compiled once per AST node and per rule's
    ``expansions`` (rules keep their where clause for their lifetime; the cache
    holds the node, so ids stay unique)."""
    per_rule = by_identity(_CACHE, expr, lambda _: {})
    key = tuple(sorted((expansions or {}).items()))
    compiled = per_rule.get(key)
    if compiled is None:
        compiled = per_rule[key] = compile_where(expr, expansions)
    return compiled
