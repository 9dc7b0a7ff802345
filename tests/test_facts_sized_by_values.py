"""Sizes the example's values decide are no facts (probe N F09): after ``x[x > 0]``,
``nonzero``, ``unique`` or an ``item()`` used as a size, a shape recorded from the
example inputs need not hold for other inputs of the same shapes, so a rule asking
about it does not fire there; shapes the inputs' shapes decide are still facts."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import rewrite
from rewrite.engine.facts import sized_by_values

SQUEEZE = rewrite.parse("rule squeeze_noop: squeeze(x, d) where shape(x)[d] != 1 => x\n")


class Picked(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x):
        if self.how == "mask":
            picked = x[x > 0]
        elif self.how == "nonzero":
            picked = torch.nonzero(x).float().sum(1)
        elif self.how == "masked_select":
            picked = torch.masked_select(x, x > 0)
        elif self.how == "unique":
            picked = torch.unique(x.round())
        else:  # a count used as a size
            picked = x[: (x > 0).sum().item()]
        return (picked * 2).squeeze(0)


@pytest.mark.parametrize("how", ["mask", "nonzero", "masked_select", "unique", "item"])
def test_a_rule_on_a_size_the_values_decide_does_not_fire(how):
    torch.manual_seed(0)
    model, x = Picked(how), torch.randn(64)
    gm = fx.symbolic_trace(model)
    result = SQUEEZE.apply(gm, (x,), check=False)
    assert result.counts == {}
    one = torch.full((64,), -1.0)
    one[3] = 0.7  # picks one element (one distinct value, one count)
    torch.testing.assert_close(result.graph_module(one), gm(one))


def test_sizes_the_input_shapes_decide_are_still_facts():
    class Shaped(nn.Module):
        def forward(self, x):
            return (x * 2).squeeze(0)

    gm = fx.symbolic_trace(Shaped())
    assert SQUEEZE.apply(gm, (torch.randn(5, 3),), check=False).counts == {"squeeze_noop": 1}


def test_which_nodes_are_sized_by_values():
    gm = fx.symbolic_trace(Picked("mask"))
    by_name = {n.name: n for n in gm.graph.nodes}
    SQUEEZE.apply(gm, (torch.randn(8),), check=False)  # records facts on a copy; the index dtype is read here
    assert not sized_by_values(by_name["gt"])
    assert sized_by_values(torch.fx.symbolic_trace(Picked("nonzero")).graph.find_nodes(
        op="call_function", target=torch.nonzero)[0])
    where = fx.symbolic_trace(type("W", (nn.Module,), {"forward": lambda self, x: torch.where(x > 0)[0]})())
    node = next(n for n in where.graph.nodes if n.op == "call_function" and n.target is torch.where)
    assert sized_by_values(node)
    assert sized_by_values(next(iter(torch.export.export(Picked("nonzero"), (torch.randn(8),)).graph.find_nodes(
        op="call_function", target=torch.ops.aten.nonzero.default))))
