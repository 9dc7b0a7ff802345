"""Rewiring wide readers (``rewrite.engine.rewire``): a graph that returns, or
concatenates, many rewritten values has one reader of them all. Its arguments are
patched through a position index (the output's written back once per schedule)
instead of fx's full rebuild per rewrite, which made such fixpoints quadratic.
The result must be the graph fx's path gives, and rollbacks must restore it."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rewrite
import rewrite.engine.rewire as rewire
from rewrite.capture import capture
from rewrite.engine.workspace import working_copy
from tests.test_inplace import assert_restored, graph_text, snapshot

CLEANUP = rewrite.load("rules/cleanup.rw")
WRONG = rewrite.parse("rule wrong: neg(neg(x)) => sin(x)\n")


class ManyOutputs(nn.Module):
    """Returns n values, each ``-(-sin(x_i))`` (cleanup's neg_neg rewrites each),
    some returned twice, with a literal between them."""

    def __init__(self, n: int, repeat: int = 7, as_cat: bool = False) -> None:
        super().__init__()
        self.n, self.repeat, self.as_cat = n, repeat, as_cat

    def forward(self, x):
        outs = []
        for i in range(self.n):
            v = -(-torch.sin(x + (i + 1)))
            outs.append(v)
            if i % self.repeat == 0:
                outs.append(v)  # the same value in two places
        outs.append(torch.sigmoid(x))
        if self.as_cat:
            return torch.cat(outs)
        return tuple(outs[: len(outs) // 2]) + (None,) + tuple(outs[len(outs) // 2:])


X = torch.randn(3)


def _negs(gm):
    return sum(1 for n in gm.graph.nodes if n.target in (torch.neg, torch.ops.aten.neg.default, "neg")
               or (n.op == "call_function" and getattr(n.target, "__name__", "") == "neg"))


def _count_fx_rewires(monkeypatch):
    """The number of inputs of each reader fx's per-reader rebuild is called on."""
    calls = []
    original = fx.Node._replace_input_with

    def spy(self, old, new):
        calls.append(len(self.all_input_nodes))
        return original(self, old, new)

    monkeypatch.setattr(fx.Node, "_replace_input_with", spy)
    return calls


@pytest.mark.parametrize("as_cat", [False, True])
@pytest.mark.parametrize("level", ["fx", "export"])
def test_wide_readers_are_rewired_like_fx_does(level, as_cat, monkeypatch):
    model = ManyOutputs(60, as_cat=as_cat)
    gm = capture(model, (X,), level)
    assert _negs(gm) == 120
    expected = model(X)

    calls = _count_fx_rewires(monkeypatch)
    fast = CLEANUP.apply(gm, example_inputs=(X,))
    assert all(width <= rewire.WIDE for width in calls)  # no full rebuild of the wide reader
    monkeypatch.setattr(rewire, "WIDE", 10**9)  # every reader through fx
    slow = CLEANUP.apply(gm, example_inputs=(X,))

    for result in (fast, slow):
        result.graph_module.graph.lint()  # users and inputs agree with the arguments
        assert _negs(result.graph_module) == 0
        torch.testing.assert_close(result.graph_module(X), expected)
    assert fast.counts == slow.counts == {"neg_neg": 60}
    assert graph_text(fast.graph_module) == graph_text(slow.graph_module)
    # users and inputs hold the same entries as fx's (their order may differ)
    for a, b in zip(fast.graph_module.graph.nodes, slow.graph_module.graph.nodes):
        assert [u.name for u in a.users] == [u.name for u in b.users] or \
            sorted(u.name for u in a.users) == sorted(u.name for u in b.users)
        assert sorted(n.name for n in a.all_input_nodes) == sorted(n.name for n in b.all_input_nodes)


@pytest.mark.parametrize("level", ["fx", "export"])
def test_a_failed_check_restores_a_wide_output_exactly(level):
    gm = capture(ManyOutputs(50), (X,), level)
    before = snapshot(gm)
    with pytest.raises(rewrite.EquivalenceError):
        WRONG.apply(gm, example_inputs=(X,), inplace=True)
    assert_restored(gm, before)
    gm.graph.lint()
    torch.testing.assert_close(gm(X), ManyOutputs(50)(X))


def test_skip_rule_on_a_wide_output_keeps_the_good_rewrites():
    model = ManyOutputs(40)
    gm = capture(model, (X,), "fx")
    rules = rewrite.parse("rule good: neg(neg(x)) => x\nrule wrong: sigmoid(x) => relu(x)\n")
    with pytest.warns(UserWarning, match="rolled back"):
        result = rules.apply(gm, example_inputs=(X,), inplace=True, on_mismatch="skip-rule")
    gm.graph.lint()
    assert result.counts == {"good": 40}
    assert [r.rule for r in result.rejected] == ["wrong"]
    assert _negs(gm) == 0
    torch.testing.assert_close(gm(X), model(X))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(["rewritten", "plain", "literal", "again"]), min_size=34, max_size=80),
       st.booleans())
