"""Folding rules never hand a graph a constant its dtype cannot hold: a fold whose
new weight or bias would overflow (float16 with extreme batch-norm statistics) is
refused, so the batch norm stays and the outputs stay finite; an ordinary float16
model still folds."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import rewrite
from rewrite.functions.registry import lookup_function


def _fusion():
    return rewrite.load("rules/fusion.rw")


def _bn_count(gm):
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.modules.batchnorm._BatchNorm):
            n += 1
        elif node.op == "call_function" and "batch_norm" in str(node.target):
            n += 1
    return n


def _graphs(model, x):
    yield "fx", fx.symbolic_trace(model)
    yield "export", torch.export.export(model, (x,), strict=False).module()


def _extreme(bn, center=None):
    """gamma / sqrt(var + eps) ~ 1e5: more than float16 holds (65504)."""
    with torch.no_grad():
        bn.weight.fill_(1000.0)
        bn.running_var.fill_(1e-4)
        bn.running_mean.copy_(torch.zeros_like(bn.running_mean) if center is None else center)


def _ordinary(bn, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        n = bn.num_features
        bn.running_mean.copy_(torch.randn(n, generator=g))
        bn.running_var.copy_(torch.rand(n, generator=g) + 0.5)
        bn.weight.copy_(torch.randn(n, generator=g))
        bn.bias.copy_(torch.randn(n, generator=g))


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.b = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        with torch.no_grad():
            self.c.weight.uniform_(-1, 1)

    def forward(self, x):
        return self.b(self.c(x))


class LinearBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.l, self.b = nn.Linear(6, 5), nn.BatchNorm1d(5)
        with torch.no_grad():
            self.l.weight.uniform_(-1, 1)

    def forward(self, x):
        return self.b(self.l(x))


class BNLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.b, self.l = nn.BatchNorm1d(6), nn.Linear(6, 5)
        with torch.no_grad():
            self.l.weight.uniform_(-1, 1)

    def forward(self, x):
        return self.l(self.b(x))


def _extreme_model(cls):
    torch.manual_seed(0)
    m = cls()
    if cls is BNLinear:
        _extreme(m.b)
    else:  # the batch norm's input sits at its mean: eager output stays small
        _extreme(m.b, center=(m.c if cls is ConvBN else m.l).bias.detach())
    return m.eval().half()


def _input(cls, scale=1e-3):
    g = torch.Generator().manual_seed(1)
    shape = (1, 3, 6, 6) if cls is ConvBN else (4, 6)
    return (torch.randn(shape, generator=g) * scale).half()


@pytest.mark.parametrize("cls", [ConvBN, LinearBN, BNLinear])
def test_float16_fold_that_overflows_is_refused(cls):
    model = _extreme_model(cls)
    x = _input(cls)
    expected = model(x)
    assert torch.isfinite(expected).all()
    for level, gm in _graphs(model, x):
        result = _fusion().apply(gm, example_inputs=(x,), check=False)
        assert not result.counts, level
        assert _bn_count(result.graph_module) == 1, level
        out = result.graph_module(x)
        assert torch.isfinite(out).all(), level
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("cls", [ConvBN, LinearBN, BNLinear])
def test_float16_fold_that_overflows_passes_the_check(cls):
    """With the check on, apply neither raises nor folds."""
    model = _extreme_model(cls)
    x = _input(cls)
    for level, gm in _graphs(model, x):
        result = _fusion().apply(gm, example_inputs=(x,))
        assert _bn_count(result.graph_module) == 1, level


@pytest.mark.parametrize("cls", [ConvBN, LinearBN, BNLinear])
def test_ordinary_float16_model_still_folds(cls):
    torch.manual_seed(0)
    model = cls()
    _ordinary(model.b)
    model = model.eval().half()
    x = _input(cls, scale=1.0)
    for level, gm in _graphs(model, x):
        result = _fusion().apply(gm, example_inputs=(x,))
        assert sum(result.counts.values()) == 1, (level, result.counts)
        assert _bn_count(result.graph_module) == 0, level
        out = result.graph_module(x)
        assert out.dtype == torch.float16
        torch.testing.assert_close(out.float(), model(x).float(), rtol=2e-2, atol=2e-2)


def test_float16_fold_whose_intermediate_overflows_still_folds():
    """gamma / sqrt(var + eps) overflows float16, but the folded weight (small conv
    taps times it) does not: the fold computes in float32 and rounds once."""
    torch.manual_seed(0)
    model = ConvBN()
    with torch.no_grad():
        model.c.weight.uniform_(-1e-2, 1e-2)
    _extreme(model.b, center=model.c.bias.detach())
    model = model.eval().half()
    x = _input(ConvBN, scale=1.0)
    gm = fx.symbolic_trace(model)
    result = _fusion().apply(gm, example_inputs=(x,))
    assert result.counts == {"conv_bn": 1}
    out = result.graph_module(x)
    assert torch.isfinite(out).all()
    # float16 eager rounds the conv's output before scaling it by ~1e5: compare both
    # with the model run in float64, where the fold is no worse than eager
    ref = model.double()(x.double())
    fold_error = (out.double() - ref).abs().max()
    eager_error = (model.half()(x).double() - ref).abs().max()
    assert fold_error <= eager_error + 1e-3 * ref.abs().max()


def _const(name):
    return lookup_function(name).fn


def test_every_batch_norm_fold_refuses_an_overflowing_constant():
    """The folding functions themselves: each raises rather than return inf."""
    w4 = torch.ones(4, 4, 1, 1, dtype=torch.float16)
    w2 = torch.ones(4, 4, dtype=torch.float16)
    b = torch.zeros(4, dtype=torch.float16)
    mean, var = torch.zeros(4, dtype=torch.float16), torch.full((4,), 1e-4, dtype=torch.float16)
    gamma, beta = torch.full((4,), 1000.0, dtype=torch.float16), torch.zeros(4, dtype=torch.float16)
    calls = {
        "conv_bn_weight": (w4, b, mean, var, gamma, beta, 1e-5),
        "conv_transpose_bn_weight": (w4, b, mean, var, gamma, beta, 1e-5),
        "linear_bn_weight": (w2, b, mean, var, gamma, beta, 1e-5),
        "bn_conv_weight": (w4, 1, mean, var, gamma, beta, 1e-5),
        "bn_linear_weight": (w2, mean, var, gamma, beta, 1e-5),
        "conv_identity_weight": (w4, 1, mean, var, gamma, beta, 1e-5),
    }
    for name, args in calls.items():
        with pytest.raises(ValueError, match="not finite"):
            _const(name)(*args)
    shifted = torch.full((4,), 1.0, dtype=torch.float16)  # mean * scale overflows the bias
    biases = {
        "conv_bn_bias": (w4, b, shifted, var, gamma, beta, 1e-5),
        "linear_bn_bias": (w2, b, shifted, var, gamma, beta, 1e-5),
        "bn_conv_bias": (w4, b, 1, shifted, var, gamma, beta, 1e-5),
        "bn_linear_bias": (w2, b, shifted, var, gamma, beta, 1e-5),
        "conv_identity_bias": (b, shifted, var, gamma, beta, 1e-5),
    }
    for name, args in biases.items():
        with pytest.raises(ValueError, match="not finite"):
            _const(name)(*args)


def test_merged_conv_and_cast_refuse_an_overflow():
    big = torch.full((2, 2, 3, 3), 60000.0, dtype=torch.float16)
    with pytest.raises(ValueError, match="not finite"):
        _const("merged_conv_weight")(big, 1, big, 1, 1)
    with pytest.raises(ValueError, match="not finite"):
        _const("merged_conv_bias")(big[:, 0, 0, 0], big[:, 0, 0, 0])
    with pytest.raises(ValueError, match="overflows"):
        _const("cast")(torch.tensor([1e6]), torch.float16)
    # a value that was not finite before the cast is kept (an attention mask's -inf)
    mask = torch.tensor([0.0, float("-inf")])
    assert torch.equal(_const("cast")(mask, torch.bfloat16), mask.to(torch.bfloat16))


def test_folds_in_float32_are_unchanged():
    """float32 folds keep torch's own math, bit for bit."""
    from torch.nn.utils import fusion

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(4, 3, 3, 3, generator=g), torch.randn(4, generator=g)
    mean, var = torch.randn(4, generator=g), torch.rand(4, generator=g) + 0.5
    gamma, beta = torch.randn(4, generator=g), torch.randn(4, generator=g)
    ref_w, ref_b = fusion.fuse_conv_bn_weights(w, b, mean, var, 1e-5, gamma, beta)
    assert torch.equal(_const("conv_bn_weight")(w, b, mean, var, gamma, beta, 1e-5), ref_w.detach())
    assert torch.equal(_const("conv_bn_bias")(w, b, mean, var, gamma, beta, 1e-5), ref_b.detach())
