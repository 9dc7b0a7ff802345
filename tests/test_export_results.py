"""Every rewritten result leaves the library: results of rules/fusion.rw,
rules/cleanup.rw and the AMP rule sets, on symbolic_trace and torch.export captures
of small real models, are captured again by torch.export, saved as .pt2, loaded and
run; new constants carry meta['val']; a graph torch.export cannot capture fails with
an error naming the node."""

import functools

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

import rewrite
from rewrite.capture import ExportError, capture, export_program, save
from rewrite.examples.cnn import demo_cnn_with_inputs
from rewrite.examples.hf import hf_bert


@functools.lru_cache(maxsize=None)
def rules(name):
    return rewrite.load(*(f"rules/{part}.rw" for part in name.split("+")))


def _first(out):
    while not isinstance(out, torch.Tensor):
        out = out[0] if isinstance(out, (tuple, list)) else next(iter(out.values()))
    return out


def _round_trip(gm, inputs, tmp_path):
    path = save(gm, tmp_path / "result.pt2", level="export", example_inputs=inputs)
    loaded = torch.export.load(path)
    return loaded.module()(*inputs)


# (model factory, capture level, rule set, a rule that must fire)
CASES = [
    (demo_cnn_with_inputs, "fx", "fusion", "conv_bn"),
    (demo_cnn_with_inputs, "export", "fusion", "conv_bn"),
    (demo_cnn_with_inputs, "fx", "amp_bf16", None),
    (demo_cnn_with_inputs, "export", "amp_fp16", None),
    (hf_bert, "export", "fusion+cleanup", None),
    (hf_bert, "export_core", "cleanup", None),
    (hf_bert, "export", "amp_bf16", None),
]


@pytest.mark.parametrize("factory,level,ruleset,fires", CASES,
                         ids=[f"{f.__name__}-{lv}-{rs}" for f, lv, rs, _ in CASES])
def test_rewritten_result_exports_saves_and_loads(factory, level, ruleset, fires, tmp_path):
    model, inputs = factory()
    gm = capture(model, inputs, level)
    result = rules(ruleset).apply(gm, example_inputs=inputs)
    assert result.counts, "the rule set rewrote the graph"
    if fires is not None:
        assert result.counts.get(fires, 0) > 0, result.counts
    expected = _first(result.graph_module(*inputs))
    got = _first(_round_trip(result.graph_module, inputs, tmp_path))
    # the loaded program computes what the rewritten graph does (same kernels)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        eager = _first(model(*inputs))
    low_precision = ruleset.startswith("amp")
    torch.testing.assert_close(got.float(), eager, rtol=5e-2 if low_precision else 1e-4,
                               atol=5e-2 if low_precision else 1e-4)


@pytest.mark.parametrize("ruleset,made_by", [("fusion", "conv_bn_weight"), ("amp_bf16", "cast")])
def test_new_constants_carry_fake_vals_on_export_graphs(ruleset, made_by):
    model, inputs = demo_cnn_with_inputs()
    gm = capture(model, inputs, "export")
    result = rules(ruleset).apply(gm, example_inputs=inputs)
    new = [n for n in result.graph_module.graph.nodes if n.op == "get_attr" and made_by in n.target]
    assert new, f"{ruleset} created constants (named after {made_by})"
    fake_modes = {id(n.meta["val"].fake_mode) for n in result.graph_module.graph.nodes
                  if isinstance(n.meta.get("val"), FakeTensor)}
    assert len(fake_modes) == 1, "new constants live in the graph's own fake mode"
    for node in new:
        real = getattr(result.graph_module, node.target)
        val = node.meta.get("val")
        assert isinstance(val, FakeTensor), node.name
        assert (tuple(val.shape), val.dtype, val.stride()) == (tuple(real.shape), real.dtype, real.stride())


def to_numpy_twice(x):
    """Leaves torch: no FakeTensor (and no torch.export) can follow it."""
    return torch.from_numpy(x.numpy() * 2)


fx.wrap("to_numpy_twice")


class LeavesTorch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4).eval()

    def forward(self, x):
        return to_numpy_twice(self.bn(self.conv(x))) + 1


def test_failed_export_names_the_node_and_writes_nothing(tmp_path):
    model = LeavesTorch().eval()
    x = torch.randn(1, 3, 8, 8)
    result = rules("fusion").apply(fx.symbolic_trace(model), example_inputs=(x,))
    assert result.counts == {"conv_bn": 1}
    with pytest.raises(ExportError, match=r"cannot capture node 'to_numpy_twice' \(call_function to_numpy_twice"
                                          r"\): RuntimeError: .*numpy") as info:
        save(result.graph_module, tmp_path / "out.pt2", level="export", example_inputs=(x,))
    assert info.value.node.name == "to_numpy_twice"
    assert "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == [], "no file, not even a partial one"


def test_export_program_of_an_exportable_result_is_plain_export():
    model, inputs = demo_cnn_with_inputs()
    result = rules("fusion").apply(capture(model, inputs, "fx"), example_inputs=inputs)
    program = export_program(result.graph_module, inputs)
    ops = {n.target for n in program.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.batch_norm.default in ops, "the unfoldable batch norm stays"
    bns = sum(1 for n in program.graph.nodes if n.target == torch.ops.aten.batch_norm.default)
    assert bns == model.UNFOLDABLE


def test_a_rewritten_symbolic_trace_result_with_emitted_methods_saves(tmp_path):
    # an emitted torch.Tensor.m(x) call would make fx write "from torch._C import
    # TensorBase.m" in the pickled code: rewrite.capture.save writes x.m() instead
    class Model(torch.nn.Module):
        def forward(self, x):
            return torch.tanh(x) * 1.0 + 1

    x = torch.randn(3, 4)
    result = rewrite.parse("rule r: mul(x, 1.0) => contiguous(x)\n").apply(torch.fx.symbolic_trace(Model()), (x,))
    assert result.counts == {"r": 1}
    code = result.graph_module.code
    path = rewrite.capture.save(result.graph_module, tmp_path / "m.pt", level="fx")
    loaded = torch.load(path, weights_only=False)
    assert torch.equal(loaded(x), Model()(x)) and result.graph_module.code == code


class _ConvBnRelu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.bn = torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8)

    def forward(self, x):
        return self.bn(self.c(x)).relu()


def test_a_graph_captured_with_a_dynamic_batch_saves_with_it(tmp_path):
    # the rewritten graph takes any batch, as the captured one did: so does its .pt2,
    # and rewrite.quant.export's program
    import rewrite.quant as rq

    torch.manual_seed(0)
    model, x = _ConvBnRelu().eval(), torch.randn(2, 3, 8, 8)
    batch = torch.export.Dim("batch", min=1, max=64)
    gm = torch.export.export(model, (x,), dynamic_shapes=({0: batch},), strict=False).module()
    result = rewrite.load("rules/fusion.rw").apply(gm, (x,))
    assert result.counts == {"conv_bn": 1}
    loaded = torch.export.load(save(result.graph_module, tmp_path / "fused.pt2", "export", (x,))).module()
    five = torch.randn(5, 3, 8, 8)
    torch.testing.assert_close(loaded(five), model(five), rtol=1e-4, atol=1e-4)
    int8 = rq.quantize(gm, [(x,), (torch.randn(2, 3, 8, 8),)], form="qdq")
    program = rq.export(int8)
    assert program.module()(five).shape == (5, 8, 6, 6)
    # a graph with static sizes exports as before
    static = torch.export.export(model, (x,), strict=False).module()
    assert export_program(rewrite.load("rules/fusion.rw").apply(static, (x,)).graph_module, (x,)) is not None
