"""Benchmark: matcher speed against torch.fx's replace_pattern and Inductor's pattern matcher.

The same 23 rewrites (``benchmarks/matcher_rules.rw``: the 16 shipped cleanup rules
and 7 structural rules; roots from the commonest ops, ``add``/``mul``/``view``, to
rare ones, ``cat``/``abs``/``squeeze``) run each to its fixpoint, on the same graphs.
Every time is the whole user-visible call plus ``gc.collect(1)`` (the young garbage
it leaves; ``apply`` pauses the collector while it runs):

``rewrite``
    this project: ``rewrite.load(rules).apply(gm, check=False)``, which copies the
    input (graph copied, tensors shared: ``apply`` never mutates it).
``rewrite-inplace``
    ``apply(gm, check=False, inplace=True)`` on a fresh copy made outside the
    timing, as every in-place peer gets.
``rewrite+check``
    ``apply(gm)``: the default, with the randomized equivalence check.
``replace_pattern``
    ``torch.fx.subgraph_rewriter.replace_pattern_with_filters`` once per pattern,
    all patterns repeated until none matches, in place on a fresh copy (not timed).
    Where clauses become match filters; each commutative order and each op spelling
    (``view``/``reshape``, ``_to_copy``/``to``) is one more pattern. Pattern and
    replacement are pre-traced ``Graph``s (traced once, outside the timing; a
    ``GraphModule`` replacement would make every call sweep the module's attributes).
``inductor``
    ``torch._inductor.pattern_matcher.PatternMatcherPass`` applied until it makes
    no replacement, on a fresh copy, with lazily compiled graph modules as Inductor
    runs it (``_use_lazy_graph_module(True)``: the small graphs it traces are not
    compiled to Python). No final ``recompile``: like ``rewrite``'s result, the
    graph is left for code generation on first use ("codegen ms" in the graph table
    is that deferred cost, the same for every rewriter).
    Rules whose literals are all fixed use ``register_replacement`` (search and
    replace functions traced with ``fwd_only``, without decompositions or no-op
    removal so that ``x * 1`` stays a pattern); every match is re-traced at its
    real shapes, which is how ``register_replacement`` checks burned-in literals.
    Rules over variable literals (dims, shapes, dtypes), which
    ``register_replacement`` would burn in, use ``register_graph_pattern`` with a
    handler that splices the replacement in, as Inductor's own
    ``pointless_view_pair`` does.
``inductor-gp`` (``--peers``)
    every rule as ``register_graph_pattern``: Inductor's matcher without the
    per-match re-trace.

Graphs: synthetic transformer and conv stacks of 1k, 10k and 100k nodes
(``benchmarks/synthetic.py``: ATen ops as ``torch.export`` spells them, FakeTensor
``meta['val']`` on every node, rewrite opportunities planted at ``--density`` per 1000
nodes, so the right number of rewrites is known), ResNet-50 from
``torch.fx.symbolic_trace``, GPT-2 and a ResNet from ``transformers`` through
``torch.export.export(..., strict=False).module()``.

Reported per run: time, per-node time, ratio to ``rewrite``, rewrites made (every
rewriter must make the same ones per rule: checked), peak traced memory while
producing the rewritten graph from the input (tracemalloc, a separate run; for the
peers the copy they work on, made as ``apply`` makes its own, is inside the traced
window) against the memory of the graph itself (tracemalloc: what a
``Graph.graph_copy`` of it holds), and the time of ``Graph.graph_copy``, the floor
of any rewriter that returns a new graph (``copy.deepcopy`` of the GraphModule,
which also generates and compiles its code, is shown too).
A peer over ``--budget`` seconds is stopped and its time extrapolated (clearly
labelled). Never run as a test.

    python benchmarks/matcher.py
    python benchmarks/matcher.py --sizes 1000,10000 --peers replace_pattern,inductor --real none
    python benchmarks/matcher.py --sizes 10000 --families transformer --profile
"""

from __future__ import annotations

import argparse
import collections
import copy
import cProfile
import functools
import gc
import inspect
import io
import math
import operator
import pstats
import re
import sys
import time
import tracemalloc
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.subgraph_rewriter import replace_pattern_with_filters

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import rewrite
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(HERE.parent))
    import rewrite
import synthetic
from rewrite.engine.workspace import working_copy

RULES_PATH = HERE / "matcher_rules.rw"
SMALL_GRAPH = 2000  # nodes: graphs under this get --small-repeat runs per measurement
aten = torch.ops.aten
PEERS = ("replace_pattern", "inductor", "inductor-gp")

# ---------------------------------------------------------------- the rules, written for the peers
#
# A peer rule is a list of (pattern, replacement) function pairs with the same
# parameters, plus an optional ``where`` over the values bound to those parameters
# (graph nodes or literals): the rule file's where clause, in Python.


def _val(v: Any) -> Any:
    if isinstance(v, fx.Node):
        return v.meta.get("val", v.meta.get("tensor_meta"))
    return None


def _is_float(v: Any) -> bool:
    m = _val(v)
    return m is not None and m.dtype.is_floating_point


def _rank(v: Any) -> int | None:
    m = _val(v)
    return None if m is None else len(m.shape)


def _contiguous_x(e: dict) -> bool:
    m = _val(e["x"])
    return m is not None and hasattr(m, "is_contiguous") and m.is_contiguous()


