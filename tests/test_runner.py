"""The check's runs without code generation (``rewrite.trust.runner``) and the
module state it saves (``rewrite.ops.effects.state_writes``).

A fresh rewrite is a lazily compiled GraphModule; the check runs its graph node by
node instead of generating its code. These tests hold the runner to the generated
code (same outputs, same hooks, the module left untouched) and the state analysis to
what running a graph can actually write: whatever it may write is saved and put back.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx, nn
from torch.fx._lazy_graph_module import _LazyGraphModule

import rewrite
from rewrite.engine.workspace import working_copy
from rewrite.examples.cnn import demo_cnn_with_inputs, resnet50_with_inputs
from rewrite.ops.effects import state_writes
from rewrite.trust.check import check_equivalence, preserved_state
from rewrite.trust.runner import GraphRunner, running_as_graph, waits_for_code


def _leaves(x):
    return torch.utils._pytree.tree_leaves(x)


def _same(a, b) -> bool:
    la, lb = _leaves(a), _leaves(b)
    return len(la) == len(lb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


class Mixed(nn.Module):
    """call_module, call_method, get_attr, a nested list argument, kwargs, getitem."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("shift", torch.arange(4.0))

    def forward(self, x, y=None):
        a = self.lin(x).relu()
        parts = torch.split(a, 2, dim=-1)
        b = torch.cat([parts[1], parts[0]], dim=-1) + self.shift
        return {"out": b.sum(dim=-1, keepdim=True), "pair": (a, x.transpose(0, 1))}


def lazy(gm: fx.GraphModule) -> fx.GraphModule:
    return working_copy(gm)


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_runner_matches_generated_code_on_traced_graphs(rows, seed):
    torch.manual_seed(seed)
    gm = fx.symbolic_trace(Mixed())
    x = torch.randn(rows, 4)
    runner = GraphRunner(gm)
    assert _same(runner(x), gm(x))


def test_runner_matches_export_module_with_its_hooks():
    model, (x,) = demo_cnn_with_inputs()
    ep = torch.export.export(model.eval(), (x,))
    module = ep.module()
    copy = lazy(module)
    assert waits_for_code(copy)
    with torch.no_grad(), running_as_graph(copy) as run:
        got = run(x)
        # export's input check (a forward pre-hook) still runs around the graph
        with pytest.raises(Exception):
            run(torch.randn(2, 5, 7))
    assert _same(got, module(x))
    # left as it was: still waiting for its code, no forward of its own
    assert waits_for_code(copy) and "forward" not in vars(copy)


def test_running_as_graph_leaves_compiled_and_plain_modules_alone():
    gm = fx.symbolic_trace(Mixed())
    assert not waits_for_code(gm)  # compiled already: runs its code
    with running_as_graph(gm) as run:
        assert run is gm and "forward" not in vars(gm)
    plain = Mixed()
    with running_as_graph(plain) as run:
        assert run is plain


def test_hooks_run_once_around_the_runner():
    gm = lazy(fx.symbolic_trace(Mixed()))
    calls = []
    gm.register_forward_hook(lambda m, args, out: calls.append("post"))
    gm.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    with running_as_graph(gm) as run:
        run(torch.randn(2, 4))
    assert calls == ["pre", "post"]
    assert waits_for_code(gm)


def test_keyword_call_falls_back_to_generated_code():
    base = fx.symbolic_trace(Mixed())
    gm = lazy(base)
    x = torch.randn(3, 4)
    with running_as_graph(gm) as run:
        out = run(x=x)
    assert _same(out, base(x=x))


def test_check_of_a_rewrite_generates_no_code():
    """apply() with the check leaves the code to the first call, as check=False does."""
    model, (x,) = demo_cnn_with_inputs()
    gm = fx.symbolic_trace(model.eval())
    result = rewrite.load("rules/fusion.rw").apply(gm, example_inputs=(x,))
    assert result.counts and result.equivalence.ok
    assert isinstance(result.graph_module, _LazyGraphModule)
    assert waits_for_code(result.graph_module)
    torch.testing.assert_close(result.graph_module(x), gm(x), rtol=1e-4, atol=1e-4)


