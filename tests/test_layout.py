"""Outputs keep their memory layout (``rewrite.engine.layout``), and the check
compares it: a caller's ``out.view(-1)`` or ``out.is_contiguous()`` sees it."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import rewrite
from rewrite.trust.check import check_equivalence
from tests.fx_helpers import Fn


class _ConvHead(nn.Module):
    """A network whose output is a convolution's (a segmentation head)."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        return self.c2(torch.relu(self.c1(x)))


def _capture(model, x, level):
    return fx.symbolic_trace(model) if level == "fx" else torch.export.export(model, (x,), strict=False).module()


def test_the_check_reports_an_output_that_is_no_longer_contiguous():
    x = (torch.randn(4, 3),)
    report = check_equivalence(lambda t: (t + 1).t().contiguous(), lambda t: (t + 1).t(), x)
    assert not report.ok and "memory layout changed: contiguous" in str(report)
    # an original output with other strides keeps them (out.t().view(-1) would tell)
    report = check_equivalence(lambda t: (t + 1).t(), lambda t: (t + 1).t().contiguous(), x)
    assert not report.ok and "strides changed" in str(report)
    # strides of dimensions of size 1 address nothing: not compared
    assert check_equivalence(lambda t: (t + 1)[:1].t(), lambda t: (t + 1)[:1].t().contiguous(), x).ok
    report = check_equivalence(lambda t: torch.randn(1, 3, 4, 4).contiguous(memory_format=torch.channels_last) + t,
                               lambda t: torch.randn(1, 3, 4, 4) + t, (torch.zeros(1, 3, 4, 4),))
    assert not report.ok and "channels_last" in str(report)


@pytest.mark.parametrize("file", ["amp_bf16.rw", "amp_fp16.rw"])
@pytest.mark.parametrize("level", ["fx", "export"])
def test_amp_returns_a_convolution_output_in_the_layout_eager_does(file, level):
    # the AMP files store convolution weights channels_last: the last convolution's
    # output is channels_last until it is copied back for the caller
    model, x = _ConvHead().eval(), torch.randn(1, 3, 16, 16)
    result = rewrite.load(file).apply(_capture(model, x, level), (x,))
    out = result.graph_module(x)
    assert result.counts["to_roundtrip"] >= 1 and result.equivalence.ok
    assert out.is_contiguous() and out.view(-1).numel() == out.numel()


@pytest.mark.parametrize("level", ["fx", "export"])
def test_removing_the_copy_that_made_an_output_contiguous_is_repaired_or_refused(level):
    model, x = Fn(lambda t: (t + 1).t().contiguous()), torch.randn(4, 3)
    rules = rewrite.parse("rule drop: Tensor.contiguous(x) => x\nrule drop_aten: aten.clone.default(x, ...) => x\n")
    try:
        result = rules.apply(_capture(model, x, level), (x,))
    except rewrite.EquivalenceError as err:  # refused: the check saw the layout change
        assert "memory layout changed" in str(err)
        return
    out = result.graph_module(x)
    assert out.is_contiguous() and torch.equal(out, model(x))


def test_an_unchanged_layout_adds_no_copy():
    model, x = Fn(lambda t: torch.tanh(t) * 1.0), torch.randn(4, 3)
    gm = fx.symbolic_trace(model)
    result = rewrite.load("cleanup.rw").apply(gm, (x,))
    assert result.counts == {"mul_one": 1}
    assert len(result.graph_module.graph.nodes) == len(gm.graph.nodes) - 1
    assert "contiguous" not in result.graph_module.code


class ConvBnRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.nn.functional.relu(self.bn(self.conv(x)))


@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_amp_under_torch_compile_with_dynamic_shapes_keeps_the_output_layout(low):
    # dynamo's symbolic sizes: new nodes' facts come from its fake mode (meta tensors
    # cannot hold them), and a kept output computed from a conv with channels_last
    # weights is copied back into the model's layout
    torch.manual_seed(0)
    model, x = ConvBnRelu().eval(), torch.randn(2, 3, 6, 6)
    results = []
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=rewrite.backend(rewrite.load(f"rules/amp_{low}.rw"),
                                                                  on_result=results.append), dynamic=True)
        for batch in (2, 3):
            x = torch.randn(batch, 3, 6, 6)
            out = compiled(x)
            assert out.is_contiguous() and out.shape == model(x).shape
            torch.testing.assert_close(out, model(x), atol=0.1, rtol=0.05)
    finally:
        torch._dynamo.reset()
    assert results and all(sum(r.counts.values()) > 0 for r in results)


class _SwappedResidual(nn.Module):
    """``a + b`` of a contiguous ``a`` and a channels_last ``b``: eager lays the sum out
    as ``a``, its first operand; ``b + a`` would be channels_last."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        a = self.c1(x)
        b = self.c2(x).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2) * 2.0
        return self.c3(a + b) + 1.0


@pytest.mark.parametrize("level", ["fx", "export"])
def test_a_commutative_match_keeps_the_operand_order_that_lays_the_result_out(level):
    # observe.rw's observe_add_input matches add(x, y) with x bound to b (a is observed
    # already): the new add keeps a first, so the sum stays contiguous and the view
    # downstream still works
    import rewrite.quant as rq

    class ViewAfterSum(_SwappedResidual):
        def forward(self, x):
            a = self.c1(x)
            b = self.c2(x).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2) * 2.0
            t = torch.relu(a + b)
            return t.view(t.shape[0], -1)

    torch.manual_seed(0)
    for model in (_SwappedResidual().eval(), ViewAfterSum().eval()):
        x = torch.randn(1, 4, 3, 3)
        observed = rq.prepare(model, (x,), capture=level)  # its default check compares strides
        assert observed.meta["rewrite.quant"]["observe_counts"].get("observe_add_input") == 1
        assert observed(x).stride() == model(x).stride()
        unchecked = rewrite.load("rules/quant/observe.rw")["main"].apply(_capture(model, x, level), (x,), check=False)
        torch.testing.assert_close(unchecked.graph_module(x), model(x))
        assert unchecked.graph_module(x).stride() == model(x).stride()


@pytest.mark.parametrize("level", ["fx", "export"])
def test_an_output_read_through_an_earlier_insertion_keeps_its_layout(level):
    # the observer goes on the sum first; then the sum is respelled as a subtraction
    # laid out as its channels_last first operand: channels_last from there on, through
    # the earlier observer and a conv (whose CPU kernel follows its input's layout, as
    # the meta kernel does not), so the output is copied back to contiguous
    rules = rewrite.parse("""
rule watch_sum(priority=2): add(_, _) as s where not observed(s) => activation_observer(s)
rule respell(priority=1): add(x, y) where same_shape(x, y) and not is_contiguous(x) => sub(x, neg(y))
""")
    torch.manual_seed(0)
    model, x = _SwappedResidual().eval(), torch.randn(1, 4, 3, 3)
    gm = _capture(model, x, level)
    for check in (True, False):
        result = rules.apply(gm, (x,), check=check)
        assert result.counts == {"watch_sum": 2, "respell": 1}
        assert result.graph_module(x).is_contiguous()
        torch.testing.assert_close(result.graph_module(x), model(x))
