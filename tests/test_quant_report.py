"""Convs with string padding ("same", "valid": EfficientNet's) run as int8 kernels, and
the quantization report names every conv and linear left in float, with the reason.

String padding becomes the integers the int8 kernels take ("valid" 0, "same" at stride
1 ``dilation * (kernel - 1) // 2`` per dim); a "same" that pads one more after than
before (an even kernel with an odd dilation) stays float and ``rq.coverage`` says why.
Numerics by SQNR against fp32 and against the QDQ reference; no timing assertions.
"""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import rewrite.quant as rq
from rewrite.trust.check import generate_inputs
from rewrite.functions.quant import (
    QuantizedConv,
    QuantizedLinear,
    conv_padding_ints,
    conv_padding_problem,
    quantize_weight,
    quantized_conv,
)
from rewrite.ops import bind_node

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: fp32-vs-int8 output SQNR floor (dB) on held-out inputs for the models below
#: (measured 42.4-53.3 dB over seeds 0-4, fx and export alike; int8 equals its QDQ
#: reference there, inf dB).
FLOOR = 30.0
#: the int8 model against its reference QDQ model (the same rounding points)
QDQ_FLOOR = 30.0


class StringPadding(nn.Module):
    """String padding of every kind: "same" (3x3, and a depthwise 5x5 with dilation 2:
    symmetric), "valid", a 4x4 "same" (pads 1 before and 2 after: stays float), an
    integer-padded conv and a linear."""

    def __init__(self):
        super().__init__()
        self.same = nn.Conv2d(3, 8, 3, padding="same")
        self.bn = nn.BatchNorm2d(8)
        self.valid = nn.Conv2d(8, 8, 3, padding="valid")
        self.depthwise = nn.Conv2d(8, 8, 5, padding="same", dilation=2, groups=8)
        self.even = nn.Conv2d(8, 8, 4, padding="same")
        self.padded = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.bn(self.same(x)))
        x = self.valid(x)
        x = torch.relu(self.depthwise(x))
        x = self.even(x)
        x = self.padded(x)
        return self.fc(x.mean((2, 3)))


def _model(seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    model = StringPadding().eval()
    with torch.no_grad():  # batch norm statistics that folding really has to use
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    return model, (torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(seed)),)


def _batches(inputs: tuple, n: int, seed: int) -> list:
    return [generate_inputs(inputs, seed=seed + i) for i in range(n)]


def _float_layers(gm: fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes
            if n.op.startswith("call_") and {b.op for b in bind_node(n, gm)} & {"conv", "linear"}]


def _output_sqnr(reference, candidate, inputs) -> float:
    with torch.no_grad():
        pairs = rq._float_pairs(reference(*inputs), candidate(*inputs))
    return min(rq.sqnr(a, b) for a, b in pairs)


EXPECTED_SUMMARY = "int8 kernels: 4 of 5 convs, 1 of 1 linear; 1 left in float:"
EXPECTED_REASON = "asymmetric 'same' padding: kernel 4x4, dilation 1x1 pads (1, 1) before, (2, 2) after"


# ---------------------------------------------------------------- string padding, end to end


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_string_padding_convs_run_as_int8_kernels(capture):
    model, inputs = _model()
    before = copy.deepcopy(model.state_dict())
    observed = rq.prepare(model, inputs, capture=capture)
    rq.calibrate(observed, [inputs] + _batches(inputs, 2, 100))
    int8, qdq = rq.convert(observed, reference=True)

    convs = {name: m for name, m in int8.named_modules() if isinstance(m, QuantizedConv)}
    assert len(convs) == 4 and sum(isinstance(m, QuantizedLinear) for m in int8.modules()) == 1
    # the integer padding each kernel was packed with
    padding = {name.split("_conv")[0]: m._packed.padding() for name, m in convs.items()}
    assert padding == {"same": [1, 1], "valid": [0, 0], "depthwise": [4, 4], "padded": [1, 1]}
    # the one conv left in float is the even-kernel "same" one
    (left,) = _float_layers(int8)
    assert rq.module_path(left) == "even"

    cov = int8.meta["rewrite.quant"]["coverage"]
    assert cov == rq.coverage(int8)
    assert cov.count("conv") == (4, 5) and cov.count("linear") == (1, 1) and cov.count() == (5, 6)
    assert cov.left_float == (rq.FloatLayer("even", "conv", EXPECTED_REASON),)
    assert str(cov).splitlines() == [EXPECTED_SUMMARY, f"  even  conv  {EXPECTED_REASON}"]

    for held in _batches(inputs, 2, 500):
        assert _output_sqnr(model, int8, held) > FLOOR
        assert _output_sqnr(qdq, int8, held) > QDQ_FLOOR
    report = rq.accuracy_report(observed, int8, _batches(inputs, 2, 700))
    assert report.coverage == cov and report.output_sqnr > FLOOR
    assert str(report).splitlines()[-2:] == str(cov).splitlines()

    # the user's model is left as it was
    assert model.same.padding == "same" and model.valid.padding == "valid" and model.even.padding == "same"
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("seed", [1, 2])
def test_string_padding_sqnr_over_seeds(seed):
    model, inputs = _model(seed)
    int8 = rq.quantize(model, [inputs] + _batches(inputs, 2, 100 + seed))
    assert rq.coverage(int8).count("conv") == (4, 5)
    assert _output_sqnr(model, int8, generate_inputs(inputs, seed=900 + seed)) > FLOOR


