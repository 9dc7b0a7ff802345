"""Operand prefilters (``rewrite.engine.prefilter``): sound, effective, and invisible.

* Sound: whenever the matcher finds a match at a node, the rule's prefilter for
  that node key lets the node through. Checked on random small graphs written in
  many spellings of the same ops (operators, torch functions, methods, keywords,
  literals in either position, in-place twins), symbolic_traced and exported to
  ATen, for the shipped cleanup rules, the matcher benchmark's rules and a set of
  rules written to reach the prefilter's corners (qualified roots, keyword and
  literal arguments, families, alternatives, renamed parameters).
* Effective: on the benchmark's synthetic graphs the prefilters turn most
  candidate nodes away before matching, and the planted rewrites still happen.
* Invisible: the compiled path (prefilters on) and the interpreter (prefilters
  off) make the same rewrites and produce the same code.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import operator
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import fx, nn

import rewrite
import rewrite.engine.match
from rewrite.engine.driver import RuleIndex
from rewrite.engine.facts import GraphFacts
from rewrite.engine.match import Matcher
from rewrite.engine.prefilter import build_prefilter

REPO = Path(__file__).resolve().parents[1]
aten = torch.ops.aten

RULES = rewrite.load(REPO / "rules" / "cleanup.rw") + rewrite.load(REPO / "benchmarks" / "matcher_rules.rw")

# Rules that exercise what the shipped ones do not: qualified roots and operands,
# keyword and literal arguments (first position of a commutative op, renamed
# parameters of rsub, keyword-only), families and alternatives, sequences.
EXTRA = rewrite.parse(
    """
    family na = neg | abs
    rule x_qualified: torch.relu(F.relu(x)) => x
    rule x_add_alpha: add(x, neg(_), alpha=2) => x
    rule x_add_neg_first: add(neg(_), x) => x
    rule x_sub_alpha: sub(x, y, alpha=-1) => add(x, y)
    rule x_transpose_lit: transpose(x, 0, 1) => x
    rule x_transpose_kw: transpose(x, dim1=1, dim0=-1) => x
    rule x_mul_lit_first: mul(2.0, x) => x
    rule x_div_nested: div(neg(x), 1) => x
    rule x_squeeze_lit: squeeze(unsqueeze(x, 0), 0) => x
    rule x_aten: aten.add.Tensor(x, aten.neg.default(_)) => x
    rule x_method: Tensor.add(x, _) => x
    rule x_sub_nested_first: sub(neg(x), _) => x
    rule x_contig: contiguous(transpose(x, _, _)) => x
    rule x_family: relu(na(x)) => x
    rule x_alt: (relu | sigmoid)((neg | abs)(x)) => x
    rule x_to: to(x, torch.float64) => x
    rule x_cat: cat([relu(x)], 0) => x
    rule x_rsub: sub(1, x) => x
    rule x_sub_lit_nested: sub(neg(x), 2.0, ...) => x
    rule x_deep: add(mul(relu(x), 1), neg(_)) => x
    rule x_permute: permute(x, (1, 0)) => x
    rule x_view: view(x, (4, 4)) => x
    rule x_same: mul(x, x) => x
    rule x_nested_lit: add(x, mul(_, 2.0)) => x
    rule x_nested_lit_first: add(x, mul(-1, _)) => x
    rule x_nested_kw: relu(transpose(x, dim1=1, dim0=-1)) => x
    rule x_nested_deep_lit: add(neg(mul(x, 1)), _) => x
    rule x_nested_alt: sub(x, (mul | div)(_, 2.0)) => x
    """,
    "extra.rw",
)

ALL_RULES = tuple(RULES.rules.values()) + tuple(EXTRA.rules.values())
APPLIED = RULES + EXTRA

_PREFILTERS: dict = {}


def prefilter_for(rule, key):
    """``build_prefilter`` as the driver calls it, once per (rule, node key)."""
    k = (rule.name, rule.order, key)
    if k not in _PREFILTERS:
        _PREFILTERS[k] = build_prefilter(rule, key)
    return _PREFILTERS[k]


@contextlib.contextmanager
def compiled_mode(on: bool):
    """Run with the compiled matcher (prefilters on) or the interpreter (off)."""
    saved = rewrite.engine.match.COMPILED
    rewrite.engine.match.COMPILED = on
    try:
        yield
    finally:
        rewrite.engine.match.COMPILED = saved


# ---------------------------------------------------------------- random programs
#
# A program is a list of steps; each step applies one op, in one spelling, to the
# k-th most recent value (so chains such as relu(relu(x)) are frequent) and, for
# binary ops, to another value or a literal, in either order. The same program runs
# under symbolic_trace (torch-level graph) and torch.export (ATen graph).

LITERALS = (0, 1, -1, 2.0)
DIMS = (0, 1, -1, -2)
PERMS = ((1, 0), (0, 1), (-1, 0), (0, -1), (-1, -2), (-2, -1))
DTYPES = (torch.float32, torch.float64)


def _t(fn):
    """Marks a binary spelling whose first operand must be a tensor."""
    fn.tensor_first = True
    return fn


BINARY = {
    "add": (
        lambda a, b: a + b,
        lambda a, b: torch.add(a, b),
        lambda a, b: torch.add(a, b, alpha=2),
        lambda a, b: torch.add(a, other=b),
        _t(lambda a, b: a.add(b)),
        _t(lambda a, b: a.add(b, alpha=-1)),
        _t(lambda a, b: torch.add(input=a, other=b)),
    ),
    "mul": (
        lambda a, b: a * b,
        lambda a, b: torch.mul(a, b),
        lambda a, b: torch.mul(a, other=b),
        _t(lambda a, b: a.mul(b)),
    ),
    "sub": (
        lambda a, b: a - b,
        lambda a, b: torch.sub(a, b),
        lambda a, b: torch.sub(a, b, alpha=2),
        _t(lambda a, b: a.sub(b)),
        _t(lambda a, b: torch.rsub(a, b)),
    ),
    "div": (
        lambda a, b: a / b,
        lambda a, b: torch.div(a, b),
        _t(lambda a, b: a.div(b)),
        lambda a, b: torch.div(a, b, rounding_mode=None),
    ),
}


def _squeeze(spell):
    def run(a, q):
        d1, d2 = (0, 1, -1)[q % 3], (0, 1, -1)[(q // 3) % 3]
        out = spell(a, d1, d2)
        return out if d1 % 3 == d2 % 3 else out.reshape(4, 4)

    return run


def _dtype_cast(a, q):
    return a.double() if DTYPES[q % 2] is torch.float64 else a.float()


UNARY = {
    "neg": (lambda a, q: torch.neg(a), lambda a, q: -a, lambda a, q: a.neg(), lambda a, q: torch.negative(a)),
    "relu": (lambda a, q: torch.relu(a), lambda a, q: F.relu(a), lambda a, q: a.relu(),
             lambda a, q: F.relu(a, inplace=False), "inplace", "module"),
    "abs": (lambda a, q: torch.abs(a), lambda a, q: abs(a), lambda a, q: a.abs()),
    "sigmoid": (lambda a, q: torch.sigmoid(a), lambda a, q: a.sigmoid(), "module"),
    "contiguous": (lambda a, q: a.contiguous(), lambda a, q: a.contiguous(memory_format=torch.contiguous_format)),
    "transpose": (
        lambda a, q: a.transpose(DIMS[q % 4], DIMS[q // 4 % 4]),
        lambda a, q: torch.transpose(a, DIMS[q % 4], DIMS[q // 4 % 4]),
        lambda a, q: a.transpose(DIMS[q % 4], dim1=DIMS[q // 4 % 4]),
        lambda a, q: torch.transpose(a, dim0=DIMS[q % 4], dim1=DIMS[q // 4 % 4]),
    ),
    "permute": (
        lambda a, q: a.permute(*PERMS[q % len(PERMS)]),
        lambda a, q: a.permute(PERMS[q % len(PERMS)]),
        lambda a, q: a.permute(list(PERMS[q % len(PERMS)])),
        lambda a, q: torch.permute(a, PERMS[q % len(PERMS)]),
    ),
    "reshape": (
        lambda a, q: a.reshape(4, 4),
        lambda a, q: a.reshape((4, 4)),
        lambda a, q: a.reshape(-1, 4),
        lambda a, q: torch.reshape(a, (4, -1)),
        lambda a, q: a.view(4, 4),
        lambda a, q: a.view(-1, 4),
        lambda a, q: a.view((4, 4)),
        lambda a, q: a.reshape(16).view(4, 4),
        lambda a, q: torch.reshape(a, (16,)).reshape(4, 4),
    ),
    "squeeze": (
        _squeeze(lambda a, d1, d2: a.unsqueeze(d1).squeeze(d2)),
        _squeeze(lambda a, d1, d2: torch.squeeze(torch.unsqueeze(a, d1), d2)),
        _squeeze(lambda a, d1, d2: a.unsqueeze(d1).squeeze(dim=d2)),
    ),
    "to": (
        lambda a, q: a.to(DTYPES[q % 2]),
        lambda a, q: a.to(dtype=DTYPES[q % 2]),
        _dtype_cast,
        lambda a, q: a.type(DTYPES[q % 2]),
        lambda a, q: a.to(DTYPES[q % 2]).to(DTYPES[q // 2 % 2]),
    ),
    "cat": (
        lambda a, q: torch.cat([a], (0, 1, -1)[q % 3]),
        lambda a, q: torch.cat((a,), dim=(0, 1, -1)[q % 3]),
        lambda a, q: torch.concat([a], (0, 1, -1)[q % 3]),
    ),
    "silu": (
        lambda a, q: a * torch.sigmoid(a),
        lambda a, q: torch.sigmoid(a) * a,
        lambda a, q: torch.mul(a, a.sigmoid()),
    ),
}

KINDS = tuple(BINARY) + tuple(UNARY)
N_INPUTS = 3


class Program(nn.Module):
    """Runs a list of steps; returns the last value and a few others."""

    def __init__(self, steps: tuple, outs: tuple) -> None:
        super().__init__()
        self.steps = steps
        self.outs = outs
        self.acts = nn.ModuleDict({"relu": nn.ReLU(), "sigmoid": nn.Sigmoid()})  # call_module spellings

    def __repr__(self) -> str:
        return f"Program({self.steps!r}, {self.outs!r})"

    def forward(self, x, y, z):
        vals = [x, y, z]
        for kind, spelling, a, b, first, q in self.steps:
            n = len(vals)
            ia = n - 1 - a % n
            lhs = vals[ia]
            if kind in BINARY:
                fn = BINARY[kind][spelling % len(BINARY[kind])]
                rhs = vals[n - 1 - b[1] % n] if b[0] == "v" else b[1]
                if first and not (getattr(fn, "tensor_first", False) and b[0] == "lit"):
                    lhs, rhs = rhs, lhs
                vals.append(fn(lhs, rhs))
            else:
                fn = UNARY[kind][spelling % len(UNARY[kind])]
                if fn == "inplace":  # never on a graph input
                    vals.append(torch.relu(lhs) if ia < N_INPUTS else lhs.relu_())
                elif fn == "module":
                    vals.append(self.acts[kind](lhs))
                else:
                    vals.append(fn(lhs, q))
        return (vals[-1],) + tuple(vals[i % len(vals)] for i in self.outs)


def inputs():
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(4, 4, generator=g),
        torch.randn(4, 4, generator=g, dtype=torch.float64),
        torch.randint(-3, 4, (4, 4), generator=g),
    )


@st.composite
def programs(draw, max_steps: int = 10):
    steps = []
    for _ in range(draw(st.integers(1, max_steps))):
        # half the time, the op of the previous step again on its result:
        # relu(relu(x)), neg(neg(x)), transpose(transpose(x)) ...
        repeat = steps and draw(st.booleans())
        kind = steps[-1][0] if repeat else draw(st.sampled_from(KINDS))
        spelling = draw(st.integers(0, 8))
        a = 0 if repeat else draw(st.one_of(st.just(0), st.integers(0, 4)))
        b = draw(st.one_of(st.tuples(st.just("v"), st.one_of(st.just(0), st.integers(0, 4))),
                           st.tuples(st.just("lit"), st.sampled_from(LITERALS))))
        first = draw(st.booleans())
        q = draw(st.integers(0, 15))
        steps.append((kind, spelling, a, b, first, q))
    outs = tuple(draw(st.lists(st.integers(0, 30), max_size=2)))
    return Program(tuple(steps), outs)


def capture(prog: Program, level: str) -> fx.GraphModule:
    if level == "fx":
        return fx.symbolic_trace(prog)
    return torch.export.export(prog, inputs(), strict=False).module()


def check_soundness(gm: fx.GraphModule, tally: collections.Counter) -> None:
    """At every call node and for every rule: the compiled matcher and the
    interpreter agree, and a match implies the prefilter lets the node through."""
    ex = inputs()
    compiled = Matcher(gm, GraphFacts(gm, ex), compiled=True)
    interp = Matcher(gm, GraphFacts(gm, ex), compiled=False)
    for node in gm.graph.nodes:
        if not node.op.startswith("call_"):
            continue
        key = compiled.key(node)
        for rule in ALL_RULES:
            pf = prefilter_for(rule, key)
            m = compiled.match(rule, node)
            mi = interp.match(rule, node)
            assert (m is None) == (mi is None), (rule.name, node.format_node())
            if m is not None:
                assert m.nodes == mi.nodes, (rule.name, node.format_node())
            if pf is None:
                tally["no_prefilter"] += m is not None
                continue
            passed = pf(compiled, node)
            assert isinstance(passed, bool)
            if m is not None:
                assert passed, (
                    f"unsound prefilter: rule {rule.name!r} matches at {node.format_node()} "
                    f"but its prefilter rejects it\n{gm.graph}"
                )
                tally["matched"] += 1
                tally["rule:" + rule.name] += 1
            else:
                tally["rejected" if not passed else "passed_no_match"] += 1


def check_apply_differential(prog: Program, level: str, tally: collections.Counter) -> None:
    """The whole rewrite, with prefilters (compiled) and without (interpreter)."""
    results = {}
    for on in (True, False):
        gm = capture(prog, level)
        with compiled_mode(on):
            try:
                results[on] = APPLIED.apply(gm, example_inputs=inputs(), check=False)
            except rewrite.NonTerminationError as err:  # same in both modes, or a bug
                results[on] = ("raised", err.rules)
    on, off = results[True], results[False]
    if isinstance(on, tuple) or isinstance(off, tuple):
        assert on == off
        return
    assert on.counts == off.counts
    assert on.graph_module.code == off.graph_module.code
    for name, s in off.stats.items():
        assert s.prefiltered == 0  # the interpreter has no prefilters
        # the same nodes were visited: each one was either tried or turned away
        assert on.stats[name].tries == s.tries, name  # prefiltered counts among the tries
        assert on.stats[name].applied == s.applied
    tally["applied"] += sum(on.counts.values())
    tally["turned_away"] += sum(s.prefiltered for s in on.stats.values())


SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}


def test_prefilter_is_sound_on_random_traced_graphs():
    tally: collections.Counter = collections.Counter()

    @settings(max_examples=100, **SETTINGS)
    @given(programs())
    def run(prog):
        gm = capture(prog, "fx")
        with torch.no_grad():
            gm(*inputs())  # the generator writes only runnable programs: facts need them
        check_soundness(gm, tally)
        check_apply_differential(prog, "fx", tally)

    run()
    # the property was not vacuous: many rules matched, many nodes were turned away
    matched_rules = {k for k in tally if k.startswith("rule:")}
    assert tally["matched"] >= 30, tally
    assert len(matched_rules) >= 8, tally
    assert tally["rejected"] >= 100, tally
    assert tally["applied"] > 0 and tally["turned_away"] > 0, tally


def test_prefilter_is_sound_on_random_exported_graphs():
    tally: collections.Counter = collections.Counter()

    @settings(max_examples=20, **SETTINGS)
    @given(programs(max_steps=8))
    @example(Program((("relu", 0, 0, ("v", 0), False, 0), ("relu", 2, 0, ("v", 0), False, 0),
                      ("add", 1, 0, ("lit", 0), True, 0), ("neg", 0, 3, ("v", 0), False, 0),
                      ("add", 0, 1, ("v", 0), False, 0), ("mul", 0, 0, ("lit", -1), True, 0)), ()))
    def run(prog):
        gm = capture(prog, "export")
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        assert all(isinstance(n.target, torch._ops.OpOverload) or n.target is operator.getitem for n in calls)
        check_soundness(gm, tally)

    run()
    assert tally["matched"] >= 3, tally
    assert tally["rejected"] >= 10, tally


# ---------------------------------------------------------------- synthetic graphs

BENCH = REPO / "benchmarks"


def _load_synthetic():
    if "synthetic" in sys.modules:
        return sys.modules["synthetic"]
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("synthetic", BENCH / "synthetic.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["synthetic"] = module
    spec.loader.exec_module(module)
    return module


synthetic = _load_synthetic()
MATCHER_RULES = rewrite.load(REPO / "benchmarks" / "matcher_rules.rw")


@pytest.mark.parametrize("family", ["conv", "transformer"])
def test_prefilters_turn_most_candidates_away_on_synthetic_graphs(family):
    g = synthetic.GENERATORS[family](n_nodes=400, density=60.0)
    with compiled_mode(True):
        result = MATCHER_RULES.apply(g.gm, check=False)
    assert result.counts == g.expected
    stats = result.stats
    turned_away = sum(s.prefiltered for s in stats.values())
    matched = sum(s.tries - s.prefiltered for s in stats.values())  # nodes the matcher ran at
    assert turned_away > matched, {k: (s.prefiltered, s.tries) for k, s in stats.items()}
    assert stats["add_neg"].prefiltered > 0
    assert stats["add_zero"].prefiltered > 0
    assert stats["mul_neg_one"].prefiltered > 0
    if family == "conv":
        # every relu reads a batch norm or the residual add except the planted
        # relu(relu(h)); every add is residual except the planted ones
        assert stats["relu_relu"].prefiltered > 0
        for name in ("relu_relu", "add_neg"):
            s = stats[name]
            assert s.tries - s.prefiltered == s.applied == g.expected[name]
    else:
        assert stats["permute_permute"].prefiltered > 0
        assert stats["reshape_reshape"].prefiltered > 0
        # where clauses over the root's arguments (a family root: reshape | view):
        # only the planted no-ops reach the matcher
        for name in ("reshape_noop", "permute_identity", "transpose_same_dim"):
            s = stats[name]
            assert s.tries - s.prefiltered == s.applied == g.expected[name], (name, s)


@settings(max_examples=10, **SETTINGS)
@given(
    family=st.sampled_from(["conv", "transformer"]),
    n_nodes=st.integers(60, 260),
    density=st.sampled_from([30.0, 80.0, 150.0]),
    seed=st.integers(0, 5),
)
@example(family="conv", n_nodes=150, density=60.0, seed=0)
@example(family="transformer", n_nodes=200, density=60.0, seed=0)
def test_compiled_and_interpreter_rewrite_synthetic_graphs_alike(family, n_nodes, density, seed):
    g = synthetic.GENERATORS[family](n_nodes=n_nodes, density=density, seed=seed)
    results = {}
    for on in (True, False):
        with compiled_mode(on):
            results[on] = MATCHER_RULES.apply(g.gm, check=False)
    on, off = results[True], results[False]
    assert on.counts == off.counts == g.expected
    assert on.graph_module.code == off.graph_module.code
    for name, s in off.stats.items():
        assert s.prefiltered == 0
        assert on.stats[name].tries == s.tries
    x = synthetic.make_inputs(g, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(on.graph_module(*x), g.gm(*x), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- unit checks


def graph_of(build, modules: dict | None = None) -> tuple:
    """A GraphModule from ``build(graph, x, y) -> (node under test, output)``."""
    root = nn.Module()
    for name, mod in (modules or {}).items():
        root.add_module(name, mod)
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    node, out = build(g, x, y)
    g.output(out)
    gm = fx.GraphModule(root, g)
    node = next(n for n in gm.graph.nodes if n.name == node.name)
    return gm, node


def verdict(rules, name: str, build, modules: dict | None = None) -> tuple:
    """(prefilter or None, its verdict at the node, whether the rule matches)."""
    gm, node = graph_of(build, modules)
    ex = (torch.randn(4, 4), torch.randn(4, 4))
    matcher = Matcher(gm, GraphFacts(gm, ex), compiled=True)
    rule = rules.rules[name]
    pf = build_prefilter(rule, matcher.key(node))
    matched = matcher.match(rule, node) is not None
    return pf, (None if pf is None else pf(matcher, node)), matched


def fn(g, target, *args, **kwargs):
    return g.call_function(target, args, kwargs)


def meth(g, name, *args, **kwargs):
    return g.call_method(name, args, kwargs)


def same(node):
    """The node under test is also the graph's output."""
    return node, node


