"""Rule sets with Inductor: ``rewrite.backend(rules, compiler="inductor")`` (rules,
then Inductor's kernels) and ``rewrite.inductor_pass(rules)`` (rules as an Inductor
custom pass on its post-grad ATen graph). Inductor compiles are slow on CPU: the
models are tiny and every test compiles once or twice.

What Inductor compiled is read from its own post-grad graph, by a recorder installed
as ``post_grad_custom_post_pass``; the FX graph cache is off so every compile runs
the passes."""

import copy
import functools

import pytest
import torch
import torch.nn as nn

import rewrite
from rewrite.examples.cnn import resnet_tiny_with_inputs
from rewrite.examples.hf import hf_bert

inductor_config = pytest.importorskip("torch._inductor.config")


@functools.lru_cache(maxsize=None)
def fusion_cleanup():
    return rewrite.load("rules/fusion.rw") + rewrite.load("rules/cleanup.rw")


class Recorder:
    """Records the call_function targets of each graph Inductor lowers."""

    def __init__(self):
        self.graphs = []

    def __call__(self, graph):
        self.graphs.append([n.target for n in graph.nodes if n.op == "call_function"])

    def count(self, op):
        return sum(targets.count(op) for targets in self.graphs)


@pytest.fixture
def recorder():
    torch._dynamo.reset()
    rec = Recorder()
    with inductor_config.patch(post_grad_custom_post_pass=rec, fx_graph_cache=False):
        yield rec
    torch._dynamo.reset()


def _first(out):
    while not isinstance(out, torch.Tensor):
        out = out[0] if isinstance(out, (tuple, list)) else next(iter(out.values()))
    return out


def test_inductor_backend_compiles_the_folded_cnn(recorder):
    model, (x,) = resnet_tiny_with_inputs()
    results = []
    compiled = torch.compile(model, backend=rewrite.backend(fusion_cleanup(), compiler="inductor",
                                                            on_result=results.append))
    with torch.no_grad():
        out = compiled(x)
        expected = model(x)
    assert [r.counts for r in results] == [{"conv_bn": 17}]
    # Inductor compiled the rewritten graph: convolutions, and no batch norm left
    # (freezing is off, so Inductor did not fold them itself)
    assert recorder.count(torch.ops.aten.convolution.default) == 17
    assert not any("batch_norm" in str(t) for targets in recorder.graphs for t in targets)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    # the model is not touched: its BN modules are still there and used eagerly
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 17


def test_inductor_backend_on_a_transformer(recorder):
    model, (ids,) = hf_bert()
    results = []
    compiled = torch.compile(model, backend=rewrite.backend(fusion_cleanup(), compiler="inductor",
                                                            on_result=results.append))
    with torch.no_grad():
        out = _first(compiled(ids))
        expected = _first(model(ids))
    counts = {}
    for r in results:
        for name, n in r.counts.items():
            counts[name] = counts.get(name, 0) + n
    assert counts.get("dropout_eval", 0) > 0, counts
    assert recorder.graphs, "Inductor compiled the rewritten graphs"
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


