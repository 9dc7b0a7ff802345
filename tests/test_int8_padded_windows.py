"""int8 convs where a window lies wholly in the padding (a 1x1 conv padded by 1, a
dilated kernel over a size-1 dim): the x86 and onednn kernels return wrong values
there (and fbgemm's and the float conv can crash on such weights' strides). The
modules ``lower.rw`` inserts compute those shapes as the QDQ graph they replaced
did; every other shape stays on the kernel."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import rewrite
from rewrite.functions.quant import quantized_conv, quantized_conv_add, vnni_available

ENGINES = [e for e in ("x86", "fbgemm", "onednn") if e in torch.backends.quantized.supported_engines]


@contextlib.contextmanager
def quantized_engine(name):
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


def _case(draw, rank):
    size = [draw(st.integers(1, 5)) for _ in range(rank)]
    kernel = [draw(st.integers(1, 3)) for _ in range(rank)]
    stride, pad, dil, groups = (draw(st.integers(1, 2)), draw(st.integers(0, 3)), draw(st.integers(1, 3)),
                                draw(st.sampled_from([1, 2])))
    if any(n + 2 * pad < dil * (k - 1) + 1 for n, k in zip(size, kernel)):
        pad = max(dil * (k - 1) for k in kernel)  # the window fits
    zp = draw(st.sampled_from([0, 111]))
    torch.manual_seed(draw(st.integers(0, 2 ** 16)))
    values = torch.randn(2, 2 * groups, *size) * 2
    if not vnni_available():
        # without VNNI the kernels add u8 x s8 pairs in 16 bits and saturate above 7-bit
        # activations, which the observers never calibrate there (README: CPUs without VNNI)
        values = values.clamp(-zp * 0.028, (127 - zp) * 0.028)
    x = torch.quantize_per_tensor(values, 0.028, zp, torch.quint8)
    w = torch.quantize_per_tensor(torch.randn(2 * groups, 2, *kernel), 0.02, 0, torch.qint8)
    b = torch.randn(2 * groups)
    y = getattr(F, f"conv{rank}d")(x.dequantize(), w.dequantize(), b, stride, pad, dil, groups)
    return x, w, b, (stride, pad, dil, groups), y


def _steps_apart(got, y, relu):
    y = torch.relu(y) if relu else y
    scale = y.abs().max().item() / 127 + 1e-3
    ref = torch.quantize_per_tensor(y, scale, 128, torch.quint8)
    return scale, ref


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_int8_conv_matches_the_float_graph_on_every_padding(engine, data):
    rank = data.draw(st.sampled_from([1, 2] if engine == "onednn" else [1, 2, 3]))
    x, w, b, (stride, pad, dil, groups), y = _case(data.draw, rank)
    relu = data.draw(st.booleans())
    scale, ref = _steps_apart(None, y, relu)
    with quantized_engine(engine):
        got = quantized_conv(None, w, b, stride, pad, dil, groups, scale, 128, relu)(x)
    assert got.shape == ref.shape
    assert (got.int_repr().int() - ref.int_repr().int()).abs().max().item() <= 1


@pytest.mark.parametrize("engine", ["onednn"] if "onednn" in ENGINES else [])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_int8_conv_add_matches_the_float_graph_on_every_padding(engine, data):
    x, w, b, (stride, pad, dil, groups), c = _case(data.draw, 2)
    acc = torch.quantize_per_tensor(torch.randn_like(c), 0.03, 128, torch.quint8)
    relu = data.draw(st.booleans())
    scale, ref = _steps_apart(None, c + acc.dequantize(), relu)
    with quantized_engine(engine):
        got = quantized_conv_add(None, None, w, b, stride, pad, dil, groups, scale, 128, relu)(x, acc)
    assert (got.int_repr().int() - ref.int_repr().int()).abs().max().item() <= 1


@pytest.mark.parametrize("engine", ["x86"] if "x86" in ENGINES else [])
def test_lowering_a_padded_1x1_conv_keeps_its_border(engine):
    """The rule fires (the graph now holds the int8 module) and the border, which
    reads only padding, is the bias requantized, as in the QDQ graph."""

    root = torch.nn.Module()
    w = torch.randn(4, 3, 1, 1)
    root.register_buffer("w", torch.quantize_per_channel(w, w.abs().amax((1, 2, 3)).double() / 127,
                                                         torch.zeros(4, dtype=torch.long), 0, torch.qint8))
    root.register_buffer("b", torch.randn(4))
    g = torch.fx.Graph()
    xin, wq, bias = g.placeholder("x"), g.get_attr("w"), g.get_attr("b")
    conv = g.call_function(torch.conv2d, (g.call_function(torch.dequantize, (xin,)),
                                          g.call_function(torch.dequantize, (wq,)), bias, 1, 1))
    g.output(g.call_function(torch.quantize_per_tensor, (conv, 0.05, 128, torch.quint8)))
    gm = torch.fx.GraphModule(root, g)
    x = torch.quantize_per_tensor(torch.randn(2, 3, 5, 5), 0.03, 111, torch.quint8)
    with quantized_engine(engine):
        result = rewrite.load("rules/quant/lower.rw").apply(gm, example_inputs=(x,), check=False)
    assert result.counts.get("lower_conv") == 1
    kinds = {type(m).__name__ for m in result.graph_module.modules()}
    assert "QuantizedConv" in kinds
    with quantized_engine(engine):
        expected, got = gm(x).int_repr().int(), result.graph_module(x).int_repr().int()
    assert (expected - got).abs().max().item() <= 1
    assert (got[..., 0, :] - expected[..., 0, :]).abs().max().item() <= 1  # the border row


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kernel, pad, dil", [(3, 1, 1), (2, 1, 1), (3, 2, 1), (2, 1, 2), (5, 2, 1)])
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_conv3d_over_an_input_of_depth_one(engine, kernel, pad, dil, threads):
    """The x86 and onednn int8 conv3d is off by up to the whole int8 range over an
    input of depth 1 with a kernel deeper than 1, though every window reads the input
    (DemoCNN's conv3d, fed an unsqueezed 2-d map, hit it): such inputs take the float
    graph too."""
    torch.manual_seed(kernel * 10 + pad)
    x = torch.quantize_per_tensor(torch.rand(2, 3, 1, 6, 6), 0.01, 66, torch.quint8)
    wf = torch.randn(4, 3, kernel, 3, 3)
    w = torch.quantize_per_channel(wf, wf.abs().amax((1, 2, 3, 4)).double() / 127, torch.zeros(4, dtype=torch.long),
                                   0, torch.qint8)
    b = torch.randn(4)
    y = F.conv3d(x.dequantize(), w.dequantize(), b, 1, (pad, 1, 1), (dil, 1, 1))
    scale, ref = _steps_apart(None, y, False)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with quantized_engine(engine):
            got = quantized_conv(None, w, b, 1, (pad, 1, 1), (dil, 1, 1), 1, scale, 128, False)(x)
    finally:
        torch.set_num_threads(before)
    assert got.shape == ref.shape
    assert (got.int_repr().int() - ref.int_repr().int()).abs().max().item() <= 1