def test_the_check_still_catches_a_wrong_candidate_run_as_a_graph():
    gm = fx.symbolic_trace(Mixed())
    wrong = lazy(gm)
    for node in wrong.graph.nodes:
        if node.target == "relu":
            node.target = "sigmoid"
    wrong.recompile()  # lazily: still waits for its code
    assert waits_for_code(wrong)
    report = check_equivalence(gm, wrong, (torch.randn(3, 4),))
    assert not report.ok and waits_for_code(wrong)


# ---------------------------------------------------------------- state_writes


def _graph_module(build, **state) -> fx.GraphModule:
    root = nn.Module()
    for name, t in state.items():
        if isinstance(t, nn.Parameter):
            root.register_parameter(name, t)
        else:
            root.register_buffer(name, t)
    g = fx.Graph()
    build(g)
    return fx.GraphModule(root, g)


def test_eval_resnet_writes_no_state_and_train_writes_batch_norm_statistics():
    model, _ = resnet50_with_inputs()
    assert state_writes(fx.symbolic_trace(model.eval())) == frozenset()
    gm = fx.symbolic_trace(model.train())
    written = state_writes(gm)
    stats = {id(m.running_mean) for m in gm.modules() if isinstance(m, nn.BatchNorm2d)}
    assert stats and stats <= written
    convs = {id(m.weight) for m in gm.modules() if isinstance(m, nn.Conv2d)}
    assert not convs & written


def _write_through_slice(g):
    x, p = g.placeholder("x"), g.get_attr("p")
    part = g.call_function(operator.getitem, (p, slice(0, 2)))
    g.call_function(operator.setitem, (part, 0, 5.0))
    g.output(g.call_function(operator.add, (x, p)))


def _functional_batch_norm(g):
    x, rm, rv = g.placeholder("x"), g.get_attr("rm"), g.get_attr("rv")
    g.output(g.call_function(F.batch_norm, (x, rm, rv), {"training": True}))


def _aten_batch_norm(g):
    x, rm, rv = g.placeholder("x"), g.get_attr("rm"), g.get_attr("rv")
    g.output(g.call_function(torch.ops.aten.batch_norm.default,
                             (x, None, None, rm, rv, True, 0.1, 1e-5, False)))


def _positional_inplace(g):
    g.placeholder("x")
    p = g.get_attr("p")
    v = g.call_method("view", (p, -1))
    g.output(g.call_function(F.relu, (v, True)))


def _method_inplace(g):
    x, p = g.placeholder("x"), g.get_attr("p")
    g.call_method("mul_", (g.call_function(torch.ops.aten.t.default, (p,)), 2.0))
    g.output(g.call_function(operator.mul, (x, 2)))


@pytest.mark.parametrize("build,names", [
    (_write_through_slice, ["p"]),
    (_functional_batch_norm, ["rm", "rv"]),
    (_aten_batch_norm, ["rm", "rv"]),
    (_positional_inplace, ["p"]),
    (_method_inplace, ["p"]),
])
def test_writes_the_graph_hides_are_found_and_undone(build, names):
    state = {"p": torch.tensor([[1.0], [-1.0], [2.0], [-3.0]]), "rm": torch.zeros(4), "rv": torch.ones(4)}
    gm = _graph_module(build, **state)
    written = state_writes(gm)
    assert {id(getattr(gm, n)) for n in names} <= written
    before = {n: t.clone() for n, t in state.items()}
    x = torch.randn(3, 4, 2) if "rm" in names else torch.randn(4, 1)
    with preserved_state(gm, runs_only=True):
        with torch.no_grad():
            gm(x)
        assert any(not torch.equal(getattr(gm, n), before[n]) for n in names)  # it did write
    for n in names:
        assert torch.equal(getattr(gm, n), before[n]), n


def test_unknown_calls_and_user_modules_make_everything_writable():
    def opaque(t):
        return t

    gm = _graph_module(lambda g: g.output(g.call_function(opaque, (g.get_attr("p"),))), p=torch.ones(2))
    assert state_writes(gm) == frozenset({id(gm.p)})  # a Python function may write its arguments

    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("n", torch.zeros(()))

        def forward(self, x):
            self.n.add_(1)
            return x

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.counter = Counter()

        def forward(self, x):
            return self.counter(x) * 2

    class KeepCounter(fx.Tracer):  # the user module stays a call_module node
        def is_leaf_module(self, m, qualname):
            return isinstance(m, Counter) or super().is_leaf_module(m, qualname)

    outer = Outer()
    traced = fx.GraphModule(outer, KeepCounter().trace(outer))
    assert any(n.op == "call_module" for n in traced.graph.nodes)
    assert id(traced.counter.n) in state_writes(traced)
    with preserved_state(traced, runs_only=True):
        traced(torch.ones(2))
        assert traced.counter.n.item() == 1
    assert traced.counter.n.item() == 0


