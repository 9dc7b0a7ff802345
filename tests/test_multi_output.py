"""Multi-output patterns: ``op(...) as (a, b)`` binds an op's results (read through
``operator.getitem``), a tuple replacement gives one value per result, and a
tuple binding as an argument matches the list of all the results. Each rule is
run at the capture levels where its op appears, the graph checked for the
change and the outputs compared; the must-not-fire cases keep the graph."""

import operator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import rewrite
from rewrite.capture import capture_with_inputs
from rewrite.ops import lookup_op


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def _names(gm):
    return [getattr(t, "__name__", None) or str(t) for t in _targets(gm)]


def _apply(text, model, x, level):
    gm, inputs = capture_with_inputs(model, (x,), level)
    result = rewrite.parse(text).apply(gm, example_inputs=inputs)
    return gm, inputs, result


def _same(before, after, inputs):
    want, got = before(*inputs), after(*inputs)
    want = want if isinstance(want, (tuple, list)) else (want,)
    got = got if isinstance(got, (tuple, list)) else (got,)
    assert len(want) == len(got)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w)


# ------------------------------------------------------------------ root: tuple replacement


class MaxDim(nn.Module):
    def forward(self, x):
        v, i = torch.max(x, 1)
        return v * 2, i


MAX_TO_AMAX = """
# max(x, d) == (amax(x, d), argmax(x, d)); argmax refuses bool tensors
rule max_to_amax: aten.max.dim(x, d, k) as (_, _) where dtype(x) != torch.bool
    => (aten.amax(x, [d], k), aten.argmax(x, d, k))
"""


@pytest.mark.parametrize("level", ["export", "export_core"])
def test_max_dim_becomes_amax_and_argmax(level):
    x = torch.randn(3, 5)
    gm, inputs, result = _apply(MAX_TO_AMAX, MaxDim(), x, level)
    assert result.counts == {"max_to_amax": 1}
    after = _targets(result.graph_module)
    assert torch.ops.aten.max.dim not in after
    assert torch.ops.aten.amax.default in after and torch.ops.aten.argmax.default in after
    assert operator.getitem not in after  # the getitems went with the op
    _same(gm, result.graph_module, inputs)


class LayerNormModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        return self.norm(x).relu()


NATIVE_LAYER_NORM = """
# native_layer_norm(...)[0] == layer_norm(...): the mean and rstd results unused
rule layer_norm_from_native: aten.native_layer_norm(x, s, w, b, eps) as (_, _, _)
    => (layer_norm(x, s, w, b, eps), _, _)
"""


def test_native_layer_norm_back_to_layer_norm_in_core_aten():
    x = torch.randn(2, 6)
    model = LayerNormModel().eval()
    gm, inputs, result = _apply(NATIVE_LAYER_NORM, model, x, "export_core")
    assert result.counts == {"layer_norm_from_native": 1}
    after = _targets(result.graph_module)
    assert torch.ops.aten.native_layer_norm.default not in after
    assert torch.ops.aten.layer_norm.default in after
    _same(gm, result.graph_module, inputs)


class Chunks(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, 1)
        return a.relu() + b


CHUNK_TO_SLICES = """
# chunk(x, 2, d) of a size-4 dim == (x[0:2], x[2:4]) along d
rule chunk_to_slices: (Tensor.chunk | aten.chunk) (x, 2, d) as (_, _) where shape(x)[d] == 4
    => (aten.slice.Tensor(x, d, 0, 2), aten.slice.Tensor(x, d, 2, 4))
"""


@pytest.mark.parametrize("level", ["fx", "dynamo", "export"])
def test_chunk_to_slices_at_every_level(level):
    x = torch.randn(3, 4)
    gm, inputs, result = _apply(CHUNK_TO_SLICES, Chunks(), x, level)
    assert result.counts == {"chunk_to_slices": 1}
    names = _names(result.graph_module)
    assert "chunk" not in names and "getitem" not in names
    assert names.count("slice.Tensor") == 2
    _same(gm, result.graph_module, inputs)


# ------------------------------------------------------------------ root: one multi-output call


class Splits(nn.Module):
    def forward(self, x):
        a, b = torch.split(x, 2, 1)
        return a - b


