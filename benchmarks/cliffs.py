"""Benchmark: graphs and rules where the matcher once fell off a cliff, against torch.fx's replace_pattern.

Eight hand-built cases (the README's "Graphs and rules not in this benchmark", under
"Matcher speed"): a deep pattern rooted at the commonest op, 50 rules sharing a root
and differing in a nested literal, chained rewrites, a variable written twice
(``mul(x, x)``, with and without matches), a rule over three commutative ops, an ATen
rule with a where clause over FakeTensor shapes, and a ``symbolic_trace`` graph of
modules. Each case is one graph, one rule file and the same rule written as
``replace_pattern`` patterns; every rewriter runs to its fixpoint and both must make
the same rewrites per rule (checked: "same" / "DIFF").

Every time is the whole call, in place, on a fresh lazily compiled copy of the graph
module made outside the timing (``_LazyGraphModule`` over a deep copy of the graph:
no code generated until the module is called), plus ``gc.collect(1)`` after the call
(the young garbage it leaves), as in ``benchmarks/matcher.py``; best of ``--repeat``
runs. A run over ``--budget`` seconds ends the repeats of that rewriter.

``rewrite``
    ``rewrite.parse(rules, ...).apply(gm, check=False, inplace=True)`` (rules parsed
    once, outside the timing).
``replace_pattern``
    ``torch.fx.subgraph_rewriter.replace_pattern_with_filters(gm, pattern, replacement,
    match_filters)`` once per pattern, all patterns repeated until a full pass replaces
    nothing. Patterns and replacements are ``fx.Graph``s traced once, outside the
    timing; one pattern per argument order the graph holds; where clauses become match
    filters.

    python benchmarks/cliffs.py
    python benchmarks/cliffs.py --cases B,G --scale 0.5 --repeat 1
"""

from __future__ import annotations

import argparse
import collections
import copy
import gc
import operator
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.subgraph_rewriter import replace_pattern_with_filters

HERE = Path(__file__).resolve().parent
try:
    import rewrite
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(HERE.parent))
    import rewrite

aten = torch.ops.aten
BUDGET = 20.0  # seconds: a run longer than this ends that rewriter's repeats


# ---------------------------------------------------------------- graphs


def _module(build: Callable[..., fx.Node], n_inputs: int = 1) -> fx.GraphModule:
    """A GraphModule of the plain fx.Graph ``build(graph, *inputs)`` returns the output of."""
    g = fx.Graph()
    xs = [g.placeholder(f"x{i}") for i in range(n_inputs)]
    g.output(build(g, *xs))
    return fx.GraphModule(nn.Module(), g)


def graph_A(units: int, every: int = 50) -> fx.GraphModule:
    """Adds and muls; one unit in ``every`` holds ``add(h, mul(p, neg(sigmoid(q))))``."""
    def build(g: fx.Graph, x: fx.Node) -> fx.Node:
        h = x
        for i in range(units):
            if i % every == 0:
                p = g.call_function(operator.add, (h, 2.0))
                q = g.call_function(operator.add, (h, 3.0))
                n = g.call_function(operator.neg, (g.call_function(torch.sigmoid, (q,)),))
                h = g.call_function(operator.add, (h, g.call_function(operator.mul, (p, n))))
            else:
                a = g.call_function(operator.add, (h, 1.0))
                c = g.call_function(operator.add, (a, h))
                h = g.call_function(operator.mul, (c, 0.5))
        return h
    return _module(build)


def graph_B(units: int, n_literals: int = 100) -> fx.GraphModule:
    """``relu(h + (-h) * k)`` with k cycling through 0..2*n_literals-1."""
    def build(g: fx.Graph, x: fx.Node) -> fx.Node:
        h = x
        for i in range(units):
            m = g.call_function(operator.mul, (g.call_function(torch.neg, (h,)), float(i % (2 * n_literals))))
            h = g.call_function(torch.relu, (g.call_function(operator.add, (h, m)),))
        return h
    return _module(build)


def graph_C(units: int, fan: int = 1000) -> fx.GraphModule:
    """An accumulator adding (1 in 7) or subtracting ``neg(h)``; h is relu(acc), renewed every ``fan`` units."""
    def build(g: fx.Graph, x: fx.Node) -> fx.Node:
        h = acc = x
        for i in range(units):
            if i % fan == 0:
                h = g.call_function(torch.relu, (acc,))
            n = g.call_function(operator.neg, (h,))
            acc = g.call_function(operator.add if i % 7 == 0 else operator.sub, (acc, n))
        return acc
    return _module(build)


