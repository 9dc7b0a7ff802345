"""Quantization-aware training from rule files (rules/quant/qat.rw, rewrite.qat).

prepare_qat puts fake quantizers where PTQ's observe rules put observers (counted by
the op each one watches, against rewrite.quant.prepare on the same model) and makes
every quantized conv / linear a trainable QAT module; gradients reach every weight;
after a few training steps convert gives the same int8 kernels as PTQ, whose outputs
match the eval-mode QAT model; batch norms and fake quantizers behave as they should
in train and eval mode; the policy written in a rule file (bit width, per-tensor
weights, a layer kept in float, the observer) is honoured. On symbolic_trace and
torch.export captures. No timing assertions.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.ao.quantization import FakeQuantizeBase
from torch.ao.quantization.observer import MinMaxObserver, MovingAverageMinMaxObserver, ObserverBase

import rewrite
import rewrite.qat as rqat
import rewrite.quant as rq
from rewrite.functions.qat import QATConv, QATConvBn, QATLayer, QATLinear, weight_fake_quant
from rewrite.functions.quant import QuantizedConv, QuantizedLinear, ops_of

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CAPTURES = ["fx", "export"]
#: what rewrite.quant.convert requires of int8 against its QDQ reference (dB)
PTQ_SQNR_BOUND = 25.0


class Net(nn.Module):
    """conv+bn+relu, a residual block (conv+bn, add, relu), max pool, conv+relu
    without batch norm, two linears."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(x + self.bn2(self.conv2(x)))
        x = F.max_pool2d(x, 2)
        x = F.relu(self.conv3(x))
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def _net() -> nn.Module:
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():  # batch norms with statistics of their own
        for bn in (model.bn1, model.bn2):
            bn.running_mean.uniform_(-0.2, 0.2)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.2, 0.2)
    return model.eval()


def _x(seed: int = 0, n: int = 8) -> torch.Tensor:
    return torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def _calib() -> list:
    return [(_x(100 + i),) for i in range(3)]


def _train(qat: fx.GraphModule, steps: int = 4, lr: float = 0.05) -> None:
    qat.train()
    opt = torch.optim.SGD(qat.parameters(), lr=lr)
    target = torch.arange(8) % 5
    for i in range(steps):
        loss = F.cross_entropy(qat(_x(10 + i)), target)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _watched(gm: fx.GraphModule, nodes: list) -> collections.Counter:
    """What each observer / fake quantizer watches: the op computing its input."""
    out: collections.Counter = collections.Counter()
    for node in nodes:
        src = node.args[0]
        if src.op == "placeholder":
            out["input"] += 1
        elif src.op == "call_module" and isinstance(gm.get_submodule(src.target), QATLayer):
            out[gm.get_submodule(src.target).kind] += 1
        else:
            ops = set(ops_of(src, gm))
            out[next(o for o in ("relu", "add", "conv", "linear", "max_pool2d") if o in ops)] += 1
    return out


@pytest.fixture(scope="module", params=CAPTURES)
def prepared(request):
    return request.param, rqat.prepare_qat(_net(), (_x(),), capture=request.param, calibration=_calib())


# ---------------------------------------------------------------- prepare


def test_fake_quantizers_go_where_the_observers_go(prepared):
    capture, qat = prepared
    observed = rq.prepare(_net(), (_x(),), capture=capture, check=False)
    observers = [n for n in observed.graph.nodes
                 if n.op == "call_module" and isinstance(observed.get_submodule(n.target), ObserverBase)]
    fqs = rqat.fake_quant_nodes(qat)
    # the model input; relu after conv1+bn1, after the residual add, after conv3, after fc1;
    # conv2+bn2's output (what the add reads); fc2's output
    expected = collections.Counter({"input": 1, "relu": 4, "conv": 1, "linear": 1})
    assert _watched(observed, observers) == expected
    assert _watched(qat, fqs) == expected
    assert all(isinstance(qat.get_submodule(n.target), FakeQuantizeBase) for n in fqs)
    # fake quantizers only, no observer
    assert not any(isinstance(qat.get_submodule(n.target), ObserverBase) for n in qat.graph.nodes
                   if n.op == "call_module")