RELU_SPELLINGS = {
    "torch.relu": lambda g, a: fn(g, torch.relu, a),
    "F.relu": lambda g, a: fn(g, F.relu, a),
    "method": lambda g, a: meth(g, "relu", a),
    "aten": lambda g, a: fn(g, aten.relu.default, a),
    "inplace": lambda g, a: meth(g, "relu_", a),
}


NOTHING_CHEAP = rewrite.parse("""
rule bare: relu(x) => x
rule dims: transpose(x, a, b) where is_noop_transpose(x, a, b) => x
rule seq: reshape(x, (4, 4)) => x
rule free: add(x, _, ...) => x
rule vars: add(x, y) => sub(x, y)
""")


@pytest.mark.parametrize("name,key", [
    ("bare", ("call_function", torch.relu)),
    ("bare", ("call_function", F.relu)),
    ("bare", ("call_method", "relu")),
    ("bare", ("call_method", "relu_")),
    ("bare", ("call_function", aten.relu.default)),
    ("seq", ("call_method", "reshape")),  # a sequence literal is left to the matcher
    ("seq", ("call_function", torch.reshape)),
    ("free", ("call_function", torch.add)),
    ("free", ("call_function", operator.add)),
    ("vars", ("call_function", operator.add)),  # operator.add has no alpha to read
    ("bare", ("call_function", torch.sigmoid)),  # not a key of the rule at all
])
def test_no_prefilter_when_the_root_constrains_nothing(name, key):
    assert build_prefilter(NOTHING_CHEAP.rules[name], key) is None