def graph_F(units: int, every: int = 20) -> fx.GraphModule:
    """``(h * prev + 1) * 0.5``; one unit in ``every`` (and the first) squares h instead."""
    def build(g: fx.Graph, x: fx.Node) -> fx.Node:
        h = prev = x
        for i in range(units):
            m = g.call_function(operator.mul, (h, h if i % every == 0 else prev))
            prev = h
            h = g.call_function(operator.mul, (g.call_function(operator.add, (m, 1.0)), 0.5))
        return h
    return _module(build)


def graph_G(units: int, every: int = 10) -> fx.GraphModule:
    """``h * prev + y * 3``; one unit in ``every`` is ``h * prev + h * 2`` (h factors out)."""
    def build(g: fx.Graph, x: fx.Node, y: fx.Node) -> fx.Node:
        h, prev = x, y
        for i in range(units):
            a = g.call_function(operator.mul, (h, prev))
            c = g.call_function(operator.mul, (h, 2.0) if i % every == 0 else (y, 3.0))
            prev = h
            h = g.call_function(operator.add, (a, c))
        return h
    return _module(build, 2)


class _AtenGraph:
    """Appends ATen calls to a graph with a FakeTensor ``meta['val']`` on every node, as
    ``torch.export`` leaves them (one fake dispatch per distinct op and input shapes)."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()
        self.vals: dict[Any, Any] = {}

    def input(self, shape: tuple[int, ...]) -> fx.Node:
        node = self.graph.placeholder(f"x{len(self.graph.nodes)}")
        node.meta["val"] = self.mode.from_tensor(torch.empty(shape))
        return node

    def call(self, target: Any, *args: Any) -> fx.Node:
        node = self.graph.call_function(target, args)
        key = (target, *(("T", tuple(a.meta["val"].shape)) if isinstance(a, fx.Node) else repr(a) for a in args))
        if key not in self.vals:
            fake = fx.node.map_arg(args, lambda n: n.meta["val"])
            with self.mode:
                self.vals[key] = target(*fake)
        node.meta["val"] = self.vals[key]
        return node

    def finish(self, out: fx.Node) -> fx.GraphModule:
        self.graph.output(out)
        return fx.GraphModule(nn.Module(), self.graph)


def graph_K(units: int, every: int = 10) -> fx.GraphModule:
    """ATen ``h + expand(bias)``, a broadcasting bias add; elsewhere the expand reads
    ``bias * 0.5`` and feeds a relu, so only one unit in ``every`` matches."""
    b = _AtenGraph()
    h = b.input((8, 16))
    bias = b.input((1, 16))
    for i in range(units):
        if i % every == 0:
            e = b.call(aten.expand.default, bias, [8, 16])
        else:
            e = b.call(aten.relu.default, b.call(aten.expand.default, b.call(aten.mul.Tensor, bias, 0.5), [8, 16]))
        h = b.call(aten.add.Tensor, h, e)
    return b.finish(h)


class ConvStack(nn.Module):
    """Conv2d / BatchNorm2d / ``torch.relu`` blocks; every 4th block has a second ``torch.relu``."""

    def __init__(self, blocks: int, channels: int = 4) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1) for _ in range(blocks))
        self.bns = nn.ModuleList(nn.BatchNorm2d(channels) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            x = torch.relu(bn(conv(x)))
            if i % 4 == 0:
                x = torch.relu(x)
        return x


def graph_J2(blocks: int) -> fx.GraphModule:
    torch.manual_seed(0)
    return fx.symbolic_trace(ConvStack(blocks).eval())


# ---------------------------------------------------------------- rules, and the same rules as patterns


def _same_shape_x_expand(match: Any, original: fx.Graph, pattern: fx.Graph) -> bool:
    """``where same_shape(x, e)`` of rule add_expand, as a match filter."""
    x = next(n for p, n in match.nodes_map.items() if p.op == "placeholder" and p.name == "x")
    e = next(n for p, n in match.nodes_map.items() if p.op == "call_function" and p.target is aten.expand.default)
    xv, ev = x.meta.get("val"), e.meta.get("val")
    return xv is not None and ev is not None and tuple(xv.shape) == tuple(ev.shape)


def _rules_B(n_literals: int = 100) -> str:
    # odd literals only: half the units match; a rewritten mul has a negative literal, so nothing fires twice
    return "".join(f"rule r{k}: add(x, mul(y, {float(k)})) => sub(x, mul(y, {float(-k)}))\n"
                   for k in range(1, n_literals + 1, 2))


def _peers_B(n_literals: int = 100) -> list:
    def rule(k: float) -> list:  # k closed over, not a parameter: symbolic_trace makes parameters inputs
        def replacement(x, y):
            return x - y * (-k)
        name = f"r{int(k)}"
        return [(name, lambda x, y: x + y * k, replacement), (name, lambda x, y: y * k + x, replacement)]
    return [p for k in range(1, n_literals + 1, 2) for p in rule(float(k))]


def _distrib(x, y, z):
    return x * (y + z)


def _add_expand(x, y):
    return aten.add.Tensor(x, y)


@attrs.frozen
class Case:
    """One graph, its rules, and the same rules for replace_pattern: (rule, pattern, replacement[, filter])."""

    description: str
    units: int
    build: Callable[[int], fx.GraphModule]
    rules: str
    peers: Callable[[], list]
    inputs: Callable[[], tuple]

    def graph(self, scale: float = 1.0) -> fx.GraphModule:
        return self.build(max(1, round(self.units * scale)))


def _vector(n: int = 1, size: int = 8, high: float = 1.0) -> Callable[[], tuple]:
    return lambda: tuple(torch.rand(size) * high for _ in range(n))


CASES = {
    "A": Case("one 4-deep pattern rooted at `add`, on a graph of adds (1 in 50 units matches)",
              2500, graph_A,
              "rule deep: add(x, mul(y, neg(sigmoid(z)))) => sub(x, mul(y, sigmoid(z)))\n",
              lambda: [("deep", lambda x, y, z: x + y * (-torch.sigmoid(z)), lambda x, y, z: x - y * torch.sigmoid(z)),
                       ("deep", lambda x, y, z: y * (-torch.sigmoid(z)) + x, lambda x, y, z: x - y * torch.sigmoid(z))],
              _vector()),
    "B": Case("50 rules rooted at `add`, differing in a literal one level down (half the units match)",
              3333, graph_B, _rules_B(), _peers_B, _vector()),
    "C": Case("chained rewrites: `add(x, neg(y))` / `sub(x, neg(y))`, each reads the previous one's new node",
              5000, graph_C,
              "rule add_neg: add(x, neg(y)) => sub(x, y)\nrule sub_neg: sub(x, neg(y)) => add(x, y)\n",
              lambda: [("add_neg", lambda x, y: x + (-y), lambda x, y: x - y),
                       ("add_neg", lambda x, y: (-y) + x, lambda x, y: x - y),
                       ("sub_neg", lambda x, y: x - (-y), lambda x, y: x + y)],
              _vector()),
    "F": Case("`mul(x, x) => pow(x, 2)` on a graph of `mul(h, prev)`, nothing matches (but the first unit)",
              3333, lambda units: graph_F(units, every=10**9),
              "rule square: mul(x, x) => pow(x, 2)\n",
              lambda: [("square", lambda x: x * x, lambda x: torch.pow(x, 2))],
              _vector()),
    "F20": Case("`mul(x, x) => pow(x, 2)`, 1 in 20 units a square",
                3333, graph_F,
                "rule square: mul(x, x) => pow(x, 2)\n",
                lambda: [("square", lambda x: x * x, lambda x: torch.pow(x, 2))],
                _vector()),
    "G": Case("distributive `add(mul(x, y), mul(x, z)) => mul(x, add(y, z))`, three commutative ops (1 in 10)",
              2500, graph_G,
              "rule distrib: add(mul(x, y), mul(x, z)) => mul(x, add(y, z))\n",
              # add's two orders are the same pattern with y and z renamed: 4 patterns cover the mul orders
              lambda: [("distrib", lambda x, y, z: x * y + x * z, _distrib),
                       ("distrib", lambda x, y, z: y * x + x * z, _distrib),
                       ("distrib", lambda x, y, z: x * y + z * x, _distrib),
                       ("distrib", lambda x, y, z: y * x + z * x, _distrib)],
              _vector(2, high=0.01)),
    "K": Case("ATen `add(x, expand(y) as e) where same_shape(x, e)`, a broadcasting bias add (1 in 10), "
              "FakeTensor meta",
              3333, graph_K,
              "rule add_expand: add(x, aten.expand(y, _) as e) where same_shape(x, e) => add(x, y)\n",
              lambda: [("add_expand", lambda x, y: aten.add.Tensor(x, aten.expand.default(y, [8, 16])), _add_expand,
                        _same_shape_x_expand),
                       ("add_expand", lambda x, y: aten.add.Tensor(aten.expand.default(y, [8, 16]), x), _add_expand,
                        _same_shape_x_expand)],
              lambda: (torch.randn(8, 16), torch.randn(1, 16))),
    "J2": Case("`relu(relu(_) as r) => r` on a `symbolic_trace` of conv/BN/`torch.relu` blocks (1 in 4 doubled)",
               3000, graph_J2,
               "rule relu_relu: relu(relu(_) as r) => r\n",
               lambda: [("relu_relu", lambda x: torch.relu(torch.relu(x)), lambda x: torch.relu(x))],
               lambda: (torch.randn(1, 4, 8, 8),)),
}


# ---------------------------------------------------------------- timing


@attrs.frozen
class Run:
    seconds: float
    counts: dict  # rule name -> rewrites
    gm: fx.GraphModule  # the rewritten copy
    stopped: bool = False  # the fixpoint loop ran past its budget


def fresh(gm: fx.GraphModule) -> fx.GraphModule:
    """A lazily compiled copy: a new graph, the same submodules and tensors, no code generated yet."""
    return _LazyGraphModule(gm, copy.deepcopy(gm.graph))


def run_ours(rules: rewrite.RuleSet, gm: fx.GraphModule) -> Run:
    work = fresh(gm)
    gc.collect()
    start = time.perf_counter()
    result = rules.apply(work, check=False, inplace=True)
    gc.collect(1)
    seconds = time.perf_counter() - start
    return Run(seconds, {k: v for k, v in result.counts.items() if v}, work)


def trace_peers(case: Case) -> list:
    """(rule, pattern graph, replacement graph, match filters), traced once."""
    out = []
    for rule, pattern, replacement, *where in case.peers():
        out.append((rule, fx.symbolic_trace(pattern).graph, fx.symbolic_trace(replacement).graph, where))
    return out


def run_peer(patterns: Sequence, gm: fx.GraphModule, budget: float = 5 * BUDGET) -> Run:
    work = fresh(gm)
    counts: collections.Counter = collections.Counter()
    stopped = False
    gc.collect()
    start = time.perf_counter()
    while not stopped:
        changed = 0
        for rule, pattern, replacement, where in patterns:
            got = replace_pattern_with_filters(work, pattern, replacement, where)
            counts[rule] += len(got)
            changed += len(got)
        if not changed:
            break
        stopped = time.perf_counter() - start > budget
    gc.collect(1)
    seconds = time.perf_counter() - start
    return Run(seconds, {k: v for k, v in counts.items() if v}, work, stopped)


def best(one: Callable[[], Run], repeat: int, budget: float = BUDGET) -> Run:
    """The fastest of ``repeat`` runs; a run over ``budget`` seconds ends the repeats."""
    runs = []
    for _ in range(max(1, repeat)):
        runs.append(one())
        if runs[-1].seconds > budget:
            break
    return min(runs, key=lambda r: r.seconds)


@attrs.frozen
class Measurement:
    name: str
    original: fx.GraphModule
    ours: Run
    peer: Run

    @property
    def same(self) -> bool:
        return self.ours.counts == self.peer.counts and not self.peer.stopped

    def row(self) -> str:
        a, b = self.ours.seconds, self.peer.seconds
        n = sum(self.ours.counts.values())
        verdict = f"same ({n})" if self.same else (
            f"DIFF ({self.ours.counts} vs {self.peer.counts}{', stopped' if self.peer.stopped else ''})")
        return (f"| {self.name} | {len(self.original.graph.nodes)} | {a * 1e3:.0f} | {b * 1e3:.0f} | "
                f"{b / a:.1f}x | {verdict} |")


def measure(name: str, scale: float = 1.0, repeat_ours: int = 3, repeat_peer: int = 2,
            budget: float = BUDGET) -> Measurement:
    case = CASES[name]
    gm = case.graph(scale)
    rules = rewrite.parse(case.rules, f"cliffs_{name}.rw")
    patterns = trace_peers(case)
    ours = best(lambda: run_ours(rules, gm), repeat_ours, budget)
    peer = best(lambda: run_peer(patterns, gm, 5 * budget), repeat_peer, budget)
    return Measurement(name, gm, ours, peer)


def main(argv: Sequence[str] | None = None) -> list[Measurement]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, from " + ",".join(CASES))
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every case's unit count")
    parser.add_argument("--repeat", type=int, default=None,
                        help="runs per rewriter, best kept (default 3 for rewrite, 2 for replace_pattern)")
    parser.add_argument("--budget", type=float, default=BUDGET,
                        help="seconds: a run over this ends the repeats (and 5x this stops a fixpoint loop)")
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.cases.split(",") if s.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {','.join(CASES)}")
    print("| case | nodes | apply(inplace=True) ms | replace_pattern ms | ratio | same rewrites |")
    print("|---|---|---|---|---|---|", flush=True)
    out = []
    for name in names:
        out.append(measure(name, args.scale, args.repeat or 3, args.repeat or 2, args.budget))
        print(out[-1].row(), flush=True)
    print()
    for name in names:
        print(f"- {name}: {CASES[name].description}")
    return out


if __name__ == "__main__":
    main()
