"""rules/fusion.rw on the batch norms a plain conv -> BN fold misses: through views
(LeViT's linear -> flatten -> BatchNorm1d -> reshape_as), into the linear or unpadded
conv after them (LeViT's and SwiftFormer's heads, SwiftFormer's MLP) and into parallel
branches (TextNet's RepVGG layers: 3x3 + 3x1 + 1x3 convs plus a BN identity branch).
On transformers models from small configs (random weights and BN statistics, export
capture) every foldable BN goes and outputs match; hand-written modules show each
rule at every capture level and the cases where the identity fails."""

import collections
import functools

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

import rewrite
from rewrite.capture import capture
from rewrite.examples.cnn import randomize_batchnorm
from rewrite.ops import bind_node

transformers = pytest.importorskip("transformers")

_BN_MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@functools.lru_cache(maxsize=None)
def fusion():
    return rewrite.load("rules/fusion.rw")


def ops(gm):
    """Canonical op -> count (every spelling at every level)."""
    return collections.Counter(b[0].op for n in gm.graph.nodes for b in [bind_node(n, gm)] if b)


def fused(model, args, level="export"):
    """Capture, apply fusion.rw (checked: raises if outputs differ), compare again."""
    gm = capture(model, args, level)
    result = fusion().apply(gm, example_inputs=args)
    with torch.no_grad():
        want, got = pytree.tree_leaves(model(*args)), pytree.tree_leaves(result.graph_module(*args))
    assert len(want) == len(got)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    return result, ops(gm), ops(result.graph_module)


def bn_modules(model):
    return sum(isinstance(m, _BN_MODULES) for m in model.modules())


def _pixels(size=64):
    return (torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(0)),)


def _eval(model):
    return randomize_batchnorm(model).eval()


# ---------------------------------------------------------------- transformers models


def test_levit_every_batch_norm_folds():
    """LeViT: 4 conv+BN patch embeddings, 22 MLPLayerWithBN (attention qkv/projection,
    MLP, subsample queries) and the classifier's BN1d before its linear."""
    torch.manual_seed(0)
    config = transformers.LevitConfig(image_size=64, hidden_sizes=[16, 24, 32], num_attention_heads=[1, 2, 2],
                                      depths=[1, 1, 1], key_dim=[8, 8, 8], patch_size=16)
    model = _eval(transformers.LevitForImageClassification(config))
    result, before, after = fused(model, _pixels())
    assert bn_modules(model) == before["batch_norm"] == 27
    assert after["batch_norm"] == 0
    assert result.counts == {"conv_bn": 4, "linear_view_bn": 22, "bn_linear": 1}
    assert after["linear"] == before["linear"] and after["reshape_as"] == 0 and after["flatten"] == before["flatten"] - 22


def test_textnet_rep_layers_become_one_conv_each():
    """TextNet's RepConv layers: main kxk conv + BN, vertical kx1 and horizontal 1xk
    conv + BN, and a BN identity branch when the layer keeps its shape. Every BN folds
    and every layer is one conv."""
    torch.manual_seed(0)
    config = transformers.TextNetConfig(
        stem_out_channels=8, hidden_sizes=[8, 8, 16, 16, 32],
        conv_layer_kernel_sizes=[[[3, 3], [3, 3]], [[3, 3], [1, 3]], [[3, 3], [3, 1]], [[3, 3], [3, 3]]],
        conv_layer_strides=[[1, 2], [2, 1], [2, 1], [2, 1]])
    model = _eval(transformers.TextNetModel(config))
    result, before, after = fused(model, _pixels())
    assert bn_modules(model) == before["batch_norm"] == 27
    assert after["batch_norm"] == 0
    layers = [m for m in model.modules() if type(m).__name__ == "TextNetRepConvLayer"]
    identities = sum(m.rbr_identity is not None for m in layers)
    branches = sum((m.vertical_conv is not None) + (m.horizontal_conv is not None) for m in layers)
    assert result.counts == {"conv_bn": before["conv"], "conv_add_conv": branches, "conv_add_bn": identities}
    assert identities == 4 and after["conv"] == 1 + len(layers)  # the stem and one per layer
    assert after["add"] == 0


