"""Regressions from the session-51 probes: apply and the library's other entry points
under a caller's active ``FakeTensorMode`` (probe CQ F2 of session 50)."""

from __future__ import annotations

import warnings

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
