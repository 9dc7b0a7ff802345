"""Property tests for rules/cleanup.rw: on random shapes and values each rule fires
where it should, and the rewritten graph gives bit-identical outputs (the rules are
exact), at the symbolic_trace and torch.export levels."""

import functools

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import rewrite


@functools.lru_cache(maxsize=None)
def cleanup():
    return rewrite.load("rules/cleanup.rw")


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


shapes = st.lists(st.integers(1, 4), min_size=2, max_size=4).map(tuple)
float_dtypes = st.sampled_from([torch.float32, torch.float64, torch.bfloat16])


def _perm(draw_shape, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randperm(len(draw_shape), generator=g).tolist())


def _inverse(p):
    inv = [0] * len(p)
    for i, d in enumerate(p):
        inv[d] = i
    return tuple(inv)


CASES = {
    "mul_one": lambda s, d: (lambda x: torch.relu(x) * 1),
    "div_one": lambda s, d: (lambda x: torch.relu(x) / 1),
    "add_zero": lambda s, d: (lambda x: torch.relu(x) + 0),
    "sub_zero": lambda s, d: (lambda x: torch.relu(x) - 0),
    "neg_neg": lambda s, d: (lambda x: -(-x)),
    "relu_relu": lambda s, d: (lambda x: torch.relu(torch.relu(x))),
    "contiguous_contiguous": lambda s, d: (lambda x: x.contiguous().contiguous()),
    "transpose_transpose": lambda s, d: (lambda x: x.transpose(0, -1).transpose(-1, 0)),
    "transpose_same_dim": lambda s, d: (lambda x: x.transpose(1, 1)),
    "permute_permute": lambda s, d: (lambda p: lambda x: x.permute(*p).permute(*_inverse(p)))(_perm(s, 1)),
    "permute_identity": lambda s, d: (lambda x: x.permute(*range(len(s)))),
    "reshape_reshape": lambda s, d: (lambda x: x.reshape(-1).view(s[::-1]) + 1),
    "reshape_noop": lambda s, d: (lambda x: x.reshape(s)),
    "cat_single": lambda s, d: (lambda x: torch.cat([x], 0)),
    "to_same_dtype": lambda s, d: (lambda x: x.to(d)),
    "to_roundtrip": lambda s, d: (lambda x: x.to(torch.float64).to(d)),
}


@pytest.mark.parametrize("rule", sorted(CASES))
@settings(max_examples=8, deadline=None)
@given(shape=shapes, dtype=float_dtypes, seed=st.integers(0, 2**16))
def test_cleanup_rule_is_exact(rule, shape, dtype, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    # on a value the graph computes (a rule never makes an output alias an input)
    model = Fn(lambda x, f=CASES[rule](shape, dtype): f(torch.tanh(x)))
    gm = fx.symbolic_trace(model)
    result = cleanup().apply(gm, example_inputs=(x,))
    # a float64 round trip through float64 is two same-dtype casts instead
    expected = "to_same_dtype" if (rule, dtype) == ("to_roundtrip", torch.float64) else rule
    assert result.counts.get(expected, 0) >= 1, result.counts
    assert torch.equal(result.graph_module(x), model(x))
    assert len(result.graph_module.graph.nodes) < len(gm.graph.nodes)


@pytest.mark.parametrize("rule", ["mul_one", "neg_neg", "transpose_transpose", "permute_permute",
                                  "reshape_reshape", "to_same_dtype"])
def test_cleanup_rule_fires_on_export_graphs(rule):
    shape = (2, 3, 4)
    x = torch.randn(shape)
    # after a linear: the strides of values laid out as the input are unknown in an
    # export graph (is_contiguous, which reshape_reshape asks)
    eye = torch.eye(shape[-1])
    model = Fn(lambda x, f=CASES[rule](shape, torch.float32): f(torch.tanh(torch.nn.functional.linear(x, eye))))
    gm = torch.export.export(model, (x,)).module()
    result = cleanup().apply(gm, example_inputs=(x,))
    assert result.counts.get(rule, 0) >= 1, result.counts
    assert torch.equal(result.graph_module(x), model(x))


def test_inexact_cases_are_left_alone():
    x = torch.arange(6).reshape(2, 3)  # int64: x * 1.0 would change the dtype
    for fn in (lambda x: x * 1.0, lambda x: x.to(torch.bfloat16).to(torch.int64),
               lambda x: x.float().to(torch.float16).float()):
        gm = fx.symbolic_trace(Fn(fn))
        result = cleanup().apply(gm, example_inputs=(x,))
        assert result.counts == {}, (fn, result.counts)


@pytest.mark.parametrize("rule", sorted(CASES))
def test_cleanup_never_returns_the_callers_input(rule):
    """Applied straight to a graph input, a rule that would return the input itself
    does not fire (eager returns a fresh tensor: writing into the output must not
    change the input)."""
    shape, dtype = (2, 3), torch.float32
    x = torch.randn(shape)
    model = Fn(CASES[rule](shape, dtype))
    result = cleanup().apply(fx.symbolic_trace(model), example_inputs=(x,))
    expected, out = model(x.clone()), result.graph_module(x)
    assert torch.equal(out, expected)
    fresh_in_eager = model(x).untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    if fresh_in_eager:
        assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr(), result.counts


@pytest.mark.parametrize("level", ["fx", "export"])
@pytest.mark.parametrize("check", [False, True])
def test_reshape_reshape_keeps_the_copy_of_a_non_contiguous_tensor(level, check):
    # eager: reshape(12) of the transposed tensor copies, so the result is contiguous;
    # reshape(x.t(), (3, 4)) would be x.t() itself (strides (1, 3)): a later .view fails
    def f(x):
        return (x.t().reshape(12).reshape(3, 4) + 1).view(12)

    x = torch.randn(4, 3)
    model = Fn(f)
    gm = fx.symbolic_trace(model) if level == "fx" else torch.export.export(model, (x,)).module()
    result = cleanup().apply(gm, example_inputs=(x,), check=check)
    assert "reshape_reshape" not in result.counts
    out = result.graph_module(x)
    assert torch.equal(out, f(x)) and out.is_contiguous()


def test_reshape_reshape_fires_on_a_contiguous_tensor_recorded_by_symbolic_trace():
    x = torch.randn(4, 3)
    model = Fn(lambda x: torch.tanh(x).reshape(12).reshape(3, 4) + 1)
    result = cleanup().apply(fx.symbolic_trace(model), example_inputs=(x,))
    assert result.counts.get("reshape_reshape") == 1
    out = result.graph_module(x)
    assert torch.equal(out, model(x)) and out.is_contiguous()


def test_add_zero_keeps_a_negative_zero_a_documented_limit():
    # README, "What it cannot promise": -0.0 + 0 is +0.0 in eager; add_zero returns -0.0
    model = Fn(lambda x: torch.tanh(x) + 0.0)
    x = torch.tensor([-0.0, 1.0])
    result = cleanup().apply(fx.symbolic_trace(model), example_inputs=(torch.randn(2),))
    assert result.counts == {"add_zero": 1}
    eager, rewritten = model(x), result.graph_module(x)
    assert torch.equal(eager, rewritten)  # equal as numbers...
    assert not torch.signbit(eager[0]) and torch.signbit(rewritten[0])  # ...not as signed zeros
