"""Regressions from session 35's adversarial probes (W: the in-place contract, X:
shipped rule sets on models the suite had not seen). Each test failed before its fix."""
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import rewrite
from rewrite import EquivalenceError

FUSION = "rules/fusion.rw"


class _Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(torch.sigmoid(self.bn(self.conv(x))))


def _counted(holds_model):
    """A forward hook on one submodule counts calls in a buffer of another: state
    outside the hooked module, which no graph node reads or writes. The hook holds
    the model (and can reach every weight) or only the counter."""
    gm = fx.symbolic_trace(_Counted().eval())
    gm.conv.register_buffer("seen", torch.zeros((), dtype=torch.long))
    seen = gm.conv.seen

    def count_on_model(module, inputs, output):
        gm.conv.seen.add_(1)

    def count(module, inputs, output):
        seen.add_(1)

    gm.act.register_forward_hook(count_on_model if holds_model else count)
    return gm


BROKEN = 'import "rules/fusion.rw"\nrule broken: sigmoid(x) => relu(x)\n'


@pytest.mark.parametrize("holds_model", [True, False])
@pytest.mark.parametrize("how", ["copy", "inplace", "inplace-failing"])
def test_a_hook_writing_state_outside_its_module_leaves_the_callers_state_as_it_was(how, holds_model):
    gm, x = _counted(holds_model), torch.randn(2, 3, 8, 8)
    seen = gm.conv.seen  # a fold in place drops the conv module
    if how == "inplace-failing":
        with pytest.raises(EquivalenceError):
            rewrite.parse(BROKEN).apply(gm, example_inputs=(x,), inplace=True)
    else:
        result = rewrite.load(FUSION).apply(gm, example_inputs=(x,), inplace=how == "inplace")
        # a hook holding the model may write the weights the fold reads: in place, they
        # are the ones it writes (a copy owns copies of what the hook can reach)
        assert result.counts == ({} if holds_model and how == "inplace" else {"conv_bn": 1})
    assert seen.item() == 0 and seen._version == 0


def test_a_hook_writing_a_weight_through_data_is_put_back_after_a_failed_inplace_apply():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.act = nn.Conv2d(3, 4, 3), nn.Tanh()

        def forward(self, x):
            return self.act(torch.sigmoid(self.conv(x)))

    model = Net().eval()
    gm = fx.symbolic_trace(model)
    with torch.no_grad():
        gm.conv.weight.mul_(10)

    def max_norm(module, inputs):  # ``.data`` writes bump no version the caller's tensor has
        gm.conv.weight.data.clamp_(-0.05, 0.05)

    gm.act.register_forward_pre_hook(max_norm)
    before = gm.conv.weight.detach().clone()
    with pytest.raises(EquivalenceError):
        rewrite.parse("rule broken: sigmoid(x) => relu(x)\n").apply(gm, example_inputs=(torch.randn(2, 3, 8, 8),),
                                                                   inplace=True)
    assert torch.equal(model.conv.weight, before)


# ---------------------------------------------------------------- what a hook can reach

from rewrite.ops.reach import reachable_tensors  # noqa: E402

_GLOBAL_TENSOR = torch.zeros(3)


def _names_a_global(module, inputs, output):
    _GLOBAL_TENSOR.add_(1)


class _Holder:
    def __init__(self, t):
        self.t = t

    def hook(self, module, inputs, output):
        self.t.add_(1)


def test_what_a_hook_reaches():
    import functools

    model = nn.Sequential(nn.Linear(2, 2))
    feats = []
    ids = lambda found: None if found is None else {id(t) for t in found}  # noqa: E731
    assert ids(reachable_tensors(lambda m, i, o: None)) == set()
    assert ids(reachable_tensors(lambda m, i, o: feats.append(o))) == set()  # a feature list holds no state
    assert ids(reachable_tensors(lambda m, i, o: model)) == {id(p) for p in model.parameters()}
    assert ids(reachable_tensors(_names_a_global)) == {id(_GLOBAL_TENSOR)}
    held = torch.ones(2)
    assert ids(reachable_tensors(_Holder(held).hook)) == {id(held)}
    assert ids(reachable_tensors(functools.partial(lambda t, m, i, o: None, held))) == {id(held)}
    weak = __import__("weakref").ref(model)
    assert ids(reachable_tensors(lambda m, i, o: weak())) == {id(p) for p in model.parameters()}


