"""Quantization, QAT and analysis on models the other tests do not use.

Each test is a class of failure found on such a model, checked on a small one:
onednn's conv + add kernels after a stride-2 int8 conv (a MobileNetV2 block), zero
padding with its default fill and in every spelling, linear layers written as
``addmm`` (transformers' GPT-2 ``Conv1D``), runs that must leave the caller's inputs
and model state alone (prepare, prepare_qat, analyze), and the ``torch.export``
input guard, which computes nothing. Outputs are compared by SQNR, as in
``tests/test_quant.py``; no timing assertions.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rewrite.qat as rqat
import rewrite.quant as rq
from rewrite.analysis import analyze
from rewrite.capture import capture
from rewrite.functions.quant import QuantizedConvAdd
from rewrite.trust.check import generate_inputs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: the int8 model against its QDQ reference, and fp32 against int8 (random weights)
QDQ_FLOOR = 30.0
FP32_FLOOR = 20.0


def _batches(inputs: tuple, n: int = 2) -> list:
    return [inputs] + [generate_inputs(inputs, seed=100 + i) for i in range(n)]


def _sqnr(a, b) -> float:
    a = a if isinstance(a, torch.Tensor) else a[0]
    b = b if isinstance(b, torch.Tensor) else b[0]
    return rq.sqnr(a, b)


# ---------------------------------------------------------------- onednn: conv + add after int8 convs


class _InvertedResidual(nn.Module):
    """MobileNetV2: a stride-2 conv + relu6 stem, then 1x1 -> depthwise 3x3 -> 1x1 (no
    activation) added to the block input."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU6())
        self.block = nn.Sequential(nn.Conv2d(8, 16, 1), nn.ReLU6(), nn.Conv2d(16, 16, 3, 1, 1, groups=16),
                                   nn.ReLU6(), nn.Conv2d(16, 8, 1))

    def forward(self, x):
        x = self.stem(x)
        return x + self.block(x)


@pytest.mark.parametrize("capture_level", ["fx", "export"])
def test_onednn_fuses_the_residual_add_after_a_stride_2_int8_conv(capture_level):
    torch.manual_seed(0)
    model, inputs = _InvertedResidual().eval(), (torch.randn(2, 3, 16, 16),)
    observed = rq.prepare(model, inputs, backend="onednn", capture=capture_level, check=False)
    rq.calibrate(observed, _batches(inputs))
    int8, qdq = rq.convert(observed, reference=True)
    cov = int8.meta["rewrite.quant"]["coverage"]
    assert cov.count("conv") == (4, 4), str(cov)
    assert sum(isinstance(m, QuantizedConvAdd) for m in int8.modules()) == 1
    with torch.no_grad():
        assert _sqnr(qdq(*inputs), int8(*inputs)) > QDQ_FLOOR
        assert _sqnr(model(*inputs), int8(*inputs)) > FP32_FLOOR


# ---------------------------------------------------------------- zero padding in every spelling


_PADS = {
    "F.pad default fill": lambda x: F.pad(x, (1, 1, 1, 1)),
    "F.pad int fill": lambda x: F.pad(x, (1, 1, 1, 1), value=0),
    "F.pad asymmetric": lambda x: F.pad(x, (0, 1, 0, 1)),
    "constant_pad_nd": lambda x: torch.constant_pad_nd(x, (1, 1, 1, 1)),
}


class _PaddedPair(nn.Module):
    def __init__(self, pad) -> None:
        super().__init__()
        self.pad = pad
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.b(self.pad(F.relu(self.a(x))))


@pytest.mark.parametrize("capture_level", ["fx", "export"])
@pytest.mark.parametrize("pad", sorted(_PADS))
def test_zero_padding_between_int8_convs_runs_on_int8(pad, capture_level):
    torch.manual_seed(0)
    model, inputs = _PaddedPair(_PADS[pad]).eval(), (torch.randn(1, 3, 8, 8),)
    observed = rq.prepare(model, inputs, capture=capture_level, check=False)
    rq.calibrate(observed, _batches(inputs))
    int8, qdq = rq.convert(observed, reference=True)
    cov = int8.meta["rewrite.quant"]["coverage"]
    assert cov.count("conv") == (2, 2), str(cov)
    with torch.no_grad():
        assert _sqnr(qdq(*inputs), int8(*inputs)) > QDQ_FLOOR
        assert _sqnr(model(*inputs), int8(*inputs)) > FP32_FLOOR