TRANSPOSE_SPELLINGS = {
    "method": lambda g, x, a, b, **kw: meth(g, "transpose", x, a, b, **kw),
    "torch": lambda g, x, a, b, **kw: fn(g, torch.transpose, x, a, b, **kw),
    "aten": lambda g, x, a, b, **kw: fn(g, aten.transpose.int, x, a, b, **kw),
}


@pytest.mark.parametrize("spelling", sorted(TRANSPOSE_SPELLINGS))
def test_where_conjuncts_over_root_arguments_are_a_prefilter(spelling):
    # transpose(x, a, b) where is_noop_transpose(x, a, b): the clause reads only the
    # root's own arguments, so a transpose that is not a no-op is turned away
    # before binding, and one that is goes on to match
    make = TRANSPOSE_SPELLINGS[spelling]
    for a, b, expect in ((0, 1, False), (1, 1, True), (-1, 1, True), (0, -1, False)):
        pf, passed, matched = verdict(NOTHING_CHEAP, "dims", lambda g, x, y: same(make(g, x, a, b)))
        assert pf is not None
        assert (passed, matched) == (expect, expect), (a, b)


def test_where_prefilter_lets_keywords_through():
    # a keyword spelling is left to the matcher (binding reorders it)
    pf, passed, matched = verdict(NOTHING_CHEAP, "dims",
                                  lambda g, x, y: same(fn(g, torch.transpose, x, dim0=0, dim1=1)))
    assert passed is True and matched is False


