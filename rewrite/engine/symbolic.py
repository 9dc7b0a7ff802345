"""Where clauses on graphs with symbolic sizes decide only what holds for every size.

A ``torch.export`` with dynamic shapes records sizes as symbols (``s17``) with the
example's values as hints. Comparing two of them (``x.shape == y.shape`` in
``same_shape``) calls ``bool()`` on a symbolic expression, which torch answers from
the hints and turns into a guard (``Eq(s17, s77)``) on the export's ShapeEnv, which
nothing checks any more: a rule would fire for every size on the strength of the
example's. While a where clause runs (``deciding``), an expression the ShapeEnv cannot
decide from what it knows for all sizes (its ranges, guards and replacements) raises
``SymbolicUnknown`` instead: the clause is unknown, and the rule does not fire.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterator

import torch

__all__ = ["SymbolicUnknown", "as_traced", "decide", "deciding", "size_hint", "symbolic_env"]

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


class SymbolicUnknown(Exception):
    """A where clause asked a question about symbolic sizes whose answer depends on
    the sizes (holds for the example's, not for every one)."""


def symbolic_env(fake_mode: Any) -> Any:
    """The ShapeEnv of a graph's fake mode when it has symbols, else None."""
    env = getattr(fake_mode, "shape_env", None)
    if env is None:
        return None
    symbols = getattr(env, "backed_var_to_val", None)
    if symbols is None:
        symbols = env.var_to_val
    return env if symbols else None


@contextlib.contextmanager
def deciding(env: Any) -> Iterator[None]:
    """Within the block, a symbolic question ``env`` cannot answer for all sizes
    raises ``SymbolicUnknown`` (and adds no guard); one it can is answered. Torch's
    own questions that come with an answer for when it is unsure
    (``guard_or_false``, asked by fake kernels inferring a new node's facts) get
    that answer, as they would without the block."""
    if env is None:
        yield
        return

    def evaluate_sym_node(sym_node: Any, size_oblivious: bool = False, fallback_value: Any = None) -> Any:
        expr = sym_node.expr
        static = env._maybe_evaluate_static(expr, size_oblivious=size_oblivious)
        if static is None or (not _as_traced and not _holds_for_small_sizes(env, expr, static)):
            if fallback_value is not None:
                return fallback_value
            raise SymbolicUnknown(str(expr))
        return static

    env.evaluate_sym_node = evaluate_sym_node  # this ShapeEnv only, for this block
    try:
        yield
    finally:
        del env.evaluate_sym_node


_as_traced = 0  # > 0 within ``as_traced``


@contextlib.contextmanager
def as_traced() -> Iterator[None]:
    """Within the block (inside ``deciding``), a size is what the ShapeEnv assumes of
    it, at least 2 (its 0/1 specialization), not every size the program accepts:
    for inferring a new node's facts while a where clause asks for them, which torch
    computes for the graph as it was traced (a flatten's strides ask ``s0 == 1``)."""
    global _as_traced
    _as_traced += 1
    try:
        yield
    finally:
        _as_traced -= 1


#: at most this many size symbols assumed at least 2 are tried at 0 and 1, every
#: combination (3 ** n); a question about more is not decided
_MAX_SMALL_SYMBOLS = 3


def _small_size_substitutions(env: Any, exprs: Any) -> Any:
    """Substitutions that set each size symbol of ``exprs`` the ShapeEnv assumes to be
    at least 2 (it specializes 0 and 1: export's, dynamo's) to 0, 1 or leaves it, in
    every combination; None when there are too many to try. The program accepts sizes
    down to its ``Dim``'s ``min`` (``Dim("B", min=1)``: ``ep.range_constraints`` says
    1, the graph's ShapeEnv 2), so what holds for every size must hold there too."""
    if not getattr(env, "specialize_zero_one", False):
        return [{}]
    ranges = env.var_to_range
    assumed = sorted({s for e in exprs for s in getattr(e, "free_symbols", ())
                      if getattr(ranges.get(s), "lower", None) == 2}, key=str)
    if len(assumed) > _MAX_SMALL_SYMBOLS:
        return None
    import sympy

    return [{s: sympy.Integer(v) for s, v in zip(assumed, values) if v is not None}
            for values in itertools.product((None, 0, 1), repeat=len(assumed))]


def _holds_for_small_sizes(env: Any, expr: Any, static: Any) -> bool:
    """Whether ``static``, the ShapeEnv's answer for ``expr``, also holds when its
    sizes are 0 or 1, alone or together (``_small_size_substitutions``)."""
    substitutions = _small_size_substitutions(env, (expr,))
    answer = None if substitutions is None else _one_answer(env, substitutions, expr.xreplace)
    return answer is not None and not bool(answer != static)


def decide(op: str, a: Any, b: Any) -> bool:
    """``a op b`` (``==``, ``!=``, ``<``, ``<=``, ``>``, ``>=``) for sizes, one of them
    symbolic, answered only if it holds for every size the program accepts, or
    ``SymbolicUnknown``. The operands' expressions are given the small sizes before
    they are compared: a size symbol is positive to sympy, so ``Ne(s0, 0)`` would be
    True before any question reached the ShapeEnv."""
    import sympy

    env = next((v.node.shape_env for v in (a, b) if isinstance(v, _SYMBOLIC)), None)
    exprs = [v.node.expr if isinstance(v, _SYMBOLIC) else sympy.sympify(v) for v in (a, b)]
    substitutions = _small_size_substitutions(env, exprs) if env is not None else None
    relation = getattr(sympy, _RELATIONS[op])
    answer = None if substitutions is None else _one_answer(
        env, substitutions, lambda substitution: relation(*(e.xreplace(substitution) for e in exprs)))
    if answer is None:
        raise SymbolicUnknown(f"{a} {op} {b}")
    return bool(answer)


def _one_answer(env: Any, substitutions: list, question: Any) -> Any:
    """The ShapeEnv's answer to ``question(substitution)``, the same under every
    substitution, or None (not decided under one, or not the same)."""
    answer = None
    for substitution in substitutions:
        try:
            value = env._maybe_evaluate_static(question(substitution))
        except Exception:  # noqa: BLE001 - a size of 0 may divide by zero: not decided
            return None
        if value is None or (answer is not None and bool(value != answer)):
            return None
        answer = value
    return answer


_RELATIONS = {"==": "Eq", "!=": "Ne", "<": "Lt", "<=": "Le", ">": "Gt", ">=": "Ge"}


def size_hint(n: Any, fallback: int = 2) -> int:
    """A size as a plain int without guarding on it: a symbolic size's example value
    (its hint), ``fallback`` for one without any. ``int(s0)`` would add ``s0 == 2``
    to the graph's ShapeEnv and pin a dynamic export to that size for good."""
    if isinstance(n, int):
        return n
    try:
        from torch.fx.experimental.symbolic_shapes import optimization_hint

        return int(optimization_hint(n, fallback=fallback))
    except Exception:  # noqa: BLE001 - an older torch: the node's own hint, never int(n)
        hint = getattr(getattr(n, "node", None), "hint", None)
        return int(hint) if isinstance(hint, int) else fallback