def _ints(*xs: Any) -> bool:
    return all(isinstance(x, int) and not isinstance(x, bool) for x in xs)


def _transposes_cancel(e: dict) -> bool:
    r = _rank(e["x"])
    return r is not None and _ints(e["a"], e["b"], e["c"], e["d"]) and \
        {e["a"] % r, e["b"] % r} == {e["c"] % r, e["d"] % r}


def _transpose_noop(e: dict) -> bool:
    r = _rank(e["x"])
    return r is not None and _ints(e["a"], e["b"]) and e["a"] % r == e["b"] % r


def _perms_cancel(e: dict) -> bool:
    p, q = e["p"], e["q"]
    if not isinstance(p, (list, tuple)) or not isinstance(q, (list, tuple)) or len(p) != len(q):
        return False
    n = len(p)
    return [p[q[i] % n] % n for i in range(n)] == list(range(n))


def _identity_perm(e: dict) -> bool:
    p = e["p"]
    return isinstance(p, (list, tuple)) and list(p) == list(range(len(p)))


def _reshape_noop(e: dict) -> bool:
    m, s = _val(e["x"]), e["s"]
    if m is None or not isinstance(s, (list, tuple)) or not _ints(*s):
        return False
    have = tuple(m.shape)
    return len(s) == len(have) and sum(d == -1 for d in s) <= 1 and all(d in (h, -1) for d, h in zip(s, have))


_WIDTH = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def _lossless(src: Any, dst: Any) -> bool:
    return src == dst or (src in _WIDTH and dst in _WIDTH and _WIDTH[dst] > _WIDTH[src])


def _to_same(e: dict) -> bool:
    m = _val(e["x"])
    return m is not None and m.dtype == e["d"]


def _to_roundtrip(e: dict) -> bool:
    m = _val(e["x"])
    return m is not None and m.dtype == e["b"] and _lossless(m.dtype, e["a"])


@attrs.frozen
class PeerRule:
    """One rule of matcher_rules.rw as the peers need it."""

    name: str
    variants: tuple  # ((pattern_fn, replacement_fn), ...)
    where: Callable[[dict], bool] | None = None
    fixed: bool = True  # all literals fixed: register_replacement can express it


class _Aten:
    """Op spellings of ATen graphs (torch.export, make_fx, Inductor)."""

    mul, div, add, sub = aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor
    neg, relu, abs = aten.neg.default, aten.relu.default, aten.abs.default
    sigmoid, silu = aten.sigmoid.default, aten.silu.default
    transpose, permute = aten.transpose.int, aten.permute.default
    views = (aten.view.default, aten.reshape.default)
    reshape = aten.reshape.default
    cat = aten.cat.default
    squeeze, unsqueeze = aten.squeeze.dim, aten.unsqueeze.default

    @staticmethod
    def contiguous(x):
        return aten.clone.default(x, memory_format=torch.contiguous_format)

    tos = (lambda x, d: aten._to_copy.default(x, dtype=d), lambda x, d: aten.to.dtype(x, d))
    cats = (lambda x, d: aten.cat.default([x], d), lambda x: aten.cat.default([x]))


class _Torch:
    """Op spellings of symbolic_trace graphs: one per op (the peers cannot match
    ``x.view(a, b)`` and ``x.view((a, b))`` with one pattern, nor call_module)."""

    mul, div, add, sub, neg = operator.mul, operator.truediv, operator.add, operator.sub, operator.neg
    relu, abs, sigmoid, silu = torch.relu, torch.abs, torch.sigmoid, F.silu
    transpose, permute = torch.transpose, torch.permute
    views = (torch.reshape,)
    reshape = torch.reshape
    squeeze, unsqueeze = torch.squeeze, torch.unsqueeze

    @staticmethod
    def contiguous(x):
        return x.contiguous()

    tos = (lambda x, d: x.to(d),)
    cats = (lambda x, d: torch.cat([x], d), lambda x: torch.cat([x]))


