"""What a caller can observe of a rewrite beyond values: whether an output requires
grad, its strides, and calls that pass one tensor for two inputs or a module's own
tensor as an input. Each case was a rewrite the default check accepted (or a rule
that fired) although the caller could tell; found by an adversarial probe."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import rewrite
from rewrite.capture import INFERENCE_KEY
from rewrite.trust.check import check_equivalence
from rewrite.verify import verify_rule


def _capture(model, inputs, level):
    if level == "fx":
        return fx.symbolic_trace(model)
    gm = torch.export.export(model, tuple(t.clone() for t in inputs)).module()
    if not model.training:  # as rewrite.capture marks an eval-mode model's (an export keeps no trace of it)
        gm.meta[INFERENCE_KEY] = True
    return gm


class ZerosOfAWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return torch.zeros_like(self.w) + x


def test_an_output_that_newly_requires_grad_fails_the_check():
    x = torch.randn(3)
    gm = torch.export.export(ZerosOfAWeight(), (x,)).module()
    rules = rewrite.parse("rule z: aten.zeros_like(x, ...) => mul(x, 0.0)")
    with pytest.raises(rewrite.EquivalenceError, match="gradients reach parameter w through this output in the "
                                                       "rewrite, not in the original"):
        rules.apply(gm, (x,))
    assert not gm(x).requires_grad  # the caller's module is as it was


class TransposedCopy(nn.Module):
    def forward(self, x):
        return (x + 1).t().contiguous().t()  # a transposed view of a contiguous copy


def test_an_output_whose_strides_change_fails_the_check():
    # the check sees an output's strides change (the engine is not asked here)
    x = torch.randn(3, 4)
    model = TransposedCopy()
    assert model(x).t().is_contiguous()
    report = check_equivalence(model, lambda x: (x + 1).t().t(), (x,))
    assert not report and "strides changed" in str(report)


def test_a_forwarded_view_of_a_returned_value_keeps_its_strides():
    # forwarding a view to an output makes the engine ask its size (the view must not
    # keep a larger value alive), which records the facts of a symbolic_trace graph:
    # the output is then laid out again as it was
    x = torch.randn(3, 4)
    gm = _capture(TransposedCopy(), (x,), "fx")
    result = rewrite.parse("rule c(shared=True): contiguous(x) => x").apply(gm, (x,))
    assert result.counts["c"] == 1
    assert result.graph_module(x).stride() == gm(x).stride()
    torch.testing.assert_close(result.graph_module(x), gm(x))


@pytest.mark.parametrize("check", [True, False])
def test_outputs_computed_from_a_relaid_value_keep_their_strides(check):
    # the rule drops the copy that made y contiguous: outputs read from y through
    # views and elementwise ops would follow x.t()'s strides; the engine lays them
    # out as before (export graphs record every value's strides)
    class ReadsACopy(nn.Module):
        def forward(self, x):
            y, z, w = ((x * k).t().contiguous() for k in (2, 3, 4))
            return y.unsqueeze(0), z + 1, w[0], (x + 1).t().contiguous().t()

    model, x = ReadsACopy(), torch.randn(3, 4)
    gm = _capture(model, (x,), "export")
    result = rewrite.parse("rule c(shared=True): contiguous(x) => x").apply(gm, (x,), check=check)
    assert result.counts["c"] == 4
    for want, got in zip(model(x), result.graph_module(x)):
        assert torch.equal(want, got) and want.stride() == got.stride()


@pytest.mark.parametrize("check", [True, False])
def test_relaid_outputs_sharing_memory_are_relaid_at_their_source(check):
    # y[0] and y.unsqueeze(0) are views of one copy: copying each back into its layout
    # would end the memory they share; the value they both view is copied back once
    class TwoViews(nn.Module):
        def forward(self, x):
            y = (x * 2).t().contiguous()
            return y.unsqueeze(0), y[0]

    model, x = TwoViews(), torch.randn(3, 4)
    gm = _capture(model, (x,), "export")
    result = rewrite.parse("rule c(shared=True): contiguous(x) => x").apply(gm, (x,), check=check)
    assert result.counts == {"c": 1}
    got, want = result.graph_module(x), model(x)
    for a, b in zip(got, want):
        assert torch.equal(a, b) and a.stride() == b.stride()
    assert got[1].data_ptr() == got[0].data_ptr()


def test_outputs_that_would_newly_share_memory_are_not_rewritten():
    # dropping the copy would make the first output a view of the memory the second
    # views: the rule does not fire
    class SharesWithTheOther(nn.Module):
        def forward(self, x):
            m = x * 2
            return m.t().contiguous().unsqueeze(0), m[0]

    model, x = SharesWithTheOther(), torch.randn(3, 4)
    gm = _capture(model, (x,), "export")
    result = rewrite.parse("rule c(shared=True): contiguous(x) => x").apply(gm, (x,), check=False)
    assert result.counts == {}
    got = result.graph_module(x)
    assert got[0].data_ptr() != got[1].data_ptr()


def test_a_rewrite_keeping_a_transposed_outputs_strides_passes():
    class Transposed(nn.Module):
        def forward(self, x):
            return (x * 1.0).t()

    x = torch.randn(3, 4)
    result = rewrite.load("rules/cleanup.rw").apply(fx.symbolic_trace(Transposed()), (x,))
    out = result.graph_module(x)
    assert out.stride() == Transposed()(x).stride() and torch.equal(out, x.t())


class WritesTheOtherInput(nn.Module):
    def forward(self, a, b):
        c = b * 2.0
        a.add_(1)
        return c * 4.0


@pytest.mark.parametrize("level", ["fx", "export"])
def test_no_match_spans_a_write_into_another_input(level):
    """m(t, t) is a legal call: b is a, and the original read it before the write."""
    a, b = torch.randn(3), torch.randn(3)
    gm = _capture(WritesTheOtherInput(), (a, b), level)
    result = rewrite.parse("rule r: mul(mul(x, 2.0), 4.0) where is_float(x) => mul(x, 8.0)").apply(gm, (a, b))
    assert result.counts.get("r", 0) == 0
    t1, t2 = torch.ones(3), torch.ones(3)
    assert torch.equal(gm(t1, t1), result.graph_module(t2, t2))


class ConvWriteBn(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.bn = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)

    def forward(self, a, x):
        c = self.c(x)
        a.mul_(2)
        return self.bn(c)


def test_fusion_folds_no_batch_norm_across_a_write_into_another_input():
    x = torch.randn(1, 3, 4, 4)
    model = ConvWriteBn().eval()
    gm = torch.export.export(model, (x.clone(), x.clone())).module()
    result = rewrite.load("rules/fusion.rw").apply(gm, (x.clone(), x.clone()))
    t1, t2 = x.clone(), x.clone()
    torch.testing.assert_close(result.graph_module(t2, t2), gm(t1, t1))


class WritesItsBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.ones(3))

    def forward(self, x):
        y = x * 1.0
        self.n.add_(1)
        return y * 3.0


def test_no_input_is_forwarded_past_a_write_into_module_state():
    """m(m.n) is a legal call: x is the buffer the forward writes."""
    gm = torch.export.export(WritesItsBuffer(), (torch.randn(3),)).module()
    reference = torch.export.export(WritesItsBuffer(), (torch.randn(3),)).module()
    result = rewrite.load("rules/cleanup.rw").apply(gm, (torch.randn(3),))
    assert result.counts.get("mul_one", 0) == 0
    expected = reference(dict(reference.named_buffers())["n"])
    got = result.graph_module(dict(result.graph_module.named_buffers())["n"])
    assert torch.equal(expected, got)


def test_verify_draws_int16():
    """A rule wrong only in int16 (x * x wraps to a negative there) is refuted."""
    rules = rewrite.parse("rule abs_sq: abs(mul(x, x)) where dtype(x) != torch.int8 and dtype(x) != torch.int32 "
                          "and dtype(x) != torch.int64 and dtype(x) != torch.uint8 => mul(x, x)", "sq.rw")
    verdict = verify_rule(rules, "abs_sq", max_examples=100, seed=0)
    assert verdict.status == "counterexample" and "int16" in str(verdict)


class FlattenInput(nn.Module):
    def forward(self, x):
        return x.reshape(-1) * 2.0


class FlattenProjection(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).reshape(-1) * 2.0


def test_an_export_inputs_strides_are_unknown():
    """The exported program accepts a transposed input of the same shape: whether
    the input, or a value laid out as it is, is contiguous is not known."""
    x = torch.randn(3, 4)
    rules = rewrite.parse("rule r: reshape(x, s) where is_contiguous(x) => view(x, s)")
    gm = torch.export.export(FlattenInput(), (x,)).module()
    result = rules.apply(gm, (x,))
    assert result.counts.get("r", 0) == 0
    transposed = torch.randn(4, 3).t()
    assert torch.equal(result.graph_module(transposed), gm(transposed))
    # a linear's result is laid out afresh whatever its input's strides
    gm = torch.export.export(FlattenProjection(), (x,)).module()
    result = rules.apply(gm, (x,))
    assert result.counts["r"] == 1
    torch.testing.assert_close(result.graph_module(transposed), gm(transposed))


class PatchEmbed(nn.Module):
    """ViT's patch embedding: the output is a transposed view of a conv's."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Conv2d(3, 16, 4, stride=4)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class ToNHWC(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.c(x).permute(0, 2, 3, 1)


