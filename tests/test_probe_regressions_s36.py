"""Regressions from session 36's adversarial probes (Z1: fooling the check and
verify, Z2: shipped rule sets on unseen models, Z3: graphs with mutation and
aliasing). Each test failed before its fix."""
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import rewrite
from rewrite.engine.leaves import LeafModuleWarning

# rules whose replacement is memory of its own where the matched value was a view
COPYING = """
rule view_copy: view(x, s) => reshape(clone(x), s)
rule t_copy: t(x) => permute(clone(x), [1, 0])
rule getitem_copy: getitem(x, i) where is_tensor(x) and is_literal(i) => clone(select(x, 0, i))
"""


class _WriteThroughView(nn.Module):  # h is written through its view
    def forward(self, x):
        h = x * 2.0
        h.view(-1).add_(1.0)
        return h


class _WriteThroughT(nn.Module):
    def forward(self, x):
        h = x * 2.0
        h.t().mul_(3.0)
        return h + 1


class _WriteInputThroughView(nn.Module):  # the caller's input, through a view
    def forward(self, x):
        x.view(-1).add_(1.0)
        return x.sum()


class _WriteThenReadView(nn.Module):  # a write into the viewed memory reaches the view's readers
    def forward(self, x):
        h = x * 2.0
        v = h[0]
        h.add_(1.0)
        return v * 3


class _ViewReturnedWithBase(nn.Module):  # two outputs sharing memory
    def forward(self, x):
        h = x * 2.0
        return h, h.view(-1)


class _ViewOfInputReturned(nn.Module):
    def forward(self, x):
        return x.t(), x.sum()


class _ViewReadOnly(nn.Module):  # nothing observes the sharing: the rules fire
    def forward(self, x):
        h = x * 2.0
        return h.view(-1) + 1, h.t() * 2, h[1] - 1


def _capture(model, capture, x):
    if capture == "fx":
        return fx.symbolic_trace(model)
    return torch.export.export(model, (x.clone(),)).module()


def _storages(out):
    return [t.untyped_storage().data_ptr() for t in (out if isinstance(out, tuple) else (out,))]


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("model", [_WriteThroughView, _WriteThroughT, _WriteInputThroughView, _WriteThenReadView,
                                   _ViewReturnedWithBase, _ViewOfInputReturned])
def test_a_view_whose_sharing_is_observed_is_not_made_a_copy(model, capture):
    """Probe Z3 F1: a replacement of a view by memory of its own (a copy) dropped a
    write through the view, or the sharing of two outputs, even unchecked."""
    x = torch.randn(3, 3)
    gm = _capture(model(), capture, x)
    result = rewrite.parse(COPYING).apply(gm, example_inputs=(x.clone(),), check=False)
    xa, xb = x.clone(), x.clone()
    want, got = model()(xa), result.graph_module(xb)
    for a, b in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        assert torch.equal(a, b)
    assert torch.equal(xa, xb)  # the caller's input written alike
    if isinstance(want, tuple):  # outputs sharing memory still do, with each other and the input
        assert (len(set(_storages(want))) == 1) == (len(set(_storages(got))) == 1)
        assert (want[0].untyped_storage().data_ptr() == xa.untyped_storage().data_ptr()) == \
               (got[0].untyped_storage().data_ptr() == xb.untyped_storage().data_ptr())


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_view_nobody_observes_is_still_rewritten(capture):
    x = torch.randn(3, 3)
    gm = _capture(_ViewReadOnly(), capture, x)
    result = rewrite.parse(COPYING).apply(gm, example_inputs=(x.clone(),))
    assert sum(result.counts.values()) >= 2, result.counts  # export spells h[1] as select
    for a, b in zip(_ViewReadOnly()(x), result.graph_module(x)):
        assert torch.equal(a, b)


