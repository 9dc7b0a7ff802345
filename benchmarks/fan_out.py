"""Benchmark: rewriting around a value that thousands of nodes read, or a node that
reads thousands of rewritten values.

``--shape fan-out`` (the default): one value ``v = tanh(x)`` read by ``n`` nodes
``v + 0.0`` (summed in a chain), and the cleanup rule ``add_zero`` (``x + 0.0 => x``
where no new aliasing is observable) run to its fixpoint: every rewrite makes one
more reader of ``v``. ``--shape fan-in-output`` / ``fan-in-cat``: ``n`` values
``-(-sin(x))`` returned together (a tuple of n) or concatenated by one ``cat``, and
``neg_neg`` (``-(-x) => x``): every rewrite changes one input of that one reader.
Work that walks all of a node's readers, or rebuilds all of its inputs, per rewrite
makes the whole call quadratic in ``n``; the table shows time per node as ``n`` grows
(flat is linear).

Peers, timed as in ``benchmarks/matcher.py`` (whole call, in place on a fresh copy
made outside the timing, plus ``gc.collect(1)``):

``rewrite``
    ``rewrite.load("rules/cleanup.rw").apply(gm, (x,), check=False, inplace=True)``
    (all 16 cleanup rules, shape facts recorded from ``x``).
``replace_pattern``
    ``torch.fx.subgraph_rewriter.replace_pattern_with_filters`` with pre-traced
    ``Graph`` pattern ``torch.add(v, 0.0)`` (fan-in: ``torch.neg(torch.neg(v))``)
    and replacement ``v`` (one rule, no alias analysis), repeated until nothing
    matches.

    python benchmarks/fan_out.py [--sizes 500,2000,8000] [--shape fan-out|fan-in-output|fan-in-cat]
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from pathlib import Path

import torch
from torch import fx
from torch.fx.subgraph_rewriter import replace_pattern_with_filters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rewrite  # noqa: E402
from rewrite.examples.wide import fan_in_graph, fan_out_graph  # noqa: E402


def _graph(fn) -> fx.Graph:
    return fx.symbolic_trace(fn).graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="500,2000,8000")
    parser.add_argument("--shape", default="fan-out", choices=("fan-out", "fan-in-output", "fan-in-cat"))
    args = parser.parse_args()
    rules = rewrite.load(str(Path(__file__).resolve().parents[1] / "rules" / "cleanup.rw"))
    if args.shape == "fan-out":
        pattern, rule, build = _graph(lambda v: torch.add(v, 0.0)), "add_zero", fan_out_graph
    else:
        reader = args.shape.rpartition("-")[2]
        pattern, rule = _graph(lambda v: torch.neg(torch.neg(v))), "neg_neg"

        def build(n: int) -> fx.GraphModule:
            return fan_in_graph(n, reader)
    replacement = _graph(lambda v: v)
    x = torch.randn(4)
    what = "readers of v" if args.shape == "fan-out" else "inputs of the " + args.shape.rpartition("-")[2]
    print(f"| {what} | nodes | rewrite ms | us per node | replace_pattern ms | us per node | "
          "replace_pattern / rewrite |")
    print("|---|---|---|---|---|---|---|")
    for n in (int(s) for s in args.sizes.split(",")):
        base = build(n)
        nodes = len(base.graph.nodes)

        def ours() -> float:
            gm = copy.deepcopy(base)
            gc.collect()
            start = time.perf_counter()
            result = rules.apply(gm, (x,), check=False, inplace=True)
            gc.collect(1)
            assert result.counts == {rule: n}
            return time.perf_counter() - start

        def peer() -> float:
            gm = copy.deepcopy(base)
            gc.collect()
            start = time.perf_counter()
            done = 0
            while True:
                got = replace_pattern_with_filters(gm, pattern, replacement)
                if not got:
                    break
                done += len(got)
            gc.collect(1)
            assert done == n
            return time.perf_counter() - start

        a = min(ours() for _ in range(2))
        b = peer()
        print(f"| {n} | {nodes} | {a * 1e3:.0f} | {a / nodes * 1e6:.0f} | {b * 1e3:.0f} | {b / nodes * 1e6:.0f} "
              f"| {b / a:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