def peer_rules(o: Any) -> list[PeerRule]:
    """The 23 rules of matcher_rules.rw for op spellings ``o`` (``_Aten``/``_Torch``)."""
    float_x = lambda e: _is_float(e["x"])
    tensor_x = lambda e: isinstance(e["x"], fx.Node)

    def view_pair(outer, inner):
        return (lambda x, s1, s2: outer(inner(x, s1), s2), lambda x, s1, s2: o.reshape(x, s2))

    def view_one(v):
        return (lambda x, s: v(x, s), lambda x, s: x)

    def to_pair(t):
        return (lambda x, a, b: t(t(x, a), b), lambda x, a, b: x)

    def to_one(t):
        return (lambda x, d: t(x, d), lambda x, d: x)

    def cat_one(c):
        return (c, (lambda x, d: x) if len(inspect.signature(c).parameters) == 2 else (lambda x: x))

    return [
        PeerRule("mul_one", ((lambda x: o.mul(x, 1), lambda x: x),), float_x),
        PeerRule("div_one", ((lambda x: o.div(x, 1), lambda x: x),), float_x),
        PeerRule("add_zero", ((lambda x: o.add(x, 0), lambda x: x),), float_x),
        PeerRule("sub_zero", ((lambda x: o.sub(x, 0), lambda x: x),), float_x),
        PeerRule("neg_neg", ((lambda x: o.neg(o.neg(x)), lambda x: x),)),
        PeerRule("relu_relu", ((lambda x: o.relu(o.relu(x)), lambda x: o.relu(x)),)),
        PeerRule("contiguous_contiguous", ((lambda x: o.contiguous(o.contiguous(x)), lambda x: o.contiguous(x)),)),
        PeerRule("transpose_transpose", ((lambda x, a, b, c, d: o.transpose(o.transpose(x, a, b), c, d),
                                          lambda x, a, b, c, d: x),), _transposes_cancel, fixed=False),
        PeerRule("transpose_same_dim", ((lambda x, a, b: o.transpose(x, a, b), lambda x, a, b: x),),
                 _transpose_noop, fixed=False),
        PeerRule("permute_permute", ((lambda x, p, q: o.permute(o.permute(x, p), q), lambda x, p, q: x),),
                 _perms_cancel, fixed=False),
        PeerRule("permute_identity", ((lambda x, p: o.permute(x, p), lambda x, p: x),), _identity_perm, fixed=False),
        PeerRule("reshape_reshape", tuple(view_pair(a, b) for a in o.views for b in o.views), _contiguous_x,
                 fixed=False),
        PeerRule("reshape_noop", tuple(view_one(v) for v in o.views), _reshape_noop, fixed=False),
        PeerRule("cat_single", tuple(cat_one(c) for c in o.cats), fixed=False),
        PeerRule("to_same_dtype", tuple(to_one(t) for t in o.tos), _to_same, fixed=False),
        PeerRule("to_roundtrip", tuple(to_pair(t) for t in o.tos), _to_roundtrip, fixed=False),
        PeerRule("squeeze_unsqueeze", ((lambda x, d: o.squeeze(o.unsqueeze(x, d), d), lambda x, d: x),), fixed=False),
        PeerRule("abs_abs", ((lambda x: o.abs(o.abs(x)), lambda x: o.abs(x)),)),
        PeerRule("abs_neg", ((lambda x: o.abs(o.neg(x)), lambda x: o.abs(x)),)),
        PeerRule("add_neg", ((lambda x, y: o.add(x, o.neg(y)), lambda x, y: o.sub(x, y)),
                             (lambda x, y: o.add(o.neg(y), x), lambda x, y: o.sub(x, y))), tensor_x),
        PeerRule("sub_neg", ((lambda x, y: o.sub(x, o.neg(y)), lambda x, y: o.add(x, y)),), tensor_x),
        PeerRule("mul_neg_one", ((lambda x: o.mul(x, -1), lambda x: o.neg(x)),), float_x),
        PeerRule("silu_from_sigmoid", ((lambda x: o.mul(x, o.sigmoid(x)), lambda x: o.silu(x)),
                                       (lambda x: o.mul(o.sigmoid(x), x), lambda x: o.silu(x)))),
    ]


def _params(fn: Callable) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _trace(fn: Callable) -> fx.GraphModule:
    return fx.symbolic_trace(fn)


# ---------------------------------------------------------------- the rewriters


@attrs.define
class Run:
    """One rewriter on one graph."""

    seconds: float  # the whole call, collection of its garbage included (the fastest of the repeats)
    counts: dict[str, int]
    inner_seconds: float | None = None  # rewrite only: RewriteResult.seconds (no copy, no check)
    copy_seconds: float | None = None  # rewrite only: apply's copy of the input
    complete: bool = True  # False: stopped at the budget
    work_done: int = 0  # calls / passes made
    note: str = ""
    peak_bytes: int | None = None
    repeats: int = 1


class Ours:
    """``rules.apply`` as a user calls it: the default (a copy of the input, its
    tensors shared), ``inplace=True`` (on a module the caller owns: a fresh lazily
    compiled copy made outside the timing, as every in-place peer gets), or with the
    equivalence check (``check=True``, the default of ``apply``)."""

    def __init__(self, rules_path: Path = RULES_PATH, inplace: bool = False, check: bool = False) -> None:
        self.rules = rewrite.load(str(rules_path))
        self.inplace, self.check = inplace, check
        self.name = "rewrite" + ("-inplace" if inplace else "") + ("+check" if check else "")

    def rewrite(self, gm: fx.GraphModule, budget: float, example_inputs: Any = None) -> Run:
        start = time.perf_counter()
        result = self.rules.apply(gm, example_inputs=example_inputs, check=self.check, inplace=self.inplace)
        gc.collect(1)  # the young garbage the call leaves (apply pauses the collector while it runs)
        wall = time.perf_counter() - start
        return Run(wall, dict(result.counts), inner_seconds=result.seconds, copy_seconds=result.copy_seconds)


