"""Regressions found by session 32's probes (N: fooling the check, P: side effects
of the public API on the caller's world), each failing before its fix."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import rewrite
import rewrite.quant as rq
from rewrite.analysis import analyze


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.fc(self.drop(x))


def _rng_kept(call):
    before = torch.get_rng_state()
    call()
    return torch.equal(before, torch.get_rng_state())


def test_analyze_leaves_the_callers_random_stream_alone():
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    train = fx.symbolic_trace(DropoutNet().train())
    assert _rng_kept(lambda: analyze(train, (x,)))  # a dropout that draws
    exported = torch.export.export(DropoutNet().eval(), (x,), strict=False).module()
    assert _rng_kept(lambda: analyze(exported))  # inputs made from the graph's metadata


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_prepare_and_quantize_leave_the_callers_random_stream_alone(capture):
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    model = DropoutNet().train()
    gm = fx.symbolic_trace(model) if capture == "fx" else torch.export.export(model, (x,), strict=False).module()
    assert _rng_kept(lambda: rq.prepare(gm, (x,), fuse=False, check=False))
    assert _rng_kept(lambda: rq.quantize(gm, [(x,)]))


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_max_rewrites_must_be_a_positive_int(bad):
    gm = fx.symbolic_trace(DropoutNet().eval())
    rules = rewrite.parse("rule relu_twice: relu(relu(x)) => relu(x)\n")
    with pytest.raises(ValueError, match="max_rewrites must be a positive int"):
        rules.apply(gm, (torch.randn(2, 4),), max_rewrites=bad)
    assert rules.apply(gm, (torch.randn(2, 4),), max_rewrites=1).counts == {}


def test_a_change_rule_in_once_is_replayed_under_its_own_schedule_for_the_check():
    """The check compares the rewrite with the model after the intentional changes
    alone: replayed under the rule set's schedule (a change rule that matches its own
    replacement runs in once(...); in a fixpoint it never settled)."""
    rules = rewrite.parse("""
rule bump(change=True): relu(x) => relu(add(x, 1.0))
rule mul_one: mul(x, 1) where is_float(x) => x
ruleset main = seq(once(bump), once(mul_one))
""")["main"]

    class M(nn.Module):
        def forward(self, x):
            return torch.relu(x) * 1.0

    gm, x = fx.symbolic_trace(M()), torch.randn(4)
    result = rules.apply(gm, (x,))
    assert result.counts == {"bump": 1, "mul_one": 1} and result.equivalence.ok
    torch.testing.assert_close(result.graph_module(x), torch.relu(x + 1.0))
    wrong = rewrite.parse("""
rule bump(change=True): relu(x) => relu(add(x, 1.0))
rule bad: mul(x, 1) where is_float(x) => neg(x)
ruleset main = seq(once(bump), once(bad))
""")["main"]
    with pytest.raises(rewrite.EquivalenceError, match="bad"):
        wrong.apply(gm, (x,))
