"""Regression tests for ways the default check (``apply`` with the check on) could be
fooled, found by an adversarial tester; each wrong rewrite below used to pass or crash:

- two outputs that are disjoint slices of one storage made to overlap (same storage,
  so "sharing" was already seen in the original);
- a float16 output that is NaN in the original made finite (the half-precision second
  look compared it with the float32 run only);
- ``conj_physical => conj``: equal values, but the output has the conjugate bit set;
- a selected ruleset's intentional-change reference applied every ``change`` rule of
  the file, also unscheduled ones (a correct rewrite rejected, a wrong one passed);
- a forward returning a dataclass crashed the check (``RuntimeError`` from its ``__eq__``);
- an output that was a view of a plain tensor attribute (export's lifted constant) made
  a fresh copy;
- a plain tensor attribute written in place: the check wrote the caller's model and a
  wrong rewrite of what is written passed;
- an int8 step allowed on a float output no quantize reaches;
- a float64 replacement in a float32 model earned the integer-agreement allowance;
- an output in another layout (mkldnn) crashed the check (``NotImplementedError``);
- ``zeros_like => empty_like`` passed when the allocator handed out zeroed pages;
- a lost gradient excused as a fold because apply copies a buffer the forward writes.
"""

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rewrite
from rewrite import EquivalenceError
from rewrite.trust.check import check_equivalence

RELU_RELU = "rule relu_relu: relu(relu(_) as r) => r"


@pytest.fixture(autouse=True)
def _quiet_and_seeded():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _export(model, *args):
    return torch.export.export(model, args).module()


# 1: overlapping outputs

class Halves(nn.Module):
    def forward(self, x):
        u = torch.relu(torch.relu(x * 2))
        z = torch.cat([u, u])
        return z[:4], z[4:]


def test_outputs_made_to_overlap_are_caught():
    x = torch.randn(4)
    gm = _export(Halves(), x)
    rules = rewrite.parse(
        "rule s: aten.slice.Tensor(aten.cat.default([x, x]) as c, 0, 4, _) => aten.slice.Tensor(c, 0, 0, 4)")
    with pytest.raises(EquivalenceError):
        rules.apply(gm, example_inputs=(x,))


def test_disjoint_slices_of_one_storage_in_both_still_pass():
    x = torch.randn(4)
    gm = _export(Halves(), x)
    result = rewrite.parse(RELU_RELU).apply(gm, example_inputs=(x,))
    assert result.counts == {"relu_relu": 1}
    a, b = result.graph_module(x)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    before = b.clone()
    a.add_(1.0)
    assert torch.equal(b, before)


# 2: a NaN of the original made finite in float16

class HandSoftmax(nn.Module):
    def forward(self, x):
        e = torch.exp(torch.relu(torch.relu(x)))
        return e / e.sum(-1, keepdim=True)


def _overflowing_half():
    torch.manual_seed(0)
    x = torch.randn(4, 8) * 3
    x[0, 0] = 15.0  # exp(15) > 65504: inf / inf = NaN in float16
    return x.half()


def test_a_float16_nan_made_finite_is_caught():
    x = _overflowing_half()
    gm = torch.fx.symbolic_trace(HandSoftmax())
    assert gm(x).isnan().any()
    with pytest.raises(EquivalenceError):
        rewrite.parse("rule r: div(exp(x) as e, sum(e, d, True)) => softmax(x, d)").apply(gm, example_inputs=(x,))


def test_a_float16_nan_kept_by_the_rewrite_still_passes():
    x = _overflowing_half()
    gm = torch.fx.symbolic_trace(HandSoftmax())
    result = rewrite.parse(RELU_RELU).apply(gm, example_inputs=(x,))
    assert result.counts == {"relu_relu": 1}
    assert result.graph_module(x).isnan().any()


# 3: conjugate bit

class Conj(nn.Module):
    def forward(self, x):
        return torch.conj_physical(x * 2)


def test_an_output_with_the_conjugate_bit_set_is_caught():
    x = torch.randn(4, dtype=torch.complex64)
    gm = _export(Conj(), x)
    with pytest.raises(EquivalenceError):
        rewrite.parse("rule r: aten.conj_physical(x) => aten.conj(x)").apply(gm, example_inputs=(x,))


