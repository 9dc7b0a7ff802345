"""torch.export's ``aten._assert_tensor_metadata`` (one on the input of each ``.to()``)
reads a value without using it: it neither blocks a rewrite of that value (as an
interior node, or for ``single_use``) nor survives it."""

from __future__ import annotations

import torch
import torch.nn as nn

import rewrite

CHECK = torch.ops.aten._assert_tensor_metadata.default


def _checks(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is CHECK]


class ReluThenCast(nn.Module):
    def forward(self, x):
        return torch.relu(x * 2).to(torch.float64), torch.relu(x)


def test_a_check_neither_blocks_an_interior_node_nor_outlives_it():
    x = torch.randn(3, 4)
    gm = torch.export.export(ReluThenCast(), (x,), strict=False).module()
    (check,) = _checks(gm)
    assert check.args[0].target is torch.ops.aten.relu.default  # reads the relu the rule removes
    rules = rewrite.parse("""
        rule cast_first: to(relu(y) as r, d) where single_use(r) and d == torch.float64
            => relu(to(y, d))
    """)
    result = rules.apply(gm, example_inputs=(x,))
    assert result.counts == {"cast_first": 1}
    assert not _checks(result.graph_module)  # it went with the relu it checked
    for got, want in zip(result.graph_module(x), gm(x)):
        torch.testing.assert_close(got, want)


def test_a_real_second_reader_still_blocks():
    class Two(nn.Module):
        def forward(self, x):
            r = torch.relu(x * 2)
            return r.to(torch.float64), r + 1

    x = torch.randn(3, 4)
    gm = torch.export.export(Two(), (x,), strict=False).module()
    rules = rewrite.parse("rule cast_first: to(relu(y), d) where d == torch.float64 => relu(to(y, d))")
    result = rules.apply(gm, example_inputs=(x,))
    assert result.counts == {}
    assert len(_checks(result.graph_module)) == 1