def test_one_result_of_a_multi_output_op_is_its_own_memory():
    """``max(x, d)``'s values are not a view of anything: replacing them by an amax
    loses no sharing, even with both results returned and one written."""
    class M(nn.Module):
        def forward(self, x):
            v, i = torch.max(x, 1)
            v.add_(1.0)
            return v, i

    rules = rewrite.parse("""rule max_to_amax: aten.max.dim(x, d, k) as (_, _) where dtype(x) != torch.bool
        => (aten.amax(x, [d], k), aten.argmax(x, d, k))""")
    x = torch.randn(3, 4)
    result = rules.apply(torch.export.export(M(), (x.clone(),)).module(), example_inputs=(x.clone(),))
    assert result.counts == {"max_to_amax": 1}
    for a, b in zip(M()(x.clone()), result.graph_module(x.clone())):
        assert torch.equal(a, b)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_an_insertion_after_a_written_view_does_not_take_its_write(capture):
    x = torch.randn(3, 3)
    gm = _capture(_WriteThroughView(), capture, x)
    result = rewrite.parse("rule negneg: view(_, _) as v => neg(neg(v))").apply(gm, example_inputs=(x.clone(),),
                                                                                check=False)
    assert torch.equal(result.graph_module(x.clone()), _WriteThroughView()(x.clone()))


class _ShiftedMean(nn.Module):
    """A second buffer views the batch norm's running mean and is written each call."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.bn = nn.BatchNorm2d(3)
        self.register_buffer("shift", self.bn.running_mean.data[:2])

    def forward(self, x):
        self.shift.add_(1.0)
        return self.bn(self.conv(x))


def test_a_constant_written_through_other_memory_is_not_folded():
    """Probe Z3 F2: ``const()`` told written state by tensor object, so a buffer
    viewing the running mean, written in place, let conv_bn fold a mean that changes
    every call."""
    fusion = rewrite.load("rules/fusion.rw")
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 4)
    # (export: symbolic_trace runs a buffer's add_ once, while tracing, and records no node)
    gm = torch.export.export(_ShiftedMean().eval(), (x,)).module()
    assert gm.shift.untyped_storage().data_ptr() == gm.bn.running_mean.untyped_storage().data_ptr()
    assert fusion.apply(gm, example_inputs=(x,), check=False).counts == {}


def test_folds_still_fire_where_nothing_shares_written_memory():
    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)
            self.bn = nn.BatchNorm2d(3)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls.add_(1)
            return self.bn(self.conv(x))

    x = torch.randn(2, 3, 4, 4)
    gm = fx.symbolic_trace(Counted().eval())
    result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=(x,))
    assert sum(result.counts.values()) == 1, result.counts


class _Blocked(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Conv2d(4, 2, 1)
        self.bn = nn.BatchNorm2d(2)

    def forward(self, x):
        return self.bn(self.head(self.block(x)))


def test_a_hook_on_a_submodule_the_trace_would_inline_keeps_running():
    """Probe Z1 F3: ``apply(model)`` traced a hooked ``nn.Sequential`` inline: its
    feature hook ran once at trace time, on a Proxy left in the caller's list, and
    never in the result. The hooked block now stays one call; the rest is rewritten."""
    model = _Blocked().eval()
    feats = []
    model.block.register_forward_hook(lambda module, inputs, output: feats.append(output))
    x = torch.randn(1, 3, 8, 8)
    with pytest.warns(LeafModuleWarning):
        result = rewrite.load("rules/fusion.rw").apply(model, example_inputs=(x,))
    assert all(isinstance(f, torch.Tensor) and not isinstance(f, fx.Proxy) for f in feats)
    assert result.counts == {"conv_bn": 1}  # head + bn, outside the hooked block
    feats.clear()
    out = result.graph_module(x)
    assert len(feats) == 1 and torch.allclose(out, model(x), atol=1e-5)


def test_a_batch_norm_without_running_statistics_being_trained_keeps_weights_trainable():
    """Probe Z2 F1: exported in training mode, a model whose batch norm keeps no
    running statistics looked like inference: the AMP sets folded the conv and
    linear weights into casts, and the caller's parameters got no gradient."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(3, 8, 3)
            self.bn = nn.BatchNorm2d(8, track_running_stats=False)
            self.l = nn.Linear(8, 4)

        def forward(self, x):
            return self.l(torch.relu(self.bn(self.c(x))).mean((2, 3)))

    torch.manual_seed(0)
    model = M().train()
    x = torch.randn(4, 3, 8, 8)
    gm = torch.export.export(model, (x,), strict=False).module()
    result = rewrite.load("rules/amp_bf16.rw").apply(gm, example_inputs=(x,))
    assert result.counts, result.counts  # still lowered, the weights cast at run time
    result.graph_module(x).sum().backward()
    assert all(p.grad is not None for p in gm.parameters())
    assert {name for name, _ in result.graph_module.named_parameters()} <= {name for name, _ in gm.named_parameters()}


