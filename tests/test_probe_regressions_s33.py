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


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_qat_layers_get_their_shape_facts_and_lower_to_int8_at_each_capture(capture):
    """A QAT layer's forward cannot run on fake tensors (its weight fake quantizer is
    data-dependent): its facts come from ``facts_forward``; without them the export
    capture's layers stayed float (probe S F07)."""
    import rewrite.qat as rqat
    import rewrite.quant as rq

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    x = torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qat = rqat.prepare_qat(model.train(), (x,), capture=capture)
        if capture == "export":
            layers = [n for n in qat.graph.nodes if n.op == "call_module" and n.target.startswith("qat_")]
            assert layers and all(tuple(n.meta["val"].shape) != tuple(n.args[0].meta["val"].shape) for n in layers)
        int8 = rqat.convert(qat.eval())
    assert rq.coverage(int8).count() == (2, 2)
    assert _facts_that_lie(int8, (x,)) == []


# ---------------------------------------------------------------- probe S: the gradient trial


_ROUND_TRIP = """
rule relu_roundtrip: relu(x) => Tensor.view(Tensor.view(relu(x), torch.int32), torch.float32)
ruleset main = once(relu_roundtrip)
"""


class _TwoPaths(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x, y):
        return self.l(y) + torch.relu(x)


class _WritesY(_TwoPaths):
    def forward(self, x, y):
        y.mul_(2.0)
        return self.l(y) + torch.relu(x)


@pytest.mark.parametrize("model, inplace", [(_TwoPaths, False), (_TwoPaths, True), (_WritesY, False)])
def test_a_path_cut_from_one_input_is_refused_while_the_output_still_requires_grad(model, inplace):
    """In place, and where the model writes an input, the loss was let through
    (probe S F01, F06): whether the path carried anything is told by the rewrite's
    own output moving with the input, which needs neither the original nor a backward."""
    import rewrite

    torch.manual_seed(0)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    gm = torch.export.export(model(), (x.clone(), y.clone())).module()
    with pytest.raises(rewrite.EquivalenceError, match="gradients reach input 0 through this output in the original"):
        rewrite.parse(_ROUND_TRIP)["main"].apply(gm, (x, y), inplace=inplace)


class _PickTwo(nn.Module):
    def forward(self, a, b):
        return torch.stack([a, b], 0).select(0, 0) * 2.0, b * 3.0


@pytest.mark.parametrize("inplace", [False, True])
def test_dropping_a_path_that_carried_zeros_passes_though_the_input_feeds_another_output(inplace):
    """b reaches output 0 only through the unused half of a stack (zero gradient);
    b's gradient through output 1 is not output 0's (probe S F02)."""
    import rewrite

    pick = rewrite.parse("rule pick_first: select(stack([a, _], 0), 0, 0) => a\n")
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    result = pick.apply(torch.fx.symbolic_trace(_PickTwo()), (a, b), inplace=inplace)
    assert result.counts == {"pick_first": 1}
    assert all(torch.equal(p, q) for p, q in zip(result.graph_module(a, b), _PickTwo()(a, b)))
    assert pick.verify(max_examples=10, seed=0).ok  # verify agrees (probe S F03)


def test_a_models_own_generator_is_put_back_between_the_checks_runs():
    """probe S F04: the capture confirmation ran the eager model, then the graph, from
    different states of the module's private generator."""
    import rewrite

    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l, self.g = nn.Linear(4, 4), torch.Generator().manual_seed(0)

        def forward(self, x):
            return self.l(x) + 0.1 * torch.randn(x.shape, generator=self.g)

    model, x = Noisy(), torch.randn(3, 4)
    state = model.g.get_state()
    result = rewrite.load(rewrite.rules_dir() / "cleanup.rw").apply(model, (x,))
    assert result.counts == {}
    assert torch.equal(model.g.get_state(), state)


def test_a_forward_that_replaces_a_buffer_is_not_traced():
    """``self.n = self.n + 1`` runs once at trace time and freezes into the graph
    (probe S F05): refused as an in-place write is."""
    import rewrite

    class Reassign(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 4)
            self.register_buffer("n", torch.zeros(()))

        def forward(self, x):
            self.n = self.n + 1
            return self.l(x) * self.n

    model = Reassign()
    n = model.n
    with pytest.raises(TypeError, match=r"replaces 'n'.*torch\.export"):
        rewrite.load(rewrite.rules_dir() / "cleanup.rw").apply(model, (torch.randn(3, 4),))
    assert model.n is n and float(n) == 0.0


@pytest.mark.parametrize("recursion_limit", [1000, 2000])
def test_a_chain_of_families_loads_whatever_the_recursion_limit(recursion_limit):
    """probe O F09 (no file:line:col for a deep chain); session 43: the chain was an
    E001 or loaded depending on the process's recursion limit (Inductor raises it to
    2000), so a test after an Inductor compile saw it load. Families expand with an
    explicit stack now: declared in either order, a chain of 1000 loads."""
    import sys

    import rewrite

    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(recursion_limit)
    try:
        for order in (range(999, 0, -1), range(1, 1000)):
            text = "".join(f"family f{i} = f{i - 1} | relu\n" for i in order) + "family f0 = relu\n"
            rules = rewrite.parse(text + "rule r: f999(x) => x\n", "chain.rw")
            assert "r" in rules.rules
    finally:
        sys.setrecursionlimit(previous)


def test_imports_nested_too_deep_are_an_E402_at_the_import(tmp_path):
    import rewrite
    from rewrite.language.program import MAX_IMPORT_DEPTH

    n = MAX_IMPORT_DEPTH + 5
    for i in range(n):
        (tmp_path / f"a{i}.rw").write_text((f'import "a{i + 1}.rw"\n' if i + 1 < n else "")
                                           + f"rule r{i}: mul(x, {i}) => x\n")
    with pytest.raises(rewrite.RuleError, match=rf"a{MAX_IMPORT_DEPTH - 1}\.rw:1:1: error: cannot import .*"
                                                rf"imports nested more than {MAX_IMPORT_DEPTH} levels deep"):
        rewrite.load(str(tmp_path / "a0.rw"))
    (tmp_path / "a20.rw").write_text("rule r20: mul(x, 20) => x\n")  # a chain within the limit loads
    assert len(rewrite.load(str(tmp_path / "a0.rw")).rules) == 21
