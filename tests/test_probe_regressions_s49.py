"""Regressions from the session-49 probes: a mixed-precision rewrite of a model that
already computes something in bfloat16 (probe CJ F1: Falcon's ALiBi slopes)."""

from __future__ import annotations

import warnings

import pytest
import torch

import rewrite
from rewrite.trust.check import half_node_counts, more_half_nodes


class _AlibiLike(torch.nn.Module):
    """An MLP plus a small term the model itself computes in bfloat16 at run time
    (Falcon's ``slopes.bfloat16() * arange``)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(64, 64)
        self.l2 = torch.nn.Linear(64, 64)

    def forward(self, x):
        term = (x[:, :1].bfloat16() * 0.01).float()
        return self.l2(torch.relu(self.l1(x))) + term


def _exported() -> tuple:
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    return torch.export.export(_AlibiLike().eval(), (x,)).module(), x


@pytest.mark.parametrize("inplace", [False, True])
def test_amp_bf16_passes_its_check_on_a_model_already_computing_in_bfloat16(inplace):
    """bfloat16 was already on the original's path to the output, so the rewrite's
    bfloat16 linears counted as no new precision: the output was held to float32's
    tolerance and a rewrite as close as torch.autocast was refused."""
    gm, x = _exported()
    want = gm(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = rewrite.load(rewrite.rules_dir() / "amp_bf16.rw").apply(gm, (x,), training=False, inplace=inplace)
    assert result.counts.get("linear_bf16", 0) == 2
    out = result.graph_module(x)
    assert (out - want).abs().max() < 0.05  # bfloat16's rounding, not a different model
    assert result.equivalence.ok


def test_a_wrong_bfloat16_rewrite_of_such_a_model_is_still_refused():
    """The allowance is autocast's error: a rule that changes what is computed fails."""
    gm, x = _exported()
    wrong = rewrite.parse(
        "rule relu_bf16_wrong: relu(x) where dtype(x) == torch.float32 "
        "=> to(relu(to(mul(x, 1.1), torch.bfloat16)), torch.float32)")
    with pytest.raises(rewrite.EquivalenceError):
        wrong.apply(gm, (x,), training=False)


def test_more_half_nodes_reads_the_graphs_metadata():
    gm, x = _exported()
    before = half_node_counts(gm)
    assert before[torch.bfloat16] >= 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        after = rewrite.load(rewrite.rules_dir() / "amp_bf16.rw").apply(gm, (x,), training=False).graph_module
    assert more_half_nodes(before, half_node_counts(after)) == (torch.bfloat16,)
    assert more_half_nodes(before, before) == ()
    assert more_half_nodes(None, before) == ()


class _TwoOutputs(torch.nn.Module):
    """Both outputs read a small term computed in ``side`` precision; AMP lowers only
    the linear of the second."""

    def __init__(self, side: torch.dtype) -> None:
        super().__init__()
        self.l2 = torch.nn.Linear(64, 64)
        self.side = side

    def forward(self, x):
        term = (x[:, :1].to(self.side) * 0.01).float()
        return torch.sigmoid(x * 2.0) + term, self.l2(x) + term


@pytest.mark.parametrize("side", [torch.float32, torch.bfloat16])
def test_the_allowance_reaches_only_outputs_computed_more_in_half_precision(side):
    """Probe CL F1: a 1%-wrong rule on the output AMP left alone passed once the
    allowance was decided over the whole graph; it is decided per output, from the
    nodes each is computed from."""
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    gm = torch.export.export(_TwoOutputs(side).eval(), (x,)).module()
    wrong = rewrite.parse("rule wrong: sigmoid(x) => mul(sigmoid(x), 1.01)\nruleset main = once(wrong)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(rewrite.EquivalenceError):
            (rewrite.load(rewrite.rules_dir() / "amp_bf16.rw") + wrong).apply(gm, (x,), training=False)
        result = rewrite.load(rewrite.rules_dir() / "amp_bf16.rw").apply(gm, (x,), training=False)
    assert result.counts.get("linear_bf16", 0) == 1 and result.equivalence.ok


def test_an_innocuous_extra_half_node_does_not_loosen_a_wrong_float32_rule():
    """Probe CL F1: approximate rules adding one bfloat16 node on a side branch of
    the same output must not let a 1%-wrong float32 rule pass: the allowance is
    autocast's error on the tolerance as it was, not bfloat16's tolerance."""

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = torch.nn.Linear(64, 64)

        def forward(self, x):
            return torch.sigmoid(self.l1(x)) + (x[:, :1].bfloat16() * 0.5).float()

    rules = rewrite.parse('''
rule split_half(tolerance="approx"): mul(a, 0.5) where dtype(a) == torch.bfloat16 => div(a, 2.0)
rule add_node(tolerance="approx"): div(a, 2.0) where dtype(a) == torch.bfloat16 => mul(div(a, 4.0), 2.0)
rule wrong: sigmoid(x) => mul(sigmoid(x), 1.01)
ruleset main = seq(once(split_half), once(add_node), once(wrong))
''')
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    gm = torch.export.export(Model().eval(), (x,)).module()
    with pytest.raises(rewrite.EquivalenceError):
        rules.apply(gm, (x,), training=False)
