"""Where clauses and replacements on torch.export graphs with dynamic sizes.

A size symbol's value is not a fact: a clause about it holds only if it holds for
every size the program accepts, including the 0 and 1 that the graph's ShapeEnv
assumes away (its ranges start at 2 while ``Dim(min=1)`` accepts 1)."""

import pytest
import torch
from torch import nn
from torch.export import Dim

import rewrite


class Double(nn.Module):
    def forward(self, x):
        return x * 2


class SqueezeFirst(nn.Module):
    def forward(self, x):
        return torch.squeeze(x, 0) * 2


def _dynamic(model, x, low=1):
    return torch.export.export(model, (x,), dynamic_shapes=({0: Dim("B", min=low, max=64)},)).module()


@pytest.mark.parametrize("clause", ["shape(x)[0] != 8", "not shape(x)[0] == 8", "shape(x)[0] != 3"])
def test_inequality_with_a_symbolic_size_is_unknown(clause):
    x = torch.randn(8, 5)
    gm = _dynamic(Double(), x)
    rules = rewrite.parse(f"rule r(change=True): mul(x, 2) where {clause} => neg(mul(x, -2))")
    assert rules.apply(gm, example_inputs=(x,), check=False).counts == {}


def test_a_size_the_shape_env_assumes_away_is_not_decided():
    # the graph's ShapeEnv ranges B over [2, 64]; the program accepts B = 1
    x = torch.randn(8, 5)
    gm = _dynamic(SqueezeFirst(), x, low=1)
    rules = rewrite.parse("rule sq(shared=True): squeeze(x, 0) where not shape(x)[0] == 1 => x")
    result = rules.apply(gm, example_inputs=(x,))
    assert result.counts == {}
    one = torch.randn(1, 5)
    assert result.graph_module(one).shape == gm(one).shape == (5,)


def test_static_sizes_of_a_dynamic_graph_still_decide():
    x = torch.randn(8, 5)
    gm = _dynamic(Double(), x)
    rules = rewrite.parse("rule r(change=True): mul(x, 2) where shape(x)[1] == 5 => neg(mul(x, -2))")
    result = rules.apply(gm, example_inputs=(x,), check=False)
    assert result.counts == {"r": 1}
    for batch in (1, 3, 8):
        y = torch.randn(batch, 5)
        torch.testing.assert_close(result.graph_module(y), gm(y))


def test_a_new_two_operand_op_on_symbolic_sizes():
    # the operand order of a new add is chosen by layout: no shape of symbols is hashed
    x = torch.randn(8, 5)
    gm = _dynamic(Double(), x, low=2)
    result = rewrite.parse("rule r: mul(x, 2) => add(x, x)").apply(gm, example_inputs=(x,))
    assert result.counts == {"r": 1}
    assert any(n.target is torch.ops.aten.add.Tensor for n in result.graph_module.graph.nodes)
    for batch in (2, 5, 64):
        y = torch.randn(batch, 5)
        torch.testing.assert_close(result.graph_module(y), gm(y))


def test_no_guard_is_added_to_the_callers_shape_env():
    x = torch.randn(8, 5)
    gm = _dynamic(Double(), x, low=2)
    val = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"]
    env = val.shape[0].node.shape_env
    before = len(env.guards)
    rewrite.parse("rule r: mul(x, 2) => add(x, x)").apply(gm, example_inputs=(x,))
    assert len(env.guards) == before


class Scaled(nn.Module):
    def forward(self, x):
        return x * 2


@pytest.mark.parametrize("clause", ["numel(x) != 2", "not numel(x) == 2", "numel(x) not in [2, 3]"])
def test_sizes_small_together_are_tried(clause):
    # both dims may be 1 or 2: (1, 2) has 2 elements, although each size alone >= 2 says 4
    x = torch.randn(4, 5)
    gm = torch.export.export(Scaled(), (x,), dynamic_shapes=({0: Dim("A", min=1, max=8),
                                                               1: Dim("B", min=1, max=8)},)).module()
    rules = rewrite.parse(f"rule r(change=True): mul(x, 2) where {clause} => neg(mul(x, -2))")
    assert rules.apply(gm, example_inputs=(x,), check=False).counts == {}


@pytest.mark.parametrize("clause", ["shape(x)[0] != 0", "numel(x) != 0", "not shape(x)[0] == 0", "shape(x)[0] > 0",
                                    "shape(x)[0] >= 1", "numel(x) > 0", "shape(x) != [0, 6]"])
def test_a_size_of_zero_is_tried(clause):
    x = torch.randn(4, 6)
    gm = torch.export.export(Scaled(), (x,), dynamic_shapes=({0: Dim("B", min=0, max=64)},)).module()
    gm(torch.randn(0, 6))  # the program takes an empty batch
    rules = rewrite.parse(f"rule r(change=True): mul(x, 2) where {clause} => neg(mul(x, -2))")
    assert rules.apply(gm, example_inputs=(x,), check=False).counts == {}


class ConvHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.linear = nn.Linear(8, 10)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        return self.linear(torch.nn.functional.adaptive_avg_pool2d(y, 1).flatten(1))


def test_rules_read_the_facts_of_nodes_built_on_symbolic_sizes():
    # a where clause asking for a new node's facts infers them as torch traced the
    # graph (sizes at least 2), not for every size: amp_bf16 fires as on a static export
    torch.manual_seed(0)
    model, x = ConvHead().eval(), torch.randn(4, 3, 8, 8)
    amp = rewrite.load("rules/amp_bf16.rw")
    static = amp.apply(torch.export.export(model, (x,)).module(), example_inputs=(x,)).counts
    gm = torch.export.export(model, (x,), dynamic_shapes=({0: Dim("B", min=1, max=64)},)).module()
    result = amp.apply(gm, example_inputs=(x,))
    assert result.counts == static and "flatten_bf16" in static
    for batch in (1, 5):
        y = torch.randn(batch, 3, 8, 8)
        torch.testing.assert_close(result.graph_module(y), model(y), rtol=0.05, atol=0.05)


class TwoInputs(nn.Module):
    def forward(self, x, y):
        return x * 2 + y


@pytest.mark.parametrize("clause, fires", [
    ("shape(x) == shape(y)", True),      # the same symbol, the same static dim
    ("shape(x)[1] == 5", True),
    ("shape(x) == [8, 5]", False),       # the batch is symbolic
    ("shape(x)[0] not in [0]", False),   # 0 is a size the program takes
    ("shape(x)[0] in [0, 1]", False),
    ("shape(x)[1] in [4, 5]", True),
])
def test_shapes_with_a_symbolic_dim_compare_dim_by_dim(clause, fires):
    x = torch.randn(8, 5)
    batch = Dim("B", min=0, max=64)
    gm = torch.export.export(TwoInputs(), (x, x.clone()), dynamic_shapes=({0: batch}, {0: batch})).module()
    rules = rewrite.parse(f"rule r(change=True): mul(x, 2) where {clause.replace('y)', 'x)')} "
                          f"=> neg(mul(x, -2))") if "y" not in clause else rewrite.parse(
        "rule r(change=True): add(mul(x, 2), y) where " + clause + " => add(neg(mul(x, -2)), y)")
    counts = rules.apply(gm, example_inputs=(x, x.clone()), check=False).counts
    assert bool(counts) is fires, counts