def test_every_quantized_layer_is_a_qat_module(prepared):
    _, qat = prepared
    layers = [qat.get_submodule(n.target) for n in rqat.qat_layers(qat)]
    assert [type(m) for m in layers] == [QATConvBn, QATConvBn, QATConv, QATLinear, QATLinear]
    # no float conv, linear or batch norm is left in the graph
    for node in qat.graph.nodes:
        assert not {"conv", "linear", "batch_norm"} & set(ops_of(node, qat)), node.format_node()
    assert qat.training and qat.meta["rewrite.qat"]["ruleset"] == "main"
    for m in layers:
        fq = m.weight_fake_quant
        assert (fq.quant_min, fq.quant_max, fq.qscheme) == (-128, 127, torch.per_channel_symmetric)


@pytest.mark.parametrize("capture", CAPTURES)
def test_gradients_reach_every_weight(capture):
    qat = rqat.prepare_qat(_net(), (_x(),), capture=capture, calibration=_calib())
    names = dict(qat.named_parameters())
    # conv and linear weights and biases, batch-norm scales and shifts: nothing else
    assert len(names) == 2 * 5 + 2 * 2, sorted(names)
    F.cross_entropy(qat(_x(1)), torch.arange(8) % 5).backward()
    for name, p in names.items():
        assert p.requires_grad and p.grad is not None, name
        assert p.grad.abs().sum() > 0, name


def test_frozen_weights_stay_frozen():
    model = _net()
    model.conv3.weight.requires_grad_(False)
    model.fc2.requires_grad_(False)
    qat = rqat.prepare_qat(model, (_x(),), calibration=_calib())
    frozen = {n for n, p in qat.named_parameters() if not p.requires_grad}
    conv3, fc2 = (str(n.target) for n in rqat.qat_layers(qat)[2::2])  # graph order: bn1, bn2, conv3, fc1, fc2
    assert frozen == {f"{conv3}.weight", f"{fc2}.weight", f"{fc2}.bias"}
    assert len(list(qat.parameters())) == 14


def test_the_input_model_is_not_modified():
    model = _net().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    qat = rqat.prepare_qat(model, (_x(),), calibration=_calib())
    _train(qat)
    assert model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("capture", CAPTURES)
def test_a_captured_graph_module_is_copied(capture):
    model = _net()
    gm = fx.symbolic_trace(model.train()) if capture == "fx" else torch.export.export(
        model.eval(), (_x(),), strict=False).module()
    code = gm.code
    qat = rqat.prepare_qat(gm, (_x(),), calibration=_calib())
    assert len(rqat.qat_layers(qat)) == 5 and len(rqat.fake_quant_nodes(qat)) == 7
    assert gm.code == code and not any(isinstance(m, QATLayer) for m in gm.modules())


def test_rewrite_quant_names_the_qat_flow():
    assert rq.prepare_qat is rqat.prepare_qat
    assert rq.convert_qat is rqat.convert
    with pytest.raises(AttributeError):
        rq.prepare_qat_typo  # noqa: B018


# ---------------------------------------------------------------- convert


@pytest.mark.parametrize("capture, ruleset", [("fx", "main"), ("export", "main"), ("fx", "w4")])
def test_convert_after_training_matches_the_fake_quant_model(capture, ruleset):
    qat = rqat.prepare_qat(_net(), (_x(),), capture=capture, ruleset=ruleset, calibration=_calib())
    _train(qat)
    qat.eval()
    int8, qdq = rqat.convert(qat, reference=True)
    kinds = collections.Counter(type(m).__name__ for m in int8.modules() if isinstance(m, (QuantizedConv,
                                                                                           QuantizedLinear)))
    assert kinds == {"QuantizedConv": 3, "QuantizedLinear": 2}
    assert int8.meta["rewrite.quant"]["coverage"].count() == (5, 5)
    for seed in range(3):
        x = _x(50 + seed)
        with torch.no_grad():
            ref, out, ref_qdq = qat(x), int8(x), qdq(x)
        assert rq.sqnr(ref, out) >= PTQ_SQNR_BOUND
        assert rq.sqnr(ref, ref_qdq) >= 60  # the QDQ model computes what the QAT model does
    # the trained model is left as it was (convert works on a copy)
    assert rqat.qat_layers(qat) and rqat.fake_quant_nodes(qat)


