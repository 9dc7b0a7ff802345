"""Code the engine cannot read: a user's function in a module named like torch's, a
global backward hook, a hook on the model itself, a copy a rule drops before the
caller sees the layout. Each case changed what the caller observes (with
``check=False``, or with the default check passing); found by an adversarial probe."""

import sys
import textwrap

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.nn.modules import module as nn_module

import rewrite


@pytest.fixture
def torch_named_helpers(tmp_path, monkeypatch):
    # a user's module whose name starts with "torch" (as torchvision's or torchmetrics' do)
    (tmp_path / "torch_helpers_for_test.py").write_text(textwrap.dedent('''
        import torch


        def rescale(t):
            t.mul_(2.0)  # writes its argument
            return t.sum()


        torch.fx.wrap("rescale")


        class ForwardsAWrittenValue(torch.nn.Module):
            def forward(self, x):
                y = torch.sin(x)
                z = y * 1.0  # forwarding y would let the helper's write reach z
                return z + 0.0, rescale(y)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    import torch_helpers_for_test

    yield torch_helpers_for_test
    sys.modules.pop("torch_helpers_for_test", None)


def test_a_users_function_in_a_module_named_like_torch_writes_what_it_may(torch_named_helpers):
    model, x = torch_named_helpers.ForwardsAWrittenValue(), torch.randn(4)
    gm = fx.symbolic_trace(model)
    assert any(n.target is torch_named_helpers.rescale for n in gm.graph.nodes)
    result = rewrite.parse("rule mul_one: mul(x, 1) where is_float(x) => x").apply(gm, (x,), check=False)
    assert result.counts.get("mul_one", 0) == 0
    want, got = model(x.clone()), result.graph_module(x.clone())
    assert torch.equal(want[0], got[0])


class Doubled(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(x * 2) + 1


@pytest.mark.parametrize("register", [
    lambda: nn_module.register_module_full_backward_hook(lambda mod, gi, go: (gi[0] * 5,)),
    lambda: nn_module.register_module_full_backward_pre_hook(lambda mod, go: (go[0] * 5,)),
], ids=["full_backward_hook", "full_backward_pre_hook"])
def test_a_module_under_a_global_backward_hook_binds_to_no_rule(register):
    rules = rewrite.parse("rule r: relu(x) => aten.clamp_min(x, 0.0)")
    handle = register()
    try:
        gm = fx.symbolic_trace(Doubled())
        result = rules.apply(gm, (torch.randn(5),), check=False)
        assert result.counts.get("r", 0) == 0  # the hook runs on the module's call only
    finally:
        handle.remove()


def test_a_hook_on_the_model_itself_is_refused_with_what_to_do():
    model = Doubled()
    model.register_forward_hook(lambda mod, args, out: out * 2)
    with pytest.raises(TypeError, match="hooks registered on itself.*forward_hooks"):
        rewrite.load("rules/cleanup.rw").apply(model, (torch.randn(3),))
    model.act.register_forward_hook(lambda mod, args, out: out)  # a submodule's hook is captured
    plain = Doubled()
    plain.act.register_forward_hook(lambda mod, args, out: out * 3)
    x = torch.randn(3)
    assert torch.equal(rewrite.load("rules/cleanup.rw").apply(plain, (x,)).graph_module(x), plain(x))


def test_cat_single_keeps_the_contiguous_copy_of_a_transposed_value():
    class CatOfATransposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return torch.cat([self.fc(x).t()], 0), torch.cat([self.fc(x)], 0)

    model, x = CatOfATransposed().eval(), torch.randn(5, 4)
    result = rewrite.load("rules/cleanup.rw").apply(fx.symbolic_trace(model), (x,))
    assert result.counts["cat_single"] == 1  # the contiguous one only
    for want, got in zip(model(x), result.graph_module(x)):
        assert torch.equal(want, got) and want.stride() == got.stride()


class CountingAct(nn.Module):
    """A user's activation with a call counter, run by a torch layer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return torch.relu(x)


class UserCodeInATorchLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation=CountingAct(), batch_first=True)

    def forward(self, x):
        return self.layer(x) * 1.0


@pytest.mark.parametrize("check", [False, True])
def test_a_torch_layer_running_a_users_module_may_write_its_state(check):
    # the layer's class is torch's, the activation it runs is not: apply's runs (facts,
    # check) must not write the caller's buffer, nor the result's runs
    torch.manual_seed(0)
    gm, x = fx.symbolic_trace(UserCodeInATorchLayer().eval()), torch.randn(2, 3, 8)
    rules = rewrite.parse("rule mul_one: mul(x, 1) where is_float(x) => x")
    result = rules.apply(gm, (x,), check=check)  # recording facts (is_float) runs the graph
    assert gm.layer.activation.calls.item() == 0
    result.graph_module(x)
    assert gm.layer.activation.calls.item() == 0


def test_the_check_compares_state_a_users_module_inside_a_torch_layer_writes():
    class SeenMin(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen_min", torch.tensor(0.0))

        def forward(self, x):
            self.seen_min.copy_(torch.minimum(self.seen_min, x.min()))
            return x

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation=SeenMin(), batch_first=True)

        def forward(self, x):
            return torch.relu(self.layer(x) - 1).sum() * 0.0 + self.layer(torch.relu(x)).sum()

    torch.manual_seed(0)
    gm, x = fx.symbolic_trace(Model().eval()), torch.randn(2, 3, 8)
    with pytest.raises(rewrite.EquivalenceError, match="module state"):
        rewrite.parse("rule wrong: relu(x) => abs(x)").apply(gm, (x,))


def test_a_wrapper_running_a_users_module_is_user_code():
    class WritesItsInput(nn.Module):
        def forward(self, x):
            return x.mul_(2)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.DataParallel(WritesItsInput())

        def forward(self, x):
            y = torch.sin(x)
            z = y * 1.0  # forwarding y would let the wrapped write reach z
            return z + 0.0, self.inner(y)

    torch.manual_seed(0)
    model, x = Model(), torch.randn(4)
    gm = fx.symbolic_trace(model)
    result = rewrite.parse("rule mul_one: mul(x, 1) where is_float(x) => x").apply(gm, (x,), check=False)
    assert result.counts.get("mul_one", 0) == 0
    assert torch.equal(result.graph_module(x)[0], model(x)[0])


def test_a_dropout_inside_a_torch_layer_makes_the_graph_train():
    # fine-tuning with a frozen batch norm: the conv's weight must stay trainable
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.tail = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)

        def forward(self, x):
            return self.tail(self.bn(self.conv(x)).flatten(2).transpose(1, 2))

    torch.manual_seed(0)
    model = Model().train()
    model.bn.eval()
    result = rewrite.load("rules/fusion.rw").apply(fx.symbolic_trace(model), (torch.randn(2, 3, 4, 4),))
    assert "conv_bn" not in result.counts
    result.graph_module(torch.randn(2, 3, 4, 4)).sum().backward()
    assert model.conv.weight.grad is not None


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "old_weight_norm"])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_torchs_weight_reparametrizations_share_the_callers_parameters(kind, mode):
    # torch's weight and spectral norms compute the weight from parameters they only
    # read (spectral norm updates its buffers): the result shares the parameters
    import warnings

    from torch.nn.utils import parametrizations

    make = {"weight_norm": parametrizations.weight_norm, "spectral_norm": parametrizations.spectral_norm,
            "old_weight_norm": nn.utils.weight_norm}[kind]

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.fc = make(nn.Linear(4, 4))

        def forward(self, x):
            return self.fc(x) * 1.0

    torch.manual_seed(0)
    model, x = Model().train(mode == "train"), torch.randn(2, 4)
    gm = fx.symbolic_trace(model)
    result = rewrite.load("rules/fusion.rw").apply(gm, (x,))
    mine = dict(result.graph_module.named_parameters())
    assert all(mine[name] is p for name, p in gm.named_parameters())
    result.graph_module(x).sum().backward()
    assert all(p.grad is not None for p in gm.parameters())


@pytest.mark.parametrize("inner", ["aten.dropout(x, 0.0, False)", "aten.lift(x)", "aten._unsafe_view(x, [-1])",
                                   "aten.atleast_1d(x)", "aten.type_as(x, x)", "aten.dequantize(x)",
                                   "aten.conj_physical(x)", "aten.sum_to_size(x, [4])"])
def test_a_write_into_what_an_op_may_return_of_its_input_fails_to_load(inner):
    # these ops may return their argument itself: writing their result writes x (E105)
    with pytest.raises(rewrite.RuleError, match="E105"):
        rewrite.parse(f"rule r: sin(x) => aten.sin_({inner})")