def test_where_prefilter_reads_the_root_by_its_name():
    rules = rewrite.parse("rule wide: relu(_) as r where rank(r) == 3 => r")
    for shape, expect in (((2, 2, 4), True), ((16,), False)):
        def build(g, x, y, shape=shape):
            return same(fn(g, aten.relu.default, meth(g, "reshape", x, *shape)))
        pf, passed, matched = verdict(rules, "wide", build)
        assert pf is not None and (passed, matched) == (expect, expect)


def test_omitted_default_is_a_literal_need_where_the_target_has_it():
    # add(x, y) without `...` means alpha == 1: torch.add can spell alpha, so its
    # prefilter checks it; a missing alpha passes (binding fills the default)
    rule = NOTHING_CHEAP.rules["vars"]
    assert build_prefilter(rule, ("call_function", torch.add)) is not None
    for kwargs, expect in (({}, True), ({"alpha": 1}, True), ({"alpha": 2}, False)):
        _, passed, matched = verdict(NOTHING_CHEAP, "vars",
                                     lambda g, x, y, kw=kwargs: same(fn(g, torch.add, x, y, **kw)))
        assert passed is expect
        assert matched is expect


@pytest.mark.parametrize("key", [("call_function", torch.relu), ("call_function", F.relu),
                                 ("call_method", "relu"), ("call_function", aten.relu.default)])
