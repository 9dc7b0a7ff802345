"""The minimal quantization-stub and AMP-cast rule sets: rules that insert modules
and casts, and fold casts of weights at rewrite time."""

import torch
import torch.fx as fx
import torch.nn as nn
from torch.ao.quantization.observer import MinMaxObserver

import rewrite


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


X = torch.randn(2, 3, 8, 8)


def test_quant_stubs_insert_observers_once():
    model = Net().eval()
    gm = fx.symbolic_trace(model)
    result = rewrite.load("rules/quant_stubs.rw").apply(gm, example_inputs=(X,))
    assert result.counts == {"observe_conv_input": 1, "observe_linear_input": 1}
    observers = [m for m in result.graph_module.modules() if isinstance(m, MinMaxObserver)]
    assert len(observers) == 2
    result.graph_module(X)  # calibration: observers record ranges
    assert all(torch.isfinite(o.min_val) and o.min_val <= o.max_val for o in observers)
    torch.testing.assert_close(result.graph_module(X), model(X))


def test_histogram_observer_inserts_torchs_histogram_observer_after_each_conv():
    from torch.ao.quantization.observer import HistogramObserver

    model = Net().eval()
    rules = rewrite.parse("rule watch_conv: conv(_, ...) as c => histogram_observer(c)")
    for gm in (fx.symbolic_trace(model), torch.export.export(model, (X,)).module()):
        result = rules.apply(gm, example_inputs=(X,))
        assert result.counts == {"watch_conv": 1}
        observers = [m for m in result.graph_module.modules() if isinstance(m, HistogramObserver)]
        assert len(observers) == 1
        torch.testing.assert_close(result.graph_module(X), model(X))  # observing changes nothing
        assert observers[0].min_val <= observers[0].max_val  # it recorded the conv's range


def test_amp_casts_run_linear_and_conv_in_bf16_with_weights_cast_once():
    model = Net().eval()
    for gm in (fx.symbolic_trace(model), torch.export.export(model, (X,)).module()):
        result = (rewrite.load("rules/amp_casts.rw") + rewrite.load("rules/cleanup.rw")).apply(
            gm, example_inputs=(X,), rtol=5e-2, atol=5e-2, training=False  # inference (an export keeps no .eval())
        )
        assert result.counts["linear_bf16"] == 1 and result.counts["conv_bf16"] == 1
        consts = dict(result.graph_module.named_parameters()) | dict(result.graph_module.named_buffers())
        bf16 = [n for n, t in consts.items() if t.dtype == torch.bfloat16]
        assert len(bf16) == 4, bf16  # conv and linear weight and bias, cast at rewrite time
        assert result.graph_module(X).dtype == torch.float32
        torch.testing.assert_close(result.graph_module(X), model(X), rtol=5e-2, atol=5e-2)


def test_amp_casts_leave_non_float32_inputs_alone():
    model = Net().eval().double()
    x = X.double()
    result = rewrite.load("rules/amp_casts.rw").apply(fx.symbolic_trace(model), example_inputs=(x,))
    assert result.counts == {}
