"""What kind of value each part of a where clause is, and the clauses that can never hold.

A where clause runs in three-valued logic, and a rule fires only when its clause is
True. A comparison Python refuses (``shape(x) > 3``: a tuple and an int) raises at
rewrite time, which makes the clause not hold wherever it stands; a clause that is
no condition at all (``where 3``, ``where rank(x)``) is never True; a comparison of
values of kinds that are never equal (``dtype(x) == 4``) is never true. Each makes
the rule silently never fire: a mistake, found here when the file is checked (E306),
from the kinds of values the parts can have:

* literals: ``int``, ``float``, ``bool``, ``str``, ``None``, dtypes; tuples and lists
  are sequences;
* queries: the kind their Python return annotation names (``rank`` an int, ``shape``
  a sequence of ints, ``dtype`` a dtype, ``device`` a string); a query without one,
  a variable (a bound operand: a graph value or a literal) and ``value(x)`` can be
  anything and are never reported;
* predicates, comparisons, ``and``/``or``/``not``: conditions.

Inside ``and``/``or``/``not`` a value counts by its truth, as in Python (``not
numel(x)``: an empty tensor), and a comparison that is never true is reported only
where the clause needs it true (the clause or one of its conjuncts: under ``not`` or
beside an ``or`` it may be meant). Only kinds known for certain are reported, so a
clause this passes may still be wrong, never the other way round. Python's own
rules decide what compares: ``==`` between an int and a sequence never holds
(``shape(x) == 1``; a variable bound at a per-dimension argument is of any kind, and
``stride == 1`` holds for ``[1, 1]``), ordering needs two numbers
or two sequences, ``in`` needs a sequence (or a string) on its right.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Callable, Iterator

import attrs

from rewrite.language import ast

__all__ = ["ANY", "BOOL", "Problem", "returned_kind", "where_problems"]

#: kinds: a value of any kind (nothing is reported about it), and the known ones
ANY, BOOL, INT, FLOAT, STR, NONE, DTYPE, SEQ = "any", "bool", "int", "float", "str", "None", "dtype", "sequence"
NUMBER_KINDS = frozenset({BOOL, INT, FLOAT})

_NAMES = {BOOL: "a condition", INT: "an int", FLOAT: "a float", STR: "a string", NONE: "None",
          DTYPE: "a dtype", SEQ: "a sequence"}
# kinds that can be equal to each other (besides a kind and itself, and ANY)
_EQUAL_ACROSS = {frozenset({BOOL, INT}), frozenset({BOOL, FLOAT}), frozenset({INT, FLOAT})}


@attrs.frozen
class Problem:
    span: Any
    message: str
    help: str


def where_problems(where: Any, query_kind: Callable[[str], str]) -> list:
    """The E306 problems of a where clause. ``query_kind(name)`` is the kind a
    registered query returns (``ANY`` when unknown); predicates are conditions."""
    problems: list = []
    if not isinstance(where, (ast.BoolOp, ast.Not)):
        # only the clause itself must be True: inside and/or/not a value counts by its
        # truth (not numel(x): an empty tensor), as in Python
        kind = _kind(where, query_kind, problems, True)
        if kind not in (ANY, BOOL):
            problems.append(Problem(
                getattr(where, "span", None), f"a where clause must be a condition; this is {_NAMES[kind]}",
                "compare it with something (rank(x) == 4) or call a predicate"))
    else:
        _condition(where, query_kind, problems, True)
    return problems


def _condition(e: Any, query_kind: Callable, problems: list, positive: bool) -> None:
    """``e`` stands where a truth value is taken. ``positive``: the clause holds only
    if ``e`` does (the clause, or a conjunct of it); a comparison that never holds is
    reported there only (under ``not`` or beside an ``or`` it may be meant)."""
    if isinstance(e, ast.BoolOp):
        for item in e.items:
            _condition(item, query_kind, problems, positive and e.op == "and")
    elif isinstance(e, ast.Not):
        _condition(e.expr, query_kind, problems, False)
    else:
        _kind(e, query_kind, problems, positive)


def _kind(e: Any, query_kind: Callable, problems: list, positive: bool = False) -> str:
    """The kind of ``e``'s value, reporting what inside it cannot decide: a
    comparison Python refuses (anywhere: it raises, and the clause does not hold),
    one that is never true (where the clause needs it: ``positive``)."""
    if isinstance(e, ast.Literal):
        return _literal_kind(e.value)
    if isinstance(e, ast.DTypeLit):
        return DTYPE
    if isinstance(e, (ast.TupleLit, ast.ListLit)):
        for item in e.items:
            _kind(item, query_kind, problems)
        return SEQ
    if isinstance(e, ast.Call):
        for a in (*e.args, *(k.value for k in e.kwargs)):
            _kind(a, query_kind, problems)
        return query_kind(e.op.names[0])
    if isinstance(e, ast.Index):
        base, index = _kind(e.expr, query_kind, problems), _kind(e.index, query_kind, problems)
        if base not in (ANY, SEQ, STR):
            problems.append(Problem(getattr(e, "span", None), f"indexing {_NAMES[base]}: only a sequence "
                                    "(a shape, a tuple, a list) can be indexed", "index shape(x), not rank(x)"))
        elif index not in (ANY, INT, BOOL):
            problems.append(Problem(getattr(e.index, "span", None), f"an index must be an int, not "
                                    f"{_NAMES[index]}", "shape(x)[0] is the first dim, shape(x)[-1] the last"))
        return INT if base == SEQ and _is_shape(e.expr) else ANY
    if isinstance(e, ast.Compare):
        left, right = _kind(e.left, query_kind, problems), _kind(e.right, query_kind, problems)
        problem = _comparison_problem(e.op, left, right, _items_kinds(e.right, query_kind), positive) \
            or _sequence_problem(e, query_kind, positive)
        if problem is not None:
            problems.append(Problem(getattr(e, "span", None), problem[0], problem[1]))
        return BOOL
    if isinstance(e, (ast.BoolOp, ast.Not)):
        _condition(e, query_kind, problems, False)
        return BOOL
    return ANY  # a variable: a bound operand, graph value or literal


def _literal_kind(value: Any) -> str:
    if value is None:
        return NONE
    for python, kind in ((bool, BOOL), (int, INT), (float, FLOAT), (str, STR)):
        if isinstance(value, python):
            return kind
    return ANY


def _is_shape(e: Any) -> bool:
    return isinstance(e, ast.Call) and e.op.names[0] == "shape"


def _items_kinds(e: Any, query_kind: Callable) -> tuple | None:
    """The kinds of a literal sequence's items (None when ``e`` is not one)."""
    if not isinstance(e, (ast.TupleLit, ast.ListLit)):
        return None
    return tuple(_kind(item, query_kind, []) for item in e.items)