# 4: the change reference of a selected ruleset

class Activations(nn.Module):
    def forward(self, x):
        return F.gelu(x), F.silu(x), torch.relu(torch.relu(x))


CHANGES = """
rule gelu_tanh(change=True): gelu(x) => gelu(x, approximate="tanh")
rule silu_hard(change=True): silu(x) => hardswish(x)
rule relu_relu: relu(relu(_) as r) => r
rule fast_silu: silu(x) => hardswish(x)
ruleset gelu_only = fixpoint(gelu_tanh, relu_relu)
ruleset fast = fixpoint(gelu_tanh, fast_silu)
"""


def test_an_unscheduled_change_rule_is_not_in_the_reference():
    x = torch.randn(8, 8)
    gm = torch.fx.symbolic_trace(Activations())
    result = rewrite.parse(CHANGES)["gelu_only"].apply(gm, example_inputs=(x,))
    assert result.counts == {"gelu_tanh": 1, "relu_relu": 1}
    assert torch.equal(result.graph_module(x)[1], F.silu(x))


def test_a_wrong_rule_is_not_excused_by_an_unscheduled_change_rule():
    x = torch.randn(8, 8)
    gm = torch.fx.symbolic_trace(Activations())
    with pytest.raises(EquivalenceError):
        rewrite.parse(CHANGES)["fast"].apply(gm, example_inputs=(x,))


# 5: dataclass outputs

@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    probs: torch.Tensor


class ReturnsDataclass(nn.Module):
    def forward(self, x):
        return Out(torch.relu(torch.relu(x)), torch.sigmoid(x))


def test_a_dataclass_output_with_a_correct_rule_passes():
    x = torch.randn(4, 4)
    gm = torch.fx.symbolic_trace(ReturnsDataclass())
    result = rewrite.parse(RELU_RELU).apply(gm, example_inputs=(x,))
    assert result.counts == {"relu_relu": 1}
    out = result.graph_module(x)
    assert isinstance(out, Out)
    assert torch.equal(out.hidden, torch.relu(x))


def test_a_dataclass_output_with_a_wrong_rule_is_caught():
    x = torch.randn(4, 4)
    gm = torch.fx.symbolic_trace(ReturnsDataclass())
    with pytest.raises(EquivalenceError):
        rewrite.parse("rule r: sigmoid(x) => tanh(x)").apply(gm, example_inputs=(x,))


# 7: a view of a plain tensor attribute

class ViewsConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = torch.randn(4, 4)  # a plain attribute: export lifts it as a constant

    def forward(self, x):
        return torch.relu(torch.relu(x)), self.c.t()


def test_an_output_no_longer_a_view_of_a_plain_tensor_attribute_is_caught():
    x = torch.randn(4)
    gm = _export(ViewsConstant(), x)
    try:  # refused where it would fire (``lost_aliasing``), or caught by the check
        result = rewrite.parse("rule w: t(x) => permute(clone(x), [1, 0])").apply(gm, example_inputs=(x,))
    except EquivalenceError:
        return
    assert "w" not in result.counts, result.counts


def test_an_output_still_a_view_of_a_plain_tensor_attribute_passes():
    x = torch.randn(4)
    gm = _export(ViewsConstant(), x)
    result = rewrite.parse(RELU_RELU).apply(gm, example_inputs=(x,))
    assert result.counts == {"relu_relu": 1}
    out = result.graph_module(x)[1]
    assert out.untyped_storage().data_ptr() == result.graph_module.c.untyped_storage().data_ptr()


# 8: a plain tensor attribute written in place

class Counts(nn.Module):
    def __init__(self):
        super().__init__()
        self.count = torch.zeros(())  # not a buffer

    def forward(self, x):
        self.count.add_(x.abs().sum())
        return torch.relu(torch.relu(x))


def test_a_checked_apply_leaves_a_written_plain_attribute_as_it_was():
    x = torch.randn(4)
    model = Counts()
    gm = _export(model, x)
    result = rewrite.parse(RELU_RELU).apply(gm, example_inputs=(x,))
    assert result.counts == {"relu_relu": 1}
    assert gm.count.item() == 0.0
    assert model.count.item() == 0.0
    assert result.graph_module.count.item() == 0.0


