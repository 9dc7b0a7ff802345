"""Benchmark: rewriting around a value that thousands of nodes read.

One value ``v = tanh(x)`` read by ``n`` nodes ``v + 0.0`` (summed in a chain), and
the cleanup rule ``add_zero`` (``x + 0.0 => x`` where no new aliasing is observable)
run to its fixpoint: every rewrite makes one more reader of ``v``. Work that walks
all of ``v``'s readers per rewrite makes the whole call quadratic in ``n``; the
table shows time per node as ``n`` grows (flat is linear).

Peers, timed as in ``benchmarks/matcher.py`` (whole call, in place on a fresh copy
made outside the timing, plus ``gc.collect(1)``):

``rewrite``
    ``rewrite.load("rules/cleanup.rw").apply(gm, (x,), check=False, inplace=True)``
    (all 16 cleanup rules, shape facts recorded from ``x``).
``replace_pattern``
    ``torch.fx.subgraph_rewriter.replace_pattern_with_filters`` with pre-traced
    ``Graph`` pattern ``torch.add(v, 0.0)`` and replacement ``v`` (one rule, no
    alias analysis), repeated until nothing matches.

    python benchmarks/fan_out.py [--sizes 500,2000,8000]
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
from rewrite.examples.wide import fan_out_graph  # noqa: E402


def _graph(fn) -> fx.Graph:
    return fx.symbolic_trace(fn).graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="500,2000,8000")
    args = parser.parse_args()
    rules = rewrite.load(str(Path(__file__).resolve().parents[1] / "rules" / "cleanup.rw"))
    pattern, replacement = _graph(lambda v: torch.add(v, 0.0)), _graph(lambda v: v)
    x = torch.randn(4)
    print("| readers of v | nodes | rewrite ms | us per node | replace_pattern ms | us per node | "
          "replace_pattern / rewrite |")
    print("|---|---|---|---|---|---|---|")
    for n in (int(s) for s in args.sizes.split(",")):
        base = fan_out_graph(n)
        nodes = len(base.graph.nodes)

        def ours() -> float:
            gm = copy.deepcopy(base)
            gc.collect()
            start = time.perf_counter()
            result = rules.apply(gm, (x,), check=False, inplace=True)
            gc.collect(1)
            assert result.counts == {"add_zero": n}
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