def test_constraining_root_gets_a_prefilter(key):
    assert build_prefilter(RULES.rules["relu_relu"], key) is not None


def test_module_root_prefilter_reads_the_forward_input():
    # nn.ReLU()(x): the forward input is args[0] or keyword ``input``; a module whose
    # settings the pattern constrains (hardtanh's bounds) is left to the matcher
    assert build_prefilter(RULES.rules["relu_relu"], ("call_module", nn.ReLU)) is not None
    clamp = rewrite.parse("rule hard: hardtanh(x, 0.0, 6.0) => x")
    assert build_prefilter(clamp.rules["hard"], ("call_module", nn.Hardtanh)) is None


@pytest.mark.parametrize("inner", sorted(RELU_SPELLINGS) + ["neg", "placeholder", "module", "module_kw"])
@pytest.mark.parametrize("outer_kw", [False, True])
def test_relu_relu_prefilter_at_a_module_root(inner, outer_kw):
    def build(g, x, y):
        if inner in RELU_SPELLINGS:
            a = RELU_SPELLINGS[inner](g, x)
        elif inner == "neg":
            a = fn(g, torch.neg, x)
        elif inner == "module":
            a = g.call_module("inner", (x,))
        elif inner == "module_kw":
            a = g.call_module("inner", (), {"input": x})
        else:
            a = x
        r = g.call_module("outer", (), {"input": a}) if outer_kw else g.call_module("outer", (a,))
        return r, r

    pf, passed, matched = verdict(RULES, "relu_relu", build, {"inner": nn.ReLU(), "outer": nn.ReLU()})
    should_pass = inner in RELU_SPELLINGS or inner.startswith("module")
    assert passed is should_pass
    assert matched is (should_pass and inner != "inplace")