def _comparison_problem(op: str, left: str, right: str, right_items: tuple | None,
                        positive: bool) -> tuple | None:
    """(message, help) when ``left op right`` raises (anywhere), or is never true
    where the clause needs it true (``positive``)."""
    if op in ("in", "not in"):
        if right not in (ANY, SEQ, STR):
            return (f"'{op}' needs a sequence on its right, not {_NAMES[right]}",
                    "write x in (1, 2) or compare with ==")
        if right == STR and left not in (ANY, STR):
            return f"{_NAMES[left]} is never in a string: '{op}' raises", "compare it with =="
        if op == "in" and positive and right_items == ():
            return "nothing is in an empty sequence: 'in' never holds", "list the values it may be: x in (1, 2)"
        if op == "in" and positive and right_items and left != ANY \
                and all(not _may_equal(left, k) for k in right_items):
            return (f"{_NAMES[left]} is never one of these items: 'in' never holds",
                    "the items must be of the kind compared (dtypes as torch.float16)")
        return None
    if op in ("==", "!="):
        if op == "==" and positive and NONE in (left, right) and ANY not in (left, right) and left != right:
            return ("a fact is never None (None is what a query gives when the fact is unknown, and a comparison "
                    "with an unknown fact does not hold): '==' never holds",
                    "drop the comparison: a rule fires only where the facts its where clause reads are known")
        if op == "==" and positive and not _may_equal(left, right) and NONE not in (left, right):
            return (f"{_NAMES[left]} is never equal to {_NAMES[right]}: '==' never holds",
                    "compare values of one kind: dtype(x) == torch.float16, rank(x) == 4, "
                    "shape(x)[0] == 1")
        return None
    # an ordering: two numbers or two sequences (Python refuses the rest)
    if ANY in (left, right):
        return None
    if (left in NUMBER_KINDS and right in NUMBER_KINDS) or (left == right and left in (SEQ, STR)):
        return None
    return (f"'{op}' cannot order {_NAMES[left]} and {_NAMES[right]}: the comparison never holds",
            "order numbers (rank(x) >= 2, shape(x)[0] > 3)")