def test_a_feature_hook_leaves_the_folds_to_fire():
    """A hook that keeps outputs in a list reaches no weight: every conv + batch norm
    still folds, and the list gets the outputs of the caller's calls only."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    gm = fx.symbolic_trace(model)
    feats = []
    gm.get_submodule("2").register_forward_hook(lambda m, i, o: feats.append(o.shape))
    x = torch.randn(2, 3, 8, 8)
    result = rewrite.load(FUSION).apply(gm, example_inputs=(x,))
    assert result.counts == {"conv_bn": 1}
    torch.testing.assert_close(result.graph_module(x), model(x))


# ---------------------------------------------------------------- folded constants kept without a copy


def _storages(gm):
    return [t.untyped_storage().data_ptr() for t in [*gm.parameters(), *gm.buffers()] if t.numel()]


def test_folded_constants_share_memory_with_nothing():
    """A fold's result is kept without a copy: no two constants of one result, of two
    results, or of a result and its input may then be one tensor (a conv + batch norm
    called twice folds the same weights twice; two applies fold the same model)."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)

        def forward(self, x):
            return self.bn(self.conv(self.bn(self.conv(x))))

    model = Twice().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
    x = torch.randn(2, 3, 6, 6)
    rules = rewrite.load(FUSION)
    first, second = (rules.apply(fx.symbolic_trace(model), example_inputs=(x,)) for _ in range(2))
    assert first.counts == second.counts == {"conv_bn": 2}
    made = [_storages(r.graph_module) for r in (first, second)]
    for storages in made:
        assert len(storages) == len(set(storages)) == 4
    assert not set(made[0]) & set(made[1])
    assert not set(made[0]) & set(_storages(model))
    torch.testing.assert_close(first.graph_module(x), model(x))


def test_a_cast_to_the_dtype_a_weight_has_is_still_a_copy():
    """``cast`` returns its argument when the dtype is right already: the constant is
    then copied, not the caller's tensor itself."""
    text = ('rule to_f32: linear(x, w, b) where const(w) => linear(x, cast(w, torch.float32), b)\n'
            'ruleset main = once(to_f32)\n')
    model = nn.Sequential(nn.Linear(3, 3)).eval()
    result = rewrite.parse(text).apply(fx.symbolic_trace(model), example_inputs=(torch.randn(2, 3),))
    assert result.counts == {"to_f32": 1}
    new = [t for t in result.graph_module.buffers()] + [p for p in result.graph_module.parameters()
                                                        if p is not model[0].weight and p is not model[0].bias]
    assert new and all(t.data_ptr() != model[0].weight.data_ptr() for t in new)


# ---------------------------------------------------------------- masks in half precision