SPLIT_TO_CHUNK = """
# split(x, 2, d) of a size-4 dim == chunk(x, 2, d)
rule split_to_chunk: aten.split.Tensor(x, 2, d) as (_, _) where shape(x)[d] == 4 => aten.chunk(x, 2, d)
"""
CHUNK_TO_SPLIT = """
# chunk(x, 2, d) of a size-4 dim == split(x, 2, d)
rule chunk_to_split: Tensor.chunk(x, 2, d) as (_, _) where shape(x)[d] == 4 => Tensor.split(x, 2, d)
"""


def test_split_to_chunk_replaces_the_whole_value():
    x = torch.randn(3, 4)
    gm, inputs, result = _apply(SPLIT_TO_CHUNK, Splits(), x, "export")
    assert result.counts == {"split_to_chunk": 1}
    after = _targets(result.graph_module)
    assert torch.ops.aten.split.Tensor not in after and torch.ops.aten.chunk.default in after
    assert after.count(operator.getitem) == 2  # the getitems now read the chunk
    _same(gm, result.graph_module, inputs)


@pytest.mark.parametrize("level", ["fx", "dynamo"])
def test_chunk_to_split_replaces_the_whole_value(level):
    x = torch.randn(3, 4)
    gm, inputs, result = _apply(CHUNK_TO_SPLIT, Chunks(), x, level)
    assert result.counts == {"chunk_to_split": 1}
    names = _names(result.graph_module)
    assert "chunk" not in names and "split" in names
    _same(gm, result.graph_module, inputs)


class ReturnsTuple(nn.Module):
    def forward(self, x):
        return x.chunk(2, 1)


def test_whole_tuple_returned_fires_only_for_one_multi_output_call():
    x = torch.randn(3, 4)
    gm, inputs, result = _apply(CHUNK_TO_SLICES, ReturnsTuple(), x, "fx")
    assert result.counts == {}  # the tuple itself is returned: no result-by-result rewrite
    gm, inputs, result = _apply(CHUNK_TO_SPLIT, ReturnsTuple(), x, "fx")
    assert result.counts == {"chunk_to_split": 1}
    assert "split" in _names(result.graph_module)
    _same(gm, result.graph_module, inputs)


# ------------------------------------------------------------------ argument: all the results


class SplitCat(nn.Module):
    def forward(self, x):
        a, b = x.split(2, 1)
        c, d = x.chunk(2, 0)
        return torch.cat([a, b], 1) * 2 + torch.cat([c, d], 0)


CAT_OF_PIECES = """
# cat of all the pieces of a split along the split's dim == x
rule cat_split: cat((Tensor.split | aten.split.Tensor) (x, _, d) as (_, _), d) => x
rule cat_chunk: cat((Tensor.chunk | aten.chunk) (x, _, d) as (_, _), d) => x
"""


@pytest.mark.parametrize("level", ["fx", "dynamo", "export"])
def test_cat_of_all_the_pieces_is_the_input(level):
    x = torch.randn(4, 4)
    gm, inputs, result = _apply(CAT_OF_PIECES, SplitCat(), x, level)
    names = _names(result.graph_module)
    assert "cat" not in names and "getitem" not in names
    assert result.counts == {"cat_split": 1, "cat_chunk": 1}
    _same(gm, result.graph_module, inputs)


class CatPart(nn.Module):
    def forward(self, x):
        a, b, c = torch.split(x, 2, 1)
        return torch.cat([a, b], 1) + 1, c


class CatOtherDim(nn.Module):
    def forward(self, x):
        a, b = torch.split(x, 2, 1)
        return torch.cat([a, b], 0)


class CatReordered(nn.Module):
    def forward(self, x):
        a, b = torch.split(x, 2, 1)
        return torch.cat([b, a], 1)


class PieceUsedElsewhere(nn.Module):
    def forward(self, x):
        a, b = torch.split(x, 2, 1)
        return torch.cat([a, b], 1), a.sum()


@pytest.mark.parametrize("model", [CatPart(), CatOtherDim(), CatReordered(), PieceUsedElsewhere()],
                         ids=["some-pieces", "other-dim", "reordered", "piece-read-elsewhere"])
def test_cat_of_pieces_does_not_fire(model):
    x = torch.randn(4, 6 if isinstance(model, CatPart) else 4)
    gm, inputs, result = _apply(CAT_OF_PIECES, model, x, "export")
    assert result.counts == {}
    assert torch.ops.aten.cat.default in _targets(result.graph_module)


# ------------------------------------------------------------------ must not fire