def test_apply_with_check_leaves_a_state_writing_model_as_it_was():
    """BatchNorm in training mode through the whole default apply: the input's
    statistics after the check are bit for bit what they were."""
    model, (x,) = demo_cnn_with_inputs()
    gm = fx.symbolic_trace(model.train())
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    rewrite.load("rules/cleanup.rw").apply(gm, example_inputs=(x,))
    after = gm.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def _eval_norms(g):
    x, w, b, rm, rv = (g.placeholder("x"), g.get_attr("p"), g.get_attr("p"), g.get_attr("rm"), g.get_attr("rv"))
    y = g.call_function(torch.ops.aten.batch_norm.default, (x, None, None, rm, rv, False, 0.1, 1e-5, False))
    z = g.call_function(torch.ops.aten._native_batch_norm_legit_no_training.default, (y, None, None, rm, rv, 0.1, 1e-5))
    g.output(g.call_function(operator.getitem, (z, 0)))


def test_eval_mode_norms_write_nothing():
    """What a schema does not say is read from the call: batch norm writes its
    running statistics only with training set (precision: eval graphs save nothing)."""
    gm = _graph_module(_eval_norms, p=torch.ones(4), rm=torch.zeros(4), rv=torch.ones(4))
    assert state_writes(gm) == frozenset()


def test_higher_order_ops_may_write_what_they_get():
    """A cond's branches are graphs of their own: whatever it is given may be written."""

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.zeros(3))

        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda x, b: x + b, lambda x, b: x - b, (x, self.b))

    gm = torch.export.export(Branchy(), (torch.randn(3),)).module()
    hops = [n for n in gm.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]
    assert hops
    assert id(gm.b) in state_writes(gm)


def test_boxed_calling_convention_is_not_run_as_a_graph():
    from torch.fx.graph import CodeGen

    class Boxed(CodeGen):  # stands for Inductor's: the runner does not know it
        pass

    gm = lazy(fx.symbolic_trace(Mixed()))
    gm.graph.set_codegen(Boxed())
    assert not waits_for_code(gm)


def _iadd_method(g):
    x, p = g.placeholder("x"), g.get_attr("p")
    g.call_method("__iadd__", (p, x))
    g.output(g.call_function(operator.mul, (x, 2)))


def _list_of_parameters(g):
    x, ps = g.placeholder("x"), g.get_attr("ps")
    first = g.call_function(operator.getitem, (ps, 0))
    g.call_method("mul_", (first, 3.0))
    g.output(g.call_function(operator.mul, (x, 2)))


def test_more_hidden_writes_are_found():
    gm = _graph_module(_iadd_method, p=torch.ones(4, 1))
    assert id(gm.p) in state_writes(gm)
    root = nn.Module()
    root.w = nn.Parameter(torch.ones(2))
    root.ps = [root.w]
    g = fx.Graph()
    _list_of_parameters(g)
    gm = fx.GraphModule(root, g)
    assert id(root.w) in state_writes(gm)  # the list the graph reads holds it


def test_hooks_make_state_writable():
    """A hook runs besides the graph: on a leaf module, all its state may be written;
    on the root, anything (export's own input checks excepted)."""
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))
    assert state_writes(gm) == frozenset()
    gm.get_submodule("0").register_forward_pre_hook(lambda m, args: None)
    assert id(gm.get_submodule("0").weight) in state_writes(gm)
    plain = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))
    plain.register_forward_hook(lambda m, args, out: None)
    assert state_writes(plain) is None
    model, (x,) = demo_cnn_with_inputs()
    exported = torch.export.export(model.eval(), (x,)).module()
    assert exported._forward_pre_hooks and state_writes(exported) is not None


def test_a_call_given_a_module_may_run_it():
    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(2)

    root = Inner().train()
    g = fx.Graph()
    x, bn = g.placeholder("x"), g.get_attr("bn")
    g.output(g.call_method("forward", (bn, x)))
    gm = fx.GraphModule(root, g)
    assert id(gm.bn.running_mean) in state_writes(gm)


