"""The check on outputs below 1, where the table's ``atol`` is absolute: a wrong
rewrite of a softmax over many classes, or of an output scaled far below 1, is
caught by a second look at the output's own scale against a float64 run of the
original; a rewrite that only rounds otherwise still passes."""

import pytest
import torch
from torch import nn

import rewrite
from rewrite.ruleset import EquivalenceError


class Head(nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.linear = nn.Linear(32, classes)

    def forward(self, x):
        return torch.softmax(self.linear(x), -1)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.linear(x)) * 1e-6


class Cancelling(nn.Module):
    """A small output from values about 1 that cancel: rounding about 1 is all that
    tells the two association orders apart."""

    def __init__(self):
        super().__init__()
        self.register_buffer("one", torch.ones(64))
        self.register_buffer("minus_one", -torch.ones(64))

    def forward(self, x):
        return (x * 1e-3 + self.one) + self.minus_one


def _ruleset(text):
    return rewrite.parse(text + "\nruleset main = once(r)")["main"]


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("rule", [
    "rule r: softmax(x, d) => softmax(mul(x, 0.0), d)",  # uniform: every argmax changes
    "rule r: softmax(x, d) => mul(softmax(x, d), 2.0)",  # rows sum to 2
])
def test_a_wrong_bfloat16_softmax_is_caught(rule, inplace):
    torch.manual_seed(0)
    model, x = Head(1000).eval().bfloat16(), torch.randn(4, 32, dtype=torch.bfloat16)
    gm = torch.export.export(model, (x,)).module()
    with pytest.raises(EquivalenceError):
        _ruleset(rule).apply(gm, example_inputs=(x,), inplace=inplace)


@pytest.mark.parametrize("inplace", [False, True])
def test_a_wrong_rewrite_of_a_tiny_output_is_caught(inplace):
    torch.manual_seed(0)
    model, x = Tiny().eval(), torch.randn(4, 16)
    gm = torch.export.export(model, (x,)).module()
    with pytest.raises(EquivalenceError):
        _ruleset("rule r: tanh(x) => mul(tanh(x), 3.0)").apply(gm, example_inputs=(x,), inplace=inplace)


@pytest.mark.parametrize("inplace", [False, True])
def test_rounding_otherwise_on_a_small_output_passes(inplace):
    torch.manual_seed(0)
    model, x = Cancelling().eval(), torch.randn(8, 64)
    gm = torch.export.export(model, (x,)).module()
    rules = _ruleset("rule r: add(add(x, y), z) where is_float(x) => add(x, add(y, z))")
    result = rules.apply(gm, example_inputs=(x,), inplace=inplace)
    assert result.counts == {"r": 1}
    assert result.equivalence.ok
    out, ref = result.graph_module(x), model(x)
    assert not torch.equal(out, ref)  # rounded otherwise, as the test means
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)


def test_a_softmax_computed_otherwise_passes():
    torch.manual_seed(0)
    model, x = Head(1000).eval(), torch.randn(4, 32)
    gm = torch.export.export(model, (x,)).module()
    rules = _ruleset("rule r: softmax(x, d) => div(exp(sub(x, amax(x, [d], True))), "
                     "sum(exp(sub(x, amax(x, [d], True))), [d], True))")
    try:
        result = rules.apply(gm, example_inputs=(x,))
    except rewrite.RuleError:
        pytest.skip("the rule language spells this otherwise")
    assert result.counts == {"r": 1} and result.equivalence.ok


class TinyLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 8)

    def forward(self, x):
        return self.linear(x) * 1e-6


@pytest.mark.parametrize("inplace", [False, True])
def test_a_wrong_rewrite_through_a_lower_precision_is_caught_in_both_modes(inplace):
    torch.manual_seed(0)
    model, x = TinyLinear().eval(), torch.randn(4, 16)
    gm = torch.export.export(model, (x,)).module()
    rules = _ruleset("rule r: mul(x, _) where is_float(x) => to(mul(to(x, torch.bfloat16), 2e-6), torch.float32)")
    with pytest.raises(EquivalenceError):
        rules.apply(gm, example_inputs=(x,), inplace=inplace)
