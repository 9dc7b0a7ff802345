"""Benchmark: time per node of every shipped rule set as graphs grow.

Each shipped rule file (``rules/*.rw``), applied in place with ``check=False`` to
the synthetic transformer and conv graphs of ``benchmarks/synthetic.py`` (export-
style ATen graphs, every node with a FakeTensor ``val``) at each size: the whole
call plus ``gc.collect(1)``, on a fresh copy made outside the timing. A rule set whose
time per node grows with the graph does work per rewrite that depends on the graph's
size; the last column is the largest size's time per node over the smallest's
(1.0: linear).

    python benchmarks/rule_set_scaling.py [--sizes 1000,10000] [--files rules/cleanup.rw,...]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import synthetic  # noqa: E402

import rewrite  # noqa: E402
from rewrite.engine.workspace import shared_copy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000")
    parser.add_argument("--files", default=None, help="comma-separated rule files (default: rules/*.rw)")
    parser.add_argument("--families", default="transformer,conv")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # leaf-module and similar notes are not the point here
    sizes = [int(s) for s in args.sizes.split(",")]
    files = args.files.split(",") if args.files else [str(p.relative_to(HERE.parent))
                                                      for p in sorted((HERE.parent / "rules").glob("*.rw"))]
    print("| rule file | graph | " + " | ".join(f"us/node at {n}" for n in sizes)
          + " | rewrites at the largest | largest / smallest |")
    print("|---|---|" + "---|" * len(sizes) + "---|---|")
    for path in files:
        rules = rewrite.load(str(HERE.parent / path))
        for family in args.families.split(","):
            per_node, count = [], 0
            for n in sizes:
                gm = synthetic.GENERATORS[family](n, density=20).gm
                copy = shared_copy(gm)
                gc.collect()
                start = time.perf_counter()
                result = rules.apply(copy, check=False, inplace=True)
                gc.collect(1)
                per_node.append((time.perf_counter() - start) / len(gm.graph.nodes) * 1e6)
                count = sum(result.counts.values())
            print(f"| {path} | {family} | " + " | ".join(f"{t:.1f}" for t in per_node)
                  + f" | {count} | {per_node[-1] / per_node[0]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