class _DropoutHead(nn.Module):
    """A classifier head: conv+bn+relu, pool, flatten, then a value-preserving op
    (dropout, identity, view, reshape) before the linear."""

    def __init__(self, op: str, p: float = 0.2) -> None:
        super().__init__()
        self.op = op
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.drop, self.ident = nn.Dropout(p), nn.Identity()
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(F.adaptive_avg_pool2d(F.relu(self.bn(self.conv(x))), 1), 1)
        if self.op == "dropout":
            x = self.drop(x)
        elif self.op == "F.dropout":
            x = F.dropout(x, 0.3, self.training)
        elif self.op == "identity":
            x = self.ident(x)
        elif self.op == "view_reshape":
            x = x.view(x.shape[0], -1).reshape(x.shape[0], -1)
        return self.fc(x)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("op, p", [("dropout", 0.0), ("dropout", 0.2), ("F.dropout", 0.0),
                                   ("identity", 0.0), ("view_reshape", 0.0)])
def test_a_dropout_before_the_classifier_keeps_it_quantized(op, p, capture):
    # the fake quantizer before the pool reaches the linear through the dropout (the
    # identity once deployed): the linear is a QAT layer, converts to an int8 kernel,
    # and the coverage is PTQ's on the same model
    torch.manual_seed(0)
    model = _DropoutHead(op, p).eval()
    ptq = rq.quantize(model, _calib(), (_x(),), capture=capture)
    qat = rqat.prepare_qat(model, (_x(),), capture=capture, calibration=_calib())
    assert [qat.get_submodule(n.target).kind for n in rqat.qat_layers(qat)] == ["conv", "linear"]
    _train(qat, steps=2)
    assert qat.get_submodule(rqat.qat_layers(qat)[-1].target).weight.grad is not None
    qat.eval()
    for form in ("int8", "qdq"):
        int8 = rqat.convert(qat, form=form)
        cov = rq.coverage(int8)
        assert cov.left_float == () and cov.count() == (2, 2), (form, str(cov))
        assert cov.count() == rq.coverage(ptq).count()
        for seed in range(2):
            x = _x(50 + seed)
            with torch.no_grad():
                assert rq.sqnr(qat(x), int8(x)) >= PTQ_SQNR_BOUND


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("backend", ["x86", "onednn"])
def test_resnet18_every_conv_and_linear_converts_to_int8(backend, capture):
    from rewrite.examples.cnn import resnet18_with_inputs

    if backend not in torch.backends.quantized.supported_engines:
        pytest.skip(f"no {backend} engine")
    before = torch.backends.quantized.engine
    try:
        model, (x,) = resnet18_with_inputs(size=32)
        calib = [(torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(100 + i)),) for i in range(2)]
        qat = rqat.prepare_qat(model, (x,), capture=capture, backend=backend, calibration=calib)
        int8 = rqat.convert(qat.eval())
        cov = rq.coverage(int8)
        assert cov.left_float == () and cov.count("conv") == (20, 20) and cov.count("linear") == (1, 1), str(cov)
        held = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            ref, fq, out = model(held), qat(held), int8(held)
        assert rq.sqnr(fq, out) >= PTQ_SQNR_BOUND
        assert rq.sqnr(ref, out) > 20.0  # close to the float model (PTQ's CNN floor)
    finally:
        torch.backends.quantized.engine = before


def test_same_kernels_as_ptq():
    ptq = rq.quantize(_net(), _calib(), (_x(),), check=False)
    qat = rqat.prepare_qat(_net(), (_x(),), calibration=_calib())
    _train(qat, steps=2)
    int8 = rqat.convert(qat, check=False)

    def kernels(gm):
        return sorted((name, m.op_name) for name, m in gm.named_modules() if hasattr(m, "op_name"))

    # the same kernels, named after the same layers (conv1_conv_relu, fc2_linear...)
    assert kernels(int8) == kernels(ptq) and ("conv1_conv_relu", "conv2d_relu") in kernels(int8)