@pytest.mark.parametrize("model_type", [PatchEmbed, ToNHWC])
@pytest.mark.parametrize("kind", ["bf16", "fp16"])
@pytest.mark.parametrize("level", ["fx", "export"])
def test_amp_keeps_the_strides_of_a_permuted_output(model_type, kind, level):
    """The channels_last weights make the conv's output channels_last; an output
    that is a transposed view of it gets the model's strides back (it failed the
    default check)."""
    model, x = model_type().eval(), torch.randn(2, 3, 16, 16)
    gm = _capture(model, (x,), level)
    result = rewrite.load(f"rules/amp_{kind}.rw").apply(gm, (x,))
    assert result.counts[f"conv_{kind}"] == 1
    out, expected = result.graph_module(x), model(x)
    assert out.stride() == expected.stride()
    torch.testing.assert_close(out, expected, atol=0.05, rtol=0.05)


def _train_mode_cnn():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.1)).train()


@pytest.mark.parametrize("rules", ["cleanup", "amp_casts", "amp_bf16"])
@pytest.mark.parametrize("level", ["fx", "export"])
def test_a_train_mode_result_trains_the_callers_parameters(rules, level):
    """A train-mode batch norm writes its running statistics, not its weight: the
    result shares every parameter, and a folded weight (AMP's cast once) would take
    the caller's gradients, so a training graph casts weights at run time."""
    torch.manual_seed(0)
    model, x = _train_mode_cnn(), torch.randn(2, 3, 8, 8)
    gm = _capture(model, (x,), level)
    result = rewrite.load(f"rules/{rules}.rw").apply(gm, (x,))
    theirs = dict(gm.named_parameters())
    assert all(p is theirs[name] for name, p in result.graph_module.named_parameters())
    for p in gm.parameters():
        p.grad = None
    result.graph_module(x).sum().backward()
    assert all(p.grad is not None for p in gm.parameters())


