"""What a training caller observes of a rewrite beyond its values (probe N F01, F08):
a rewrite that keeps every value but cuts the gradient path to a layer (a bit-level
round trip through an integer view: no op the rule names is a "gradient op"), and one
that raises only with gradients enabled, are rejected by the default check."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import rewrite
from rewrite.trust.check import check_equivalence


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


CUT = """
rule relu_roundtrip: relu(x) => Tensor.view(Tensor.view(relu(x), torch.int32), torch.float32)
ruleset main = once(relu_roundtrip)
"""


def test_a_rewrite_that_cuts_the_gradient_to_a_layer_is_rejected():
    torch.manual_seed(0)
    gm, x = fx.symbolic_trace(TwoLayers()), torch.randn(3, 4)
    rules = rewrite.parse(CUT)["main"]
    result = rules.apply(gm, (x,), check=False)
    assert result.counts == {"relu_roundtrip": 1}
    assert torch.equal(result.graph_module(x), gm(x))  # every value kept...
    assert result.graph_module(x).requires_grad  # ...and the output still requires grad (through b)
    with pytest.raises(rewrite.EquivalenceError, match="gradients reach parameter a.weight through this output"):
        rules.apply(gm, (x,))


def test_a_cut_from_an_input_that_requires_grad_is_named():
    x = torch.randn(3).requires_grad_()
    w = nn.Parameter(torch.randn(3))
    report = check_equivalence(lambda x: x * w, lambda x: x.detach() * w, (x,))
    assert not report.ok and "gradients reach input 0" in report.first_mismatch.message
    assert check_equivalence(lambda x: x * w, lambda x: w * x, (x,)).ok


def test_a_fold_into_a_constant_is_not_a_lost_gradient():
    """conv + batch norm folded: the conv's weight becomes a new constant; the output
    still requires grad through the layer after it."""
    class ConvBNLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(self.bn(self.conv(x)).mean((2, 3)))

    torch.manual_seed(0)
    model = ConvBNLinear().eval()
    result = rewrite.load("rules/fusion.rw").apply(fx.symbolic_trace(model), (torch.randn(2, 3, 8, 8),))
    assert result.counts.get("conv_bn") == 1


class Distill(nn.Module):
    def __init__(self):
        super().__init__()
        self.student = nn.Linear(4, 3)
        self.teacher = nn.Linear(4, 3)

    def forward(self, x):
        t = torch.tanh(self.teacher(x))  # soft targets that require grad
        return F.softplus(-(t * self.student(x)))


def test_a_rewrite_that_raises_only_with_gradients_enabled_is_rejected():
    rules = rewrite.parse('rule soft_margin(tolerance="approx"): '
                          "F.softplus(neg(mul(t, s))) => aten.soft_margin_loss(s, t, 0)\n")
    gm, x = fx.symbolic_trace(Distill()), torch.randn(8, 4)
    result = rules.apply(gm, (x,), check=False)
    assert result.counts == {"soft_margin": 1}
    with torch.no_grad():
        torch.testing.assert_close(result.graph_module(x), gm(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="not differentiable"):
        result.graph_module(x)  # what a training caller would meet
    with pytest.raises(rewrite.EquivalenceError, match="raises with gradients enabled, where the original runs"):
        rules.apply(gm, (x,))


def test_both_raising_with_gradients_enabled_is_no_difference():
    w = nn.Parameter(torch.randn(3))

    def writes_a_leaf(x):
        w.add_(0)  # a leaf that requires grad written in place: raises with gradients enabled
        return x * 2

    assert check_equivalence(writes_a_leaf, writes_a_leaf, (torch.randn(3),)).ok
