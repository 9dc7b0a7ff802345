"""Graphs around one widely read value, or one node reading thousands of values, for
tests and benchmarks of work that must not grow with a node's number of readers or
inputs (``benchmarks/fan_out.py``)."""

from __future__ import annotations

import torch
from torch import fx

__all__ = ["fan_in_graph", "fan_out_graph"]


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


def fan_in_graph(n: int, reader: str = "output") -> fx.GraphModule:
    """``n`` values ``-(-sin(x))`` all read by one node: the graph's output (a tuple
    of n; ``reader="output"``) or one ``cat`` (``reader="cat"``). Every ``neg_neg``
    rewrite (``rules/cleanup.rw``) changes one of that node's n inputs."""
    g = fx.Graph()
    x = g.placeholder("x")
    values = []
    for _ in range(n):
        s = g.call_function(torch.sin, (x,))
        values.append(g.call_function(torch.neg, (g.call_function(torch.neg, (s,)),)))
    if reader == "cat":
        g.output(g.call_function(torch.cat, (values,)))
    elif reader == "output":
        g.output(tuple(values))
    else:
        raise ValueError(f"reader is 'output' or 'cat', not {reader!r}")
    return fx.GraphModule(torch.nn.Module(), g)