class SiluByHand(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return torch.relu(torch.relu(y * torch.sigmoid(y)))


RELU_RELU = rewrite.parse("""
# relu(relu(x)) == relu(x)
rule relu_relu: relu(relu(x)) => relu(x)
""")


def test_inductor_pass_rewrites_the_post_grad_graph(recorder):
    model, x = SiluByHand().eval(), torch.randn(4, 8)
    results = []
    hook = rewrite.inductor_pass(RELU_RELU, on_result=results.append)
    with inductor_config.patch(post_grad_custom_pre_pass=hook), torch.no_grad():
        out = torch.compile(model)(x)
        expected = model(x)
    assert [r.counts for r in results] == [{"relu_relu": 1}]
    assert recorder.count(torch.ops.aten.relu.default) == 1, recorder.graphs
    torch.testing.assert_close(out, expected)


def test_inductor_pass_decomposes_ops_inductor_only_decomposes(recorder):
    # silu_from_sigmoid emits aten.silu, which Inductor decomposes and never lowers:
    # the pass replaces it by Inductor's own decomposition
    model, x = SiluByHand().eval(), torch.randn(4, 8)
    results = []
    hook = rewrite.inductor_pass(rewrite.load("rules/fusion.rw"), on_result=results.append)
    with inductor_config.patch(post_grad_custom_pre_pass=hook), torch.no_grad():
        out = torch.compile(model)(x)
        expected = model(x)
    assert [r.counts for r in results] == [{"silu_from_sigmoid": 1}]
    assert recorder.count(torch.ops.aten.sigmoid.default) == 0
    assert recorder.count(torch.ops.aten.silu.default) == 0
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_inductor_pass_uuid_follows_the_rules():
    a = rewrite.inductor_pass(RELU_RELU)
    assert a.uuid() == rewrite.inductor_pass(copy.copy(RELU_RELU)).uuid()
    other = rewrite.parse("rule relu_relu: relu(relu(x)) => relu(x)\nrule d: dropout(x, _, training=False) => x\n")
    assert a.uuid() != rewrite.inductor_pass(other).uuid()
    assert a.uuid() != rewrite.inductor_pass(RELU_RELU, check=True).uuid()
    assert isinstance(a, torch._inductor.custom_graph_pass.CustomGraphPass)


def test_freeze_parameters_is_public_and_makes_weights_constants():
    model, (x,) = resnet_tiny_with_inputs()
    seen = []

    def my_backend(gm, example_inputs):
        gm = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        kept, inputs = rewrite.freeze_parameters(gm, list(example_inputs))
        result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=tuple(inputs))
        seen.append((len(example_inputs), kept, result.counts))
        return lambda *args: result.graph_module(*[args[i] for i in kept])

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=my_backend)(x)
        expected = model(x)
    torch._dynamo.reset()
    (n_inputs, kept, counts), = seen
    assert n_inputs > 1 and len(kept) == 1, "only the image is still an input"
    assert counts == {"conv_bn": 17}
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_bad_backend_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match=r"unknown compiler 'tvm'; expected one of \('python', 'inductor'\)"):
        rewrite.backend(RELU_RELU, compiler="tvm")
    gm = torch.fx.symbolic_trace(nn.ReLU())
    with pytest.raises(ValueError, match="2 example inputs for a graph with 1 placeholders"):
        rewrite.freeze_parameters(gm, [torch.ones(1), torch.ones(1)])


def test_backend_takes_a_compiler_callable():
    model, x = SiluByHand().eval(), torch.randn(4, 8)
    compiled_graphs = []

    def compiler(gm, example_inputs):
        compiled_graphs.append(gm)
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=rewrite.backend(RELU_RELU, compiler=compiler))(x)
    torch._dynamo.reset()
    (gm,) = compiled_graphs
    assert sum(1 for n in gm.graph.nodes if n.target is torch.relu) == 1
    torch.testing.assert_close(out, model(x))


def test_readme_example_runs_as_written(tmp_path, monkeypatch, recorder):
    """README "Inductor and torch.export": the code block, on the tiny ResNet."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Inductor and torch.export", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    model, (x,) = resnet_tiny_with_inputs()
    monkeypatch.chdir(tmp_path)
    namespace = {"rewrite": rewrite, "torch": torch, "model": model, "x": x,
                 "gm": torch.fx.symbolic_trace(model)}
    with inductor_config.patch(post_grad_custom_pre_pass=None), torch.no_grad():
        exec(compile(code, "<README.md: Inductor and torch.export>", "exec"), namespace)  # noqa: S102
        assert isinstance(inductor_config.post_grad_custom_pre_pass, torch._inductor.custom_graph_pass.CustomGraphPass)
        out = namespace["fast"](x)
        loaded = torch.export.load(tmp_path / "model.pt2").module()(x)
        expected = model(x)
    assert namespace["result"].counts == {"conv_bn": 17}
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(loaded, expected, rtol=1e-4, atol=1e-4)


def test_the_backend_is_for_inference_weights_frozen_no_gradients():
    """README: a folded weight is folded again after an in-place change; no gradient reaches them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    x = torch.randn(2, 3, 8, 8)
    torch._dynamo.reset()
    results = []
    compiled = torch.compile(model, backend=rewrite.backend(rewrite.load("rules/fusion.rw"),
                                                             on_result=results.append))
    out = compiled(x)
    assert [r.counts for r in results] == [{"conv_bn": 1}]
    assert any(p.requires_grad for p in model.parameters()) and not out.requires_grad
    with torch.no_grad():
        model[1].weight.mul_(2.0)
    # a weight written in place since the compile (its version counter): folded again
    assert not torch.allclose(model(x), out)
    torch.testing.assert_close(compiled(x), model(x))
    assert [r.counts for r in results] == [{"conv_bn": 1}, {"conv_bn": 1}]
    torch._dynamo.reset()
