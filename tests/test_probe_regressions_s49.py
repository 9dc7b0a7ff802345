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
