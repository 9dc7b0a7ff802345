"""Dynamo graphs keep ``torch.no_grad()`` and ``torch.autocast()`` blocks as calls that
switch the mode between the nodes they cover (``rewrite.engine.regions``): a rewrite
must not move a computation across them. Found by an adversarial probe: the default
check passed both cases below (it compares gradients only after rules that name a
grad-mode op)."""

import pytest
import torch
import torch.nn as nn

import rewrite


def _dynamo_graph(model, *inputs):
    captured = []

    def backend(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(model, backend=backend)(*inputs)
    finally:
        torch._dynamo.reset()
    return captured[0]


class NoGradCopy(nn.Module):
    def forward(self, x, y):
        with torch.no_grad():
            c = x * 1.0  # a target that must not train x
            d = c * 1.0  # within the region: may become c
        return c + y, d


class NoGradInner(nn.Module):
    def forward(self, x, y):
        with torch.no_grad():
            c = torch.sin(x)
        return torch.cos(c) + y


def _grads(fn, x, y):
    x, y = x.clone().requires_grad_(), y.clone().requires_grad_()
    out = fn(x, y)
    out = out[0] if isinstance(out, (tuple, list)) else out
    out.sum().backward()
    return x.grad, y.grad


@pytest.mark.parametrize("model, text, fired", [
    (NoGradCopy(), None, 1),
    (NoGradInner(), "rule cs: cos(sin(x)) => cos(neg(sin(neg(x))))", 0),
], ids=["forwarding_out_of_no_grad", "match_across_no_grad"])
def test_no_rewrite_moves_a_computation_across_a_no_grad_block(model, text, fired):
    x, y = torch.randn(4), torch.randn(4)
    gm = _dynamo_graph(model, x, y)
    rules = rewrite.load("rules/cleanup.rw") if text is None else rewrite.parse(text)
    result = rules.apply(gm, (x, y))
    assert sum(result.counts.values()) == fired  # NoGradCopy: d = c * 1.0 becomes c, in the region
    (gx, gy), (rx, ry) = _grads(gm, x, y), _grads(result.graph_module, x, y)
    assert gx is None and rx is None
    assert torch.equal(gy, ry)


def test_no_value_is_forwarded_out_of_an_autocast_block():
    class Autocast(nn.Module):
        def forward(self, a, b):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                m = (a @ b) * 1.0
            return m + 0.0, a * 1.0

    a, b = torch.randn(4, 4), torch.randn(4, 4)
    gm = _dynamo_graph(Autocast(), a, b)
    result = rewrite.load("rules/cleanup.rw").apply(gm, (a, b), check=False)
    for want, got in zip(gm(a, b), result.graph_module(a, b)):
        assert want.dtype == got.dtype and torch.equal(want, got)