def test_4bit_weights_use_16_levels():
    qat = rqat.prepare_qat(_net(), (_x(),), ruleset="w4", calibration=_calib())
    _train(qat, steps=2)
    qdq = rqat.convert(qat, lower=False)
    weights = [t for name, t in qdq.named_buffers() if t.is_quantized and t.dtype == torch.qint8]
    assert len(weights) == 5
    for w in weights:
        ints = w.int_repr()
        assert ints.min() >= -8 and ints.max() <= 7
        assert ints.min() == -8 or ints.max() == 7  # the range is used


def test_qdq_form_when_available():
    import inspect

    if "form" not in inspect.signature(rq.convert).parameters:
        pytest.skip("rewrite.quant.convert has no form= yet")
    qat = rqat.prepare_qat(_net(), (_x(),), calibration=_calib())
    _train(qat, steps=2)
    qat.eval()
    qdq = rqat.convert(qat, form="qdq")
    x = _x(7)
    with torch.no_grad():
        assert rq.sqnr(qat(x), qdq(x)) >= PTQ_SQNR_BOUND
    assert not any(isinstance(m, (QuantizedConv, QuantizedLinear)) for m in qdq.modules())
    # the weights are plain int8 tensors read through quantized_decomposed, as PTQ's QDQ form
    # writes them: torch.export captures it (a qint8 constant it cannot)
    assert not any(t.is_quantized for t in qdq.buffers())
    exported = rq.export(qdq, (x,)).module()
    with torch.no_grad():
        torch.testing.assert_close(exported(x), qdq(x))


@pytest.mark.parametrize("name", ["hf_resnet", "hf_bert"])
def test_models_from_transformers(name):
    """transformers models (random weights, torch.export): fake quantizers where the
    observers go, gradients to every weight, int8 outputs matching the QAT model."""
    pytest.importorskip("transformers")
    from torch.utils import _pytree as pytree

    from rewrite.examples import hf

    model, args = getattr(hf, name)()
    qat = rqat.prepare_qat(model, args, capture="export")
    observed = rq.prepare(model, args, capture="export", check=False)
    n_observers = sum(isinstance(observed.get_submodule(n.target), ObserverBase)
                      for n in observed.graph.nodes if n.op == "call_module")
    assert len(rqat.fake_quant_nodes(qat)) == n_observers > 0

    def floats(out):
        return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]

    sum(t.float().square().mean() for t in floats(qat(*args))).backward()
    assert [n for n, p in qat.named_parameters() if p.grad is None] == []
    qat.eval()
    int8 = rqat.convert(qat)
    low, total = int8.meta["rewrite.quant"]["coverage"].count()
    assert low == total == len(rqat.qat_layers(qat))
    with torch.no_grad():
        for ref, out in zip(floats(qat(*args)), floats(int8(*args)), strict=True):
            assert rq.sqnr(ref, out) >= PTQ_SQNR_BOUND


# ---------------------------------------------------------------- train and eval


def test_batch_norm_trains_on_batch_statistics_and_evaluates_folded():
    qat = rqat.prepare_qat(_net(), (_x(),), calibration=_calib())
    layer = next(qat.get_submodule(n.target) for n in rqat.qat_layers(qat)
                 if isinstance(qat.get_submodule(n.target), QATConvBn))
    mean = layer.bn.running_mean.clone()
    qat.eval()
    with torch.no_grad():
        qat(_x(3))
    assert torch.equal(layer.bn.running_mean, mean)  # eval: running statistics untouched
    qat.train()
    with torch.no_grad():
        qat(_x(3))
    assert not torch.equal(layer.bn.running_mean, mean)  # train: batch statistics update them
    # eval mode computes exactly the folded conv with the fake-quantized folded weight
    layer.eval()
    x = torch.randn(4, 3, 8, 8)
    w, b = layer.folded()
    expected = F.conv2d(x, layer.weight_fake_quant(w), b, 1, 1)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    # in train mode the output is normalized with the batch's own statistics
    layer.train()
    y = layer(x)
    torch.testing.assert_close(y.mean((0, 2, 3)), layer.bn.bias, rtol=0, atol=1e-4)


