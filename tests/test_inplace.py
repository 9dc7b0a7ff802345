"""``RuleSet.apply(..., inplace=True)``: the given module is rewritten itself, and
every failure (an exception mid-rewrite, a failed check, a skip-rule rollback)
puts it back exactly; the default copies cheaply (tensors shared, never written)
and never mutates its input; both produce the same graphs."""

import functools
import operator
import shutil

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rewrite
import rewrite.engine.facts
from rewrite.capture import capture
from rewrite.engine.driver import NonTerminationError, Schedule
from rewrite.examples.cnn import demo_cnn_with_inputs, resnet_tiny_with_inputs
from tests.test_transactions import BROKEN, Net


@functools.lru_cache(maxsize=None)
def shipped():
    return rewrite.load("rules/fusion.rw") + rewrite.load("rules/cleanup.rw")


def snapshot(gm: fx.GraphModule) -> dict:
    """Everything an in-place rollback must restore, by identity and by value."""
    nodes = list(gm.graph.nodes)
    return {
        "nodes": nodes,
        "format": [n.format_node() for n in nodes],
        "names": [n.name for n in nodes],
        "users": [list(n.users) for n in nodes],
        "meta": [(n.meta, dict(n.meta)) for n in nodes],
        "code": gm.code,
        "params": [(k, v, v.detach().clone()) for k, v in gm.named_parameters(remove_duplicate=False)],
        "buffers": [(k, v, v.detach().clone()) for k, v in gm.named_buffers(remove_duplicate=False)],
        "modules": list(gm.named_modules(remove_duplicate=False)),
        "state_keys": list(gm.state_dict()),
    }


def assert_restored(gm: fx.GraphModule, before: dict) -> None:
    now = snapshot(gm)
    assert now["nodes"] == before["nodes"]  # the same Node objects, in order
    assert now["format"] == before["format"]
    assert now["names"] == before["names"]
    assert now["users"] == before["users"]
    for (meta, saved), (meta_now, _) in zip(before["meta"], now["meta"]):
        assert meta_now is meta
        assert meta.keys() == saved.keys() and all(meta[k] is saved[k] for k in saved)
    assert now["code"] == before["code"]
    for kind in ("params", "buffers"):
        assert [k for k, _, _ in now[kind]] == [k for k, _, _ in before[kind]]
        for (_, t, _), (_, t0, v0) in zip(now[kind], before[kind]):
            assert t is t0 and torch.equal(t, v0)
    assert [(k, id(m)) for k, m in now["modules"]] == [(k, id(m)) for k, m in before["modules"]]
    assert now["state_keys"] == before["state_keys"]
    gm.graph.lint()
    # the node lookup table and the namespace are consistent too: a fresh rewrite works
    assert len(gm.graph.nodes) == len(before["nodes"])


def graph_text(gm: fx.GraphModule) -> list:
    return [n.format_node() for n in gm.graph.nodes]


CASES = [
    ("demo_cnn", demo_cnn_with_inputs, "fx"),
    ("demo_cnn", demo_cnn_with_inputs, "export"),
    ("resnet_tiny", resnet_tiny_with_inputs, "fx"),
]


# ---------------------------------------------------------------- differential


