"""Regressions from session 38's adversarial probes and open items. Each test
failed before its fix."""
import pytest
import torch
import torch.nn as nn
from torch.export import Dim

import rewrite
from rewrite.trust.sizes import DECLARED_RANGES, smallest_sizes


class _Reshape(nn.Module):
    def forward(self, x):
        return x.reshape(-1) * 2


@pytest.mark.parametrize("dim, given_ep, batch", [
    ({}, True, 1),  # Dim's default min is 0: the smallest size tried stays 1
    ({"min": 1}, True, 1),
    ({"min": 2}, True, 2),  # declared in ep.range_constraints, not enforced by ep.module()
    ({"min": 2}, False, 1),  # ep.module() alone: the ShapeEnv's 2 says nothing
    ({"min": 3}, False, 3),  # the ShapeEnv's bound above 2 is the Dim's own
    ({"min": 5, "max": 9}, True, 5),
])
def test_the_smallest_sizes_are_the_declared_minimum(dim, given_ep, batch):
    """Session 37's open item: every size symbol was tried at 1, below a declared
    ``Dim(min=3)`` (which the module refuses, so the trial was skipped) and below
    ``Dim(min=2)`` (which it does not refuse, so the check held the program to sizes
    it is not declared for)."""
    x = torch.randn(6, 3)
    ep = torch.export.export(_Reshape(), (x,), dynamic_shapes=({0: Dim("B", **dim)},))
    gm = ep.module()
    if given_ep:
        gm.meta[DECLARED_RANGES] = dict(ep.range_constraints)
    assert smallest_sizes(gm, (x,))[0].shape == (batch, 3)


def test_apply_given_the_exported_program_tries_its_declared_minimum():
    class M(nn.Module):  # row 1 exists only from a batch of 2
        def forward(self, x):
            return -(-x) * x[1]

    x = torch.randn(4, 3)
    ep = torch.export.export(M(), (x,), dynamic_shapes=({0: Dim("B", min=2, max=64)},))
    rules = rewrite.load("rules/cleanup.rw")
    from_module = rules.apply(ep.module(), example_inputs=(x,))
    assert from_module.equivalence.ok and from_module.equivalence.skipped == 1  # batch 1: refused
    from_program = rules.apply(ep, example_inputs=(x,))
    assert from_program.counts == {"neg_neg": 1}
    assert from_program.equivalence.ok and from_program.equivalence.skipped == 0  # batch 2 ran
    assert from_program.equivalence.trials == from_module.equivalence.trials
    out = from_program.graph_module(x)
    torch.testing.assert_close(out, M()(x))
