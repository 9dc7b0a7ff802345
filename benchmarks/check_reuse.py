"""Benchmark: what the check's reuse of the original's values saves (``rewrite.trust.reuse``).

On the synthetic 10k-node graphs of ``benchmarks/matcher.py``, times in one process,
round-robin, the fastest of ``--runs`` calls each:

* ``check=False``  ``rules.apply(gm, check=False)``,
* ``check``        ``rules.apply(gm)`` (the default, reuse on),
* ``check, no reuse``  the same with reuse turned off (``MAX_RECORDED_BYTES = 0``),

for two rule sets: the 22 bit-exact rules of ``benchmarks/matcher_rules.rw`` (all but
``silu_from_sigmoid``) and all 23 (``silu_from_sigmoid`` is declared approximate:
nothing is recorded). Never run as a test.

    python benchmarks/check_reuse.py --runs 5
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import rewrite
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(HERE.parent))
    import rewrite
import synthetic  # noqa: E402 - benchmarks/synthetic.py
from rewrite.engine.driver import Schedule  # noqa: E402
from rewrite.ruleset import RuleSet  # noqa: E402
from rewrite.trust import reuse  # noqa: E402


def _timed(call, runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        gc.collect()
        start = time.perf_counter()
        call()
        gc.collect(1)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=10000)
    args = parser.parse_args()
    every = rewrite.load(str(HERE / "matcher_rules.rw"))
    exact_names = tuple(n for n in every.scheduled_rules() if n != "silu_from_sigmoid")
    exact = RuleSet(every.rules, {}, Schedule("fixpoint", exact_names), "matcher_rules without silu")
    limit = reuse.MAX_RECORDED_BYTES
    print(f"| graph | rules | check=False ms | check ms | check, no reuse ms | check / check=False "
          f"| no reuse / check=False |")
    print("|---|---|---|---|---|---|---|")
    for family in ("conv", "transformer"):
        gm = synthetic.GENERATORS[family](args.nodes, density=20).gm
        for label, rules in (("22 bit-exact", exact), ("all 23", every)):
            times = {"plain": float("inf"), "check": float("inf"), "no_reuse": float("inf")}
            for _ in range(args.runs):  # round-robin: drift hits every variant alike
                times["plain"] = min(times["plain"], _timed(lambda: rules.apply(gm, check=False), 1))
                times["check"] = min(times["check"], _timed(lambda: rules.apply(gm), 1))
                reuse.MAX_RECORDED_BYTES = 0
                try:
                    times["no_reuse"] = min(times["no_reuse"], _timed(lambda: rules.apply(gm), 1))
                finally:
                    reuse.MAX_RECORDED_BYTES = limit
            p, c, n = (times[k] * 1000 for k in ("plain", "check", "no_reuse"))
            print(f"| {family}-{args.nodes // 1000}k | {label} | {p:.0f} | {c:.0f} | {n:.0f} | {c / p:.2f} | "
                  f"{n / p:.2f} |")


if __name__ == "__main__":
    main()