def test_swiftformer_folds_all_but_the_shared_head_norm():
    """SwiftFormer: conv+BN stems and depthwise convs, the MLP's BN before a 1x1 conv
    (after a residual add with two readers: it folds forward, not back). The head's BN
    is read through flatten and mean by two linears (classifier and distillation head):
    no rule folds a BN into two consumers, so that one stays."""
    torch.manual_seed(0)
    config = transformers.SwiftFormerConfig(depths=[1, 1, 1, 1], embed_dims=[8, 16, 24, 32], num_labels=10)
    model = _eval(transformers.SwiftFormerForImageClassification(config))
    result, before, after = fused(model, _pixels())
    assert bn_modules(model) == before["batch_norm"] == 14
    assert after["batch_norm"] == 1
    assert result.counts["conv_bn"] == 9 and result.counts["bn_conv"] == 4
    gm = result.graph_module
    (bn,) = [n for n in gm.graph.nodes if (bind_node(n, gm) or [None])[0] and bind_node(n, gm)[0].op == "batch_norm"]
    assert [bind_node(u, gm)[0].op for u in bn.users] == ["flatten"]


# ---------------------------------------------------------------- LeViT's pattern at every level


class MLPLayerWithBN(nn.Module):
    """transformers.models.levit.modeling_levit.MLPLayerWithBN, with a choice of view."""

    def __init__(self, features=6, bias=False, back="reshape_as", flat=(0, 1)):
        super().__init__()
        self.linear = nn.Linear(5, features, bias=bias)
        self.batch_norm = nn.BatchNorm1d(features if flat == (0, 1) else flat[2])
        self.back, self.flat = back, flat

    def forward(self, x):
        h = self.linear(x)
        y = self.batch_norm(h.flatten(*self.flat[:2]))
        return y.reshape_as(h) if self.back == "reshape_as" else y.view(2, 3, -1)  # x: (2, 3, 5)