@pytest.mark.parametrize("outer", sorted(RELU_SPELLINGS))
@pytest.mark.parametrize("inner", sorted(RELU_SPELLINGS) + ["neg", "sigmoid", "placeholder", "module"])
def test_relu_relu_prefilter(outer, inner):
    def build(g, x, y):
        if inner in RELU_SPELLINGS:
            a = RELU_SPELLINGS[inner](g, x)
        elif inner == "neg":
            a = fn(g, torch.neg, x)
        elif inner == "sigmoid":
            a = meth(g, "sigmoid", x)
        elif inner == "module":
            a = g.call_module("act", (x,))
        else:
            a = x
        r = RELU_SPELLINGS[outer](g, a)
        return r, r

    pf, passed, matched = verdict(RULES, "relu_relu", build, {"act": nn.ReLU()})
    assert pf is not None
    should_pass = inner in RELU_SPELLINGS or inner == "module"
    assert passed is should_pass
    # here nothing but the producer decides, except that an in-place relu of the graph
    # input writes the caller's tensor: it is never rewritten
    assert matched is (should_pass and inner != "inplace")


ADD_SPELLINGS = {
    "operator": lambda g, a, b: fn(g, operator.add, a, b),
    "torch": lambda g, a, b: fn(g, torch.add, a, b),
    "torch_kw": lambda g, a, b: fn(g, torch.add, a, other=b),
    "torch_all_kw": lambda g, a, b: fn(g, torch.add, input=a, other=b),
    "method": lambda g, a, b: meth(g, "add", a, b),
    "method_kw": lambda g, a, b: meth(g, "add", a, other=b),
    "Tensor.add": lambda g, a, b: fn(g, torch.Tensor.add, a, b),
    "aten": lambda g, a, b: fn(g, aten.add.Tensor, a, b),
}


@pytest.mark.parametrize("spelling", sorted(ADD_SPELLINGS))
@pytest.mark.parametrize("order", ["x_neg", "neg_x", "x_y", "neg_neg", "relu_x"])
def test_add_neg_prefilter_is_commutative(spelling, order):
    def build(g, x, y):
        n = fn(g, torch.neg, y)
        a, b = {
            "x_neg": (x, n), "neg_x": (n, x), "x_y": (x, y),
            "neg_neg": (n, fn(g, operator.neg, x)), "relu_x": (fn(g, torch.relu, y), x),
        }[order]
        s = ADD_SPELLINGS[spelling](g, a, b)
        return s, s

    pf, passed, matched = verdict(RULES, "add_neg", build)
    assert pf is not None
    assert passed is (order in ("x_neg", "neg_x", "neg_neg"))
    if matched:
        assert passed
    assert matched is (order in ("x_neg", "neg_x", "neg_neg"))


MUL_ONE_CASES = [
    (1, False, True), (1, True, True), (1.0, False, True), (1.0, True, True),
    (2, False, False), (2, True, False), (-1, False, False), (0, True, False),
    (True, False, False),  # a bool is not the int 1
]


@pytest.mark.parametrize("literal,first,expect,target", [
    (*case, target) for case in MUL_ONE_CASES for target in (operator.mul, torch.mul, aten.mul.Tensor)
    if not (case[1] and target is aten.mul.Tensor)  # aten.mul.Tensor takes the tensor first
])
def test_mul_one_literal_prefilter(literal, first, expect, target):
    def build(g, x, y):
        m = fn(g, target, *((literal, x) if first else (x, literal)))
        return m, m

    pf, passed, matched = verdict(RULES, "mul_one", build)
    assert pf is not None
    assert passed is expect
    assert matched is expect


def test_mul_one_prefilter_rejects_two_tensors_and_passes_absent_literal():
    pf, passed, matched = verdict(RULES, "mul_one", lambda g, x, y: same(fn(g, torch.mul, x, y)))
    assert pf is not None and passed is False and matched is False
    # the literal given by keyword is read from kwargs
    pf, passed, matched = verdict(RULES, "mul_one", lambda g, x, y: same(fn(g, torch.mul, x, other=1)))
    assert passed is True and matched is True
    pf, passed, matched = verdict(RULES, "mul_one", lambda g, x, y: same(meth(g, "mul", x, other=3)))
    assert passed is False and matched is False


def test_add_zero_prefilter_reads_alpha_free_patterns():
    # add(x, 0, ...) leaves alpha free: any alpha passes, only the literal counts
    for alpha, lit, expect in ((2, 0, True), (1, 0, True), (1, 1, False)):
        _, passed, matched = verdict(
            RULES, "add_zero", lambda g, x, y, lit=lit, alpha=alpha: same(fn(g, torch.add, x, lit, alpha=alpha)))
        assert passed is expect
        assert matched is expect


def test_prefilter_on_renamed_parameters_of_rsub():
    # torch.rsub(a, b) is b - a: sub(input=b, other=a). sub_zero wants other == 0.
    pf, passed, matched = verdict(RULES, "sub_zero", lambda g, x, y: same(fn(g, torch.rsub, x, 0)))
    assert pf is not None and passed is False and matched is False
    # sub(neg(x), _): the nested neg sits in rsub's second argument
    pf, passed, matched = verdict(EXTRA, "x_sub_nested_first",
                                  lambda g, x, y: same(fn(g, torch.rsub, y, fn(g, torch.neg, x))))
    assert passed is True and matched is True
    pf, passed, matched = verdict(EXTRA, "x_sub_nested_first",
                                  lambda g, x, y: same(fn(g, torch.rsub, fn(g, torch.neg, x), y)))
    assert passed is False and matched is False