def test_each_norm_call_is_read_on_its_own():
    """Whether batch norm writes is a property of the call (its training flag), not of
    the op: an eval-mode call first does not hide a training-mode one after it."""

    def build(g):
        x, rm, rv = g.placeholder("x"), g.get_attr("rm"), g.get_attr("rv")
        bn = torch.ops.aten.batch_norm.default
        y = g.call_function(bn, (x, None, None, g.get_attr("p"), g.get_attr("p"), False, 0.1, 1e-5, False))
        g.output(g.call_function(bn, (y, None, None, rm, rv, True, 0.1, 1e-5, False)))

    gm = _graph_module(build, p=torch.ones(4), rm=torch.zeros(4), rv=torch.ones(4))
    assert state_writes(gm) == {id(gm.rm), id(gm.rv)}


class _Structured(nn.Module):
    """Outputs and arguments in lists and dicts, as models return them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        parts = [h.sum(), h.mean(dim=1)]
        return {"a": h * 1.0, "b": parts, "c": (torch.cat([h, h], dim=1), [h.amax()])}


def _structure(value):
    return torch.utils._pytree.tree_structure(value)


def test_runner_builds_the_containers_the_generated_code_builds():
    """Lists and dicts, in outputs and in arguments, are the plain ones the
    generated code makes (not fx's immutable ones): the pytree structure a caller
    sees is the same, so the check compares like with like."""
    model = _Structured().eval()
    x = torch.randn(2, 3, 8, 8)
    gm = lazy(fx.symbolic_trace(model))
    got = GraphRunner(gm)(x)
    expected = fx.symbolic_trace(model)(x)
    assert _structure(got) == _structure(expected) == _structure(model(x))
    assert type(got["b"]) is list and type(got) is dict
    assert _same(got, expected)


def test_check_of_a_model_returning_lists_and_dicts():
    model = _Structured().eval()
    x = torch.randn(2, 3, 8, 8)
    gm = fx.symbolic_trace(model)
    for rules in ("rules/fusion.rw", "rules/cleanup.rw"):
        result = rewrite.load(rules).apply(gm, (x,))  # raised EquivalenceError: dict vs immutable_dict
        assert result.counts and result.equivalence.ok
        assert _structure(result.graph_module(x)) == _structure(model(x))
        assert _same(result.graph_module(x), model(x)) or rules.endswith("fusion.rw")


def _list_kinds(first, *, rest):
    """What a function sees: the container types of its arguments."""
    return torch.tensor([type(first) is list, type(rest) is list], dtype=torch.bool)


def test_lists_given_by_keyword_are_plain_and_calls_without_lists_are_direct():
    """A list given by keyword reaches the function as a plain list, as in the
    generated code; a call whose arguments hold no list (empty keywords included)
    is planned as a direct call."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    relu = graph.call_function(torch.relu, (x,))
    kinds = graph.call_function(_list_kinds, ([relu, x],), {"rest": [x, relu]})
    graph.output((relu, kinds))
    gm = lazy(fx.GraphModule(nn.Module(), graph))
    runner = GraphRunner(gm)
    plans = {step[0].name: step[1] for step in runner.steps}
    assert plans["relu"] != plans["_list_kinds"]  # direct call vs lists made plain
    x = torch.randn(3)
    got = runner(x)
    assert got[1].tolist() == [True, True]
    assert _same(got, fx.GraphModule(nn.Module(), graph)(x))  # the generated code's


def _nested_kinds(items, *, scale):
    """The container types a function sees, nested: [list, list, dict, list]."""
    inner, table = items[0], items[1]
    kinds = [type(items) is list, type(inner) is list, type(table) is dict, type(table["k"]) is list]
    return torch.tensor(kinds, dtype=torch.bool) * scale


def test_nested_containers_are_plain_at_every_level():
    graph = fx.Graph()
    x = graph.placeholder("x")
    relu = graph.call_function(torch.relu, (x,))
    kinds = graph.call_function(_nested_kinds, ([[relu, x, 2], {"k": [x, (relu, 3)]}],), {"scale": 1})
    graph.output(kinds)
    got = GraphRunner(lazy(fx.GraphModule(nn.Module(), graph)))(torch.randn(3))
    assert got.tolist() == [True, True, True, True]