class UsesIndices(nn.Module):
    def forward(self, x):
        v, i = torch.max(x, 1)
        return v, i.float()


ONLY_VALUES = """
# max(x, d)[0] == amax(x, d), for graphs that never read the indices
rule max_values: aten.max.dim(x, d, k) as (_, _) => (aten.amax(x, [d], k), _)
"""


def test_unprovided_result_with_a_user_blocks_the_rule():
    x = torch.randn(3, 5)
    gm, inputs, result = _apply(ONLY_VALUES, UsesIndices(), x, "export")
    assert result.counts == {}
    assert torch.ops.aten.max.dim in _targets(result.graph_module)


class ValuesOnly(nn.Module):
    def forward(self, x):
        v, _ = torch.max(x, 1)
        return v + 1


def test_unprovided_result_without_users_is_dropped():
    x = torch.randn(3, 5)
    gm, inputs, result = _apply(ONLY_VALUES, ValuesOnly(), x, "export")
    assert result.counts == {"max_values": 1}
    after = _targets(result.graph_module)
    assert torch.ops.aten.max.dim not in after and operator.getitem not in after
    _same(gm, result.graph_module, inputs)


class ThreeChunks(nn.Module):
    def forward(self, x):
        a, b, c = x.chunk(3, 1)
        return a + b + c


ANY_CHUNK_TO_SLICES = """
rule two_chunks: Tensor.chunk(x, n, d) as (_, _) where value(n) == 3
    => (aten.slice.Tensor(x, d, 0, 2), aten.slice.Tensor(x, d, 2, 4))
"""


@pytest.mark.parametrize("level", ["fx", "dynamo"])
def test_wrong_result_count_does_not_fire(level):
    x = torch.randn(2, 6)
    gm, inputs, result = _apply(ANY_CHUNK_TO_SLICES, ThreeChunks(), x, level)
    assert result.counts == {}
    assert "chunk" in _names(result.graph_module)


def test_a_result_bound_by_name_is_tested_in_the_where_clause():
    rules = """
    rule values_of_wide_rows: aten.max.dim(x, d, k) as (v, _) where shape(v)[0] == 3
        => (aten.amax(x, [d], k), aten.argmax(x, d, k))
    """
    gm, inputs, result = _apply(rules, MaxDim(), torch.randn(3, 5), "export")
    assert result.counts == {"values_of_wide_rows": 1}
    gm, inputs, result = _apply(rules, MaxDim(), torch.randn(4, 5), "export")
    assert result.counts == {}


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 4), cols=st.integers(1, 6), dim=st.sampled_from([0, 1]), keep=st.booleans())
def test_max_to_amax_outputs_match_for_any_shape(rows, cols, dim, keep):
    class M(nn.Module):
        def forward(self, x):
            v, i = torch.max(x, dim, keep)
            return v, i

    x = torch.randn(rows, cols)
    gm, inputs, result = _apply(MAX_TO_AMAX, M(), x, "export")
    assert result.counts == {"max_to_amax": 1}
    _same(gm, result.graph_module, inputs)


class SecondPiece(nn.Module):
    def forward(self, x):
        a, b = torch.split(x, 2, 1)
        return b * 3


def test_one_result_through_getitem():
    rules = """
    # split(x, s, d)[1] == x[s:2s] along d (here the last piece of a size-4 dim)
    rule second_piece: mul(getitem(aten.split.Tensor(x, 2, d), 1), c) where shape(x)[d] == 4
        => mul(aten.slice.Tensor(x, d, 2, 4), c)
    """
    gm, inputs, result = _apply(rules, SecondPiece(), torch.randn(3, 4), "export")
    assert result.counts == {"second_piece": 1}
    assert torch.ops.aten.split.Tensor not in _targets(result.graph_module)
    _same(gm, result.graph_module, inputs)


# ------------------------------------------------------------------ verification

GOOD = MAX_TO_AMAX + NATIVE_LAYER_NORM + CAT_OF_PIECES + CHUNK_TO_SPLIT + ONLY_VALUES


@pytest.mark.parametrize("name", ["max_to_amax", "layer_norm_from_native", "cat_split", "cat_chunk",
                                  "chunk_to_split", "max_values"])
def test_multi_output_rules_verify(name):
    from rewrite.trust.verify import verify_rule

    v = verify_rule(rewrite.parse(GOOD, "multi.rw"), name, max_examples=8, seed=0)
    assert v.status == "ok" and v.checked >= 3, v


