"""Graphs around one widely read value, for tests and benchmarks of work that must
not grow with a value's number of readers (``benchmarks/fan_out.py``)."""

from __future__ import annotations

import torch
from torch import fx

__all__ = ["fan_out_graph"]


def fan_out_graph(n: int) -> fx.GraphModule:
    """``v = tanh(x)`` read by ``n`` nodes ``v + 0.0``, summed in a chain: every
    ``add_zero`` rewrite (``rules/cleanup.rw``) gives ``v`` one more reader."""
    g = fx.Graph()
    v = g.call_function(torch.tanh, (g.placeholder("x"),))
    acc = None
    for _ in range(n):
        y = g.call_function(torch.add, (v, 0.0))
        acc = y if acc is None else g.call_function(torch.add, (acc, y))
    g.output(acc)
    return fx.GraphModule(torch.nn.Module(), g)
