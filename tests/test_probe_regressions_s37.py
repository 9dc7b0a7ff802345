"""Regressions from session 37's adversarial probes and open items. Each test
failed before its fix."""
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import rewrite

# rules whose replacement is a copy where the matched value may be a view at run time
COPYING_AT_RUN_TIME = """
rule reshape_copy: reshape(x, s) => clone(reshape(x, s))
rule flatten_copy: flatten(x, a, b) => clone(flatten(x, a, b))
rule reshape_as_copy: reshape_as(x, o) => clone(reshape_as(x, o))
rule contiguous_copy: contiguous(x) => clone(x)
ruleset copies = once(reshape_copy, flatten_copy, reshape_as_copy, contiguous_copy)
"""


class _ThroughReshape(nn.Module):
    def forward(self, x):
        h = x * 2.0
        h.reshape(-1).add_(1.0)
        return h


class _ThroughFlatten(nn.Module):
    def forward(self, x):
        h = x * 2.0
        h.flatten(0, 1).mul_(3.0)
        return h + 1


class _ThroughReshapeAs(nn.Module):
    def forward(self, x):
        h = x * 2.0
        h.reshape_as(h).sub_(1.0)
        return h


class _ThroughContiguous(nn.Module):
    def forward(self, x):
        h = x * 2.0
        h.contiguous().add_(1.0)
        return h


class _IntoBaseAfterReshape(nn.Module):  # a write into the memory reaches the reshape's readers
    def forward(self, x):
        h = x * 2.0
        v = h.reshape(-1)
        h.add_(1.0)
        return v * 3


class _InputThroughReshape(nn.Module):  # the caller's tensor, written through a run-time view
    def forward(self, x):
        x.reshape(-1).add_(1.0)
        return x.sum()


class _ReshapeReturnedWithBase(nn.Module):
    def forward(self, x):
        h = x * 2.0
        return h, h.reshape(-1)


class _ReshapeReadOnly(nn.Module):  # nothing observes the sharing: the rules fire
    def forward(self, x):
        h = x * 2.0
        return h.reshape(-1) + 1, h.flatten(0, 1) * 2, h.contiguous() - 1


def _capture(model, capture, x):
    if capture == "fx":
        return fx.symbolic_trace(model)
    return torch.export.export(model, (x.clone(),)).module()


def _leaves(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("model", [_ThroughReshape, _ThroughFlatten, _ThroughReshapeAs, _ThroughContiguous,
                                   _IntoBaseAfterReshape, _InputThroughReshape, _ReshapeReturnedWithBase])
def test_a_run_time_view_whose_sharing_is_observed_is_not_made_a_copy(model, capture):
    """Probe Z4 F4: ``reshape``, ``flatten``, ``reshape_as`` and ``contiguous`` view
    their input at run time (a contiguous one); replaced by a copy, a write through
    them no longer reached the memory they viewed, even unchecked."""
    x = torch.randn(3, 4)
    gm = _capture(model(), capture, x)
    result = rewrite.parse(COPYING_AT_RUN_TIME)["copies"].apply(gm, example_inputs=(x.clone(),), check=False)
    xa, xb = x.clone(), x.clone()
    want, got = model()(xa), result.graph_module(xb)
    for a, b in zip(_leaves(want), _leaves(got)):
        assert torch.equal(a, b)
    assert torch.equal(xa, xb)
    if isinstance(want, tuple):
        shares = {t.untyped_storage().data_ptr() for t in want}
        assert len({t.untyped_storage().data_ptr() for t in got}) == len(shares)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_run_time_view_nobody_observes_is_still_rewritten(capture):
    x = torch.randn(3, 4)
    gm = _capture(_ReshapeReadOnly(), capture, x)
    result = rewrite.parse(COPYING_AT_RUN_TIME)["copies"].apply(gm, example_inputs=(x.clone(),))
    # export leaves out a contiguous() of a contiguous tensor
    assert sum(result.counts.values()) == (3 if capture == "fx" else 2), result.counts
    for a, b in zip(_ReshapeReadOnly()(x), result.graph_module(x)):
        assert torch.equal(a, b)


def test_a_cast_to_another_dtype_is_a_copy_not_a_view():
    """The metadata shows ``to(h, float64)`` is new memory: a write into ``h``
    after it does not make its replacement unsound, and the rule fires."""
    class M(nn.Module):
        def forward(self, x):
            h = x * 2.0
            d = h.to(torch.float64)
            h.add_(1.0)
            return d * 3, h

    rules = rewrite.parse("rule to_copy: to(x, t) where dtype(x) != t => clone(to(x, t))")
    x = torch.randn(3, 4)
    gm = torch.export.export(M(), (x.clone(),)).module()
    result = rules.apply(gm, example_inputs=(x.clone(),))
    assert result.counts == {"to_copy": 1}
    for a, b in zip(M()(x.clone()), result.graph_module(x.clone())):
        assert torch.equal(a, b)
