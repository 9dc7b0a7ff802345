"""rules/fusion.rw on small models at every capture level: what folds, what must
not fold, and that one rule file gives the same rewrite at all three levels."""

import functools

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import rewrite


@functools.lru_cache(maxsize=None)
def fusion():
    return rewrite.load("rules/fusion.rw")


def _bn(n, kind=nn.BatchNorm2d, seed=0):
    bn = kind(n)
    g = torch.Generator().manual_seed(seed)
    bn.running_mean.copy_(torch.randn(n, generator=g))
    bn.running_var.copy_(torch.rand(n, generator=g) + 0.5)
    bn.weight.data.copy_(torch.randn(n, generator=g))
    bn.bias.data.copy_(torch.randn(n, generator=g))
    return bn


class ConvBN(nn.Module):
    def __init__(self, dim=2, bias=True, groups=1):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dim]
        bn = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dim]
        self.conv = conv(4, 8, 3, padding=1, bias=bias, groups=groups, stride=2)
        self.bn = _bn(8, bn)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def _input(dim):
    return torch.randn((2, 4) + (6,) * dim)


def _levels(model, x):
    yield "fx", fx.symbolic_trace(model), (x,)
    yield "export", torch.export.export(model, (x,)).module(), (x,)
    yield "export_core", torch.export.export(model, (x,)).run_decompositions().module(), (x,)


def _bn_count(gm):
    names = ("batch_norm", "_native_batch_norm_legit_no_training")
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.modules.batchnorm._BatchNorm):
            n += 1
        elif node.op == "call_function" and any(s in str(node.target) for s in names):
            n += 1
    return n


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_bn_folds_at_every_level(dim, bias):
    model = ConvBN(dim, bias).eval()
    x = _input(dim)
    for level, gm, inputs in _levels(model, x):
        result = fusion().apply(gm, example_inputs=inputs)
        assert result.counts == {"conv_bn": 1}, level
        assert _bn_count(result.graph_module) == 0, level
        torch.testing.assert_close(result.graph_module(x), model(x), rtol=1e-4, atol=1e-4)


def test_same_rewrite_at_fx_export_and_dynamo():
    model = ConvBN(2).eval()
    x = _input(2)
    counts = {level: fusion().apply(gm, example_inputs=inputs).counts for level, gm, inputs in _levels(model, x)}
    results = []
    compiled = torch.compile(model, backend=rewrite.backend(fusion(), on_result=results.append))
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    counts["dynamo"] = results[0].counts
    assert set(map(lambda c: tuple(sorted(c.items())), counts.values())) == {(("conv_bn", 1),)}, counts
    assert _bn_count(results[0].graph_module) == 0


def test_folded_weights_are_new_named_constants():
    model = ConvBN(2).eval()
    gm = fx.symbolic_trace(model)
    result = fusion().apply(gm, example_inputs=(_input(2),))
    names = dict(result.graph_module.named_parameters())
    assert "conv_weight_conv_bn_weight" in names and "conv_weight_conv_bn_bias" in names
    assert not hasattr(result.graph_module, "bn"), "the folded BatchNorm module is removed"
    assert hasattr(model, "bn") and hasattr(gm, "bn"), "the input is not mutated"


def test_metadata_is_carried_to_new_nodes():
    model = ConvBN(2).eval()
    x = _input(2)
    gm = torch.export.export(model, (x,)).module()
    result = fusion().apply(gm, example_inputs=(x,))
    conv = next(n for n in result.graph_module.graph.nodes if n.target is torch.ops.aten.conv2d.default)
    assert "stack_trace" in conv.meta and "nn_module_stack" in conv.meta
    assert tuple(conv.meta["val"].shape) == (2, 8, 3, 3)


def test_conv_with_second_user_is_not_folded():
    class Shared(ConvBN):
        def forward(self, x):
            c = self.conv(x)
            return self.bn(c), c

    model = Shared().eval()
    result = fusion().apply(fx.symbolic_trace(model), example_inputs=(_input(2),))
    assert result.counts == {}


def test_training_mode_batch_norm_is_not_folded():
    model = ConvBN(2).train()
    x = _input(2)
    result = fusion().apply(fx.symbolic_trace(model), example_inputs=(x,), check=False)
    assert result.counts == {}


class LinearBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.bn = _bn(6, nn.BatchNorm1d)
        self.drop = nn.Dropout(0.3)
        self.ident = nn.Identity()

    def forward(self, x):
        return self.ident(self.drop(self.bn(self.fc(x))))


