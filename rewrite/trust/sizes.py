"""A trial at the smallest sizes a graph with symbolic input sizes accepts.

A ``torch.export`` with a dynamic ``Dim`` records its sizes as symbols, traced at
the example's sizes under a ShapeEnv that assumes every size is at least 2; the
program accepts smaller ones (``Dim("B", min=1)``), where kernels may choose other
layouts (a ``reshape`` views where it copied) and a rewrite right at the example's
sizes may be wrong. The check's random trials all take the example's sizes, so it
also runs one trial with every size symbol at 1: the trial's inputs narrowed along
their symbolic dims (a dim ``2*s0`` to 2). When the program refuses them (its input
guards), the trial is skipped and reported so.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

__all__ = ["smallest_sizes"]

#: every size symbol is tried at this value
_SMALL = 1


def smallest_sizes(graph: Any, inputs: Any) -> Optional[Any]:
    """``inputs`` (the check's inputs of a trial, in the caller's structure) with
    every dim the graph's placeholders record as symbolic narrowed to its size when
    each symbol is 1; None when there is no such dim, when the inputs do not line up
    with the placeholders one tensor per placeholder, or when a size does not come
    out smaller than the input's (nothing new to try)."""
    if not isinstance(graph, fx.GraphModule):
        return None
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    leaves, spec = pytree.tree_flatten(inputs)
    if len(leaves) != len(placeholders):
        return None
    narrowed, changed = [], False
    for leaf, node in zip(leaves, placeholders):
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            return None  # a size passed as an input (dynamo): it would have to shrink with the tensors
        if not isinstance(val, torch.Tensor) or not any(isinstance(d, torch.SymInt) for d in val.shape):
            narrowed.append(leaf)
            continue
        if not isinstance(leaf, torch.Tensor) or leaf.dim() != val.dim():
            return None
        out = leaf
        for dim, size in enumerate(val.shape):
            if not isinstance(size, torch.SymInt):
                continue
            small = _at_small(size)
            if small is None or small < 1 or small > out.shape[dim]:
                return None
            if small < out.shape[dim]:
                out, changed = out.narrow(dim, 0, small), True
        narrowed.append(out.clone() if out is not leaf else leaf)
    return pytree.tree_unflatten(narrowed, spec) if changed else None


def _at_small(size: torch.SymInt) -> Optional[int]:
    """The value of a symbolic size with every symbol at ``_SMALL``, or None."""
    expr = getattr(size.node, "expr", None)
    symbols = getattr(expr, "free_symbols", None)
    if not symbols:
        return None
    import sympy

    try:
        value = expr.xreplace({s: sympy.Integer(_SMALL) for s in symbols})
        return int(value) if value.is_number and value.is_integer else None
    except (TypeError, ValueError, AttributeError):
        return None