def test_command_line_prints_the_coverage(capsys):
    parser = rq.add_quantize_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--model", "tests.test_quant_report:string_padding_with_inputs",
                              "--calibration", "2", "--held-out", "1"])
    assert rq.quantize_command(args) == 0
    out = capsys.readouterr().out
    assert EXPECTED_SUMMARY in out.splitlines()
    assert f"  even  conv  {EXPECTED_REASON}" in out.splitlines()


def string_padding_with_inputs() -> tuple:
    """The command line's ``module:callable`` for the model above."""
    return _model()


def test_hf_efficientnet_convs_all_int8():
    """transformers' EfficientNet pads with "same" and "valid" (odd kernels: symmetric)."""
    transformers = pytest.importorskip("transformers")
    from rewrite.examples.cnn import randomize_batchnorm

    torch.manual_seed(0)
    config = transformers.EfficientNetConfig(image_size=32, width_coefficient=0.25, depth_coefficient=0.2,
                                             hidden_dim=320)
    model = transformers.EfficientNetModel(config)
    randomize_batchnorm(model, 0)
    model.eval()
    paddings = [m.padding for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert (paddings.count("same"), paddings.count("valid"), len(paddings)) == (31, 5, 36)
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    int8 = rq.quantize(model, [(x,)] + _batches((x,), 1, 100), capture="export", check=False)
    cov = rq.coverage(int8)
    assert cov.count("conv") == (36, 36) and cov.left_float == ()
    assert str(cov) == "int8 kernels: 36 of 36 convs; none left in float"
    assert not _float_layers(int8)
    assert _output_sqnr(model, int8, generate_inputs((x,), seed=9)) > FLOOR


# ---------------------------------------------------------------- the padding arithmetic


@st.composite
def _conv_case(draw):
    rank = draw(st.sampled_from([1, 2, 3]))
    kernel = tuple(draw(st.integers(1, 5)) for _ in range(rank))
    dilation = tuple(draw(st.integers(1, 3)) for _ in range(rank))
    groups = draw(st.sampled_from([1, 2]))
    padding = draw(st.sampled_from(["same", "valid"]))
    return rank, kernel, dilation, groups, padding


@settings(max_examples=60, deadline=None, derandomize=True)
@given(_conv_case(), st.integers(0, 2 ** 16))
def test_string_padding_as_integers_is_exact_or_refused(case, seed):
    """For every kernel and dilation: the integers equal torch's own string padding
    exactly (float conv), or the padding is asymmetric and refused with the reason."""
    rank, kernel, dilation, groups, padding = case
    g = torch.Generator().manual_seed(seed)
    size = [max(d * (k - 1) + 1, 4) for k, d in zip(kernel, dilation)]
    x = torch.randn(1, 2 * groups, *size, generator=g, dtype=torch.float64)
    w = torch.randn(2 * groups, 2, *kernel, generator=g, dtype=torch.float64)
    conv = (F.conv1d, F.conv2d, F.conv3d)[rank - 1]
    asymmetric = padding == "same" and any(d * (k - 1) % 2 for k, d in zip(kernel, dilation))
    problem = conv_padding_problem(padding, kernel, dilation)
    assert (problem is not None) == asymmetric
    if asymmetric:
        assert problem.startswith("asymmetric 'same' padding")
        with pytest.raises(ValueError, match="asymmetric 'same' padding"):
            conv_padding_ints(padding, kernel, dilation)
        return
    ints = conv_padding_ints(padding, kernel, dilation)
    torch.testing.assert_close(conv(x, w, None, 1, ints, dilation, groups),
                               conv(x, w, None, 1, padding, dilation, groups), rtol=0, atol=0)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(_conv_case(), st.integers(0, 2 ** 16))
def test_int8_conv_with_string_padding_matches_the_qdq_conv(case, seed):
    """The int8 kernel built for a string-padded conv computes the float conv of the
    dequantized input and weight, rounded to its output grid: within one step."""
    rank, kernel, dilation, groups, padding = case
    if conv_padding_problem(padding, kernel, dilation) is not None:
        with pytest.raises(ValueError, match="asymmetric"):
            quantized_conv(weight=torch.randn(2 * groups, 2, *kernel), padding=padding, dilation=dilation,
                           groups=groups, scale=0.1, zero_point=128)
        return
    g = torch.Generator().manual_seed(seed)
    size = [max(d * (k - 1) + 1, 4) for k, d in zip(kernel, dilation)]
    # 7-bit activations (int values 0..127): no x86 kernel saturates, VNNI or not
    xq = torch._make_per_tensor_quantized_tensor(
        torch.randint(0, 128, (1, 2 * groups, *size), generator=g, dtype=torch.uint8), 0.05, 64)
    w = quantize_weight(torch.randn(2 * groups, 2, *kernel, generator=g))
    bias = torch.randn(2 * groups, generator=g)
    conv = (F.conv1d, F.conv2d, F.conv3d)[rank - 1]
    ref = conv(xq.dequantize(), w.dequantize(), bias, 1, padding, dilation, groups)
    lo, hi = min(float(ref.min()), 0.0), max(float(ref.max()), 0.0)
    scale = max(hi - lo, 1e-3) / 255
    zero_point = int(round(-lo / scale))
    mod = quantized_conv(weight=w, bias=bias, stride=1, padding=padding, dilation=dilation, groups=groups,
                         scale=scale, zero_point=zero_point)
    out = mod(xq if rank != 3 else xq.contiguous())
    assert out.shape == ref.shape
    assert float((out.dequantize() - ref).abs().max()) <= scale * 1.01


# ---------------------------------------------------------------- every reason a layer stays float


class _Leaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(x)


class _Reasons(nn.Module):
    """A conv inside a leaf module, a conv whose weight is an input, a transposed conv,
    and a linear on a 1-d tensor; one conv and nothing else lowers."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.leaf = _Leaf()
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.fc = nn.Linear(4, 4)

    def forward(self, x, k):
        y = self.leaf(torch.relu(self.a(x)))
        y = self.up(F.conv2d(y, k, padding=1))
        return self.fc(y.mean((0, 2, 3)))


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, _Leaf) or super().is_leaf_module(m, qualname)


def test_coverage_names_every_float_layer_with_its_reason():
    torch.manual_seed(0)
    model = _Reasons().eval()
    gm = fx.GraphModule(model, _LeafTracer().trace(model))
    x, k = torch.randn(2, 3, 8, 8), torch.randn(4, 4, 3, 3)
    int8 = rq.quantize(gm, [(x, k), (torch.randn(2, 3, 8, 8), k)])
    cov = int8.meta["rewrite.quant"]["coverage"]
    assert cov.count("conv") == (1, 3) and cov.count("conv_transpose") == (0, 1) and cov.count("linear") == (0, 1)
    reasons = {f.layer: (f.op, f.reason) for f in cov.left_float}
    assert reasons == {
        "leaf.conv": ("conv", "not observed: inside leaf module leaf (_Leaf), which the graph calls whole"),
        "conv2d": ("conv", "weight is not a constant (computed in the graph or an input)"),
        "up": ("conv_transpose", "transposed conv: no int8 rule lowers it"),
        "fc": ("linear", "input of rank 1: the int8 linear kernel takes rank >= 2"),
    }
    assert cov.summary == "int8 kernels: 1 of 3 convs, 0 of 1 transposed conv, 0 of 1 linear; 4 left in float"


def test_coverage_float64_model_stays_float_and_says_so():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).double().eval()
    int8 = rq.quantize(model, [torch.randn(1, 3, 8, 8, dtype=torch.float64)])
    cov = rq.coverage(int8)
    assert cov.count() == (0, 1)
    assert cov.left_float == (rq.FloatLayer("0", "conv", "dtype float64: int8 kernels take float32"),)
