"""Transactional apply: a broken rewrite is found by bisection, named with its
rule, node and model source line, and either raised or rolled back alone."""

import pytest
import torch
import torch.nn as nn

import rewrite

BROKEN = """
import "fusion.rw"
# wrong on purpose: sigmoid is not relu
rule broken: sigmoid(x) => relu(x)
"""


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.bn2 = nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.bn(self.conv(x))
        y = torch.sigmoid(y)  # the line the broken rule rewrites
        return self.bn2(self.conv2(y))


def _rules(tmp_path):
    import shutil

    shutil.copy(rewrite.rules_dir() / "fusion.rw", tmp_path / "fusion.rw")
    path = tmp_path / "mixed.rw"
    path.write_text(BROKEN)
    return rewrite.load(str(path))


X = torch.randn(2, 3, 8, 8)


def test_raise_names_the_first_breaking_application(tmp_path):
    model = Net().eval()
    gm = torch.export.export(model, (X,)).module()
    with pytest.raises(rewrite.EquivalenceError) as info:
        _rules(tmp_path).apply(gm, example_inputs=(X,))
    culprit = info.value.culprit
    assert culprit.rule == "broken"
    assert culprit.node == "sigmoid"
    assert "mixed.rw:4:1" in culprit.rule_location
    assert "test_transactions.py" in culprit.source and "torch.sigmoid(y)" in culprit.source
    assert "broken" in str(info.value)


def test_skip_rule_keeps_the_good_rewrites(tmp_path):
    model = Net().eval()
    gm = torch.export.export(model, (X,)).module()
    result = _rules(tmp_path).apply(gm, example_inputs=(X,), on_mismatch="skip-rule")
    assert result.counts == {"conv_bn": 2}
    assert [r.rule for r in result.rejected] == ["broken"]
    assert result.equivalence.ok
    torch.testing.assert_close(result.graph_module(X), model(X), rtol=1e-4, atol=1e-4)
    assert "rolled back: rule 'broken'" in result.summary()


def test_nothing_half_applied_when_a_rewrite_time_function_fails():
    @rewrite.register_constant()
    def explode(w):
        raise RuntimeError("boom")

    rules = rewrite.parse("""
    rule fold: batch_norm(conv(x, w, b, s, p, d, g) as c, _, _, _, _, training=False, ...)
        where const(w) and single_use(c)
        => conv(x, explode(w), b, s, p, d, g)
    """)
    model = Net().eval()
    gm = torch.fx.symbolic_trace(model)
    code = gm.code
    result = rules.apply(gm, example_inputs=(X,))
    assert result.counts == {} and result.stats["fold"].failed == 2
    assert result.graph_module.code == code  # the failed replacements left no trace
    assert gm.code == code


def test_shuffled_worklist_reaches_the_same_graph_on_shipped_sets():
    from rewrite.examples.cnn import demo_cnn_with_inputs

    model, inputs = demo_cnn_with_inputs()
    gm = torch.export.export(model, inputs).module()
    rules = rewrite.load("rules/fusion.rw") + rewrite.load("rules/cleanup.rw")
    base = rules.apply(gm, example_inputs=inputs, check=False)
    for seed in range(3):
        shuffled = rules.apply(gm, example_inputs=inputs, check=False, shuffle_seed=seed)
        assert shuffled.counts == base.counts
        torch.testing.assert_close(shuffled.graph_module(*inputs), base.graph_module(*inputs))