@pytest.mark.parametrize("level", ["fx", "export", "export_core"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("back", ["reshape_as", "view"])
def test_linear_flatten_bn_reshape_folds_at_every_level(level, bias, back):
    model = _eval(MLPLayerWithBN(bias=bias, back=back))
    x = torch.randn(2, 3, 5)
    result, before, after = fused(model, (x,), level)
    assert before["batch_norm"] == 1 and after["batch_norm"] == 0, result.counts
    assert sum(result.counts.values()) == 1
    if level == "export_core":
        assert result.counts == {"mm_view_bn" if not bias else "addmm_view_bn": 1}
    else:
        assert result.counts == {"linear_view_bn": 1} and after["linear"] == 1


def test_linear_flatten_bn_reshape_folds_under_dynamo():
    model = _eval(MLPLayerWithBN(bias=True))
    x = torch.randn(2, 3, 5)
    results = []
    compiled = torch.compile(model, backend=rewrite.backend(fusion(), on_result=results.append))
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert results[0].counts == {"linear_view_bn": 1}
    assert ops(results[0].graph_module)["batch_norm"] == 0


@settings(max_examples=8, deadline=None)
@given(lead=st.lists(st.integers(1, 4), min_size=1, max_size=3), features=st.integers(1, 7),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_linear_view_bn_on_any_leading_dims(lead, features, bias, seed):
    """Any number of leading dims merged into the batch, any feature count."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, features, bias=bias)
            self.batch_norm = nn.BatchNorm1d(features)

        def forward(self, x):
            h = self.linear(x)
            return self.batch_norm(h.reshape(-1, features)).reshape_as(h)

    torch.manual_seed(seed)
    model = randomize_batchnorm(M(), seed).eval()
    x = torch.randn(*lead, 3)
    result = fusion().apply(fx.symbolic_trace(model), example_inputs=(x,))
    assert result.counts == {"linear_view_bn": 1}
    torch.testing.assert_close(result.graph_module(x), model(x), rtol=1e-4, atol=1e-4)


def test_conv_flatten_bn_folds():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(self.conv(x).flatten(2)), self.bn(self.conv(x).view(2, 4, -1))

    model = _eval(M())
    for level in ("fx", "export"):
        result, _, after = fused(model, (torch.randn(2, 3, 5, 5),), level)
        assert result.counts == {"conv_flatten_bn": 1, "conv_view_bn": 1} and after["batch_norm"] == 0, level


# ---------------------------------------------------------------- where the identity fails


def test_flatten_that_merges_the_feature_dim_is_not_folded():
    """flatten(1, 2) of (2, 3, 6) gives (2, 18): the BN normalizes 18 columns that mix
    rows and features, not the linear's 6 outputs."""
    model = _eval(MLPLayerWithBN(flat=(1, 2, 18)))
    for level in ("fx", "export"):
        result, _, after = fused(model, (torch.randn(2, 3, 5),), level)
        assert result.counts == {} and after["batch_norm"] == 1, level


def test_batch_norm_with_a_second_reader_is_not_folded():
    class Two(MLPLayerWithBN):
        def forward(self, x):
            h = self.linear(x)
            y = self.batch_norm(h.flatten(0, 1))
            return y.reshape_as(h), y

    model = _eval(Two())
    result, _, after = fused(model, (torch.randn(2, 3, 5),))
    assert result.counts == {} and after["batch_norm"] == 1


def test_training_mode_batch_norm_is_not_folded():
    model = randomize_batchnorm(MLPLayerWithBN()).train()
    x = torch.randn(2, 3, 5)
    result = fusion().apply(fx.symbolic_trace(model), example_inputs=(x,), check=False)
    assert result.counts == {}


class BNConv(nn.Module):
    def __init__(self, padding=0, kernel=1, groups=1):
        super().__init__()
        self.bn = nn.BatchNorm2d(4)
        self.conv = nn.Conv2d(4, 6, kernel, padding=padding, groups=groups)

    def forward(self, x):
        return self.conv(self.bn(x))


@pytest.mark.parametrize("kernel,groups", [(1, 1), (3, 1), (3, 2)])
def test_bn_then_unpadded_conv_folds(kernel, groups):
    model = _eval(BNConv(kernel=kernel, groups=groups))
    for level in ("fx", "export", "export_core"):
        result, _, after = fused(model, (torch.randn(2, 4, 6, 6),), level)
        assert result.counts == {"bn_conv": 1} and after["batch_norm"] == 0, level


def test_bn_then_padded_conv_is_not_folded():
    """The conv's zero padding would read t = beta - mean * s where bn gave nothing."""
    model = _eval(BNConv(padding=1, kernel=3))
    result, _, after = fused(model, (torch.randn(2, 4, 6, 6),))
    assert result.counts == {} and after["batch_norm"] == 1


def test_bn_then_linear_on_3d_input_is_not_folded():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(3)  # normalizes dim 1, the linear reads dim 2
            self.fc = nn.Linear(5, 2)

        def forward(self, x):
            return self.fc(self.bn(x))

    result, _, after = fused(_eval(M()), (torch.randn(2, 3, 5),))
    assert result.counts == {} and after["batch_norm"] == 1


class Rep(nn.Module):
    """A RepVGG block: kxk conv + BN, optional second conv + BN, optional BN identity."""

    def __init__(self, k1=(3, 3), k2=(1, 3), identity=True, stride=1, cin=4, cout=4, groups=1):
        super().__init__()
        pad = lambda k: tuple((d - 1) // 2 for d in k)  # noqa: E731
        self.c1 = nn.Conv2d(cin, cout, k1, stride, pad(k1), groups=groups, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cin, cout, k2, stride, pad(k2), groups=groups, bias=False) if k2 else None
        self.b2 = nn.BatchNorm2d(cout)
        self.bid = nn.BatchNorm2d(cin) if identity else None

    def forward(self, x):
        y = self.b1(self.c1(x))
        if self.c2 is not None:
            y = y + self.b2(self.c2(x))
        if self.bid is not None:
            y = y + self.bid(x)
        return torch.relu(y)


@pytest.mark.parametrize("groups", [1, 2])
def test_rep_block_becomes_one_conv_at_every_level(groups):
    model = _eval(Rep(groups=groups))
    x = torch.randn(2, 4, 7, 6)
    for level in ("fx", "export", "export_core"):
        result, _, after = fused(model, (x,), level)
        assert result.counts == {"conv_bn": 2, "conv_add_conv": 1, "conv_add_bn": 1}, level
        assert after["conv"] == 1 and after["batch_norm"] == 0 and after["add"] == 0, level


def test_crossed_kernels_are_not_merged():
    """3x1 + 1x3 would merge into a 3x3: more work than the two convs, so no."""
    model = _eval(Rep(k1=(3, 1), k2=(1, 3), identity=False))
    result, _, after = fused(model, (torch.randn(2, 4, 6, 6),))
    assert "conv_add_conv" not in result.counts and after["conv"] == 2


@pytest.mark.parametrize("kernel,padding,dilation,folds", [
    (3, 2, 2, True),        # dilated, still centred
    (5, 2, 1, True),
    (2, "same", 1, False),  # even kernel: torch pads one side more, no centre tap
    (3, 0, 1, False),       # shrinks the output: the add would not even broadcast
])
def test_identity_branch_needs_a_centred_shape_keeping_conv(kernel, padding, dilation, folds):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(4, 4, kernel, 1, padding, dilation)
            self.b = nn.BatchNorm2d(4)

        def forward(self, x):
            return self.c(x) + self.b(x)

    model = _eval(M())
    x = torch.randn(2, 4, 7, 7)
    if not folds and padding == 0:
        with pytest.raises(RuntimeError):
            model(x)
        return
    result, _, after = fused(model, (x,))
    assert result.counts == ({"conv_add_bn": 1} if folds else {}) and after["batch_norm"] == (0 if folds else 1)