class _TFSame(nn.Module):
    """TF-style "same" padding written with F.pad's default fill (None: zeros)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(F.pad(x, (1, 1, 1, 1)))


@pytest.mark.parametrize("capture_level", ["fx", "export"])
def test_default_fill_padding_folds_into_the_conv(capture_level):
    model, inputs = _TFSame().eval(), (torch.randn(1, 3, 8, 8),)
    observed = rq.prepare(model, inputs, capture=capture_level)
    assert observed.meta["rewrite.quant"]["observe_counts"].get("pad_into_conv_default") == 1
    rq.calibrate(observed, _batches(inputs))
    int8 = rq.convert(observed)
    assert int8.meta["rewrite.quant"]["coverage"].count("conv") == (1, 1)
    with torch.no_grad():
        assert _sqnr(model(*inputs), int8(*inputs)) > FP32_FLOOR


# ---------------------------------------------------------------- addmm linear layers (GPT-2)


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16,
                                     use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2Model(config).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return model, (ids,)


def test_gpt2_conv1d_layers_quantize_as_linears():
    model, inputs = _tiny_gpt2()
    gm = torch.export.export(model, inputs, strict=False).module()
    int8 = rq.quantize(gm, _batches(inputs), ruleset="linear")
    cov = int8.meta["rewrite.quant"]["coverage"]
    assert cov.count("linear") == (8, 8), str(cov)  # c_attn, c_proj, c_fc, mlp.c_proj per layer
    assert int8.meta["rewrite.quant"]["observe_counts"]["addmm_as_linear"] == 8
    with torch.no_grad():
        ref, out = model(*inputs).last_hidden_state, int8(*inputs)
    assert _sqnr(ref, out) > FP32_FLOOR
    qat = rqat.prepare_qat(gm, inputs)
    assert len(rqat.qat_layers(qat)) == 8


# ---------------------------------------------------------------- x @ w.T linear layers (Falcon)


def _tiny_falcon():
    transformers = pytest.importorskip("transformers")
    config = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       new_decoder_architecture=False, use_cache=False)
    torch.manual_seed(0)
    model = transformers.FalconModel(config).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return model, (ids,)


def test_falcon_transposed_weight_products_quantize_as_linears():
    model, inputs = _tiny_falcon()
    gm = torch.export.export(model, inputs, strict=False).module()
    assert sum(1 for n in gm.graph.nodes if n.target is torch.ops.aten.numpy_T.default) == 8
    int8 = rq.quantize(gm, _batches(inputs), ruleset="linear")
    cov = int8.meta["rewrite.quant"]["coverage"]
    assert cov.count("linear") == (8, 8), str(cov)  # query_key_value, dense, h_to_4h, 4h_to_h per layer
    assert int8.meta["rewrite.quant"]["observe_counts"]["matmul_transposed_as_linear"] == 8
    with torch.no_grad():
        ref, out = model(*inputs).last_hidden_state, int8(*inputs)
    assert _sqnr(ref, out) > FP32_FLOOR


class _TransposedProduct(nn.Module):
    """A linear layer spelled ``x @ w.transpose(0, 1)``: no rule makes it a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 4))

    def forward(self, x):
        return torch.relu(x @ self.weight.transpose(0, 1))


def test_coverage_names_a_product_with_a_constant_weight_it_left_in_float():
    model, inputs = _TransposedProduct().eval(), (torch.randn(2, 3, 4),)
    int8 = rq.quantize(torch.export.export(model, inputs).module(), _batches(inputs), ruleset="linear")
    cov = int8.meta["rewrite.quant"]["coverage"]
    assert cov.count("linear") == (0, 1), str(cov)
    assert "constant weight" in cov.left_float[0].reason
    assert "1 left in float" in str(cov)


# ---------------------------------------------------------------- runs that leave no trace


class _WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 2)

    def forward(self, x):
        x.mul_(2)
        return self.fc(F.relu(self.conv(x)).mean((2, 3)))


class _Counts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.fc(F.relu(self.conv(x)).mean((2, 3)))


@pytest.mark.parametrize("capture_level", ["fx", "export"])
def test_preparing_does_not_write_the_callers_inputs(capture_level):
    x = torch.ones(2, 3, 8, 8)
    rq.prepare(_WritesItsInput().eval(), (x,), capture=capture_level, check=False)
    assert torch.equal(x, torch.ones(2, 3, 8, 8))
    rqat.prepare_qat(_WritesItsInput().eval(), (x,), capture=capture_level)
    assert torch.equal(x, torch.ones(2, 3, 8, 8))


def test_calibration_and_analysis_leave_the_callers_buffer_alone():
    model, x = _Counts().eval(), torch.randn(2, 3, 8, 8)
    observed = rq.prepare(model, (x,), capture="export")
    rq.calibrate(observed, [(x,), (x,)])
    int8 = rq.convert(observed)
    assert model.calls.item() == 0  # the caller's model never ran
    # calibration observes: the counter is put back (session 46: the int8 model's first
    # call computes what the caller's model's first call does), and convert's check
    # runs leave no count behind
    assert observed.calls.item() == 0
    assert int8.calls.item() == 0
    gm = capture(model, (x,), "export")
    analyze(gm, (x,))
    assert gm.calls.item() == 0 and model.calls.item() == 0


# ---------------------------------------------------------------- the export input guard


def test_export_guard_is_not_measured():
    model, x = _WritesItsInput().eval(), torch.randn(1, 3, 8, 8)

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.fc = model.conv, model.fc

        def forward(self, x):
            return self.fc(F.relu(self.conv(x)).mean((2, 3)))

    plain = Plain().eval()
    fx_totals = analyze(capture(plain, (x,), "fx"), (x,)).totals
    export = analyze(capture(plain, (x,), "export"), (x,))
    assert any(n.name == "_guards_fn" and not n.is_compute and n.bytes_read == 0 for n in export.nodes)
    assert (export.totals.nodes, export.totals.bytes_read, export.totals.flops) == (
        fx_totals.nodes, fx_totals.bytes_read, fx_totals.flops)
