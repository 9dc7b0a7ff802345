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
from typing import Any, Iterator

__all__ = ["SymbolicUnknown", "deciding", "symbolic_env"]


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
    raises ``SymbolicUnknown`` (and adds no guard); one it can is answered."""
    if env is None:
        yield
        return

    def evaluate_sym_node(sym_node: Any, size_oblivious: bool = False, fallback_value: Any = None) -> Any:
        expr = sym_node.expr
        static = env._maybe_evaluate_static(expr, size_oblivious=size_oblivious)
        if static is None or not _holds_for_zero_and_one(env, expr, static):
            raise SymbolicUnknown(str(expr))
        return static

    env.evaluate_sym_node = evaluate_sym_node  # this ShapeEnv only, for this block
    try:
        yield
    finally:
        del env.evaluate_sym_node


def _holds_for_zero_and_one(env: Any, expr: Any, static: Any) -> bool:
    """Whether ``static``, the ShapeEnv's answer for ``expr``, also holds when its sizes
    are 0 or 1. A ShapeEnv that specializes 0 and 1 (export's, dynamo's) assumes
    every size symbol is at least 2, while the program accepts sizes down to its
    ``Dim``'s ``min`` (``Dim("B", min=1)``: ``ep.range_constraints`` says 1, the
    graph's ShapeEnv 2): ``shape(x)[0] == 1`` is not False for every size there."""
    if not getattr(env, "specialize_zero_one", False):
        return True
    ranges = env.var_to_range
    assumed = [s for s in getattr(expr, "free_symbols", ()) if getattr(ranges.get(s), "lower", None) == 2]
    if not assumed:
        return True
    import sympy

    for size in (0, 1):
        try:
            value = env._maybe_evaluate_static(expr.xreplace({s: sympy.Integer(size) for s in assumed}))
        except Exception:  # noqa: BLE001 - a size of 0 may divide by zero: not decided
            return False
        if value is None or bool(value != static):
            return False
    return True
