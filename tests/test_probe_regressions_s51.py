"""Regressions from the session-51 probes: apply and the library's other entry points
under a caller's active ``FakeTensorMode`` (probe CQ F2 of session 50)."""

from __future__ import annotations

import functools
import types
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import rewrite
from rewrite.analysis.measure import analyze
from rewrite.testing import assert_equivalent


class _LinearTimesOne(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.l(x)) * 1.0


def _active_fake_mode():
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


@pytest.mark.parametrize("check", [True, False])
def test_apply_inside_a_fake_tensor_mode_works_on_the_real_model(check):
    """Inside ``with FakeTensorMode():`` the check failed with torch's raw
    AssertionError ("Please convert all Tensors to FakeTensors"), and check=False
    silently fired nothing (no fact could be recorded)."""
    model, x = _LinearTimesOne(), torch.randn(2, 4)
    with FakeTensorMode() as mode:
        result = rewrite.load("rules/cleanup.rw").apply(model, (x,), check=check)
        assert _active_fake_mode() is mode  # the caller's mode is back
    assert result.counts == {"mul_one": 1}
    assert torch.allclose(result.graph_module(x), model(x))


@pytest.mark.parametrize("inside", [True, False])
def test_fake_example_inputs_are_refused_clearly(inside):
    model = _LinearTimesOne()
    mode = FakeTensorMode()
    fake = mode.from_tensor(torch.randn(2, 4))
    rules = rewrite.load("rules/cleanup.rw")
    for check in (True, False):
        with pytest.raises(ValueError, match="FakeTensors"):
            if inside:
                with mode:
                    rules.apply(model, (fake,), check=check)
            else:
                rules.apply(model, (fake,), check=check)


def test_other_entry_points_inside_a_fake_tensor_mode():
    """analyze, quantize and assert_equivalent raised torch's AssertionError too."""
    model, x = _LinearTimesOne().eval(), torch.randn(2, 4)
    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        analysis = analyze(torch.fx.symbolic_trace(model), (x,))
        int8 = rewrite.quant.quantize(model, [(x,)] * 2)
        assert_equivalent(model, model, (x,))
    assert analysis.totals.flops == 2 * 2 * 4 * 4
    assert isinstance(int8(x), torch.Tensor) and not isinstance(int8(x), torch._subclasses.FakeTensor)


class _ReturnsViewsOfItsInputAndBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.randn(3, 4))

    def forward(self, x):
        return x.transpose(0, 1).transpose(0, 1), x.view(3, 4), self.b.permute(1, 0).permute(1, 0)


class _ReturnsAValueAndAViewOfIt(nn.Module):
    def forward(self, x):
        h = torch.relu(x)
        return h.transpose(0, 1).transpose(0, 1), h


class _ViewsOfAFreshValue(nn.Module):
    def forward(self, x):
        h = torch.relu(x)
        return h.transpose(0, 1).transpose(0, 1) + 1, h.view(3, 4) * 2


def _capture(model, x, level):
    return torch.fx.symbolic_trace(model) if level == "fx" else torch.export.export(model, (x,)).module()


@pytest.mark.parametrize("level", ["fx", "export"])
def test_a_returned_view_of_an_input_or_buffer_stays_a_new_tensor_object(level):
    """Probe CS f1: ``x.transpose(0, 1).transpose(0, 1)`` and ``x.view(3, 4)`` are
    new tensor objects over ``x``'s memory. cleanup.rw replaced them by ``x`` itself,
    and the check (values and memory overlap) could not tell: the result returned
    the caller's input object (twice) and the module's buffer, so ``out.t_()``
    transposed the caller's input and ``out.unsqueeze_(0)`` reshaped the buffer the
    caller's own model then failed on."""
    x = torch.randn(3, 4)
    gm = _capture(_ReturnsViewsOfItsInputAndBuffer(), x, level)
    result = rewrite.load("rules/cleanup.rw").apply(gm, (x,))

    def identities(module):
        mine = torch.randn(3, 4)
        out = module(mine)
        tensors = list(module.buffers()) + list(module.parameters()) + [
            getattr(module, name) for name in dir(module) if name.startswith("_tensor_constant")]
        return [(o is mine, any(o is t for t in tensors)) for o in out], out[0] is out[1]

    assert identities(result.graph_module) == identities(gm)  # no output is the caller's object
    mine = torch.randn(3, 4)
    result.graph_module(mine)[0].t_()
    assert mine.shape == (3, 4)