class ReplacePattern:
    name = "replace_pattern"

    def __init__(self, rules: list[PeerRule]) -> None:
        self.calls = []  # (rule name, pattern gm, replacement gm, filters)
        for rule in rules:
            for pattern, replacement in rule.variants:
                filters = [self._filter(rule.where, _params(pattern))] if rule.where else None
                # pre-traced Graphs (not GraphModules: a GraphModule replacement makes
                # every call sweep the module's attributes), as the docs allow
                self.calls.append((rule.name, _trace(pattern).graph, _trace(replacement).graph, filters))

    @staticmethod
    def _filter(where: Callable, names: list[str]) -> Callable:
        def keep(match: Any, graph: Any, pattern_graph: Any) -> bool:
            try:
                return bool(where(dict(zip(names, match.placeholder_nodes))))
            except Exception:  # noqa: BLE001 - an undecidable filter does not hold
                return False
        return keep

    def rewrite(self, gm: fx.GraphModule, budget: float) -> Run:
        counts: collections.Counter = collections.Counter()
        start = time.perf_counter()
        calls = 0
        while True:
            changed = 0
            for name, pattern, replacement, filters in self.calls:
                got = replace_pattern_with_filters(gm, pattern, replacement, match_filters=filters)
                calls += 1
                counts[name] += len(got)
                changed += len(got)
                if time.perf_counter() - start > budget:
                    return Run(time.perf_counter() - start, dict(+counts), complete=False, work_done=calls)
            if not changed:
                break
        gc.collect(1)
        return Run(time.perf_counter() - start, dict(+counts), work_done=calls)