@pytest.mark.parametrize("name,factory,level", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_inplace_and_copy_make_the_same_graph(name, factory, level):
    model, inputs = factory()
    gm = capture(model.eval(), inputs, level)
    with torch.no_grad():
        expected = gm(*inputs)
    copied = shipped().apply(gm, example_inputs=inputs)
    assert copied.counts, "the case must exercise some rules"
    assert copied.graph_module is not gm
    result = shipped().apply(gm, example_inputs=inputs, inplace=True)
    assert result.graph_module is gm
    assert result.counts == copied.counts
    assert graph_text(gm) == graph_text(copied.graph_module)
    assert gm.code == copied.graph_module.code
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(copied.graph_module(*inputs), expected, rtol=1e-4, atol=1e-4)
    # export graphs: every surviving node carries a FakeTensor val, as in the input
    if level == "export":
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is not operator.getitem:
                assert isinstance(n.meta.get("val"), torch.Tensor), n.name
                assert "rewrite_new" not in n.meta


_OPS = [
    lambda x: x * 1, lambda x: x + 0, lambda x: x - 0, lambda x: x / 1,
    lambda x: torch.relu(x), lambda x: torch.relu(torch.relu(x)), lambda x: torch.neg(torch.neg(x)),
    lambda x: x.transpose(0, 1).transpose(0, 1), lambda x: torch.sigmoid(x),
    lambda x: x.permute(1, 0).permute(1, 0), lambda x: x.reshape(-1).view(x.shape),
]


class Chain(nn.Module):
    def __init__(self, picks):
        super().__init__()
        self.picks = picks

    def forward(self, x):
        for i in self.picks:
            x = _OPS[i](x)
        return x


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(picks=st.lists(st.integers(0, len(_OPS) - 1), min_size=1, max_size=12),
       level=st.sampled_from(["fx", "export"]))
def test_inplace_equals_copy_on_generated_graphs(picks, level):
    x = torch.randn(3, 3)
    gm = capture(Chain(picks), (x,), level)
    expected = gm(x)
    copied = shipped().apply(gm, example_inputs=(x,), check=False)
    result = shipped().apply(gm, example_inputs=(x,), check=False, inplace=True)
    assert result.counts == copied.counts
    assert graph_text(gm) == graph_text(copied.graph_module)
    torch.testing.assert_close(gm(x), expected)


# ---------------------------------------------------------------- the default never mutates


@pytest.mark.parametrize("name,factory,level", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_default_shares_tensors_and_never_writes_them(name, factory, level):
    model, inputs = factory()
    gm = capture(model.eval(), inputs, level)
    before = snapshot(gm)
    result = shipped().apply(gm, example_inputs=inputs)
    assert result.counts
    assert_restored(gm, before)  # the input: untouched, by identity and value
    out = result.graph_module
    mine = {id(t) for _, t, _ in before["params"] + before["buffers"]}
    theirs = dict(out.named_parameters(remove_duplicate=False)) | dict(out.named_buffers(remove_duplicate=False))
    shared = [k for k, t in theirs.items() if id(t) in mine]
    new = [k for k, t in theirs.items() if id(t) not in mine]
    assert shared, "unchanged tensors are shared, not copied"
    assert new, "a folded constant is a new tensor (copy-on-write)"
    # the result's own tables: nothing it adds or drops shows in the input
    assert set(theirs) != {k for k, _, _ in before["params"] + before["buffers"]}
    for name_, m in gm.named_modules():
        if name_:
            assert out.get_submodule(name_) is not m if name_ in dict(out.named_modules()) else True


# ---------------------------------------------------------------- rollback


# the broken rule file and the model of the transaction tests (sigmoid -> relu is wrong)


X = torch.randn(2, 3, 8, 8)


def _broken(tmp_path):
    shutil.copy(rewrite.rules_dir() / "fusion.rw", tmp_path / "fusion.rw")
    path = tmp_path / "mixed.rw"
    path.write_text(BROKEN)
    return rewrite.load(str(path))


@pytest.mark.parametrize("level", ["fx", "export"])
def test_failed_check_restores_the_module_exactly(tmp_path, level):
    gm = capture(Net().eval(), (X,), level)
    before = snapshot(gm)
    with pytest.raises(rewrite.EquivalenceError) as info:
        _broken(tmp_path).apply(gm, example_inputs=(X,), inplace=True)
    assert info.value.culprit.rule == "broken"
    assert_restored(gm, before)
    # and the restored module still rewrites as a fresh one does
    good = rewrite.load("rules/fusion.rw")
    expected = good.apply(gm, example_inputs=(X,))
    result = good.apply(gm, example_inputs=(X,), inplace=True)
    assert result.counts == expected.counts == {"conv_bn": 2}
    assert graph_text(gm) == graph_text(expected.graph_module)


@pytest.mark.parametrize("level", ["fx", "export"])
def test_skip_rule_rolls_back_one_application_in_place(tmp_path, level):
    gm = capture(Net().eval(), (X,), level)
    expected = gm(X)
    copied = _broken(tmp_path).apply(gm, example_inputs=(X,), on_mismatch="skip-rule")
    with pytest.warns(UserWarning, match="rolled back"):
        result = _broken(tmp_path).apply(gm, example_inputs=(X,), on_mismatch="skip-rule", inplace=True)
    assert result.graph_module is gm
    assert result.counts == copied.counts == {"conv_bn": 2}
    assert [r.rule for r in result.rejected] == ["broken"]
    assert any(n.target in (torch.sigmoid, torch.ops.aten.sigmoid.default) for n in gm.graph.nodes)
    assert graph_text(gm) == graph_text(copied.graph_module)
    torch.testing.assert_close(gm(X), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("level", ["fx", "export"])
def test_exception_mid_rewrite_restores_the_module_exactly(level, monkeypatch):
    gm = capture(Net().eval(), (X,), level)
    before = snapshot(gm)
    calls = []

    def fail(self, nodes):  # after every rewrite is made, before the result is checked
        calls.append(len(nodes))
        raise KeyboardInterrupt("stop")

    monkeypatch.setattr(rewrite.engine.facts.GraphFacts, "settle", fail)
    with pytest.raises(KeyboardInterrupt):
        shipped().apply(gm, example_inputs=(X,), inplace=True)
    assert calls and calls[0] > 0  # the graph had been rewritten when it failed
    assert_restored(gm, before)


class Doubles(nn.Module):
    def forward(self, x):
        return torch.relu(x * 2) * 2


def test_non_termination_restores_the_module_exactly():
    gm = fx.symbolic_trace(Doubles())
    before = snapshot(gm)
    undo_each_other = rewrite.parse("rule a: mul(x, 2) => add(x, x)\nrule b: add(x, x) => mul(x, 2)\n")
    with pytest.raises(NonTerminationError):
        undo_each_other.apply(gm, example_inputs=(torch.randn(3),), inplace=True, check=False)
    assert_restored(gm, before)


def test_facts_recorded_on_the_input_are_rolled_back(tmp_path):
    # symbolic_trace graphs carry no shapes: facts get recorded on the input's own
    # nodes while rewriting in place; a rollback removes them
    gm = fx.symbolic_trace(Net().eval())
    assert not any("rewrite_facts" in n.meta for n in gm.graph.nodes)
    rules = rewrite.parse("rule r: sigmoid(x) where rank(x) == 4 => relu(x)\n")
    before = snapshot(gm)
    with pytest.raises(rewrite.EquivalenceError):
        rules.apply(gm, example_inputs=(X,), inplace=True)
    assert_restored(gm, before)
    assert not any("rewrite_facts" in n.meta for n in gm.graph.nodes)


def test_inplace_refuses_what_it_cannot_rewrite_in_place():
    with pytest.raises(ValueError, match="GraphModule"):
        shipped().apply(Net().eval(), inplace=True)


def test_nothing_to_rewrite_leaves_the_module_and_its_code():
    gm = fx.symbolic_trace(Net().eval())
    before = snapshot(gm)
    result = rewrite.parse("rule r: tanh(x) => x\n").apply(gm, example_inputs=(X,), inplace=True)
    assert not result.counts and result.graph_module is gm
    assert_restored(gm, before)


# ---------------------------------------------------------------- settings and schedules


def test_schedules_are_frozen_records():
    rules = rewrite.parse("rule a: relu(x) => x\nrule b: neg(neg(x)) => x\nruleset main = seq(a, once(b))\n")
    assert isinstance(rules.schedule, Schedule)
    assert rules.schedule.kind == "seq"
    assert rules.schedule.items[0] == "a" and rules.schedule.items[1] == Schedule("once", ("b",))
    with pytest.raises(Exception):
        rules.schedule.kind = "once"
    with pytest.raises(ValueError):
        Schedule("sometimes", ("a",))
    assert rules["a"].schedule == Schedule("fixpoint", ("a",))
    assert rules["b"].schedule == Schedule("once", ("b",))  # run as the schedule runs it (session 43)
    assert (rules + rules).schedule.kind == "seq"


def test_driver_settings_are_constructor_arguments():
    import random

    from rewrite.engine.driver import Driver
    from rewrite.ops import detect_dialect

    gm = fx.symbolic_trace(Chain([4, 4, 4]))
    rules = rewrite.parse("rule r: relu(relu(x)) => relu(x)\n")
    driver = Driver(gm, detect_dialect(gm), limit=1, skip={("r", "nothing")}, shuffle=random.Random(0))
    driver.run(rules.schedule, lambda name: rules.rules.get(name) or rules.sets[name])
    assert driver.counts == {"r": 1}  # the limit held
    assert sum(n.target is torch.relu for n in gm.graph.nodes) == 2


class _Holder(nn.Module):
    """Holds the weight it is built from, as a trainable parameter."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight)


@rewrite.register_module(inputs=("x",))
def inplace_test_holder(x=None, weight=None):
    return _Holder(weight)


class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3, bias=False)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.fc.weight)


def test_a_module_built_from_a_parameter_holds_its_own_copy():
    # the result shares the input's parameters, so a module a rule builds from one
    # gets a copy: training it leaves the input alone
    x = torch.randn(2, 4)
    gm = fx.symbolic_trace(Lin().eval())  # inference: const(w) holds
    weight = gm.fc.weight
    before = weight.detach().clone()
    rules = rewrite.parse("rule hold: linear(x, w) where const(w) => inplace_test_holder(x, w)\n")
    result = rules.apply(gm, example_inputs=(x,))
    assert result.counts == {"hold": 1}
    held = [m for m in result.graph_module.modules() if isinstance(m, _Holder)]
    assert len(held) == 1 and held[0].weight is not weight
    assert isinstance(held[0].weight, nn.Parameter) and held[0].weight.requires_grad
    torch.testing.assert_close(result.graph_module(x), gm(x))
    with torch.no_grad():
        held[0].weight.add_(1.0)
    assert torch.equal(weight, before)


SHIPPED = ["fusion.rw", "cleanup.rw", "amp_bf16.rw", "amp_fp16.rw", "quant/observe.rw"]


@pytest.mark.parametrize("path", SHIPPED)
@pytest.mark.parametrize("level", ["fx", "export"])
def test_every_shipped_rule_set_rewrites_the_same_in_place(path, level):
    model, inputs = demo_cnn_with_inputs()
    gm = capture(model.eval(), inputs, level)
    rules = rewrite.load(path)
    copied = rules.apply(gm, example_inputs=inputs, check=False)
    before = snapshot(gm)
    assert_restored(gm, before)
    result = rules.apply(gm, example_inputs=inputs, check=False, inplace=True)
    assert result.counts == copied.counts
    assert graph_text(gm) == graph_text(copied.graph_module)
    assert sorted(n for n, _ in gm.named_modules()) == sorted(n for n, _ in copied.graph_module.named_modules())
    assert list(gm.state_dict()) == list(copied.graph_module.state_dict())


# ---------------------------------------------------------------- the check: once per trial


class Ids(nn.Module):
    def forward(self, ids):
        return torch.relu(torch.relu(ids.float() * 2))


def test_trials_that_cannot_tell_are_skipped_and_reported():
    ids = torch.zeros((0,), dtype=torch.long)  # an empty input: every trial the same
    rules = rewrite.parse("rule rr: relu(relu(x)) => relu(x)\n")
    result = rules.apply(fx.symbolic_trace(Ids()), example_inputs=(ids,))
    assert result.counts == {"rr": 1}
    report = result.equivalence
    assert report.ok and report.skipped == 2
    assert "2 trial(s) skipped" in str(report)
    varied = rules.apply(fx.symbolic_trace(Ids()), example_inputs=(torch.arange(3),))
    assert varied.equivalence.ok and varied.equivalence.skipped == 0


def test_the_reference_runs_once_per_trial_across_bisection(tmp_path, monkeypatch):
    import rewrite.trust.check as check

    calls = {"reference": 0, "candidate": 0}
    real = check._call
    gm = capture(Net().eval(), (X,), "export")

    def counting(fn, inputs, seed, *rest):
        calls["reference" if fn is gm else "candidate"] += 1
        return real(fn, inputs, seed, *rest)

    monkeypatch.setattr(check, "_call", counting)
    with pytest.raises(rewrite.EquivalenceError):
        _broken(tmp_path).apply(gm, example_inputs=(X,))
    # bisection ran several candidates; the original at most once per trial
    assert calls["candidate"] >= 3
    assert 1 <= calls["reference"] <= 3