def _sequence_problem(e: Any, query_kind: Callable, positive: bool) -> tuple | None:
    """(message, help) for a comparison of sequences the kinds alone let through:
    ordering a list against a tuple (Python refuses: a shape is a tuple), and, where
    the clause needs it true, a shape equal to a literal sequence holding an item
    that is never a size (``shape(x) == (2, "a")``)."""
    if e.op in ("<", "<=", ">", ">="):
        types_ = {_python_sequence(e.left), _python_sequence(e.right)}
        if types_ == {"list", "tuple"}:
            return (f"'{e.op}' cannot order a list and a tuple (a shape is a tuple): the comparison never holds",
                    "write both as tuples: shape(x) >= (1, 1)")
        return None
    if e.op != "==" or not positive:
        return None
    for shape_side, other in ((e.left, e.right), (e.right, e.left)):
        items = _items_kinds(other, query_kind)
        if _is_shape(shape_side) and items and any(not _may_equal(INT, k) for k in items):
            bad = next(k for k in items if not _may_equal(INT, k))
            return (f"a shape holds ints, never {_NAMES[bad]}: '==' never holds",
                    "compare with sizes: shape(x) == (2, 3)")
    return None


def _python_sequence(e: Any) -> str | None:
    """``"list"`` or ``"tuple"`` when ``e`` is certainly one (a literal, a shape)."""
    if isinstance(e, ast.ListLit):
        return "list"
    if isinstance(e, ast.TupleLit) or _is_shape(e):
        return "tuple"
    return None


def _may_equal(a: str, b: str) -> bool:
    return ANY in (a, b) or a == b or frozenset({a, b}) in _EQUAL_ACROSS


# ---------------------------------------------------------------- query kinds


def returned_kind(fn: Callable) -> str:
    """The kind a query's return annotation names (``Optional`` stripped: None is
    an unknown fact, not a value); ``ANY`` without a usable one."""
    try:
        hint = typing.get_type_hints(fn).get("return", Any)
    except Exception:  # noqa: BLE001 - an annotation that does not evaluate says nothing
        return ANY
    kinds = {_hint_kind(h) for h in _union_members(hint) if h is not type(None)}
    return kinds.pop() if len(kinds) == 1 else ANY


def _union_members(hint: Any) -> Iterator:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for member in typing.get_args(hint):
            yield from _union_members(member)
    else:
        yield hint


def _hint_kind(hint: Any) -> str:
    import torch

    origin = typing.get_origin(hint) or hint
    try:
        if origin in (tuple, list, torch.Size):
            return SEQ
        return {bool: BOOL, int: INT, float: FLOAT, str: STR, torch.dtype: DTYPE}.get(origin, ANY)
    except TypeError:  # an annotation that is no type (-> [int]): says nothing
        return ANY