class Inductor:
    """PatternMatcherPass; ``graph_patterns_only`` registers every rule with
    register_graph_pattern (no per-match re-trace)."""

    def __init__(self, rules: list[PeerRule], graph_patterns_only: bool = False) -> None:
        from torch._inductor import pattern_matcher as pm

        self.name = "inductor-gp" if graph_patterns_only else "inductor"
        self.pm = pm
        self.counts: collections.Counter = collections.Counter()
        self.pass_ = pm.PatternMatcherPass(pass_name="rewrite_benchmark")
        trace_fn = functools.partial(pm.fwd_only, run_functional_passes=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for rule in rules:
                for pattern, replacement in rule.variants:
                    if rule.fixed and not graph_patterns_only:
                        example = [torch.empty(2, 3, 4) for _ in _params(pattern)]
                        pm.register_replacement(pattern, replacement, example, trace_fn, self.pass_,
                                                extra_check=self._counted(rule), get_decomp_fn=dict)
                    else:
                        self._register_graph_pattern(rule, pattern, replacement)

    def _counted(self, rule: PeerRule) -> Callable:
        def check(match: Any) -> bool:
            ok = rule.where is None or bool(rule.where(match.kwargs))
            if ok:
                self.counts[rule.name] += 1
            return ok
        return check

    def _register_graph_pattern(self, rule: PeerRule, pattern: Callable, replacement: Callable) -> None:
        names = _params(pattern)
        expr = self.pm.fx_to_pattern(_trace(pattern), argnames=names)
        rgraph = _trace(replacement).graph
        placeholders = [n for n in rgraph.nodes if n.op == "placeholder"]
        where = rule.where
        counts = self.counts

        def check(match: Any) -> bool:
            try:
                return where is None or bool(where(match.kwargs))
            except Exception:  # noqa: BLE001
                return False

        def handler(match: Any, *args: Any, **kwargs: Any) -> None:
            root = match.output_node()
            graph = root.graph
            out = graph.graph_copy(rgraph, {p: kwargs[name] for p, name in zip(placeholders, names)})
            if isinstance(out, fx.Node) and "val" not in out.meta and "val" in root.meta:
                out.meta["val"] = root.meta["val"]
            root.replace_all_uses_with(out)
            match.erase_nodes()
            counts[rule.name] += 1

        self.pm.register_graph_pattern(expr, extra_check=check, pass_dict=self.pass_)(handler)

    def rewrite(self, gm: fx.GraphModule, budget: float) -> Run:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module

        self.counts.clear()
        start = time.perf_counter()
        passes = 0
        complete = True
        with warnings.catch_warnings(), _use_lazy_graph_module(True):
            warnings.simplefilter("ignore")
            while self.pass_.apply(gm):
                passes += 1
                if time.perf_counter() - start > budget:
                    complete = False
                    break
        passes += complete
        gc.collect(1)
        return Run(time.perf_counter() - start, dict(+self.counts), complete=complete, work_done=passes)


# ---------------------------------------------------------------- graphs


@attrs.define
class Bench:
    name: str
    gm: fx.GraphModule
    dialect: str  # "aten" or "fx"
    expected: dict[str, int] | None = None
    example_inputs: Any = None
    family: str = ""


def synthetic_graphs(families: Sequence[str], sizes: Sequence[int], density: float) -> list[Bench]:
    out = []
    for family in families:
        for n in sizes:
            g = synthetic.GENERATORS[family](n, density=density)
            out.append(Bench(g.name, g.gm, "aten", g.expected, None, family))
    return out


def real_graphs(which: Sequence[str]) -> list[Bench]:
    out = []
    if "resnet50" in which:
        from rewrite.examples.cnn import resnet50_with_inputs

        model, (x,) = resnet50_with_inputs()
        out.append(Bench("resnet50 (symbolic_trace)", fx.symbolic_trace(model), "fx", None, (x,)))
    from rewrite.examples import hf

    for key, builder in (("gpt2", hf.hf_gpt2), ("hf_resnet", hf.hf_resnet)):
        if key in which:
            model, args = builder()
            gm = torch.export.export(model, args, strict=False).module()
            out.append(Bench(f"{key} (export)", gm, "aten", None, args))
    return out


# ---------------------------------------------------------------- measuring


def _best_run(fn: Callable[[], Run], repeats: int, slow: float = 2.0, total: float = 40.0) -> Run:
    """The fastest of up to ``repeats`` runs (the machine is shared: the minimum is
    the least disturbed), stopping early once a run takes over ``slow`` seconds or
    all runs together over ``total``."""
    runs = []
    spent = 0.0
    for _ in range(repeats):
        gc.collect()
        runs.append(fn())
        spent += runs[-1].seconds
        if runs[-1].seconds > slow or not runs[-1].complete or spent > total:
            break
    best = min(runs, key=lambda r: r.seconds)
    best.repeats = len(runs)
    return best


def _time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _traced_peak(fn: Callable[[], Any]) -> tuple[int, int]:
    """(current bytes held after fn, peak bytes during fn), tracemalloc."""
    gc.collect()
    tracemalloc.start()
    try:
        keep = fn()
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del keep
    return current, peak


def _graph_copy(gm: fx.GraphModule) -> fx.Graph:
    g = fx.Graph()
    g.graph_copy(gm.graph, {})
    return g


@attrs.define
class GraphRow:
    bench: Bench
    nodes: int
    deepcopy_s: float
    graph_copy_s: float
    graph_bytes: int  # held by a graph_copy of the graph
    codegen_s: float = 0.0  # GraphModule.recompile: generate and compile the code
    deepcopy_bytes: int = 0  # held by a deepcopy of the GraphModule (graph, code, module)
    deepcopy_peak: int = 0
    runs: dict[str, Run] = attrs.Factory(dict)


def measure(bench: Bench, rewriters: dict[str, Any], args: Any, previous: dict[str, Run]) -> GraphRow:
    """Every rewriter's whole call on ``bench``. ``rewrite`` and ``rewrite+check``
    get the input itself (they copy it); every in-place rewriter (``rewrite-inplace``
    and the peers) a fresh lazily compiled copy made outside the timing."""
    gm = bench.gm
    nodes = len(gm.graph.nodes)
    # a call of a few milliseconds is at the machine's mercy: small graphs get more
    # runs, the same number for every rewriter and for graph_copy
    repeat = args.repeat if nodes >= SMALL_GRAPH else max(args.repeat, args.small_repeat)
    row = GraphRow(bench, nodes, _time(lambda: copy.deepcopy(gm), repeat),
                   _time(lambda: _graph_copy(gm), repeat), 0)
    row.graph_bytes = _traced_peak(lambda: _graph_copy(gm))[0]
    row.deepcopy_bytes, row.deepcopy_peak = _traced_peak(lambda: copy.deepcopy(gm))
    scratch = copy.deepcopy(gm)
    row.codegen_s = _time(scratch.recompile, repeat)
    del scratch

    for name, rewriter in rewriters.items():
        ours = isinstance(rewriter, Ours)
        if name.startswith("inductor") and bench.dialect != "aten":
            row.runs[name] = Run(math.nan, {}, complete=False, note="n/a: needs an ATen graph with FakeTensor vals")
            continue
        if not ours and nodes > args.peer_max_nodes:
            row.runs[name] = Run(math.nan, {}, complete=False, note=f"skipped: over --peer-max-nodes {args.peer_max_nodes}")
            continue
        if ours and rewriter.check and nodes > args.check_max_nodes:
            row.runs[name] = Run(math.nan, {}, complete=False, note=f"skipped: over --check-max-nodes {args.check_max_nodes}")
            continue
        p = rewriter[bench.dialect] if isinstance(rewriter, dict) else rewriter
        in_place = not ours or rewriter.inplace

        def once(p=p, in_place=in_place) -> Run:
            work = working_copy(gm) if in_place else gm
            if ours:
                return p.rewrite(work, args.budget, bench.example_inputs)
            return p.rewrite(work, args.budget)

        run = _best_run(once, repeat, slow=1e9 if ours else 2.0)
        if not run.complete:
            prev = previous.get(name)
            if prev is not None and prev.complete and prev.work_done:
                est = run.seconds / run.work_done * prev.work_done
                run.note = (f"stopped at the {args.budget:.0f} s budget after {run.work_done} of ~{prev.work_done} "
                            f"{'calls' if name == 'replace_pattern' else 'passes'}; ~{est:.0f} s extrapolated")
                run.seconds = est
            else:
                run.note = f"stopped at the {args.budget:.0f} s budget; no estimate"
                run.seconds = math.nan
        elif not args.no_memory and run.seconds < args.mem_budget:
            # the call's own peak: for in-place rewriters the copy is made before the window
            def traced(p=p, in_place=in_place) -> Any:
                work = working_copy(gm) if in_place else gm
                return _traced_peak(lambda: (p.rewrite(work, args.budget, bench.example_inputs) if ours
                                             else p.rewrite(work, args.budget)))[1]
            run.peak_bytes = traced()
        row.runs[name] = run
        print(f"  {bench.name}: {name} {run.seconds * 1e3:.0f} ms, {sum(run.counts.values())} rewrites"
              f"{' (' + run.note + ')' if run.note else ''}", flush=True)
    return row


# ---------------------------------------------------------------- report


def _agreement(row: GraphRow, name: str) -> str:
    run = row.runs[name]
    if math.isnan(run.seconds) and not run.counts:
        return "-"
    if row.bench.expected is None and name == "rewrite":
        return "(reference)"
    ref = row.bench.expected if row.bench.expected is not None else row.runs["rewrite"].counts
    if not run.complete:
        return "partial"
    return "yes" if run.counts == ref else "NO"


def _mb(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def print_report(rows: list[GraphRow], args: Any) -> None:
    print()
    print(f"torch {torch.__version__}, {len(rewrite.load(str(RULES_PATH)))} rules "
          f"({RULES_PATH.relative_to(HERE.parent)}), synthetic density {args.density:g} planted motifs "
          f"per 1000 nodes, best of up to {args.repeat} runs ({max(args.repeat, args.small_repeat)} on graphs "
          f"under {SMALL_GRAPH} nodes; of 1 when a peer's run takes over 2 s, 40 s in all)")
    print()
    print("| graph | nodes | rewrites expected | graph_copy ms | deepcopy ms | codegen ms | graph MB "
          "| deepcopy MB | deepcopy peak MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        exp = "-" if r.bench.expected is None else str(sum(r.bench.expected.values()))
        print(f"| {r.bench.name} | {r.nodes} | {exp} | {r.graph_copy_s * 1e3:.1f} | {r.deepcopy_s * 1e3:.1f} "
              f"| {r.codegen_s * 1e3:.1f} | {_mb(r.graph_bytes)} | {_mb(r.deepcopy_bytes)} "
              f"| {_mb(r.deepcopy_peak)} |")
    print()
    print("| graph | rewriter | call ms | us/node | x rewrite-inplace | rewrites | same rewrites | "
          "call / graph_copy | peak MB | peak / graph |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    notes = []
    for r in rows:
        base = r.runs.get("rewrite-inplace", r.runs.get("rewrite"))
        ours = base.seconds if base is not None else math.nan
        for name, run in r.runs.items():
            if math.isnan(run.seconds):
                t = per = ratio = "-"
            else:
                t = f"{run.seconds * 1e3:.1f}" + ("*" if not run.complete else "")
                per = f"{run.seconds / r.nodes * 1e6:.2f}"
                ratio = f"{run.seconds / ours:.1f}"
            vs_copy = "-" if math.isnan(run.seconds) else f"{run.seconds / r.graph_copy_s:.2f}"
            peak = run.peak_bytes
            n_rw = "-" if math.isnan(run.seconds) and not run.counts else str(sum(run.counts.values()))
            print(f"| {r.bench.name} | {name} | {t} | {per} | {ratio} | {n_rw} "
                  f"| {_agreement(r, name)} | {vs_copy} | {_mb(peak)} "
                  f"| {'-' if peak is None else f'{peak / r.graph_bytes:.2f}'} |")
            if run.note:
                notes.append(f"{r.bench.name}, {name}: {run.note}")
            if _agreement(r, name) == "NO":
                ref = r.bench.expected if r.bench.expected is not None else r.runs["rewrite"].counts
                diff = {k: (run.counts.get(k, 0), ref.get(k, 0)) for k in sorted(set(ref) | set(run.counts))
                        if run.counts.get(k, 0) != ref.get(k, 0)}
                notes.append(f"{r.bench.name}, {name}: rewrites differ (got, expected): {diff}")
    for r in rows:
        if r.bench.expected is None:
            counts = r.runs["rewrite"].counts
            notes.append(f"{r.bench.name}: rewrite's rewrites: {dict(sorted(counts.items())) or 'none'}")
    if notes:
        print()
        for n in notes:
            print(f"* {n}")
    print()
    print("call ms: the whole user-visible call, the collection of the young garbage it leaves included")
    print("(gc.collect(1) after it, inside the timing, for every rewriter). rewrite = apply(gm, check=False), which copies the")
    print("input (graph copied, tensors shared); rewrite+check = apply(gm) with its default check; rewrite-inplace")
    print("= apply(gm, check=False, inplace=True); the peers rewrite in place. Every in-place rewriter gets a fresh")
    print("lazily compiled copy (made outside the timing): code generation is left to the first call for all")
    print("(codegen ms above; replace_pattern's per-call recompile is then free). * = extrapolated.")
    print("same rewrites: per-rule counts equal to the planted ones (synthetic) or to rewrite's.")
    print("peak: tracemalloc peak of the call (for in-place rewriters the copy they are given is made before);")
    print("graph MB: memory held by a graph_copy of the graph.")
    _targets(rows)


_COLD_LOAD = """
import time, sys
start = time.perf_counter()
import rewrite
rewrite.load(sys.argv[1])
print(time.perf_counter() - start)
"""


def print_load_times() -> None:
    """Parsing, checking and compiling each shipped rule file: warm (parser built,
    modules imported; fastest of 5) and cold (a fresh interpreter with torch already
    imported: `import rewrite`, grammar, built-in functions, the file)."""
    import subprocess

    root = HERE.parent
    # (a file that declares a `param`, rules/amp/policy.rw, loads only through an import)
    files = [p for p in sorted((root / "rules").rglob("*.rw")) if not re.search(r"^param ", p.read_text(), re.M)]
    files.append(RULES_PATH)
    print()
    print("| rule file | rules | load ms (warm) | ms per rule | load ms (cold process, after import torch) |")
    print("|---|---|---|---|---|")
    for path in files:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            rules = rewrite.load(str(path))
            times.append(time.perf_counter() - start)
        cold = subprocess.run([sys.executable, "-c", "import torch\n" + _COLD_LOAD, str(path)],
                              capture_output=True, text=True, check=False)
        try:
            cold_ms = f"{float(cold.stdout.strip().splitlines()[-1]) * 1e3:.0f}"
        except (ValueError, IndexError):
            cold_ms = "failed"
        warm = min(times)
        print(f"| {path.relative_to(root)} | {len(rules)} | {warm * 1e3:.1f} | {warm / max(len(rules), 1) * 1e3:.2f} "
              f"| {cold_ms} |")


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _targets(rows: list[GraphRow]) -> None:
    print()
    print("targets (issue 16; ratios of whole calls in this run):")
    by_name = {r.bench.name: r for r in rows}
    families = sorted({r.bench.family for r in rows if r.bench.family})

    def secs(r: GraphRow, name: str) -> float:
        run = r.runs.get(name)
        return math.nan if run is None else run.seconds

    for fam in families:
        r10 = by_name.get(f"{fam}-10k")
        if r10 is not None:
            ours = secs(r10, "rewrite-inplace")
            for peer, goal in (("replace_pattern", 20), ("inductor", 100), ("inductor-gp", 10)):
                t = secs(r10, peer)
                if math.isnan(t) or math.isnan(ours):
                    continue
                same = _agreement(r10, peer) == "yes"
                print(f"  {fam}-10k: apply(inplace=True) {t / ours:6.1f}x faster than {peer:<16} (goal >= {goal}x): "
                      f"{_met(t / ours >= goal)}{'' if same else ' (rewrites differ!)'}")
            t_check, t_plain = secs(r10, "rewrite+check"), secs(r10, "rewrite")
            if not math.isnan(t_check):
                print(f"  {fam}-10k: apply with check = {t_check / t_plain:.2f}x check=False (goal <= 2): "
                      f"{_met(t_check / t_plain <= 2)}")
        r1, r100 = by_name.get(f"{fam}-1k"), by_name.get(f"{fam}-100k")
        if r1 is not None and r100 is not None:
            for name in ("rewrite-inplace", "rewrite"):
                p1, p100 = secs(r1, name) / r1.nodes, secs(r100, name) / r100.nodes
                if not math.isnan(p1 / p100):
                    print(f"  {fam}: {name} per-node time 100k / 1k = {p100 / p1:.2f} (goal <= 1.5): "
                          f"{_met(p100 / p1 <= 1.5)}")
    for r in rows:
        run = r.runs.get("rewrite")
        if run is None or math.isnan(run.seconds):
            continue
        vs = run.seconds / r.graph_copy_s
        line = f"  {r.bench.name}: apply (copy, no check) = {vs:.2f}x graph_copy (goal <= 1.5): {_met(vs <= 1.5)}"
        if run.peak_bytes is not None:
            m = run.peak_bytes / r.graph_bytes
            line += f"; peak memory = {m:.2f}x graph (goal <= 1.5): {_met(m <= 1.5)}"
        print(line)


def check_cost(args: Any) -> None:
    """The default check's cost where rules fire on a real model: fusion.rw on
    ResNet-50 (symbolic_trace), apply() against apply(check=False), whole calls."""
    from rewrite.examples.cnn import resnet50_with_inputs

    model, (x,) = resnet50_with_inputs()
    gm = fx.symbolic_trace(model.eval())
    rules = rewrite.load("rules/fusion.rw")
    times = {}
    for check in (False, True):
        def call(check=check) -> Any:
            result = rules.apply(gm, example_inputs=(x,), check=check)
            gc.collect(1)
            return result
        times[check] = _time(call, max(1, min(args.repeat, 3)))
    result = rules.apply(gm, example_inputs=(x,))
    print()
    print(f"check cost: rules/fusion.rw on resnet50 (symbolic_trace), input {tuple(x.shape)}, "
          f"{sum(result.counts.values())} rewrites; {result.equivalence}")
    print(f"  apply(check=False) {times[False] * 1e3:.0f} ms; apply() {times[True] * 1e3:.0f} ms: "
          f"{times[True] / times[False]:.2f}x (goal <= 2): {_met(times[True] / times[False] <= 2)}")


def _phases(stats: pstats.Stats) -> list[tuple[str, float]]:
    """Cumulative seconds of the phases of apply, from a profile (by function name)."""
    wanted = [
        ("copy of the input (workspace.shared_copy)", "workspace.py", "shared_copy"),
        ("  of which GraphModule.__init__ of the copy", "graph_module.py", "__init__"),
        ("rules: Driver.run (match + replace)", "driver.py", "run"),
        ("  of which matching (Matcher.match)", "match.py", "match"),
        ("  of which replacing (Replacer.apply)", "replace.py", "apply"),
        ("graph.lint", "graph.py", "lint"),
        ("GraphModule.recompile (all calls)", "graph_module.py", "recompile"),
    ]
    found = []
    for label, file, fn in wanted:
        total = sum(v[3] for (f, _, name), v in stats.stats.items() if f.endswith(file) and name == fn)
        found.append((label, total))
    return found


def profile(bench: Bench, ours: Ours, top: int) -> None:
    """Where rewrite's time goes: apply's phases, then the hottest functions."""
    prof = cProfile.Profile()
    gc.collect()
    prof.enable()
    result = ours.rules.apply(bench.gm, example_inputs=bench.example_inputs, check=False)
    prof.disable()
    stats = pstats.Stats(prof)
    total = sum(v[3] for (f, _, name), v in stats.stats.items() if f.endswith("ruleset.py") and name == "apply")
    print()
    print(f"cProfile of rewrite's apply on {bench.name} ({len(bench.gm.graph.nodes)} nodes, "
          f"{sum(result.counts.values())} rewrites): {total * 1e3:.0f} ms under the profiler")
    for label, seconds in _phases(stats):
        print(f"  {label:<60} {seconds * 1e3:8.0f} ms  {seconds / total:6.1%}")
    tries = sum(s.tries for s in result.stats.values())
    print(f"  rule tries {tries}, rewrites {sum(result.counts.values())}")
    for key, title, restrict in (("tottime", "hottest functions (own time)", ()),
                                 ("cumulative", "rewrite/ functions by cumulative time", ("rewrite/",))):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(*restrict, top)
        text = out.getvalue()
        body = text[text.find("   ncalls"):].rstrip()
        print()
        print(f"  {title}:")
        print("\n".join("  " + line.replace(str(HERE.parent) + "/", "").replace(
            str(Path(torch.__file__).parent.parent) + "/", "") for line in body.splitlines()))
    print()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="synthetic graph sizes (nodes)")
    parser.add_argument("--families", default="transformer,conv", help="synthetic families (transformer, conv)")
    parser.add_argument("--peers", default="replace_pattern,inductor,inductor-gp",
                        help=f"comma-separated from {', '.join(PEERS)}, or 'none'")
    parser.add_argument("--real", default="resnet50,gpt2,hf_resnet",
                        help="real graphs: resnet50, gpt2, hf_resnet, or 'none'")
    parser.add_argument("--density", type=float, default=20.0, help="planted motifs per 1000 nodes")
    parser.add_argument("--repeat", type=int, default=5, help="runs per measurement (the fastest is reported)")
    parser.add_argument("--small-repeat", type=int, default=25,
                        help=f"runs per measurement on graphs under {SMALL_GRAPH} nodes (at least --repeat)")
    parser.add_argument("--budget", type=float, default=120.0,
                        help="seconds a peer may take on one graph before it is stopped and extrapolated")
    parser.add_argument("--mem-budget", type=float, default=30.0,
                        help="measure a peer's memory (a slow traced rerun) only when it took less than this")
    parser.add_argument("--peer-max-nodes", type=int, default=10**9, help="skip peers on larger graphs")
    parser.add_argument("--no-memory", action="store_true", help="skip the tracemalloc runs")
    parser.add_argument("--check-max-nodes", type=int, default=20000,
                        help="time apply with its default check only on graphs up to this size")
    parser.add_argument("--no-check-cost", action="store_true", help="skip the ResNet-50 check-cost line")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile rewrite's apply on the 10k graphs (or the largest) and print the top functions")
    parser.add_argument("--profile-top", type=int, default=25)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")

    sizes = [int(s) for s in args.sizes.split(",") if s]
    families = [f for f in args.families.split(",") if f and f != "none"]
    peers = [p for p in args.peers.split(",") if p and p != "none"]
    for p in peers:
        if p not in PEERS:
            parser.error(f"unknown peer {p!r}; choose from {PEERS}")
    real = [r for r in args.real.split(",") if r and r != "none"]

    print("building graphs ...", flush=True)
    start = time.perf_counter()
    benches = synthetic_graphs(families, sizes, args.density) + real_graphs(real)
    print(f"built {len(benches)} graphs in {time.perf_counter() - start:.1f} s", flush=True)

    ours = Ours()
    rewriters: dict[str, Any] = {"rewrite": ours, "rewrite-inplace": Ours(inplace=True),
                                 "rewrite+check": Ours(check=True)}
    aten_rules, torch_rules = peer_rules(_Aten), peer_rules(_Torch)
    if "replace_pattern" in peers:
        rewriters["replace_pattern"] = {"aten": ReplacePattern(aten_rules), "fx": ReplacePattern(torch_rules)}
    if "inductor" in peers:
        rewriters["inductor"] = Inductor(aten_rules)
    if "inductor-gp" in peers:
        rewriters["inductor-gp"] = Inductor(aten_rules, graph_patterns_only=True)

    rows: list[GraphRow] = []
    previous: dict[tuple[str, str], Run] = {}
    for bench in benches:
        prev = {name: previous[(bench.family, name)] for name in rewriters if (bench.family, name) in previous}
        row = measure(bench, rewriters, args, prev if bench.family else {})
        rows.append(row)
        for name, run in row.runs.items():
            if run.complete:
                previous[(bench.family, name)] = run
    print_report(rows, args)
    if not args.no_check_cost:
        check_cost(args)
    print_load_times()

    if args.profile:
        targets = [b for b in benches if b.name.endswith("-10k")] or benches[-1:]
        for bench in targets:
            profile(bench, ours, args.profile_top)


if __name__ == "__main__":
    main()