def test_an_eval_model_still_casts_its_weights_once():
    model, x = _train_mode_cnn().eval(), torch.randn(2, 3, 8, 8)
    result = rewrite.load("rules/amp_bf16.rw").apply(torch.export.export(model, (x,)).module(), (x,))
    assert result.counts["conv_bf16"] == 1


class CacheWriter(nn.Module):
    """Writes a computed value into a buffer (a KV cache, an EMA of activations)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(2, 4))

    def forward(self, x):
        h = self.lin(x)
        self.cache.copy_(h)
        return h * 1.0


@pytest.mark.parametrize("level", ["fx", "export"])
@pytest.mark.parametrize("inplace", [False, True])
def test_the_check_leaves_no_autograd_history_on_the_callers_buffers(level, inplace):
    # the check's first trial runs with gradients enabled: the buffer written from a
    # value that requires grad got a grad_fn, and deepcopy of the caller's model failed
    import copy

    model, x = CacheWriter().eval(), torch.randn(2, 4)
    gm = _capture(model, (x,), level)
    cache = gm.cache.clone()
    result = rewrite.load("rules/cleanup.rw").apply(gm, (x,), inplace=inplace)
    assert result.counts["mul_one"] == 1
    for t in (gm.cache, model.cache):
        assert t.grad_fn is None and not t.requires_grad
    assert torch.equal(gm.cache, cache)
    copy.deepcopy(model)
    copy.deepcopy(gm)


class TwoNamesOneMemory(nn.Module):
    """A buffer written through one name and read through another that views it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 3))
        self.register_buffer("cache_t", self.cache.t())

    def forward(self, x):
        self.cache.add_(x)
        return self.cache_t * 1.0 + 0.0