@pytest.mark.parametrize("spell,expect", [
    (lambda g, x: meth(g, "transpose", x, -1, 1), True),
    (lambda g, x: meth(g, "transpose", x, 0, 1), False),
    (lambda g, x: meth(g, "transpose", x, dim0=-1, dim1=1), True),
    (lambda g, x: meth(g, "transpose", x, dim1=1, dim0=0), False),
    (lambda g, x: fn(g, torch.transpose, x, -1, dim1=1), True),
    (lambda g, x: fn(g, aten.transpose.int, x, -1, 1), True),
    (lambda g, x: fn(g, aten.transpose.int, x, 1, -1), False),
])
def test_keyword_literals_in_pattern_and_node(spell, expect):
    pf, passed, matched = verdict(EXTRA, "x_transpose_kw", lambda g, x, y: same(spell(g, x)))
    assert pf is not None
    assert passed is expect
    assert matched is expect


def test_qualified_root_and_operand():
    rule = "x_qualified"  # torch.relu(F.relu(x))
    cases = [
        (lambda g, x: fn(g, torch.relu, fn(g, F.relu, x)), True, True),
        (lambda g, x: fn(g, torch.relu, fn(g, torch.relu, x)), False, False),
        (lambda g, x: fn(g, torch.relu, meth(g, "relu", x)), False, False),
    ]
    for spell, expect_pass, expect_match in cases:
        pf, passed, matched = verdict(EXTRA, rule, lambda g, x, y, spell=spell: same(spell(g, x)))
        assert pf is not None
        assert passed is expect_pass and matched is expect_match
    # other spellings of the root are not the rule's keys: nothing to check there
    assert build_prefilter(EXTRA.rules[rule], ("call_method", "relu")) is None


def test_to_with_fixed_dtype_forms():
    # x.double() fixes dtype: no argument to read, so no prefilter for that key
    assert build_prefilter(EXTRA.rules["x_to"], ("call_method", "double")) is None
    for spell, expect in (
        (lambda g, x: meth(g, "to", x, torch.float64), True),
        (lambda g, x: meth(g, "to", x, dtype=torch.float64), True),
        (lambda g, x: meth(g, "to", x, torch.float16), False),
        (lambda g, x: fn(g, aten._to_copy.default, x, dtype=torch.float64), True),
        (lambda g, x: fn(g, aten._to_copy.default, x, dtype=torch.float32), False),
    ):
        pf, passed, matched = verdict(EXTRA, "x_to", lambda g, x, y, spell=spell: same(spell(g, x)))
        assert pf is not None
        assert passed is expect and matched is expect


def test_index_builds_prefilters_only_in_compiled_mode():
    rules = tuple(MATCHER_RULES.rules.values())
    with_pf = RuleIndex(rules, prefilters=True)
    without = RuleIndex(rules, prefilters=False)
    assert with_pf.by_key.keys() == without.by_key.keys()
    assert all(pf is None for pairs in without.by_key.values() for _, pf in pairs)
    key = ("call_function", aten.relu.default)
    assert [r.name for r, _ in with_pf.by_key[key]] == [r.name for r, _ in without.by_key[key]]
    assert {r.name: pf for r, pf in with_pf.by_key[key]}["relu_relu"] is not None


def test_stats_count_turned_away_nodes():
    # three relus: relu(neg(x)) and relu(x) are turned away, relu(relu(..)) matches
    class M(nn.Module):
        def forward(self, x):
            return torch.relu(torch.relu(-x)) + torch.relu(x)

    rules = RULES["relu_relu"]
    gm = fx.symbolic_trace(M())
    with compiled_mode(True):
        on = rules.apply(gm, (torch.randn(4, 4),), check=False)
    with compiled_mode(False):
        off = rules.apply(gm, (torch.randn(4, 4),), check=False)
    assert on.counts == off.counts == {"relu_relu": 1}
    s_on, s_off = on.stats["relu_relu"], off.stats["relu_relu"]
    assert s_on.tries - s_on.prefiltered == s_on.applied == 1  # only the matching relu reached the matcher
    assert s_on.prefiltered >= 2
    assert s_off.prefiltered == 0 and s_off.tries == s_on.tries
    assert on.graph_module.code == off.graph_module.code


NESTED_LIT_CASES = [  # add(x, mul(y, 2.0)): the literal one level down, in every spelling
    (lambda g, x, y: fn(g, operator.add, x, fn(g, operator.mul, y, 2.0)), True),
    (lambda g, x, y: fn(g, operator.add, fn(g, torch.mul, 2, y), x), True),  # both commuted, int 2
    (lambda g, x, y: fn(g, torch.add, x, meth(g, "mul", y, other=2.0)), True),
    (lambda g, x, y: fn(g, aten.add.Tensor, x, fn(g, aten.mul.Tensor, y, 2.0)), True),
    (lambda g, x, y: fn(g, operator.add, x, fn(g, operator.mul, y, 3.0)), False),
    (lambda g, x, y: fn(g, operator.add, x, fn(g, operator.mul, y, x)), False),
    (lambda g, x, y: fn(g, operator.add, x, fn(g, operator.mul, y, True)), False),
    (lambda g, x, y: fn(g, operator.add, fn(g, torch.mul, y, 3.0), fn(g, torch.mul, x, 2.0)), True),
    (lambda g, x, y: fn(g, operator.add, fn(g, torch.mul, y, 3.0), fn(g, torch.mul, x, 4.0)), False),
]


