"""The check compares gradients when a rule that fired names a stop-gradient, a
rounding or a quantizer (``rewrite.trust.gradients``): such rewrites can keep
every forward value and change what training computes."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import rewrite
from rewrite.ruleset import EquivalenceError
from rewrite.trust import check as check_module
from rewrite.trust.check import check_equivalence


class _Detached(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return h.detach() * 2 + h


class _StraightThrough(nn.Module):
    """Rounding with a straight-through gradient (x + (round(x) - x).detach())."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x) * 4
        return h + (torch.round(h) - h).detach()


class _TokensDetached(nn.Module):
    """Integer input: only the embedding's gradient can tell."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 4)

    def forward(self, ids):
        e = self.emb(ids)
        return self.lin(e.detach()) + self.lin(e)


UNDETACH = {"fx": "rule undetach: Tensor.detach(x) => x\n", "export": "rule undetach: aten.detach.default(x) => x\n"}


def _capture(model, args, level):
    if level == "fx":
        return fx.symbolic_trace(model)
    return torch.export.export(model, args, strict=False).module()


def _grads(module, args):
    module.zero_grad(set_to_none=True)
    xs = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    module(*xs).sum().backward()
    return [p.grad.clone() for p in module.parameters()] + [x.grad for x in xs if x.grad is not None]


@pytest.mark.parametrize("level", ["fx", "export"])
@pytest.mark.parametrize("inplace", [False, True])
def test_removing_a_detach_is_caught_by_its_gradients(level, inplace):
    x = torch.randn(2, 4)
    gm = _capture(_Detached(), (x,), level)
    before = gm.code
    with pytest.raises(EquivalenceError, match="changed the model's gradients.*gradient of input 0"):
        rewrite.parse(UNDETACH[level]).apply(gm, (x,), inplace=inplace)
    assert gm.code == before  # in place: rolled back


@pytest.mark.parametrize("level", ["fx", "export"])
def test_skip_rule_rolls_the_detach_removal_back(level):
    x = torch.randn(2, 4)
    gm = _capture(_Detached(), (x,), level)
    with pytest.warns(UserWarning, match="rolled back"):
        result = rewrite.parse(UNDETACH[level]).apply(gm, (x,), on_mismatch="skip-rule")
    assert result.counts == {} and [r.rule for r in result.rejected] == ["undetach"]
    for mine, theirs in zip(_grads(result.graph_module, (x,)), _grads(gm, (x,))):
        assert torch.equal(mine, theirs)


def test_parameter_gradients_are_compared_when_no_input_is_floating():
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    gm = torch.export.export(_TokensDetached(), (ids,), strict=False).module()
    with pytest.raises(EquivalenceError, match="gradient of parameter emb.weight"):
        rewrite.parse(UNDETACH["export"]).apply(gm, (ids,))


def test_replacing_a_straight_through_estimator_by_a_rounding_is_caught():
    rules = rewrite.parse(
        "rule ste_is_round: add(h, Tensor.detach(sub(torch.round(h), h))) => torch.round(h)\n")
    x = torch.randn(8, 4)
    gm = fx.symbolic_trace(_StraightThrough())
    assert rules.apply(gm, (x,), check=False).counts == {"ste_is_round": 1}  # same values...
    with pytest.raises(EquivalenceError, match="gradients"):  # ...no gradient
        rules.apply(gm, (x,))


def test_a_rule_that_keeps_gradients_passes():
    class TwiceDetached(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return h.detach().detach() + h

    x = torch.randn(2, 4)
    gm = fx.symbolic_trace(TwiceDetached())
    result = rewrite.parse("rule detach_twice: Tensor.detach(Tensor.detach(x)) => Tensor.detach(x)\n").apply(gm, (x,))
    assert result.counts == {"detach_twice": 1} and result.equivalence.ok
    for mine, theirs in zip(_grads(result.graph_module, (x,)), _grads(gm, (x,))):
        assert torch.equal(mine, theirs)


def test_rules_without_gradient_ops_run_no_backward(monkeypatch):
    calls = []
    real = check_module.gradient_run
    monkeypatch.setattr(check_module, "gradient_run", lambda *a: calls.append(1) or real(*a))

    class AddZero(nn.Module):
        def forward(self, x):
            return torch.tanh(x) + 0.0

    x = torch.randn(3)
    result = rewrite.load("cleanup.rw").apply(fx.symbolic_trace(AddZero()), (x,))
    assert result.counts == {"add_zero": 1} and result.equivalence.ok and calls == []


def test_check_equivalence_compares_gradients_on_request():
    lin = nn.Linear(3, 3)
    x = (torch.randn(2, 3),)

    def stopped(t):
        return lin(t).detach() * 2 - lin(t)  # the same values, the opposite gradient

    assert check_equivalence(lin, stopped, x).ok  # the same values
    report = check_equivalence(lin, stopped, x, gradients=True)
    assert not report.ok and "gradient" in str(report.first_mismatch)
    assert check_equivalence(lin, lambda t: lin(t) * 1.0, x, gradients=True).ok
    # no gradient reaches the original's output: nothing to compare
    assert check_equivalence(lambda t: lin(t).detach(), lambda t: lin(t).detach() * 1.0, x, gradients=True).ok
    # a gradient reaches the rewrite's output only: it requires grad there only
    report = check_equivalence(lambda t: lin(t).detach(), lin, x, gradients=True)
    assert not report.ok and "requires grad in the rewrite only" in str(report)


def test_an_output_gradients_no_longer_reach_is_reported():
    lin = nn.Linear(3, 3)
    x = (torch.randn(2, 3),)
    report = check_equivalence(lambda t: (lin(t), lin(t) * 2), lambda t: (lin(t), (lin(t) * 2).detach()), x,
                               gradients=True)
    assert not report.ok and "gradients reach this output in the original" in str(report)