class ConstantOfABuffer(nn.Module):
    """fx records ``self.kc.transpose(1, 2)`` as a tensor constant viewing the buffer."""

    def __init__(self):
        super().__init__()
        self.k = nn.Linear(3, 3)
        self.register_buffer("kc", torch.zeros(4, 3, 3))

    def forward(self, x):
        self.kc.index_copy_(1, torch.tensor([0, 1, 2]), self.k(x))
        return x @ self.kc.transpose(1, 2)


@pytest.mark.parametrize("make, level", [(TwoNamesOneMemory, "fx"), (TwoNamesOneMemory, "export"),
                                         (ConstantOfABuffer, "fx")])
@pytest.mark.parametrize("rules", ["rules/fusion.rw", "rules/cleanup.rw"])
def test_the_results_own_copy_of_written_state_keeps_the_memory_its_tensors_share(make, level, rules):
    # the result gets its own copy of the buffers its forward writes; a second name
    # viewing the same memory must view the copy, or the result reads stale values
    import copy
    import warnings

    torch.manual_seed(0)
    model = make().eval()
    x = torch.ones(4, 3) if make is TwoNamesOneMemory else torch.randn(4, 3, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = _capture(copy.deepcopy(model), (x,), level)
    twin = copy.deepcopy(gm)  # deepcopy keeps the sharing
    result = rewrite.load(rules).apply(gm, (x,))
    for _ in range(2):
        assert torch.equal(result.graph_module(x), twin(x))


class LastToken(nn.Module):
    """Next-token logits ``head(h)[:, -1]`` and an expanded gate: outputs with gaps or
    overlaps, which the AMP files' cast back to float32 returns compact."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 50)
        self.gate = nn.Linear(8, 1)

    def forward(self, h):
        return self.head(h)[:, -1], self.head(h)[:, :, ::2], self.gate(h).expand(-1, -1, 6)


@pytest.mark.parametrize("level", ["fx", "export"])
@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_amp_passes_its_check_on_outputs_with_gaps_returned_compact(level, low):
    model, h = LastToken().eval(), torch.randn(2, 5, 8)
    result = rewrite.load(f"rules/amp_{low}.rw").apply(_capture(model, (h,), level), (h,))
    assert sum(result.counts.values()) > 0
    for want, got in zip(model(h), result.graph_module(h)):
        assert got.dtype == want.dtype and got.shape == want.shape
        got.view(-1)  # anything the original's view serves, the compact copy serves


def test_a_transposed_slice_keeps_its_strides():
    # a gapped output in another order than row-major: its strides are compared
    class TransposedSlice(nn.Module):
        def forward(self, x):
            return (x + 1).t().contiguous().t()[:, ::2]

    x = torch.randn(3, 8)
    rules = rewrite.parse("rule c(shared=True): contiguous(x) => x")
    with pytest.raises(rewrite.EquivalenceError, match="strides changed"):
        rules.apply(fx.symbolic_trace(TransposedSlice()), (x,))
