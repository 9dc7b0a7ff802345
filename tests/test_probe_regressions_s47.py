"""Regressions found in session 47: a where-clause variable compared with an int
as a literal at the argument it was bound at compares (probe BW F6)."""

import pytest
import torch
import torch.nn as nn

import rewrite


class _ConvReshape(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, stride=2)

    def forward(self, x):
        return self.c(x).reshape(16, 16).relu()


def _fires(rule: str) -> int:
    x = torch.randn(4, 3, 9, 9)
    gm = torch.export.export(_ConvReshape(), (x,)).module()
    result = rewrite.parse(rule + "\nruleset main = once(a)").apply(gm, (x,))
    out = result.graph_module(x)
    assert torch.allclose(out, gm(x))
    return sum(result.counts.values())


_CONV = "conv(x, w, b, s, p, d, g)"


@pytest.mark.parametrize("clause, fires", [
    ("s == 2", 1), ("s in (2, 3)", 1), ("s == 2 or s == 3", 1), ("s != 2", 0),
    ("s not in (2, 3)", 0), ("not (s in (2, 3))", 0), ("s == [2, 2]", 1), ("s in ([2, 2],)", 1),
])
def test_a_stride_variable_equals_its_expansion_in_every_spelling(clause, fires):
    """A stride ``[2, 2]`` is "stride 2": ``s == 2`` held but ``s in (2, 3)`` did not
    (the clause compared ``[2, 2] in (2, 3)`` as Python does), so two spellings of one
    condition disagreed."""
    rule = f"rule a: {_CONV} where {clause} => add({_CONV}, 0.0)"
    assert _fires(rule) == fires


@pytest.mark.parametrize("clause, fires", [
    ("s == 16", 0), ("s in (2, 16)", 0), ("s == 16 or s == 2", 0), ("s != 16", 1),
    ("s == [16, 16]", 1), ("s in ([16, 16], [1])", 1),
])
def test_a_size_variable_is_no_expansion_of_an_int(clause, fires):
    """``reshape(x, s) where s == 16`` held for the size ``[16, 16]`` (a size is no int
    repeated per dimension: ``reshape(x, 16)`` is ``[16]``)."""
    assert _fires(f"rule a: reshape(x, s) where {clause} => add(reshape(x, s), 0.0)") == fires


def test_a_one_element_size_still_equals_its_int():
    """``x.mean(0)`` is export's ``mean(x, [0])``: a dims variable bound to ``[1]``
    equals ``1``, as the literal ``mean(x, 1)`` matches it."""
    class M(nn.Module):
        def forward(self, x):
            return x.sum(1) * 2

    x = torch.randn(3, 4)
    gm = torch.export.export(M(), (x,)).module()
    for clause, fires in (("d == 1", 1), ("d in (1,)", 1), ("d == 0", 0)):
        rule = f"rule a: sum(x, d) where {clause} => add(sum(x, d), 0.0)\nruleset main = once(a)"
        result = rewrite.parse(rule).apply(gm, (x,))
        assert torch.allclose(result.graph_module(x), gm(x))
        assert sum(result.counts.values()) == fires, clause


class _Attention(nn.Module):
    """nanoGPT's attention: ``nn.Linear`` projections around a written-out attention."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax((q @ k.transpose(-2, -1)) * (1.0 / self.head_dim ** 0.5), dim=-1)
        return x + self.o((att @ v).transpose(1, 2).reshape(b, t, d))


@pytest.mark.parametrize("capture", ["symbolic_trace", "export"])
def test_attention_fuses_in_every_layer_behind_nn_linear(capture):
    """A correct attention rule fused only the last of three layers of a
    symbolic_trace graph: the layout walk took every module call, ``nn.Linear`` too,
    for one that carries its input's layout on, and the next layer's ``q.view``
    for a reader of the new attention's layout (``F.linear`` stopped it)."""
    from rewrite.capture import symbolic_trace

    model = nn.Sequential(*(_Attention() for _ in range(3))).eval()
    x = torch.randn(2, 5, 16)
    gm = symbolic_trace(model) if capture == "symbolic_trace" else torch.export.export(model, (x,)).module()
    rules = rewrite.load("rules/transformer.rw")["transformer"]
    result = rules.apply(gm, (x,))
    assert result.counts.get("attention_scale") == 3, result.counts
    assert torch.allclose(result.graph_module(x), model(x), atol=1e-5)
    assert "scaled_dot_product_attention" in str(result.graph_module.graph)