def test_a_wrong_write_to_a_plain_attribute_is_caught():
    x = torch.randn(4)
    gm = _export(Counts(), x)
    with pytest.raises(EquivalenceError):
        rewrite.parse("rule wrong: abs(x) => neg(x)").apply(gm, example_inputs=(x,))


# 9: the int8 step only for outputs computed from a quantized value

class QuantAndFloat(nn.Module):
    def forward(self, x, y):
        q = torch.quantize_per_tensor(x, 0.5, 0, torch.qint8).dequantize()
        return q * 2, torch.sigmoid(y) * 0.1


def test_a_float_output_no_quantize_reaches_gets_no_int8_step():
    x, y = torch.randn(8, 8) * 10, torch.randn(8, 8)
    gm = _export(QuantAndFloat(), x, y)
    with pytest.raises(EquivalenceError):
        rewrite.parse('rule wrong(tolerance="approx"): sigmoid(x) => tanh(x)').apply(gm, example_inputs=(x, y))


# 10: a higher precision earns no integer allowance

class Positive(nn.Module):
    def forward(self, y):
        return torch.gt(y, 0)


def _gt_in_float64(threshold):
    return rewrite.parse(
        'rule r(tolerance="approx"): aten.gt.Scalar(x, 0) where dtype(x) == torch.float32 '
        f"=> torch.gt(to(x, torch.float64), {threshold})")


def test_a_float64_rewrite_that_flips_bools_is_caught():
    y = torch.randn(400)
    gm = _export(Positive(), y)
    with pytest.raises(EquivalenceError):
        _gt_in_float64(0.05).apply(gm, example_inputs=(y,))


def test_an_exact_float64_rewrite_in_a_float32_model_passes():
    y = torch.randn(400)
    gm = _export(Positive(), y)
    result = _gt_in_float64(0).apply(gm, example_inputs=(y,))
    assert result.counts == {"r": 1}
    assert torch.equal(result.graph_module(y), y > 0)


# 11: another layout

class Relu(nn.Module):
    def forward(self, x):
        return torch.relu(x * 2.0)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no mkldnn in this torch")
def test_an_output_in_another_layout_is_a_mismatch_not_a_crash():
    # The check compared layouts (an mkldnn output was a mismatch, not a crash); a
    # replacement can no longer build to_mkldnn at all (E106, probe AN F4), and one
    # whose facts show another layout than its root's is refused when made (_unlike).
    with pytest.raises(rewrite.RuleError, match="E106"):
        rewrite.parse("rule r: relu(x) => aten.to_mkldnn(relu(x))\nruleset main = once(r)")
    x = torch.randn(4, 4)
    mkldnn = x.to_mkldnn()
    report = check_equivalence(lambda t: t.relu(), lambda t: t.relu().to_mkldnn(), (x,))
    assert not report.ok and mkldnn.layout != x.layout


# 12: uninitialized memory

class ZerosPlus(nn.Module):
    def forward(self, x):
        return torch.zeros_like(x) + x * 2


def test_a_rewrite_reading_uninitialized_memory_is_refused_at_load():
    # Above glibc's largest mmap threshold (32 MiB) empty_like got fresh, zeroed
    # pages, so the wrong rewrite computed the right values in the check (which now
    # fills uninitialized memory). A replacement can no longer build empty_like at
    # all (E106): it hands the model uninitialized memory.
    with pytest.raises(rewrite.RuleError, match="E106"):
        rewrite.parse("rule wrong: aten.zeros_like.default(x, ...) => aten.empty_like.default(x)")


# 13: a lost gradient is not a fold because a written buffer was copied

class StepCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps.add_(1)
        return x + self.w * 0 + self.steps


def test_dropping_a_parameter_is_caught_when_the_forward_writes_a_buffer():
    x = torch.randn(4)
    gm = _export(StepCounter(), x)
    assert gm(x).requires_grad
    with pytest.raises(EquivalenceError):
        rewrite.parse("rule drop: add(x, mul(_, 0)) where is_float(x) => mul(x, 1.0)").apply(gm, example_inputs=(x,))
