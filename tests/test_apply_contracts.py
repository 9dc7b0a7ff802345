"""What ``apply`` leaves of the caller's module: an in-place rollback puts back
every node's readers in their order, no submodule the graph never used is deleted,
and the check runs under ``torch.inference_mode``."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rewrite
from rewrite.ruleset import EquivalenceError


class ConvBn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class SharedReaders(nn.Module):
    """``h`` is read by the add a rule rewires and by the tanh a wrong rule drops."""

    def forward(self, x):
        a = torch.cos(x)
        h = torch.sin(x)
        return (a * 1.0 + h) + torch.tanh(h)


WRONG = """
rule mul_one: mul(x, 1) where is_float(x) => x
rule drop_tanh: tanh(x) => x
"""


def _readers(gm):
    return {n.name: [u.name for u in n.users] for n in gm.graph.nodes}


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("on_mismatch", ["raise", "skip-rule"])
def test_rollback_puts_readers_back_in_order(capture, on_mismatch):
    x = torch.randn(4, 5)
    model = SharedReaders()
    gm = torch.fx.symbolic_trace(model) if capture == "fx" else torch.export.export(model, (x,)).module()
    readers, code = _readers(gm), gm.code
    rules = rewrite.parse(WRONG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if on_mismatch == "raise":
            with pytest.raises(EquivalenceError):
                rules.apply(gm, example_inputs=(x,), inplace=True)
            assert _readers(gm) == readers
            assert gm.code == code
        else:
            result = rules.apply(gm, example_inputs=(x,), inplace=True, on_mismatch="skip-rule")
            assert result.rejected and result.counts.get("mul_one") == 1
            copy = rules.apply(SharedReaders() if capture == "fx" else torch.export.export(model, (x,)).module(),
                               example_inputs=(x,), on_mismatch="skip-rule")
            assert result.graph_module.code == copy.graph_module.code
            torch.testing.assert_close(result.graph_module(x), model(x))


@pytest.mark.parametrize("inplace", [False, True])
def test_a_submodule_the_graph_never_calls_stays(inplace):
    x = torch.randn(1, 3, 8, 8)
    model = ConvBn().eval()
    gm = torch.fx.symbolic_trace(model)
    gm.aux_head = nn.Linear(8, 2)  # used by the caller's own code, not by the graph
    result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=(x,), inplace=inplace)
    assert result.counts == {"conv_bn": 1}
    out = result.graph_module
    assert isinstance(out.aux_head, nn.Linear) and isinstance(gm.aux_head, nn.Linear)
    assert {"aux_head.weight", "aux_head.bias"} <= set(out.state_dict())
    assert not hasattr(out, "bn")  # what the rewrite left unreferenced is gone
    torch.testing.assert_close(out(x), model(x), rtol=1e-4, atol=1e-5)


def test_containers_a_fold_emptied_are_deleted():
    # export reads weights by get_attr through plain container modules
    x = torch.randn(1, 3, 8, 8)
    model = nn.Sequential(ConvBn()).eval()
    gm = torch.export.export(model, (x,)).module()
    result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=(x,))
    assert result.counts == {"conv_bn": 1}
    names = {name for name, _ in result.graph_module.named_modules()}
    assert "0.conv" not in names  # its weights were folded into new ones; the container went with them
    for name, module in result.graph_module.named_modules():
        if name and type(module) is nn.Module:  # every container left holds something
            assert list(module.parameters()) or list(module.buffers()) or list(module.children()), name
    torch.testing.assert_close(result.graph_module(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("inplace", [False, True])
def test_apply_under_inference_mode(inplace):
    x = torch.randn(1, 3, 8, 8)
    model = ConvBn().eval()
    with torch.inference_mode():
        gm = torch.fx.symbolic_trace(model)
        result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=(x,), inplace=inplace)
    assert result.counts == {"conv_bn": 1}
    assert result.equivalence is not None and result.equivalence.ok
    # the folded weight is a plain tensor: the result trains like any module
    assert not any(p.is_inference() for p in result.graph_module.parameters())
    y = result.graph_module(torch.randn(1, 3, 8, 8, requires_grad=True))
    y.sum().backward()
    torch.testing.assert_close(result.graph_module(x), model(x), rtol=1e-4, atol=1e-5)