def test_the_check_leaves_a_hooks_feature_list_as_it_was():
    """The check runs the caller's hooked block: what its hook appends to a list (or
    a dict) it closes over is put back after apply, as the caller's tensors are."""
    model = _Blocked().eval()
    feats, by_name = [], {}

    def hook(module, inputs, output):
        feats.append(output)
        by_name[len(by_name)] = output

    model.block.register_forward_hook(hook)
    x = torch.randn(1, 3, 8, 8)
    with pytest.warns(LeafModuleWarning):
        result = rewrite.load("rules/fusion.rw").apply(model, example_inputs=(x,))
    assert feats == [] and by_name == {}
    result.graph_module(x)
    assert len(feats) == 1 and len(by_name) == 1  # the hook still runs


@pytest.mark.parametrize("offset, folds", [(0.0, True), (1e4, False)])
def test_a_batch_norm_of_raw_features_is_not_folded_into_the_linear_after_it(offset, folds):
    """Folded into the linear after it, a batch norm of features about 1e4 with a
    spread of 1 (raw readings: why a model normalizes its input) computes
    ``w * s @ x - w * s @ mean`` in one float32 accumulation, which cancels; the
    batch norm subtracts the mean exactly first (verify's offset draws found it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(16), nn.Linear(16, 4)).eval()
    with torch.no_grad():
        model[0].running_mean.copy_(offset + torch.randn(16))
        model[0].running_var.copy_(torch.rand(16) + 0.5)
    x = offset + torch.randn(8, 16)
    result = rewrite.load("rules/fusion.rw").apply(fx.symbolic_trace(model), example_inputs=(x,))
    assert ("bn_linear" in result.counts) == folds, result.counts
    torch.testing.assert_close(result.graph_module(x), model(x), rtol=1e-4, atol=1e-4)


def test_the_check_leaves_a_recorder_hooks_own_attributes_as_they_were():
    """Probe Z4 F5: a callable recorder object counting calls in its own attributes,
    a ``defaultdict`` and a ``deque`` it fills: apply's check runs leave none of it."""
    import collections

    class Recorder:
        def __init__(self):
            self.calls, self.features = 0, []
            self.by_module, self.recent = collections.defaultdict(list), collections.deque(maxlen=4)

        def __call__(self, module, inputs, output):
            self.calls += 1
            self.features.append(output)
            self.by_module[module].append(output)
            self.recent.append(output)

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    recorder = Recorder()
    model[2].register_forward_hook(recorder)
    result = rewrite.load("rules/fusion.rw").apply(model, example_inputs=(torch.randn(1, 3, 8, 8),))
    assert result.counts == {"conv_bn": 1}
    assert (recorder.calls, recorder.features, dict(recorder.by_module), len(recorder.recent)) == (0, [], {}, 0)


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.fc2(self.fc(x) * 1.0 + 0.0)


def test_a_hook_reaching_the_graph_module_leaves_its_rewrite_alone():
    """Probe Z4 F7: in place, a hook reaching the GraphModule had the check put back
    its nodes' metadata (the facts the rewrite records): nothing was rewritten."""
    gm = fx.symbolic_trace(_Scaled())
    registry = {"model": gm}
    gm.fc.register_forward_hook(lambda module, inputs, output, reg=registry: None)
    result = rewrite.load("rules/cleanup.rw").apply(gm, example_inputs=(torch.randn(3, 4),), inplace=True)
    assert sum(result.counts.values()) == 2, result.counts
    assert "mul" not in gm.code


def test_a_trace_failing_on_a_hooked_submodule_says_why():
    """Probe Z4 F6: a hooked backbone stays a call, and a parent iterating its output
    cannot be traced: the error names the hooked submodule and what to do."""
    class Backbone(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1)

        def forward(self, x):
            return [self.a(x), self.b(x)]

    class Det(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = Backbone()
            self.heads = nn.ModuleList([nn.Conv2d(4, 2, 1), nn.Conv2d(4, 2, 1)])

        def forward(self, x):
            return [h(f) for h, f in zip(self.heads, self.backbone(x))]

    model = Det().eval()
    model.backbone.register_forward_hook(lambda module, inputs, output: None)
    with pytest.raises(TypeError, match=r"submodules with hooks \(backbone\) stay calls"):
        rewrite.load("rules/fusion.rw").apply(model, example_inputs=(torch.randn(1, 3, 4, 4),))