def test_integer_constants_from_trainable_parameters_do_not_require_grad():
    @rewrite.register_constant()
    def as_int8_for_test(w):
        return (w * 100).round().clamp(-128, 127).to(torch.int8)

    rules = rewrite.parse("""
    rule int8_weight: linear(x, w, b) where const(w) => linear(x, to(as_int8_for_test(w), torch.float32), b)
    """)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()  # in training mode its weight is no constant
    assert model[0].weight.requires_grad
    gm = torch.fx.symbolic_trace(model)
    result = rules.apply(gm, example_inputs=(torch.randn(2, 4),), check=False)
    assert result.counts == {"int8_weight": 1}
    out = result.graph_module
    (const,) = [t for name, t in out.named_parameters() if name.endswith("as_int8_for_test")]
    assert const.dtype == torch.int8 and not const.requires_grad
    x = torch.randn(2, 4)
    want = torch.nn.functional.linear(x, (model[0].weight * 100).round().clamp(-128, 127), model[0].bias)
    torch.testing.assert_close(out(x), want)


class _CastWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))
        self.v = torch.nn.Parameter(torch.randn(3, dtype=torch.float16))

    def forward(self, x):
        return x + self.w.to(torch.float64) + self.v.to(torch.float64)


def test_a_constant_function_can_be_the_whole_replacement():
    rules = rewrite.parse("""
    rule fold_cast: to(w, d) where is_tensor(w) and const(w) => cast(w, d)
    """)
    model = _CastWeight()
    gm = torch.fx.symbolic_trace(model.eval())  # inference: const(w) holds
    x = torch.randn(3, dtype=torch.float64)
    result = rules.apply(gm, example_inputs=(x,))
    assert result.counts == {"fold_cast": 2}
    out = result.graph_module
    assert not [n for n in out.graph.nodes if n.op == "call_method" and n.target == "to"]
    consts = {n.target: getattr(out, n.target) for n in out.graph.nodes if n.op == "get_attr"}
    assert {t.dtype for t in consts.values()} == {torch.float64}
    assert result.equivalence.ok
    torch.testing.assert_close(out(x), model(x))


def test_a_constant_root_that_is_no_tensor_fails_cleanly():
    @rewrite.register_constant()
    def first_element_for_test(w):
        return float(w.flatten()[0])

    rules = rewrite.parse("""
    rule scalar: to(w, _) where const(w) => first_element_for_test(w)
    """)
    gm = torch.fx.symbolic_trace(_CastWeight().eval())
    code = gm.code
    result = rules.apply(gm, example_inputs=(torch.randn(3, dtype=torch.float64),))
    assert result.counts == {} and result.stats["scalar"].failed == 2
    assert result.graph_module.code == code


class _ReturnsCast(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x + 1, self.w.to(torch.float64)


class _WritesIntoCast(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        y = self.w.to(torch.float64)
        y.add_(x)
        return y * 2


@pytest.mark.parametrize("model_cls", [_ReturnsCast, _WritesIntoCast])
@pytest.mark.parametrize("rule", [
    "rule fold_cast: to(w, d) where is_tensor(w) and const(w) => cast(w, d)",
    "rule same: to(w, d) where const(w) and dtype(w) != d => to(cast(w, d), d)\n"
    "rule done: to(w, d) where const(w) and dtype(w) == d => w",
])
def test_a_constant_never_replaces_a_value_the_graph_returns_or_writes(model_cls, rule):
    """Returned, the module's tensor would be handed to the caller; written in place,
    every call would change it: such rewrites fail instead, and calls stay independent."""
    gm = torch.fx.symbolic_trace(model_cls().eval())
    x = torch.ones(3, dtype=torch.float64)
    result = rewrite.parse(rule).apply(gm, example_inputs=(x,), check=False)
    out = result.graph_module
    with torch.no_grad():
        first = out(x)
        first = first[1] if isinstance(first, tuple) else first
        first.mul_(0)  # what a caller may do with an output
        again = out(x)
        again = again[1] if isinstance(again, tuple) else again
        want = model_cls()(x)
    torch.testing.assert_close(again, want[1] if isinstance(want, tuple) else want)
    # never applied: refused when built (returned), or not a constant at all (the cast
    # may alias the parameter, which the graph then writes: const(w) is false)
    assert not result.counts
    if model_cls is _ReturnsCast:
        assert sum(s.failed for s in result.stats.values()) >= 1