@pytest.mark.parametrize("text", [
    # amin is not max
    "rule bad: aten.max.dim(x, d, k) as (_, _) => (aten.amin(x, [d], k), aten.argmax(x, d, k))",
    # the second piece is not the first
    "rule bad: aten.split.Tensor(x, s, d) as (_, _) => (aten.slice.Tensor(x, d, 0, s), aten.slice.Tensor(x, d, 0, s))",
    # the pieces in the other order
    "rule bad: cat(aten.split.Tensor(_, _, d) as (a, b), d) => cat([b, a], d)",
])
def test_wrong_multi_output_rules_get_a_counterexample(text):
    from rewrite.trust.verify import verify_rule

    v = verify_rule(rewrite.parse(text, "bad.rw"), "bad", max_examples=30, seed=0)
    assert v.status == "counterexample", v


# ------------------------------------------------------------------ canonical names

_CANONICAL = all(lookup_op(n) is not None for n in ("max", "split"))


class MaxAndPieces(nn.Module):
    def forward(self, x):
        v, i = torch.max(x, 1)
        a, b = torch.split(x, 2, 1)
        return v * 2, i, torch.cat([a, b], 1) + 1


@pytest.mark.skipif(not _CANONICAL, reason="the vocabulary has no canonical max/split yet")
@pytest.mark.parametrize("level", ["fx", "dynamo", "export", "export_core"])
def test_canonical_multi_output_ops_at_every_level(level):
    text = """
    rule max_to_amax: max(x, d, k) as (_, _) => (aten.amax(x, [d], k), aten.argmax(x, d, k))
    rule cat_split: cat(split(x, _, d) as (_, _), d) => x
    """
    gm, inputs, result = _apply(text, MaxAndPieces(), torch.randn(3, 4), level)
    assert result.counts == {"max_to_amax": 1, "cat_split": 1}
    names = _names(result.graph_module)
    assert "cat" not in " ".join(names) and "getitem" not in names
    _same(gm, result.graph_module, inputs)


class PieceReadTwice(nn.Module):
    def forward(self, x):
        a, b = torch.split(x, 2, 1)
        return torch.cat([a, b], 1) + a.repeat(1, 2)


def test_a_result_named_again_in_the_pattern_is_the_same_value():
    text = """
    rule r: add(cat(aten.split.Tensor(x, _, d) as (a, _), d), aten.repeat(a, r)) => add(x, aten.repeat(a, r))
    """
    gm, inputs, result = _apply(text, PieceReadTwice(), torch.randn(3, 4), "export")
    assert result.counts == {"r": 1}
    after = _targets(result.graph_module)
    assert torch.ops.aten.cat.default not in after and after.count(operator.getitem) == 1  # a stays
    _same(gm, result.graph_module, inputs)
    other = """
    rule r: add(cat(aten.split.Tensor(x, _, d) as (a, _), d), aten.repeat(a, r)) => add(x, aten.repeat(a, r))
    """

    class OtherPiece(nn.Module):
        def forward(self, x):
            a, b = torch.split(x, 2, 1)
            return torch.cat([a, b], 1) + b.repeat(1, 2)

    gm, inputs, result = _apply(other, OtherPiece(), torch.randn(3, 4), "export")
    assert result.counts == {}


@pytest.mark.parametrize("level", ["fx", "export"])
def test_the_results_of_a_split_a_rewrite_created_have_facts(level):
    """A later rule asks the dtype of a piece of a split the engine just created: the
    getitem's facts are inferred from the new node's list of results."""
    import torch.fx as fx

    from rewrite.engine.facts import GraphFacts

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x)

    x = torch.randn(3, 4)
    gm = fx.symbolic_trace(M()) if level == "fx" else torch.export.export(M(), (x,), strict=False).module()
    facts = GraphFacts(gm, (x,))
    relu = next(n for n in gm.graph.nodes if n.op == "call_function")
    target = torch.split if level == "fx" else torch.ops.aten.split.Tensor
    with gm.graph.inserting_after(relu):
        split = gm.graph.call_function(target, (relu, 2, -1))
    with gm.graph.inserting_after(split):
        piece = gm.graph.call_function(operator.getitem, (split, 1))
    for node in (split, piece):
        facts.new_node(node)
    meta = facts.meta(piece)
    assert meta is not None and tuple(meta.shape) == (3, 2) and meta.dtype == torch.float32