def test_linear_bn_and_eval_noops():
    model = LinearBN().eval()
    x = torch.randn(4, 5)
    for level, gm, inputs in _levels(model, x):
        result = fusion().apply(gm, example_inputs=inputs)
        folded = result.counts.get("linear_bn", 0) + result.counts.get("addmm_bn", 0)
        assert folded == 1, (level, result.counts)
        assert _bn_count(result.graph_module) == 0, level
        if level == "fx":
            assert result.counts["dropout_eval"] == 1 and result.counts["identity"] == 1


def test_linear_bn_on_3d_input_is_not_folded():
    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 6)
            self.bn = _bn(3, nn.BatchNorm1d)  # normalizes dim 1 (length 3), not features

        def forward(self, x):
            return self.bn(self.fc(x))

    model = Seq().eval()
    x = torch.randn(2, 3, 5)
    result = fusion().apply(fx.symbolic_trace(model), example_inputs=(x,))
    assert result.counts == {}


@pytest.mark.parametrize("groups,folds", [(1, True), (2, False)])
def test_conv_transpose_bn_only_where_valid(groups, folds):
    class CT(nn.Module):
        def __init__(self):
            super().__init__()
            self.ct = nn.ConvTranspose2d(4, 8, 3, stride=2, groups=groups)
            self.bn = _bn(8)

        def forward(self, x):
            return self.bn(self.ct(x))

    model = CT().eval()
    x = _input(2)
    for level, gm, inputs in _levels(model, x):
        result = fusion().apply(gm, example_inputs=inputs)
        assert result.counts == ({"conv_transpose_bn": 1} if folds else {}), level
        torch.testing.assert_close(result.graph_module(x), model(x), rtol=1e-4, atol=1e-4)


def test_silu_from_sigmoid_in_either_order():
    class M(nn.Module):
        def forward(self, x):
            return x * torch.sigmoid(x) + torch.sigmoid(x) * x

    x = torch.randn(3, 4)
    result = fusion().apply(fx.symbolic_trace(M()), example_inputs=(x,))
    assert result.counts == {"silu_from_sigmoid": 2}


def test_folded_convs_keep_the_conv_source_metadata():
    """The new conv of a conv+BN fold stands for the conv: it takes the conv's module
    stack and stack trace, not the batch norm's."""
    import rewrite
    from rewrite.examples.cnn import demo_cnn_with_inputs

    model, inputs = demo_cnn_with_inputs()
    gm = torch.export.export(model.eval(), inputs).module()
    result = rewrite.load("rules/fusion.rw").apply(gm, inputs)
    assert result.counts["conv_bn"] == 4
    convs = [n for n in result.graph_module.graph.nodes
             if n.op == "call_function" and "conv" in str(n.target)]
    assert len(convs) == 6
    for node in convs:
        (_, module_type), = list(node.meta["nn_module_stack"].values())[-1:]
        assert "Conv" in module_type and "BatchNorm" not in module_type, (node.name, module_type)


class _Flattening(nn.Module):
    """A classic CNN head: ``x.view(x.size(0), -1)``, a size dynamo makes symbolic."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(x.view(x.size(0), -1))


def test_the_backend_checks_graphs_with_symbolic_sizes():
    # a second batch size makes dynamo recompile with the batch symbolic: its example
    # inputs hold the size as a SymInt, which the check's runs take as the size it is
    torch.manual_seed(0)
    model = _Flattening().eval()
    results = []
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=rewrite.backend(fusion(), on_result=results.append))
        for batch in (2, 3, 4):
            x = torch.randn(batch, 3, 8, 8)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    finally:
        torch._dynamo.reset()
    assert len(results) >= 2 and results[0].counts == {"conv_bn": 1}
    assert any(isinstance(n.meta.get("example_value"), torch.SymInt)
               for r in results[1:] for n in r.graph_module.graph.nodes if n.op == "placeholder")


def test_the_backend_folds_under_dynamic_shapes_and_sees_a_changed_eps():
    # dynamic=True: dynamo passes bn.eps and bn.momentum as 0-d tensors read with .item();
    # the backend reads them as numbers (the fold needs eps) and compares them each call
    torch.manual_seed(0)
    model = ConvBN(2).eval()
    results = []
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=rewrite.backend(fusion(), on_result=results.append), dynamic=True)
        for batch in (2, 3):
            x = torch.randn(batch, *_input(2).shape[1:])
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
        assert results[0].counts == {"conv_bn": 1} and _bn_count(results[0].graph_module) == 0
        model.bn.eps = 0.5  # a new value: the call runs the graph as dynamo gave it
        x = _input(2)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    finally:
        torch._dynamo.reset()
