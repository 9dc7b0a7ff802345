"""Facts recorded on graphs that carry none (symbolic_trace): the example inputs
run through the graph once, and every value's shape, dtype, layout (and a
non-tensor value itself: ``x.shape``, ``x.size(0)``) is kept on its node. Compared
with torch.fx's own ``ShapeProp`` on the same graph, through the runner and
through the Interpreter it falls back to (a ``**kwargs`` placeholder)."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.passes.shape_prop import ShapeProp

import rewrite
from rewrite.engine.facts import FACTS_KEY, GraphFacts


class Mixed(nn.Module):
    """Modules, methods, functions, a shape read, an int, a multi-output op and a
    non-contiguous view: every kind of value a recorder meets."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.lin = nn.Linear(4, 5)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        n = y.size(0)
        shape = y.shape
        top, idx = torch.max(y, dim=1)
        z = y.permute(0, 2, 3, 1)  # not contiguous
        w = self.lin(z).reshape(n, -1)
        return w * 1.0, top.to(torch.float64), idx, shape


class Keywords(nn.Module):
    def forward(self, x, **kwargs):
        return (x * 1.0).transpose(0, 1) + kwargs["y"]


def _expected(gm: fx.GraphModule, *args) -> dict:
    """What ShapeProp finds: node name -> (shape, dtype, stride) of a tensor value."""
    scratch = copy.deepcopy(gm)
    ShapeProp(scratch).propagate(*args)
    out = {}
    for node in scratch.graph.nodes:
        tm = node.meta.get("tensor_meta")
        if hasattr(tm, "shape"):
            out[node.name] = (tuple(tm.shape), tm.dtype, tuple(tm.stride))
    return out


def _recorded(gm: fx.GraphModule, *args) -> dict:
    facts = GraphFacts(gm, args)
    out = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        m = facts.meta(node)  # the first question records every node's facts
        if m is not None:
            out[node.name] = (tuple(m.shape), m.dtype, tuple(m.stride))
    return out


@settings(max_examples=10, deadline=None)
@given(batch=st.integers(1, 3), side=st.integers(2, 6), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_recorded_facts_are_shape_props(batch, side, dtype):
    model = Mixed().to(dtype).eval()
    gm = fx.symbolic_trace(model)
    x = torch.randn(batch, 3, side, side, dtype=dtype)
    expected = _expected(gm, x)
    recorded = _recorded(gm, x)
    assert recorded == expected
    assert len(recorded) >= 10
    # non-tensor values are recorded as they are: the int and the shape
    size_node = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "size")
    shape_node = next(n for n in gm.graph.nodes if n.target is getattr and n.args[1] == "shape")
    assert size_node.meta[FACTS_KEY] == batch
    assert tuple(shape_node.meta[FACTS_KEY]) == (batch, 4, side, side)
    # a multi-output node: one facts per result
    max_node = next(n for n in gm.graph.nodes if n.target is torch.max)
    assert [f.dtype for f in max_node.meta[FACTS_KEY]] == [dtype, torch.int64]


def test_a_graph_the_runner_does_not_plan_is_recorded_by_the_interpreter():
    gm = fx.symbolic_trace(Keywords())
    assert any(str(n.target).startswith("**") for n in gm.graph.nodes if n.op == "placeholder")
    x, y = torch.randn(2, 3), torch.randn(3, 2)
    facts = GraphFacts(gm, (x, {"y": y}))
    mul = next(n for n in gm.graph.nodes if n.target is operator.mul)
    t = next(n for n in gm.graph.nodes if n.target == "transpose")
    assert tuple(facts.meta(mul).shape) == (2, 3)
    m = facts.meta(t)
    assert (tuple(m.shape), tuple(m.stride), m.contiguous) == ((3, 2), (1, 3), False)


def test_recording_writes_nothing_and_rules_that_ask_fire():
    model = Mixed().train()  # batch norm updates its running statistics when run
    gm = fx.symbolic_trace(model)
    x = torch.randn(2, 3, 5, 5)
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    x_before = x.clone()
    rules = rewrite.load("benchmarks/matcher_rules.rw")  # mul_one asks is_float(x)
    result = rules.apply(gm, example_inputs=(x,), check=False)
    assert result.counts.get("mul_one") == 1
    assert all(torch.equal(before[k], v) for k, v in gm.state_dict().items())
    assert torch.equal(x, x_before)
    assert not any(n.target is operator.mul for n in result.graph_module.graph.nodes)
    model.eval()
    result.graph_module.eval()
    torch.testing.assert_close(result.graph_module(x)[:3], model(x)[:3])


@pytest.mark.parametrize("inplace", [False, True])
def test_facts_stay_on_the_rewritten_graph_only(inplace):
    gm = fx.symbolic_trace(Mixed().eval())
    x = torch.randn(1, 3, 4, 4)
    rules = rewrite.load("benchmarks/matcher_rules.rw")
    result = rules.apply(gm, example_inputs=(x,), check=False, inplace=inplace)
    assert result.counts
    # facts recorded from one call's example inputs hold for those inputs only: neither
    # the input (the copy) nor the rewritten module (in place) keeps them for a later apply
    assert not any(FACTS_KEY in n.meta for n in gm.graph.nodes)
    assert not any(FACTS_KEY in n.meta for n in result.graph_module.graph.nodes)
