"""Leaf modules that hide ops a rule set rewrites are reported (issue: 1 of 8 linears
quantized inside an fx-captured nn.TransformerEncoder, without a word)."""

import warnings

import pytest
import torch
from torch import fx, nn

import rewrite
from rewrite.engine.leaves import LeafModuleWarning, hidden_ops

LINEAR_RULES = "rule unbiased: linear(x, w, b) where is_none(b) => linear(x, w)"
RELU_RULES = "rule relu_relu: relu(relu(x)) => relu(x)"


class EncoderWithHead(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.encoder(x))


def _leaf_warnings(rules: str, gm: fx.GraphModule, inputs: tuple) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rewrite.parse(rules).apply(gm, example_inputs=inputs)
    return [str(w.message) for w in caught if issubclass(w.category, LeafModuleWarning)]


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_an_fx_captured_encoder_warns_with_the_hidden_linears_and_the_fix(layers):
    model = EncoderWithHead(layers).eval()
    x = torch.randn(2, 5, 16)
    found = _leaf_warnings(LINEAR_RULES, fx.symbolic_trace(model), (x,))
    assert len(found) == 1
    # each layer: linear1, linear2 and attention's out_proj (a Linear subclass)
    assert f"linear x{3 * layers}" in found[0] and "TransformerEncoder x1" in found[0]
    assert "torch.export" in found[0]
    assert hidden_ops(fx.symbolic_trace(model), {"linear"}) == {"encoder": {"linear": 3 * layers}}


def test_no_warning_after_export_capture_which_sees_inside():
    model = EncoderWithHead().eval()
    x = torch.randn(2, 5, 16)
    gm = torch.export.export(model, (x,), strict=False).module()
    assert _leaf_warnings(LINEAR_RULES, gm, (x,)) == []


@pytest.mark.parametrize("rules", [RELU_RULES, "rule neg_neg: neg(neg(x)) => x"])
def test_no_warning_when_the_rules_do_not_rewrite_what_is_hidden(rules):
    model = EncoderWithHead().eval()
    assert _leaf_warnings(rules, fx.symbolic_trace(model), (torch.randn(2, 5, 16),)) == []


def test_no_warning_for_modules_the_vocabulary_reads():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4))).eval()
    assert _leaf_warnings(LINEAR_RULES, fx.symbolic_trace(model), (torch.randn(2, 8),)) == []


def test_quantize_warns_on_fx_and_quantizes_inside_with_export():
    import rewrite.quant as rq

    model = EncoderWithHead().eval()
    x = torch.randn(2, 5, 16)
    def int8_linears(gm):
        return sum(n.op == "call_module" and type(gm.get_submodule(n.target)).__name__ == "QuantizedLinear"
                   for n in gm.graph.nodes)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fx_int8 = rq.quantize(model, (x,))
    assert any(issubclass(w.category, LeafModuleWarning) and "linear x6" in str(w.message) for w in caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_int8 = rq.quantize(model, (x,), capture="export")
    assert not any(issubclass(w.category, LeafModuleWarning) for w in caught)
    # the head only, versus the head and in-projections, linear1/2 and out_proj of both layers
    assert int8_linears(fx_int8) == 1 and int8_linears(export_int8) >= 7
