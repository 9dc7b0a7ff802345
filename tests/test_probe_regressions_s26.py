"""Session 26's fixes: what the check draws for all-zero integer inputs.

An all-zero integer example (``token_type_ids`` of one segment) used to stay zero in
every trial, so a rewrite wrong only where an id is not 0 passed the check. Random
trials now draw ``[0, 1]`` for it, and a trial the original itself fails on (an
index into a table of one row) is drawn again with those inputs zero.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import rewrite
from rewrite.trust.check import generate_inputs


class _AddsIds(nn.Module):
    def forward(self, x, ids):
        return (x * 2) + ids.float()


class _OneRowTable(nn.Module):
    """A one-segment model: its type ids index an embedding of one row."""

    def __init__(self) -> None:
        super().__init__()
        self.types = nn.Embedding(1, 3)

    def forward(self, x, ids):
        return self.types(ids) + x * 1


def test_a_rewrite_wrong_only_for_nonzero_ids_is_caught():
    gm = fx.symbolic_trace(_AddsIds())
    rules = rewrite.parse("rule drop_ids: add(x, _) => x\n", "drop.rw")
    example = (torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(rewrite.EquivalenceError):
        rules.apply(gm, example)
    # the input model is untouched, and without the check the rule does fire
    assert rules.apply(gm, example, check=False).counts == {"drop_ids": 1}


def test_a_trial_the_original_fails_on_is_drawn_again_with_the_zeros_kept():
    model = _OneRowTable()
    gm = fx.symbolic_trace(model)
    rules = rewrite.parse("rule mul_one: mul(x, 1) => x\n", "one.rw")
    x, ids = torch.randn(4, 3), torch.zeros(4, dtype=torch.long)
    result = rules.apply(gm, (x, ids))
    assert result.counts == {"mul_one": 1}
    assert result.equivalence.ok and result.equivalence.trials == 3
    assert all(n.target != "mul" and n.target is not torch.mul for n in result.graph_module.graph.nodes
               if n.op in ("call_function", "call_method"))
    torch.testing.assert_close(result.graph_module(x, ids), model(x, ids))


def test_widened_one_valued_integers_draw_their_neighbours_and_nothing_else_changes():
    example = (torch.zeros(64, dtype=torch.long), torch.ones(64, dtype=torch.long),
               torch.full((64,), 3, dtype=torch.int32), torch.randn(8))
    wide = generate_inputs(example, seed=1, widen_constants=True)
    plain = generate_inputs(example, seed=1)
    assert set(wide[0].tolist()) == {0, 1} and set(plain[0].tolist()) == {0}
    assert set(wide[1].tolist()) <= {0, 1}
    assert set(wide[2].tolist()) == {2, 3, 4} and set(plain[2].tolist()) == {3}
    assert wide[0].dtype == torch.long and wide[2].dtype == torch.int32
