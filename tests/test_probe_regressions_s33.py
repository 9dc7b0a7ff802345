"""Regressions from session 33's probe of what leaves the library and how a graph is
seen (probe R): the HTML viewer's template, dynamo captures for measuring, and
onnxruntime's inputs."""

import json
import re
import warnings

import pytest
import torch
from torch import nn

from rewrite.analysis import analyze
from rewrite.analysis.show import render
from rewrite.capture import GraphBreakError, capture_with_inputs


class _Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({"__SVG__": nn.Linear(4, 4), "__DATA__": nn.Linear(4, 4)})

    def forward(self, x):
        return self.blocks["__DATA__"](self.blocks["__SVG__"](x).relu())


@pytest.mark.parametrize("name", ["graph.html", "my__DATA__.html", "my__SVG__.html"])
def test_a_placeholder_in_a_name_or_title_is_not_expanded(tmp_path, name):
    gm = torch.fx.symbolic_trace(_Named())
    page = render(gm, tmp_path / name, (torch.randn(2, 4),)).read_text()
    blob = re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S).group(1)
    data = json.loads(blob)  # the viewer's JSON.parse would fail on an SVG pasted into it
    assert any("__SVG__" in json.dumps(n) for n in data["nodes"])  # the name itself, kept as it is
    assert page.count("<svg") == 1
    title = re.search(r"<title>(.*?)</title>", page, re.S).group(1)
    assert title == name[:-len(".html")]


class _Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h).sum()


def test_a_dynamo_capture_split_by_a_graph_break_is_refused_not_measured_in_part():
    with pytest.raises(GraphBreakError, match="2 graphs at graph breaks"):
        capture_with_inputs(_Breaks(), (torch.randn(2, 8),), "dynamo")


def test_a_dynamo_capture_of_a_transformer_layer_counts_its_flops():
    """The fused fast path (eval, no_grad) would put one opaque kernel in the graph,
    counted as 0 FLOPs; the capture runs without it, as the export capture does."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    flops = {}
    for level in ("export", "dynamo"):
        gm, inputs = capture_with_inputs(layer, (x,), level)
        assert not any("_transformer_encoder_layer_fwd" in str(n.target) for n in gm.graph.nodes)
        flops[level] = analyze(gm, inputs).totals.flops
    assert flops["dynamo"] == flops["export"] > 0
    assert torch.backends.mha.get_fastpath_enabled()  # put back


def test_run_onnx_compares_what_it_was_given_with_the_model_inputs(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from rewrite.quant import QuantizationError, run_onnx

    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU()).eval()
    path = tmp_path / "m.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, 4),), str(path), dynamo=True, verbose=False)
    x = torch.randn(2, 4)
    (out,) = run_onnx(path, (x,))
    assert torch.allclose(out, model(x), atol=1e-5)
    cases = [((torch.randn(3, 4),), r"takes shape \[2, 4\], given \[3, 4\]"),
             ((torch.randn(2, 4, dtype=torch.float64),), r"takes tensor\(float\), given float64"),
             ((), r"takes 1 input\(s\) \(.*\); 0 were given"),
             ((x, torch.randn(5)), r"takes 1 input\(s\) \(.*\); 2 were given")]
    for inputs, message in cases:
        with pytest.raises(QuantizationError, match=message):
            run_onnx(path, inputs)


def test_verify_writes_nothing_into_the_working_directory(tmp_path, monkeypatch):
    """Hypothesis keeps a cache of constants even without a database (probe P F01)."""
    import hypothesis.configuration as configuration

    import rewrite

    monkeypatch.chdir(tmp_path)
    before = getattr(configuration, "__hypothesis_home_directory", None)
    assert rewrite.parse("rule mul_one: mul(x, 1) where is_float(x) => x\n").verify(max_examples=3).ok
    assert list(tmp_path.iterdir()) == []
    assert getattr(configuration, "__hypothesis_home_directory", None) == before


def test_a_dynamo_capture_leaves_the_callers_model_and_random_stream_as_they_were():
    """The recording run is the caller's own model (probe P F09)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)).train()
    x = torch.randn(3, 4)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    gm, inputs = capture_with_inputs(model, (x,), "dynamo")
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert any(n.op == "call_function" and "batch_norm" in str(n.target) for n in gm.graph.nodes)


