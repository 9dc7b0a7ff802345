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