@pytest.mark.parametrize("case", range(len(NESTED_LIT_CASES)))
def test_nested_literal_is_a_prefilter_need(case):
    spell, expect = NESTED_LIT_CASES[case]
    pf, passed, matched = verdict(EXTRA, "x_nested_lit", lambda g, x, y: same(spell(g, x, y)))
    assert pf is not None
    assert passed is expect and matched is expect


@pytest.mark.parametrize("spell,expect", [
    (lambda g, x: fn(g, torch.relu, meth(g, "transpose", x, -1, 1)), True),
    (lambda g, x: fn(g, torch.relu, meth(g, "transpose", x, 0, 1)), False),
    (lambda g, x: fn(g, torch.relu, fn(g, torch.transpose, x, dim0=-1, dim1=1)), True),
    (lambda g, x: fn(g, torch.relu, fn(g, torch.transpose, x, dim0=1, dim1=-1)), False),
    (lambda g, x: fn(g, torch.relu, fn(g, torch.relu, x)), False),
])
def test_nested_keyword_literals(spell, expect):
    pf, passed, matched = verdict(EXTRA, "x_nested_kw", lambda g, x, y: same(spell(g, x)))
    assert pf is not None
    assert passed is expect and matched is expect


@pytest.mark.parametrize("inner,lit,expect", [
    (operator.mul, 1, True), (operator.mul, 1.0, True), (operator.mul, 2, False), (torch.div, 1, False),
])
def test_nested_literal_two_levels_down(inner, lit, expect):
    def build(g, x, y):
        return same(fn(g, operator.add, fn(g, torch.neg, fn(g, inner, x, lit)), y))

    pf, passed, matched = verdict(EXTRA, "x_nested_deep_lit", build)
    assert pf is not None
    assert passed is expect and matched is expect


def test_nested_alternatives_each_keep_their_literal():
    for inner, lit, expect in ((torch.mul, 2.0, True), (torch.div, 2.0, True), (torch.div, 3.0, False),
                               (torch.mul, 3.0, False), (torch.sub, 2.0, False)):
        pf, passed, matched = verdict(
            EXTRA, "x_nested_alt", lambda g, x, y, inner=inner, lit=lit: same(fn(g, torch.sub, x, fn(g, inner, y, lit))))
        assert pf is not None
        assert passed is expect and matched is expect


def test_many_rules_differing_one_level_down_reach_the_matcher_only_where_they_match():
    """Rules that share a root and differ only in a nested literal: each rule's
    matcher runs only at the adds whose mul holds its literal."""
    text = "".join(f"rule r{k}: add(x, mul(y, {float(k)})) => sub(x, mul(y, {float(-k)}))\n" for k in range(1, 9))
    rules = rewrite.parse(text, "many.rw")

    class M(nn.Module):
        def forward(self, x):
            for k in range(12):
                x = x + (-x) * float(k)
            return x

    gm = fx.symbolic_trace(M())
    ex = (torch.randn(3, 3),)
    with compiled_mode(True):
        on = rules.apply(gm, ex)
    with compiled_mode(False):
        off = rules.apply(gm, ex, check=False)
    assert on.counts == off.counts == {f"r{k}": 1 for k in range(1, 9)}
    assert on.equivalence.ok
    for k in range(1, 9):
        s = on.stats[f"r{k}"]
        assert s.tries - s.prefiltered == s.applied == 1  # no failed match reached the matcher
    assert on.graph_module.code == off.graph_module.code


@pytest.mark.parametrize("spell,passes,matches", [
    (lambda g, x, y: fn(g, operator.mul, x, x), True, True),
    (lambda g, x, y: meth(g, "mul", x, other=x), True, True),
    (lambda g, x, y: fn(g, aten.mul.Tensor, y, y), True, True),
    (lambda g, x, y: fn(g, torch.mul, x, y), False, False),
    (lambda g, x, y: fn(g, torch.mul, x, 2.0), False, False),
    (lambda g, x, y: fn(g, operator.mul, 2.0, x), False, False),
    # two get_attr nodes of one constant are the same operand; two constants are
    # left to the matcher (it compares them by name)
    (lambda g, x, y: fn(g, torch.mul, g.get_attr("m.weight"), g.get_attr("m.weight")), True, True),
    (lambda g, x, y: fn(g, torch.mul, g.get_attr("m.weight"), g.get_attr("m.bias")), True, False),
])
def test_variable_written_twice_needs_the_same_operand(spell, passes, matches):
    pf, passed, matched = verdict(EXTRA, "x_same", lambda g, x, y: same(spell(g, x, y)),
                                  modules={"m": nn.Linear(4, 4)})
    assert pf is not None
    assert passed is passes and matched is matches


@pytest.mark.parametrize("level", ["fx", "export"])
def test_a_relayout_of_several_nodes_keeps_the_graph_in_order(level):
    """Found by the random search above (session 39): outputs sharing memory relaid at
    their source through a dense order (permute, contiguous, permute) were inserted
    each right after the source, in reverse: a node read one defined after it."""
    steps = tuple(("add", 0, 0, ("v", 0), False, 0) for _ in range(5)) + (
        ("permute", 0, 0, ("v", 0), False, 2), ("permute", 0, 0, ("v", 0), False, 0),
        ("permute", 0, 0, ("v", 0), False, 0))
    tally: collections.Counter = collections.Counter()
    check_apply_differential(Program(steps, (19,)), level, tally)
    gm = capture(Program(steps, (19,)), level)
    result = APPLIED.apply(gm, example_inputs=inputs(), check=False)
    result.graph_module.graph.lint()
    assert result.counts