def test_any_output_layout_rewires_like_fx(layout, nested):
    """Outputs mixing rewritten values, plain ones, literals and repeats, flat or
    under a second tuple: the position index gives fx's graph."""
    g = fx.Graph()
    x = g.placeholder("x")
    items, last = [], None
    for i, kind in enumerate(layout):
        if kind == "literal":
            items.append(i)
            continue
        if kind == "again" and last is not None:
            items.append(last)
            continue
        s = g.call_function(torch.sin, (x,))
        last = g.call_function(torch.neg, (g.call_function(torch.neg, (s,)),)) if kind == "rewritten" else s
        items.append(last)
    out = (tuple(items[:5]), tuple(items[5:])) if nested else tuple(items)
    g.output(out)
    gm = fx.GraphModule(nn.Module(), g)
    expected = gm(X)

    fast = CLEANUP.apply(gm, check=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rewire, "WIDE", 10**9)
        slow = CLEANUP.apply(gm, check=False)
    fast.graph_module.graph.lint()
    assert graph_text(fast.graph_module) == graph_text(slow.graph_module)
    assert fast.counts == slow.counts
    assert _negs(fast.graph_module) == 0
    torch.testing.assert_close(fast.graph_module(X), expected)


class ReturnsEach(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x):
        return tuple(torch.sin(x + (i + 1)) for i in range(self.n)) + (x,)


@pytest.mark.parametrize("inplace", [False, True])
def test_an_insertion_before_a_wide_output_rewires_only_the_outside_readers(inplace):
    """``sin(x) as s => relu(s)`` keeps s and puts relu between it and its readers
    (fx's ``delete_user_cb`` path): every returned sin now goes through a relu."""
    model = ReturnsEach(50)
    gm = capture(model, (X,), "fx")
    rules = rewrite.parse("rule clamp(change=True): sin(_) as s => relu(s)\n")
    result = rules.apply(gm, check=False, inplace=inplace)
    out = result.graph_module
    out.graph.lint()
    assert result.counts == {"clamp": 50}
    returned = out.graph.output_node().args[0]
    assert all(v.target is torch.relu for v in returned[:-1]) and returned[-1].op == "placeholder"
    torch.testing.assert_close(out(X), tuple(torch.relu(v) for v in model(X)[:-1]) + (X,))


@pytest.mark.parametrize("reader", ["output", "cat"])
def test_the_benchmark_fan_in_graphs_rewrite_without_rebuilding_their_reader(reader, monkeypatch):
    from rewrite.examples.wide import fan_in_graph

    gm = fan_in_graph(80, reader)
    expected = gm(X)
    calls = _count_fx_rewires(monkeypatch)
    result = CLEANUP.apply(gm, example_inputs=(X,), inplace=True)
    assert result.counts == {"neg_neg": 80}
    assert all(width <= rewire.WIDE for width in calls)
    gm.graph.lint()
    assert _negs(gm) == 0
    torch.testing.assert_close(gm(X), expected)


def _wide_aliasing_graph(n: int, at_input: frozenset, at_shared: frozenset) -> fx.GraphModule:
    """Returns n values ``-(-v)``: v the input ``x`` at positions ``at_input``, one
    intermediate ``s`` (also returned, last) at ``at_shared``, a fresh ``sin`` elsewhere."""
    g = fx.Graph()
    x = g.placeholder("x")
    shared = g.call_function(torch.cos, (x,))
    values = []
    for i in range(n):
        v = x if i in at_input else shared if i in at_shared else g.call_function(torch.sin, (x,))
        values.append(g.call_function(torch.neg, (g.call_function(torch.neg, (v,)),)))
    g.output(tuple(values) + (shared,))
    return fx.GraphModule(torch.nn.Module(), g)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(rewire.WIDE + 1, 3 * rewire.WIDE), data=st.data(), inplace=st.booleans())
def test_a_wide_output_never_comes_to_alias_an_input_or_another_output(n, data, inplace):
    """Through the wide-reader path too, ``neg_neg`` is refused where the output
    would then return the caller's input itself, or the same tensor twice (a value
    the graph also returns); every other position is rewritten, and the result
    computes what the original computes, in fresh memory."""
    positions = st.frozensets(st.integers(0, n - 1), max_size=4)
    at_input = data.draw(positions)
    at_shared = data.draw(positions) - at_input
    gm = _wide_aliasing_graph(n, at_input, at_shared)
    x = torch.randn(5)
    expected = gm(x)
    work = working_copy(gm) if inplace else gm
    result = CLEANUP.apply(work, (x,), inplace=inplace)
    assert result.counts.get("neg_neg", 0) == n - len(at_input) - len(at_shared)
    out = result.graph_module(x)
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want)
    storages = [t.untyped_storage().data_ptr() for t in out]
    assert x.untyped_storage().data_ptr() not in storages
    assert len(set(storages)) == len(storages)
