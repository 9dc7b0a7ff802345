"""A trial at the smallest sizes a graph with symbolic input sizes accepts.

A ``torch.export`` with a dynamic ``Dim`` records its sizes as symbols, traced at
the example's sizes under a ShapeEnv that assumes every size is at least 2; the
program accepts smaller ones (``Dim("B", min=1)``), where kernels may choose other
layouts (a ``reshape`` views where it copied) and a rewrite right at the example's
sizes may be wrong. The check's random trials all take the example's sizes, so it
also runs one trial with every size symbol at 1: the trial's inputs narrowed along
their symbolic dims (a dim ``2*s0`` to 2). When the program refuses them (its input
guards), the trial is skipped and reported so.

A symbol is tried at its declared minimum instead where that is known and above 1:
the ShapeEnv's lower bound when it is above 2 (``Dim("B", min=3)``, which the
exported module enforces), or ``ep.range_constraints`` when ``apply`` was given the
``ExportedProgram`` itself (``DECLARED_RANGES`` in the module's ``meta``): a program
declared for a batch of 2 and up is not held to batch 1, which its module does not
refuse.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

__all__ = ["smallest_sizes", "DECLARED_RANGES"]

#: a size symbol with no declared minimum above it is tried at this value
_SMALL = 1

#: key in a GraphModule's ``meta``: the ``range_constraints`` of the ExportedProgram
#: it was taken from (``apply`` given ``ep``), symbol -> ValueRanges
DECLARED_RANGES = "rewrite_declared_ranges"


def smallest_sizes(graph: Any, inputs: Any) -> Optional[Any]:
    """``inputs`` (the check's inputs of a trial, in the caller's structure) with
    every dim the graph's placeholders record as symbolic narrowed to its size when
    each symbol is 1; None when there is no such dim, when the inputs do not line up
    with the placeholders one tensor per placeholder, or when a size does not come
    out smaller than the input's (nothing new to try). A size a dynamo graph takes as
    an input (a ``SymInt`` placeholder) is given its own smallest value."""
    if not isinstance(graph, fx.GraphModule):
        return None
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    leaves, spec = pytree.tree_flatten(inputs)
    if len(leaves) != len(placeholders):
        return None
    declared = graph.meta.get(DECLARED_RANGES) or {}
    narrowed, changed = [], False
    for leaf, node in zip(leaves, placeholders):
        val = node.meta.get("val", node.meta.get("example_value"))
        if isinstance(val, torch.SymInt):  # a size passed as an input (dynamo): it shrinks with the tensors
            small = _at_small(val, declared)
            if small is None or not isinstance(leaf, int) or isinstance(leaf, bool) or small > leaf:
                return None
            narrowed.append(small)
            changed |= small < leaf
            continue
        if not isinstance(val, torch.Tensor) or not any(isinstance(d, torch.SymInt) for d in val.shape):
            narrowed.append(leaf)
            continue
        if not isinstance(leaf, torch.Tensor) or leaf.dim() != val.dim():
            return None
        out = leaf
        for dim, size in enumerate(val.shape):
            if not isinstance(size, torch.SymInt):
                continue
            small = _at_small(size, declared)
            if small is None or small < 1 or small > out.shape[dim]:
                return None
            if small < out.shape[dim]:
                out, changed = out.narrow(dim, 0, small), True
        narrowed.append(out.clone() if out is not leaf else leaf)
    return pytree.tree_unflatten(narrowed, spec) if changed else None


def _at_small(size: torch.SymInt, declared: Any) -> Optional[int]:
    """The value of a symbolic size with every symbol at its smallest (``_smallest``), or None."""
    expr = getattr(size.node, "expr", None)
    symbols = getattr(expr, "free_symbols", None)
    if not symbols:
        return None
    import sympy

    env = getattr(size.node, "shape_env", None)
    try:
        value = expr.xreplace({s: sympy.Integer(_smallest(s, env, declared)) for s in symbols})
        return int(value) if value.is_number and value.is_integer else None
    except (TypeError, ValueError, AttributeError):
        return None


def _smallest(symbol: Any, env: Any, declared: Any) -> int:
    """The smallest value ``symbol`` is tried at: the declared minimum when one is
    known above ``_SMALL``, else ``_SMALL``. The ShapeEnv's lower bound of 2 says
    nothing (it assumes every size is at least 2); above 2 it is the Dim's own."""
    bounds = [_lower(declared.get(symbol))]
    assumed = _lower(getattr(env, "var_to_range", {}).get(symbol))
    if assumed is not None and assumed > 2:
        bounds.append(assumed)
    known = [b for b in bounds if b is not None]
    return max([_SMALL, *known])


def _lower(ranges: Any) -> Optional[int]:
    """A ValueRanges' finite integer lower bound, or None."""
    lower = getattr(ranges, "lower", None)
    try:
        return int(lower) if lower is not None and getattr(lower, "is_finite", True) else None
    except (TypeError, ValueError):
        return None