class _MaskedAttention(nn.Module):
    """Eager attention with an additive padding mask of ``finfo(dtype).min`` (as
    transformers builds it) in the model's dtype."""

    def __init__(self, fill=None):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.fill = fill

    def forward(self, x, keep):
        q, k, v = (t.view(x.shape[0], x.shape[1], 2, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        fill = torch.finfo(x.dtype).min if self.fill is None else self.fill
        mask = torch.zeros(keep.shape, dtype=x.dtype).masked_fill(keep == 0, fill)[:, None, None, :]
        scores = torch.matmul(q, k.transpose(-2, -1)) * 0.35 + mask
        return torch.matmul(torch.softmax(scores, -1), v)


@pytest.mark.parametrize("dtype,fill,fires", [
    (torch.float32, None, True), (torch.bfloat16, None, True), (torch.float16, None, False),
    (torch.bfloat16, -10000.0, False), (torch.float32, -10000.0, True)])
def test_a_mask_that_rounds_scores_away_in_half_precision_only_stays_written_out(dtype, fill, fires):
    """float16's finfo.min (-65504), or a -10000 mask in bfloat16, rounds a fully padded
    row's scores to one value in the written-out softmax (a uniform average) where
    scaled_dot_product_attention adds the mask in float32 and keeps them (probe X F1:
    a float16 T5 encoder off by 1.7 on a padded sequence, which passed the check)."""
    torch.manual_seed(0)
    model = _MaskedAttention(fill).eval().to(dtype)
    x, keep = torch.randn(3, 6, 16, dtype=dtype), torch.ones(3, 6, dtype=torch.long)
    keep[1, 4:] = 0
    gm = torch.export.export(model, (x, keep)).module()
    result = rewrite.load("rules/transformer.rw")["transformer"].apply(gm, example_inputs=(x, keep))
    assert bool(result.counts.get("attention_scale_mask")) is fires, result.counts
    padded = keep.clone()
    padded[2] = 0  # a sequence that is padding throughout
    with torch.no_grad():
        want, got = model(x, padded).float(), result.graph_module(x, padded).float()
    scale = want.abs().max().item()
    assert (want - got).abs().max().item() <= 0.02 * scale


# ---------------------------------------------------------------- probe Y: the reach walk itself


def _fold_model():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    return model, fx.symbolic_trace(model), torch.randn(2, 3, 8, 8)


def test_a_feature_list_of_inference_tensors_does_not_break_apply():
    """Features captured under ``torch.inference_mode()`` have no version counter:
    nothing outside inference mode can write them, and the check does not save them."""
    model, gm, x = _fold_model()
    feats = []
    gm.get_submodule("2").register_forward_hook(lambda m, i, o: feats.append(o))
    with torch.inference_mode():
        gm(x)
    assert rewrite.load(FUSION).apply(gm, example_inputs=(x,)).counts == {"conv_bn": 1}


def test_what_c_containers_and_notebook_globals_reach():
    import collections
    import sys
    import types

    held = torch.zeros(2)
    ids = lambda found: None if found is None else {id(t) for t in found}  # noqa: E731
    assert ids(reachable_tensors(collections.deque([held]))) == {id(held)}
    assert ids(reachable_tensors(types.MappingProxyType({"t": held}))) == {id(held)}
    assert ids(reachable_tensors(held.__setitem__)) == {id(held)}
    assert ids(reachable_tensors(iter([held]))) == {id(held)}
    # a module without __file__ (a notebook's __main__, ``python -c``) is the caller's own
    cell = types.ModuleType("probe_y_cell")
    sys.modules[cell.__name__] = cell
    try:
        exec("import torch\nCOUNTER = torch.zeros(())\ndef hook(m, i, o):\n    COUNTER.add_(1)\n", cell.__dict__)
        assert ids(reachable_tensors(cell.hook)) == {id(cell.COUNTER)}
    finally:
        del sys.modules[cell.__name__]


class _Odd:
    """A slotted object that answers every attribute (a config proxy)."""

    __slots__ = ("_data",)

    def __init__(self):
        object.__setattr__(self, "_data", {})

    def __getattr__(self, name):
        return self._data[name]


def test_an_object_that_fails_when_looked_into_leaves_apply_working():
    model, gm, x = _fold_model()
    odd = _Odd()

    def hook(module, inputs, output):
        getattr(odd, "anything", None) if False else None  # holds odd, returns nothing

    gm.get_submodule("2").register_forward_hook(hook)
    result = rewrite.load(FUSION).apply(gm, example_inputs=(x,))
    torch.testing.assert_close(result.graph_module(x), model(x))


def test_a_hook_writing_what_its_module_holds_is_put_back():
    """``module.trackers`` is a plain list, not a buffer: the module the hook is given
    is walked too."""
    model, gm, x = _fold_model()
    stats = torch.zeros(4)
    relu = gm.get_submodule("2")
    relu.trackers = [stats]

    def track(module, inputs, output):
        module.trackers[0].add_(output.mean((0, 2, 3)).detach())

    relu.register_forward_hook(track)
    rewrite.load(FUSION).apply(gm, example_inputs=(x,))
    assert torch.equal(stats, torch.zeros(4))


def test_a_bfloat16_mask_of_moderate_size_stays_written_out():
    """bfloat16 rounds -40 to steps of 0.25: a row masked throughout rounds its scores
    more coarsely written out than in sdpa (the bound is below 4 there)."""
    model = _MaskedAttention(-40.0).eval().to(torch.bfloat16)
    x, keep = torch.randn(3, 6, 16, dtype=torch.bfloat16), torch.ones(3, 6, dtype=torch.long)
    gm = torch.export.export(model, (x, keep)).module()
    result = rewrite.load("rules/transformer.rw")["transformer"].apply(gm, example_inputs=(x, keep))
    assert "attention_scale_mask" not in result.counts


# ---------------------------------------------------------------- the histogram observer's search


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["normal", "skewed", "outliers", "few", "constant", "bimodal", "relu"]),
       seed=st.integers(0, 2 ** 16), n=st.sampled_from([1, 7, 100, 5000]), batches=st.integers(1, 3))