@pytest.mark.parametrize("level", ["fx", "export"])
def test_two_outputs_do_not_become_one_object(level):
    x = torch.randn(3, 4)
    result = rewrite.load("rules/cleanup.rw").apply(_capture(_ReturnsAValueAndAViewOfIt(), x, level), (x,))
    assert result.counts == {}
    first, second = result.graph_module(x)
    assert first is not second
    first.t_()
    assert second.shape == (3, 4)


@pytest.mark.parametrize("level", ["fx", "export"])
def test_views_of_a_fresh_value_still_cancel(level):
    """The guard is about tensor objects the caller can hold: views of a value the
    graph computes, read by other ops, still cancel."""
    x = torch.randn(3, 4)
    model = _ViewsOfAFreshValue()
    result = rewrite.load("rules/cleanup.rw").apply(_capture(model, x, level), (x,))
    assert result.counts == {"transpose_transpose": 1, "reshape_noop": 1}
    for got, want in zip(result.graph_module(x), model(x)):
        torch.testing.assert_close(got, want)


class _TrainingBlock(nn.Module):
    """conv -> batch norm -> in-place ReLU, as torchvision's ResNet writes it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.ReLU(inplace=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.act(self.bn(self.conv(x))).mean((2, 3)))


class _SpectralNormThenTwoNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.utils.parametrizations.spectral_norm(nn.Conv2d(3, 4, 3, padding=1))
        self.bn = nn.BatchNorm2d(4)
        self.bn2 = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(torch.relu(self.bn2(self.bn(self.conv(x)))).mean((2, 3)))


@pytest.mark.parametrize("model_type, rules", [
    (_TrainingBlock, "rules/fusion.rw"),
    (_TrainingBlock, "rules/amp_bf16.rw"),
    (_SpectralNormThenTwoNorms, "rules/fusion.rw"),
])
def test_a_training_norm_leaves_the_weights_around_it_the_callers(model_type, rules):
    """Probe CR F1, F2: a training batch norm counted as returning (a view of) its
    own weight and bias, and as writing its input's memory. An in-place ReLU after
    it, or a second norm reading it, made the result own copies of the norm's (and a
    spectral-norm conv's) parameters: ``backward()`` of the result left the caller's
    parameters without gradients, and the check could not tell."""
    torch.manual_seed(0)
    model, x = model_type().train(), torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = rewrite.load(rules).apply(model, (x,))
    mine = dict(model.named_parameters())
    assert all(mine[name] is p for name, p in result.graph_module.named_parameters())
    model.zero_grad(set_to_none=True)
    result.graph_module(x).sum().backward()
    assert [name for name, p in model.named_parameters() if p.grad is None] == []


_MUL_ONE = "rule mul_one: mul(x, 1) where is_float(x) => x"


class _Totals:
    def __init__(self):
        self.total = torch.zeros(4)


def _bumping(t):
    def bump():
        t.add_(1.0)
    return bump


def _reading(t):
    def read():
        return t
    return read


class _BumpsThroughCode(nn.Module):
    """A leaf module writing a tensor it reaches through code it holds."""

    def __init__(self, how, t):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how
        if how == "closure":
            self.bump = _bumping(t)
        elif how == "partial":
            self.bump = functools.partial(torch.Tensor.add_, t, 1.0)
        else:
            self.holder = _Totals()
            self.holder.total = t
            self.ref = weakref.ref(self.holder)

    def forward(self, x):
        if self.how == "weakref":
            self.ref().total.add_(1.0)
        else:
            self.bump()
        return self.lin(x)


class _KeepsAndReads(nn.Module):
    """Keeps the tensor it writes in a helper object (which a copy owns), and reads it
    back through a closure (which a copy cannot rebuild)."""

    def __init__(self):
        super().__init__()
        t = torch.zeros(4)
        self.state = types.SimpleNamespace(loc=t)
        self.read = _reading(t)

    def forward(self, x):
        self.state.loc.add_(1.0)
        return x + self.read()


_SHARED_STATS = _Totals()


@torch.fx.wrap
def _plus_shared_total(y):
    return y + _SHARED_STATS.total


class _WritesSharedStats(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.stats = _SHARED_STATS

    def forward(self, x):
        self.stats.total.add_(1.0)
        return self.lin(x)


class _Outer(nn.Module):
    def __init__(self, block, wrapped=False):
        super().__init__()
        self.block = block
        self.wrapped = wrapped

    def forward(self, x):
        y = self.block(x)
        if self.wrapped:
            y = _plus_shared_total(y)
        return (y + 1.0) * 1.0


class _LeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m, qualified_name):
        return isinstance(m, (_BumpsThroughCode, _KeepsAndReads, _WritesSharedStats)) \
            or super().is_leaf_module(m, qualified_name)


def _leaf_traced(model):
    return torch.fx.GraphModule(model, _LeafTracer().trace(model))


def _writes_as_the_model_does(model, watched, x):
    """apply (a copy, checked) returns a result that computes what the model computes,
    call after call, and writes ``watched`` (the caller's: code reaches it by a path
    a copy of the module tree cannot redirect) as the model does."""
    gm = _leaf_traced(model)
    start = watched.clone()
    result = rewrite.parse(_MUL_ONE).apply(gm, (x,))
    assert result.counts == {"mul_one": 1}
    assert torch.equal(watched, start)  # apply's own runs put it back
    got = [result.graph_module(x) for _ in range(3)]
    assert not torch.equal(watched, start)  # the result writes it, as the model would
    watched.copy_(start)
    want = [gm(x) for _ in range(3)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("how", ["closure", "partial", "weakref"])
def test_a_tensor_written_through_code_a_module_holds_stays_one_tensor(how):
    """Probe CT F1: a closure, a functools.partial or a weakref to a helper: the
    tensor is the code's, as a global is; the result writes it as the model does and
    computes what it computes (a copy would be written by one path and read by
    another)."""
    t = torch.zeros(4)
    block = _BumpsThroughCode(how, t)
    watched = block.holder.total if how == "weakref" else t
    _writes_as_the_model_does(_Outer(block).eval(), watched, torch.randn(3, 4))


def test_a_holder_other_code_reads_through_a_global_stays_the_callers():
    """Probe CT F4 (a regression of session 50's helper copies): the result wrote its
    copy of the holder while a wrapped function read the caller's through a global:
    its outputs drifted from the model's by 1, 2, 3 on successive calls, unchecked
    when no rule fired. What code reaches through a global is the caller's for the
    result too (as a written tensor no module holds is): the values agree."""
    x = torch.randn(3, 4)
    for check in (True, False):
        _SHARED_STATS.total.zero_()
        gm = _leaf_traced(_Outer(_WritesSharedStats(), wrapped=True).eval())
        result = rewrite.parse(_MUL_ONE).apply(gm, (x,), check=check)
        assert result.counts == {"mul_one": 1}
        assert torch.equal(_SHARED_STATS.total, torch.zeros(4))  # apply's own runs put it back
        got = [result.graph_module(x) for _ in range(3)]
        _SHARED_STATS.total.zero_()
        want = [gm(x) for _ in range(3)]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def test_a_helpers_tensor_a_closure_reads_back_stays_one_tensor():
    """The same inside one module: the written tensor in a helper object (which a copy
    would own) and in a closure that reads it back (which a copy cannot redirect)."""
    block = _KeepsAndReads()
    _writes_as_the_model_does(_Outer(block).eval(), block.state.loc, torch.randn(3, 4))


class _CountingRelu:
    def __init__(self):
        self.calls = torch.zeros(())

    def __call__(self, x):
        self.calls.add_(1)
        return torch.relu(x)


class _MyEncoderLayer(nn.TransformerEncoderLayer):
    pass


class _EncoderUser(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x * 1.0) * 1.0


class _EncoderLeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m, qualified_name):
        return isinstance(m, _MyEncoderLayer) or super().is_leaf_module(m, qualified_name)


@pytest.mark.parametrize("kind", [nn.TransformerEncoderLayer, _MyEncoderLayer])
@pytest.mark.parametrize("check", [True, False])
def test_a_torch_module_running_the_users_stateful_callable_leaves_its_state_alone(kind, check):
    """Probe CT F3: torch's own module holding a user's callable object with state
    (``activation=obj``) was not walked as user code: apply's runs wrote the
    caller's counter (7 times with the check), and so did the result. Since session
    50 a do-nothing subclass counts as torch's class, which made it a regression."""
    torch.manual_seed(0)
    act = _CountingRelu()
    model = _EncoderUser(kind(8, 2, 16, dropout=0.0, batch_first=True, activation=act)).eval()
    gm = torch.fx.GraphModule(model, _EncoderLeafTracer().trace(model))
    x = torch.randn(2, 3, 8)
    result = rewrite.parse(_MUL_ONE).apply(gm, (x,), check=check)
    assert act.calls.item() == 0
    torch.testing.assert_close(result.graph_module(x), model(x))
    assert act.calls.item() == 1  # the caller's own run, not the result's


class _DrawsFromAnOption(nn.Module):
    def forward(self, x, opts):
        return (x + torch.rand(x.shape, generator=opts.g)) * 1.0


@pytest.mark.parametrize("check", [True, False])
def test_a_generator_inside_an_object_input_is_not_moved(check):
    """Probe CT F2: a ``torch.Generator`` passed directly or in a list was copied for
    apply's runs, one an object input holds (``opts.g``) was not: apply moved the
    caller's generator, and the check (both runs drawing from the one generator)
    rejected ``mul(x, 1) => x``."""
    g = torch.Generator().manual_seed(5)
    state = g.get_state().clone()
    x = torch.randn(3)
    result = rewrite.parse(_MUL_ONE).apply(torch.fx.symbolic_trace(_DrawsFromAnOption()),
                                           (x, types.SimpleNamespace(g=g)), check=check)
    assert result.counts == {"mul_one": 1}
    assert torch.equal(g.get_state(), state)


class _UsersBlock(nn.Module):
    def __init__(self, tied=None):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.tied = [tied] if tied is not None else []  # a list: not registered twice

    def forward(self, x):
        y = self.lin(x)
        return y @ self.tied[0].weight[:4].t() if self.tied else y


class _BlockUser(nn.Module):
    def __init__(self, tie):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.block = _UsersBlock(self.emb if tie else None)

    def forward(self, x):
        return (self.block(x) + self.emb.weight.sum()) * 1.0


class _BlockTracer(torch.fx.Tracer):
    def is_leaf_module(self, m, qualified_name):
        return isinstance(m, _UsersBlock) or super().is_leaf_module(m, qualified_name)


@pytest.mark.parametrize("tie", [False, True])
def test_a_users_leaf_module_keeps_the_callers_weights(tie):
    """A user's leaf module counts as writing everything it holds (nothing reads its
    code), and the result owned copies of its weights: gradients of the result missed
    the caller's parameters. A weight it reads through a plain list (a tied
    embedding, probe CT F6) was refused outright. Weights that require grad stay the
    caller's, as when what the graph writes is unknown."""
    model = _BlockUser(tie)
    gm = torch.fx.GraphModule(model, _BlockTracer().trace(model))
    x = torch.randn(2, 4)
    result = rewrite.parse(_MUL_ONE).apply(gm, (x,))
    assert result.counts == {"mul_one": 1}
    mine = dict(model.named_parameters())
    assert all(mine[name] is p for name, p in result.graph_module.named_parameters())
    result.graph_module(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


class _CancelledViewThenSelf(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.id = nn.Identity()

    def forward(self, x):
        v = x.transpose(0, 1).transpose(0, 1)
        return v.contiguous() if self.how == "contiguous" else v.float() if self.how == "float" else self.id(v)


@pytest.mark.parametrize("how", ["contiguous", "float", "identity"])
@pytest.mark.parametrize("level", ["fx", "export"])
def test_a_cancelled_view_returned_through_an_op_returning_self_stays_a_new_object(how, level):
    """Probe CU F1: the identity guard followed only in-place ops from the view to the
    output; ``contiguous()``, a no-op ``float()`` or ``nn.Identity`` return their
    input as it is, so the result returned the caller's input object."""
    x = torch.randn(3, 4)
    gm = _capture(_CancelledViewThenSelf(how), x, level)
    result = rewrite.load("rules/cleanup.rw").apply(gm, (x,))
    mine = torch.randn(3, 4)
    assert (result.graph_module(mine) is mine) == (gm(mine) is mine)


def test_statistics_a_feature_hook_holding_the_model_reaches_stay_the_results():
    """Probe CX f1: hooks counted among the code whose reach stays the caller's made a
    feature hook holding the model (a bound method of an extractor) leave a training
    batch norm's statistics shared: the result's runs wrote the caller's. Hooks do
    not count (a hook reading the statistics, probe CU F7, is documented)."""
    torch.manual_seed(0)
    model, x = _FeatureModel().train(), torch.randn(2, 3, 6, 6)
    extractor = _Extractor(model)
    model.c.register_forward_hook(extractor.save)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = rewrite.load("rules/cleanup.rw").apply(model, (x,), check=False)
    assert result.graph_module.bn.running_mean is not model.bn.running_mean
    before = model.bn.running_mean.clone()
    result.graph_module(x)
    assert torch.equal(model.bn.running_mean, before)


class _FeatureModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.relu(self.bn(self.c(x))) * 1.0


class _Extractor:
    def __init__(self, model):
        self.model = model
        self.features = []

    def save(self, module, inputs, output):
        self.features.append(output.detach())


class _CallsTheGlobalsNamesake(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.model = inner
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        return self.model(x)


model = None  # a script's global named as a leaf module's attribute


def test_an_attribute_name_is_not_a_global_the_code_reads():
    """Probe CU F3: the walk of a leaf module's code counted every name its code
    holds as a global, attribute names included: ``self.model(x)`` reached a
    script's global ``model``, and with it the whole model."""
    global model
    inner = nn.Linear(4, 4)
    net = _Outer(_CallsTheGlobalsNamesake(inner)).eval()
    model = net
    try:
        gm = torch.fx.GraphModule(net, _SelfModelTracer().trace(net))
        result = rewrite.parse(_MUL_ONE).apply(gm, (torch.randn(2, 4),))
    finally:
        model = None
    assert result.counts == {"mul_one": 1}
    assert result.graph_module.block.seen is not net.block.seen  # owned, not left to a global


class _SelfModelTracer(torch.fx.Tracer):
    def is_leaf_module(self, m, qualified_name):
        return isinstance(m, _CallsTheGlobalsNamesake) or super().is_leaf_module(m, qualified_name)


class _WritesThroughAMappingProxy(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = types.MappingProxyType({"n": torch.zeros(())})

    def forward(self, x):
        self.table["n"].add_(1)
        return x + 1


class _MappingProxyTracer(torch.fx.Tracer):
    def is_leaf_module(self, m, qualified_name):
        return isinstance(m, _WritesThroughAMappingProxy) or super().is_leaf_module(m, qualified_name)


def test_a_tensor_in_a_mapping_proxy_a_module_writes_is_refused():
    """Probe CU F8: neither owned nor refused, so each run of the result wrote the
    caller's tensor."""
    net = _Outer(_WritesThroughAMappingProxy()).eval()
    gm = torch.fx.GraphModule(net, _MappingProxyTracer().trace(net))
    with pytest.raises(ValueError, match="inplace=True"):
        rewrite.parse(_MUL_ONE).apply(gm, (torch.randn(2, 4),))


def _conv_bn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()


def test_a_compiled_models_parameters_can_still_be_swapped():
    """Probe CW F2: the backend's copy of dynamo's graph kept dynamo's weak references
    to every parameter (``grapharg``, the fake mode's memo): ``swap_tensors`` (and
    ``load_state_dict`` under the swap flag) raised "has weakref associated"."""
    torch._dynamo.reset()
    model, x = _conv_bn(), torch.randn(1, 3, 6, 6)
    compiled = torch.compile(model, backend=rewrite.backend(rewrite.load("rules/fusion.rw")))
    with torch.no_grad():
        compiled(x)
    torch.utils.swap_tensors(model[0].weight, nn.Parameter(torch.randn_like(model[0].weight)))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))


def test_weights_replaced_after_an_inference_mode_build_compile():
    """Probe CW F4: ``p.data = t`` on a parameter made under inference mode: not an
    inference tensor, yet reading its version counter raises; the backend crashed."""
    torch._dynamo.reset()
    with torch.inference_mode():
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    with torch.no_grad():
        model[0].weight.data = torch.randn(4, 3, 3, 3)
    x = torch.randn(2, 3, 6, 6)
    compiled = torch.compile(model, backend=rewrite.backend(rewrite.load("rules/fusion.rw")))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


def test_fake_tensors_anywhere_are_refused_clearly():
    """Probe CU F6: a FakeTensor held by an object input fired nothing silently;
    analyze with fake inputs and apply on a model built under a fake mode raised
    torch's own errors."""
    mode = FakeTensorMode()
    fake = mode.from_tensor(torch.randn(2, 4))
    rules = rewrite.load("rules/cleanup.rw")
    with pytest.raises(ValueError, match="FakeTensors"):
        rules.apply(_LinearTimesOne(), (types.SimpleNamespace(x=fake),), check=False)
    with pytest.raises(ValueError, match="FakeTensors"):
        analyze(torch.fx.symbolic_trace(_LinearTimesOne()), (fake,))
    with mode:
        fake_model = _LinearTimesOne()
    with pytest.raises(ValueError, match="FakeTensors"):
        rules.apply(fake_model, (torch.randn(2, 4),), check=False)


class _WritesACancelledView(nn.Module):
    def __init__(self, write):
        super().__init__()
        self.write = write

    def forward(self, x):
        h = torch.relu(x)
        v = h.transpose(0, 1).transpose(0, 1)
        if self.write == "data":
            v.mul_(2)
        else:
            v.t_()
        return v + 1, h * 2


@pytest.mark.parametrize("write", ["data", "metadata"])
def test_a_cancelled_view_written_in_place(write):
    """A data write through the view and through its base is one write into one
    memory: the views still cancel (probe CU F5, a rewrite lost by the first version
    of the identity guard). ``t_()`` changes the object it is called on: on ``h``
    itself it would transpose ``h`` for its other reader."""
    x = torch.randn(3, 4) if write == "data" else torch.randn(4, 4)
    model = _WritesACancelledView(write)
    result = rewrite.load("rules/cleanup.rw").apply(torch.fx.symbolic_trace(model), (x,))
    assert result.counts == ({"transpose_transpose": 1} if write == "data" else {})
    for got, want in zip(result.graph_module(x), model(x)):
        torch.testing.assert_close(got, want)


class _FallsBackThenFolds(nn.Module):
    """A graph that replaces a buffer every call (it falls back to running as dynamo
    gave it) and writes statistics with a kernel that bumps no version counter; after
    a graph break, a graph whose conv + batch norm fold reads them."""

    def __init__(self):
        super().__init__()
        self.conv0 = nn.Conv2d(3, 4, 3)
        self.conv = nn.Conv2d(3, 4, 3)
        self.register_buffer("rm", torch.zeros(4))
        self.register_buffer("rv", torch.ones(4))
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x):
        z = torch.nn.functional.batch_norm(self.conv0(x), self.rm, self.rv, training=True, momentum=0.5)
        self.step = self.step + 1
        torch._dynamo.graph_break()
        y = torch.nn.functional.batch_norm(self.conv(x), self.rm, self.rv, training=False)
        return y + z.mean()


def test_a_graph_that_fell_back_still_counts_its_writes():
    """Probe CW F1: once a graph ran as dynamo gave it, its writes into frozen tensors
    were no longer counted: the next graph kept a fold of stale statistics (0.15 off
    from the sixth call on)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _FallsBackThenFolds().eval()
    twin = _FallsBackThenFolds().eval()
    twin.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=rewrite.backend(rewrite.load("rules/fusion.rw")))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for _ in range(8):
            x = torch.randn(2, 3, 6, 6)
            torch.testing.assert_close(compiled(x), twin(x), rtol=1e-4, atol=1e-4)


class _HookedBlockNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.feats = []
        self.block.register_forward_hook(lambda m, i, o: self.feats.append(o.detach()))  # over the model

    def forward(self, x):
        return self.block(self.pre(x) * 1.0)


def test_a_hooked_block_keeps_the_callers_weights():
    """Probe CU F4: a feature hook closing over the model made every parameter count
    as written, and the result owned copies of them: backward() through the result
    left the caller's parameters without gradients."""
    torch.manual_seed(0)
    model, x = _HookedBlockNet(), torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = rewrite.load("rules/cleanup.rw").apply(model, (x,))
    assert result.counts == {"mul_one": 1}
    mine = dict(model.named_parameters())
    assert all(mine[name] is p for name, p in result.graph_module.named_parameters())
    result.graph_module(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


class _ReturnsAQuantizedSlice(nn.Module):
    def __init__(self):
        super().__init__()
        full = torch.quantize_per_tensor(torch.randn(5, 8), 0.1, 0, torch.qint8)
        self.register_buffer("q", full[1:, ::2])

    def forward(self, x):
        return x * 1.0, self.q


def test_a_copied_quantized_slice_keeps_its_strides_and_offset():
    """Probe CT F5: a quantized buffer copied into the result (a hook hides what the
    block writes) kept its strides only where they permute dense memory: a strided
    slice came back contiguous at offset 0."""
    block = _ReturnsAQuantizedSlice()
    block.register_forward_hook(lambda m, i, o: None)
    net = nn.Sequential(block)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = rewrite.parse(_MUL_ONE).apply(net, (torch.randn(3),))
    mine, theirs = result.graph_module.get_buffer("0.q"), block.q
    assert mine is not theirs and torch.equal(mine.dequantize(), theirs.dequantize())
    assert (mine.stride(), mine.storage_offset()) == (theirs.stride(), theirs.storage_offset())


def test_a_compiled_models_parameters_can_be_swapped_after_a_rebuild():
    """The rewrite for new values converts the new tensors to fake ones again: their
    weak references are dropped too."""
    torch._dynamo.reset()
    model, x = _conv_bn(), torch.randn(1, 3, 6, 6)
    compiled = torch.compile(model, backend=rewrite.backend(rewrite.load("rules/fusion.rw")))
    with torch.no_grad():
        compiled(x)
        model[1].running_mean.add_(1.0)  # a write: the graph is rewritten from the new values
        torch.testing.assert_close(compiled(x), model(x))
    torch.utils.swap_tensors(model[0].weight, nn.Parameter(torch.randn_like(model[0].weight)))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))


def test_a_dynamic_shape_graph_compiles_with_the_backend():
    """Probe CX f2 (a regression of the FakeTensor refusal): dynamo passes a dynamic
    graph's sizes as SymInts, whose shape environment holds FakeTensors: the input
    walk went into them, and every dynamic graph was refused."""
    torch._dynamo.reset()
    model = nn.Linear(4, 4)
    compiled = torch.compile(lambda x: model(x) * 1.0, backend=rewrite.backend(rewrite.load("rules/cleanup.rw")),
                             dynamic=True)
    for rows in (3, 5):
        x = torch.randn(rows, 4)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x))