def test_activation_ranges_move_in_training_only():
    qat = rqat.prepare_qat(_net(), (_x(),), calibration=_calib())
    fq = qat.get_submodule(rqat.fake_quant_nodes(qat)[0].target)  # the model input's
    scale = fq.scale.clone()
    big = 10 * _x(4)
    qat.eval()
    with torch.no_grad():
        out = qat(big)
    assert torch.equal(fq.scale, scale)
    # eval: each sample's output does not depend on the rest of the batch
    with torch.no_grad():
        torch.testing.assert_close(qat(big[:2]), out[:2])
    qat.train()
    with torch.no_grad():
        qat(big)
    assert fq.scale > scale  # a moving average towards the wider range


@settings(max_examples=12, deadline=None)
@given(bits=st.integers(2, 8), channels=st.integers(1, 6), per_channel=st.booleans(), seed=st.integers(0, 2**16))
def test_weight_fake_quant_is_what_convert_stores(bits, channels, per_channel, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(channels, 3, 3, 3, generator=gen) * torch.rand(channels, 1, 1, 1, generator=gen)
    scheme = "per_channel_symmetric" if per_channel else "per_tensor_symmetric"
    layer = QATConv(w, None, 1, 1, 1, 1, bits=bits, scheme=scheme).eval()
    q, bias = layer.frozen()
    assert bias is None
    ints = q.int_repr()
    assert ints.min() >= -(2 ** (bits - 1)) and ints.max() <= 2 ** (bits - 1) - 1
    torch.testing.assert_close(q.dequantize(), layer.weight_fake_quant(layer.weight), rtol=0, atol=1e-6)
    # the straight-through estimator: the gradient passes where the weight is not
    # clamped to the integer range (the largest weight of a channel may be)
    fq = layer.weight_fake_quant
    layer.weight_fake_quant(layer.weight).sum().backward()
    shape = (-1, 1, 1, 1) if per_channel else (1, 1, 1, 1)
    q = torch.round(w * (1.0 / fq.scale.reshape(shape))) + fq.zero_point.reshape(shape)
    in_range = ((q >= fq.quant_min) & (q <= fq.quant_max)).float()
    assert torch.equal(layer.weight.grad, in_range)
    assert in_range.mean() > 0.5


# ---------------------------------------------------------------- policy in the rule file


def _qat_text() -> str:
    return (rewrite.rules_dir() / "quant" / "qat.rw").read_text()


@pytest.mark.parametrize("capture", CAPTURES)
def test_a_layer_kept_in_float(capture, tmp_path):
    text = _qat_text().replace(
        'where activation(x) and const(w, b) and not output_fake_quantized(l)',
        'where activation(x) and const(w, b) and not output_fake_quantized(l)\n'
        '          and not module_name_matches(l, "fc2")')
    assert "fc2" in text
    path = tmp_path / "qat_skip_fc2.rw"
    path.write_text(text)
    qat = rqat.prepare_qat(_net(), (_x(),), capture=capture, rules=str(path), calibration=_calib())
    layers = [qat.get_submodule(n.target) for n in rqat.qat_layers(qat)]
    assert len(layers) == 4 and sum(isinstance(m, QATLinear) for m in layers) == 1
    _train(qat, steps=2)
    int8 = rqat.convert(qat, check=False)
    cov = int8.meta["rewrite.quant"]["coverage"]
    assert cov.count("linear") == (1, 2) and [f.layer for f in cov.left_float] == ["fc2"]


def test_per_tensor_weights_and_another_observer():
    text = _qat_text().replace('8, "per_channel_symmetric")', '8, "per_tensor_symmetric")')
    text = text.replace("=> activation_fake_quant(r)", '=> activation_fake_quant(r, "minmax")')
    qat = rqat.prepare_qat(_net(), (_x(),), rules=rewrite.parse(text, "qat_pt.rw"), calibration=_calib())
    for node in rqat.qat_layers(qat):
        assert qat.get_submodule(node.target).weight_fake_quant.qscheme == torch.per_tensor_symmetric
    observers = [qat.get_submodule(n.target).activation_post_process for n in rqat.fake_quant_nodes(qat)]
    moving = [isinstance(o, MovingAverageMinMaxObserver) for o in observers]
    assert all(isinstance(o, MinMaxObserver) for o in observers)
    assert moving.count(False) == 4 and moving.count(True) == 3  # the relu outputs' are plain min/max
    _train(qat, steps=2)
    qat.eval()
    int8 = rqat.convert(qat)
    x = _x(9)
    with torch.no_grad():
        assert rq.sqnr(qat(x), int8(x)) >= PTQ_SQNR_BOUND


def test_activation_scale_for_the_int8_kernels():
    from rewrite.functions.qat import activation_fake_quant
    from rewrite.functions.quant import vnni_available

    fq = activation_fake_quant()
    obs = fq.activation_post_process
    assert (fq.quant_min, fq.quant_max, fq.dtype) == (0, 255, torch.quint8)  # rounds to all 256 levels
    assert (obs.quant_min, obs.quant_max) == ((0, 255) if vnni_available() else (0, 127))
    x = torch.linspace(-1, 3, 101)
    fq.train()
    fq(x)
    assert float(fq.scale) == pytest.approx(4 / (obs.quant_max - obs.quant_min), rel=1e-6)


def test_every_qat_rule_is_an_intentional_change():
    from rewrite.trust.verify import verify_rules

    rules = rqat.qat_rules()
    report = verify_rules(rules, max_examples=2)
    assert {v.status for v in report.verdicts} == {"intentional"}
    assert len(report.verdicts) == len(list(rules)) and report.ok


# ---------------------------------------------------------------- errors


def test_clear_errors():
    with pytest.raises(ValueError, match="no ruleset 'w3'"):
        rqat.prepare_qat(_net(), (_x(),), ruleset="w3")
    with pytest.raises(ValueError, match="capture must be"):
        rqat.prepare_qat(_net(), (_x(),), capture="jit")
    with pytest.raises(ValueError, match="unknown backend"):
        rqat.prepare_qat(_net(), (_x(),), backend="tpu")
    with pytest.raises(rqat.QATError, match="prepare_qat returned"):
        rqat.convert(fx.symbolic_trace(_net()))
    with pytest.raises(rqat.QATError, match="no batch"):
        rqat.prepare_qat(_net(), (_x(),), calibration=[])
    with pytest.raises(ValueError, match="from 2 to 8"):
        weight_fake_quant(9)
    with pytest.raises(rqat.QATError, match="no fake quantizer"):
        rqat.prepare_qat(nn.Sequential(nn.Tanh()), (torch.randn(2, 3),))


class _TiedLM(nn.Module):
    """GPT-2's tie (the head's weight is the embedding's) and a linear called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.ln = nn.Embedding(12, 8), nn.LayerNorm(8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.emb(ids))
        return self.head(self.mix(torch.relu(self.mix(h))))


@pytest.mark.parametrize("capture", CAPTURES)
def test_tied_weights_train_as_one_parameter(capture):
    torch.manual_seed(0)
    model, ids = _TiedLM(), torch.randint(0, 12, (2, 5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    qat = rqat.prepare_qat(model, (ids,), capture=capture)
    layers = [qat.get_submodule(n.target) for n in rqat.qat_layers(qat)]
    assert len(layers) == 3 and all(isinstance(m, QATLinear) for m in layers)
    # as many trainable numbers as the model has: nothing untied
    assert sum(p.numel() for p in qat.parameters()) == sum(p.numel() for p in model.parameters())
    heads = [m for m in layers if m.weight.shape == (12, 8)]
    embedding = next(m for m in qat.modules() if isinstance(m, nn.Embedding)) if capture == "fx" else None
    opt = torch.optim.SGD(qat.parameters(), lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        qat(ids).square().mean().backward()
        opt.step()
    mixes = [m for m in layers if m.weight.shape == (8, 8)]
    assert mixes[0].weight is mixes[1].weight and mixes[0].bias is mixes[1].bias
    if embedding is not None:
        assert heads[0].weight is embedding.weight
    # the caller's model is untouched, and the trained model still converts
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    int8 = rqat.convert(qat)
    assert int8(ids).shape == (2, 5, 12)