def test_the_histogram_search_picks_torchs_bins(kind, seed, n, batches):
    """FiniteHistogramObserver's search reads the cumulative histogram as numbers
    (torch indexes a tensor at each of up to 100000 steps): the range it picks is
    torch's own, bit for bit."""
    from torch.ao.quantization.observer import HistogramObserver

    from rewrite.functions.quant import FiniteHistogramObserver

    g = torch.Generator().manual_seed(seed)
    obs = FiniteHistogramObserver()
    for _ in range(batches):
        x = torch.randn(n, generator=g)
        if kind == "skewed":
            x = x.exp()
        elif kind == "outliers":
            x[: max(1, n // 100)] *= 1000
        elif kind == "few":
            x = x.round()
        elif kind == "constant":
            x = torch.full((n,), 0.5)
        elif kind == "bimodal":
            x = torch.where(torch.rand(n, generator=g) < 0.3, x - 20, x + 5)
        elif kind == "relu":
            x = x.relu() * 3
        obs(x)
    ours = obs._non_linear_param_search()
    theirs = HistogramObserver._non_linear_param_search(obs)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


class _RangeMasked(nn.Module):
    """A float16 attention whose mask is ``where(arange(n) + shift >= bound, 0, min)``."""

    def __init__(self, shift, bound):
        super().__init__()
        self.qkv, self.shift, self.bound = nn.Linear(16, 48), shift, bound

    def forward(self, x):
        q, k, v = (t.view(x.shape[0], x.shape[1], 2, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        keep = (torch.arange(x.shape[1]) + self.shift >= self.bound)[None, None, None, :].expand(
            x.shape[0], 1, x.shape[1], x.shape[1])
        mask = torch.where(keep, torch.zeros((), dtype=x.dtype), torch.finfo(x.dtype).min)
        return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.35 + mask, -1), v)


@pytest.mark.parametrize("shift,bound,fires", [(0, 0, True), (1, 1, True), (0, 1, False), (2, 3, False)])
def test_a_float16_mask_whose_condition_always_holds_is_zero(shift, bound, fires):
    """``where(arange(n) + shift >= bound, 0, finfo.min)`` is 0 everywhere when shift >=
    bound (ViT builds one): the attention is rewritten; when the first key is masked
    (shift < bound), -65504 swamps float16 scores and it stays written out."""
    torch.manual_seed(0)
    model = _RangeMasked(shift, bound).eval().half()
    x = torch.randn(2, 5, 16, dtype=torch.float16)
    gm = torch.export.export(model, (x,)).module()
    result = rewrite.load("rules/transformer.rw")["transformer"].apply(gm, example_inputs=(x,))
    assert bool(result.counts.get("attention_scale_mask")) is fires, result.counts
    with torch.no_grad():
        torch.testing.assert_close(result.graph_module(x).float(), model(x).float(), rtol=2e-2, atol=2e-2)