class _ConvThenReshape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(4, 16, 2, stride=2)  # (1, 4, 8, 8) -> (1, 16, 4, 4): the same numel
        self.l = nn.Linear(8, 32)

    def forward(self, x):
        return self.l(self.c(x).reshape(1, 4, 8, 8))  # a no-op only were the conv shape-preserving


def _facts_that_lie(gm, inputs):
    wrong = []

    class Run(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor) and val.shape != out.shape:
                wrong.append(f"{n.name}: recorded {tuple(val.shape)}, runs as {tuple(out.shape)}")
            return out

    with torch.no_grad():
        Run(gm).run(*inputs)
    return wrong


def test_a_module_a_rule_inserts_gets_its_own_output_shape_not_its_inputs():
    """QAT's conv and linear modules took their input's shape facts, so cleanup's
    reshape_noop removed a reshape the model needs (probe Q F01)."""
    import rewrite
    import rewrite.qat as rqat

    torch.manual_seed(0)
    x = torch.randn(1, 4, 8, 8)
    qm = rqat.prepare_qat(_ConvThenReshape().eval(), (x,), capture="export",
                          calibration=[(torch.randn(1, 4, 8, 8),) for _ in range(2)])
    assert any(n.op == "call_module" and "qat_conv" in str(n.target) for n in qm.graph.nodes)
    assert _facts_that_lie(qm, (x,)) == []
    int8 = rqat.convert(qm.eval())
    assert _facts_that_lie(int8, (x,)) == []
    cleanup = rewrite.load(rewrite.rules_dir() / "cleanup.rw")
    result = cleanup.apply(int8, (x,), check=False)
    assert "reshape_noop" not in result.counts
    assert torch.equal(result.graph_module(x), int8(x))


class _OptionalMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c, self.b = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x, mask=None):
        y = self.b(self.c(x))
        if mask is not None:  # fx traces mask as a Proxy: the branch is taken
            y = y * mask
        return y


@pytest.mark.parametrize("rules", ["cleanup.rw", "fusion.rw"])
def test_apply_refuses_its_own_trace_when_it_is_not_the_model(rules):
    """Nothing fired (cleanup) used to return a graph that crashes on the caller's
    inputs; a rule firing (fusion) used to be blamed for the capture (probe Q F02)."""
    import rewrite

    model = _OptionalMask().eval()
    x = torch.randn(1, 3, 6, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(rewrite.CaptureError, match=r"symbolic_trace's graph .* torch\.export\.export"):
            rewrite.load(rewrite.rules_dir() / rules).apply(model, example_inputs=(x,))
        exported = torch.export.export(model, (x,)).module()  # the advice works
        result = rewrite.load(rewrite.rules_dir() / "fusion.rw").apply(exported, example_inputs=(x,))
    assert result.counts.get("conv_bn") == 1
    assert torch.allclose(result.graph_module(x), model(x), atol=1e-5)


def test_the_quantization_flow_refuses_a_trace_that_is_not_the_model():
    import rewrite
    import rewrite.quant as rq

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(rewrite.CaptureError):
            rq.quantize(_OptionalMask().eval(), [(torch.randn(1, 3, 6, 6),)])


def test_a_module_whose_trace_is_right_is_still_rewritten_when_nothing_fires():
    import rewrite

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    x = torch.randn(2, 4)
    result = rewrite.load(rewrite.rules_dir() / "cleanup.rw").apply(model, example_inputs=(x,))
    assert result.counts == {}
    assert torch.equal(result.graph_module(x), model(x))


@pytest.mark.parametrize("path", ["x\0.rw", "\ud800.rw"])
def test_a_path_no_file_can_have_is_an_E402_not_a_python_error(path):
    """probe O F11: a NUL byte or a lone surrogate in a path raised ValueError /
    UnicodeEncodeError from deep inside; the name is shown escaped."""
    import rewrite

    with pytest.raises(rewrite.RuleError, match=r"not a usable path .*\[E402\]") as info:
        rewrite.load(path)
    assert "\0" not in str(info.value) and "\ud800" not in str(info.value)
