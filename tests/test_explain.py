"""explain: the deepest partial match, the failing element's rule-file position,
expected vs actual, bindings; near misses across a graph."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import rewrite
from rewrite.cli import main
from tests.fx_helpers import Fn

X = torch.randn(2, 3, 4, 5)


def _explain(text, fn, **kw):
    return rewrite.parse(text, "r.rw").explain(fx.symbolic_trace(Fn(fn)), example_inputs=(X,), **kw)


def test_matching_rule_says_so():
    [e] = _explain("rule nn: neg(neg(x)) => x", lambda x: -(-x) + 1, node="neg_1")
    assert e.matched and "matches" in str(e)
    # returned as it is, the input would be aliased by the output: apply refuses, and says so
    [e] = _explain("rule nn: neg(neg(x)) => x", lambda x: -(-x), node="neg_1")
    assert not e.matched and "alias" in e.actual


def test_wrong_op_names_expected_and_actual_with_position():
    [e] = _explain("rule nn: neg(neg(x)) => x", lambda x: -torch.relu(x), node="neg")
    assert not e.matched
    assert e.location == "r.rw:1:14"
    assert e.expected == "neg" and e.actual.startswith("relu: relu")
    assert e.bindings == {}


def test_literal_mismatch_and_default_mismatch():
    [e] = _explain("rule m: mul(x, 1) => x", lambda x: x * 2, node="mul")
    assert (e.expected, e.actual) == ("1", "2") and e.location == "r.rw:1:16"
    [e] = _explain("rule g: gelu(x) => x", lambda x: F.gelu(x, approximate="tanh"), node="gelu")
    assert e.element == "omitted argument 'approximate'"
    assert (e.expected, e.actual) == ("the default 'none'", "'tanh'")


def test_where_clause_names_the_false_conjunct_and_facts():
    [e] = _explain("rule w: neg(relu(x) as r) where is_float(x) and rank(x) == 3 => r",
                   lambda x: -torch.relu(x), node="neg")
    assert e.element == "where clause"
    assert e.expected == "rank(x) == 3 to hold"
    assert "shape (2, 3, 4, 5)" in e.actual
    assert e.location == "r.rw:1:49"
    assert set(e.bindings) == {"x", "r"}


@rewrite.register_predicate("explain_test_raises")
def _raises(x) -> bool:
    raise ValueError("no shape for this one")


def test_a_predicate_that_raised_is_reported_as_its_error_not_false():
    [e] = _explain("rule w: neg(x) where explain_test_raises(x) => x", lambda x: -x, node="neg")
    assert e.element == "where clause" and not e.matched
    assert e.actual.startswith("an error (") and "no shape for this one" in e.actual
    [e] = _explain("rule w: neg(x) where rank(x) == 3 => x", lambda x: -x, node="neg")
    assert e.actual.startswith("false")


def test_interior_use_is_reported():
    def f(x):
        n = -x
        return torch.relu(n), n

    [e] = _explain("rule rr: relu(neg(x)) => x", f, node="relu")
    assert e.element == "interior-use check" and "neg is also used by output" in e.actual


def test_near_misses_rank_deepest_first():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)
            self.bn = nn.BatchNorm2d(3)
            self.bn2 = nn.BatchNorm2d(3)

        def forward(self, x):
            c = self.conv(x)
            return self.bn(c) + c, self.bn2(torch.relu(x))

    gm = fx.symbolic_trace(Net().eval())
    misses = rewrite.load("rules/fusion.rw").explain(gm, rule="conv_bn", example_inputs=(X,))
    assert [m.node for m in misses] == ["bn", "bn2"]
    assert misses[0].element == "where clause" and "single_use(c)" in misses[0].expected
    assert misses[1].expected == "conv" and "relu" in misses[1].actual


def test_cli_explain_rule(capsys):
    assert main(["explain", "rules/fusion.rw", "--model", "rewrite.examples.cnn:demo_cnn_with_inputs",
                 "--rule", "conv_bn", "--capture", "export"]) == 0
    out = capsys.readouterr().out
    assert "fusion.rw:17:51: conv_bn at node 'batch_norm_2': where clause failed" in out


def test_explanations_print_as_text():
    import torch

    import rewrite

    rules = rewrite.load("rules/fusion.rw")
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval()
    found = rules.explain(model, rule="conv_bn", example_inputs=(torch.randn(1, 3, 8, 8),))
    text = str(found)
    assert isinstance(found, list) and found and text == "\n\n".join(str(e) for e in found)
    assert "conv_bn" in text and "Explanation(" not in repr(found)


def test_explain_agrees_with_apply_on_interior_nodes_the_replacement_keeps():
    """An interior node used outside the match blocks a rewrite unless the replacement
    keeps it: explain decides exactly as apply does, and names the outside user."""
    keeps = "rule k: relu(neg(_) as n) => add(n, n)"
    drops = "rule d: relu(neg(x)) => abs(x)"
    gm = fx.symbolic_trace(Fn(lambda x: (lambda n: torch.relu(n) + n.sum())(-x)))
    for text, fires in ((keeps, True), (drops, False)):
        rules = rewrite.parse(text)
        applied = rules.apply(gm, example_inputs=(torch.randn(3),), check=False).counts
        relu = next(n.name for n in gm.graph.nodes if n.target is torch.relu)
        (explanation,) = rules.explain(gm, node=relu)
        assert bool(applied) is fires and explanation.matched is fires
        if not fires:
            assert "interior-use check" in str(explanation) and "is also used by" in str(explanation)


class _ReturnsScaledInput(torch.nn.Module):
    def forward(self, x):
        return x * 1.0


class _WritesBetween(torch.nn.Module):
    def forward(self, x):
        h = x + 1
        y = h * 1.0
        h.add_(1)
        return y, h


# probe AK F1: explain said "matches" where apply's replacement-time guards refuse
@pytest.mark.parametrize("level", ["fx", "export"])
@pytest.mark.parametrize("model, reason", [(_ReturnsScaledInput(), "alias"), (_WritesBetween(), "written in place")])
def test_explain_says_why_apply_refuses_a_match(model, reason, level):
    rules = rewrite.parse("rule m1: mul(x, 1) where is_float(x) => x\n")
    x = torch.randn(2, 4)
    gm = torch.fx.symbolic_trace(model) if level == "fx" else torch.export.export(model, (x,)).module()
    assert rules.apply(gm, example_inputs=(x,)).counts == {}
    (e,) = rules.explain(gm, rule="m1", node="mul", example_inputs=(x,))
    assert not e.matched and e.element == "replacement" and reason in e.actual


def test_explain_still_says_matches_where_apply_fires():
    rules = rewrite.parse("rule m1: mul(x, 1) where is_float(x) => x\n")

    class M(torch.nn.Module):
        def forward(self, x):
            return (x + 1) * 1.0

    x = torch.randn(2, 4)
    gm = torch.fx.symbolic_trace(M())
    assert rules.apply(gm, example_inputs=(x,)).counts == {"m1": 1}
    (e,) = rules.explain(gm, rule="m1", node="mul", example_inputs=(x,))
    assert e.matched


def test_explain_names_a_left_out_result_that_is_read():
    rules = rewrite.parse("rule mo: aten.max.dim(x, d, k) as (_, _) where is_float(x)"
                          " => (aten.amax(x, [d], k), _)\n")

    class ReadsIndices(torch.nn.Module):
        def forward(self, x):
            r = torch.max(x, 1)
            return r[0] + 1, r[1]

    x = torch.randn(2, 4)
    gm = torch.export.export(ReadsIndices(), (x,)).module()
    assert rules.apply(gm, example_inputs=(x,)).counts == {}
    node = next(n.name for n in gm.graph.nodes if "max" in n.name)
    (e,) = rules.explain(gm, rule="mo", node=node, example_inputs=(x,))
    assert not e.matched and "result 1" in e.actual and "does not provide it" in e.actual


# probe AK F5: an unknown where clause (no facts) was reported as false
def test_explain_says_a_where_clause_is_unknown_not_false():
    rules = rewrite.parse("rule m1: mul(x, 1) where is_float(x) => x\n")

    class M(torch.nn.Module):
        def forward(self, x):
            return (x + 1) * 1.0 + 2

    (e,) = rules.explain(torch.fx.symbolic_trace(M()), rule="m1", node="mul")
    assert e.actual.startswith("unknown") and "example_inputs" in e.actual


# probe AK F2: a qualified op in an argument, spelled otherwise in the graph, was
# blamed on the root ("expected: cat / actual: cat")
def test_explain_points_at_a_qualified_argument_spelled_otherwise():
    rules = rewrite.parse("rule cs: cat(aten.split.Tensor(x, _, d) as (_, _), d) => x\n")

    class M(torch.nn.Module):
        def forward(self, x):
            a, b = torch.split(x, 2, 1)
            return torch.cat([a, b], 1)

    (e,) = rules.explain(torch.fx.symbolic_trace(M()), rule="cs", node="cat", example_inputs=(torch.randn(2, 4),))
    assert not e.matched and "aten.split.Tensor exactly" in e.expected


# probe AM F6: an unknown conjunct was blamed (advising example inputs) where another was false
def test_explain_blames_a_false_conjunct_before_an_unknown_one():
    rules = rewrite.parse("rule m1: mul(x, 1) where is_float(x) and rank(x) == 7 => x\n")

    class M(torch.nn.Module):
        def forward(self, x):
            return (x + 1) * 1.0 + 2

    gm = torch.fx.symbolic_trace(M())
    (e,) = rules.explain(gm, rule="m1", node="mul")
    assert e.actual.startswith("unknown")  # rank is unknown too: both unknown, the first is named
    rules = rewrite.parse("rule m1: mul(x, 1) where is_float(x) and is_number(x) => x\n")
    (e,) = rules.explain(gm, rule="m1", node="mul")
    assert e.expected == "is_number(x) to hold" and e.actual.startswith("false")


# probe AM F5: explain deep-copied the model, which a weight-normed conv cannot be
def test_explain_works_where_apply_does_on_a_weight_normed_model():
    with pytest.warns(FutureWarning):
        conv = nn.utils.weight_norm(nn.Conv1d(2, 2, 1))

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv

        def forward(self, x):
            return self.conv(x) * 1.0

    rules = rewrite.parse("rule mul_one: mul(x, 1) where is_float(x) => x\n")
    x = torch.randn(1, 2, 4)
    assert rules.apply(M(), (x,)).counts == {"mul_one": 1}
    (e,) = rules.explain(M(), rule="mul_one", node="mul", example_inputs=(x,))
    assert e.matched
