"""See and measure a graph: FLOPs, bytes, shapes, memory, and before/after pictures.

    from rewrite.analysis import analyze, compare
    a = analyze(gm, (x,))                 # per-node records, totals, roll-ups, peak memory
    print(a.table(by="module"))
    result = rules.apply(gm, (x,))
    print(result.report())                # compare(original, rewritten) as a table

Pictures (``rewrite.analysis.show``): ``render(gm, "out.svg")`` or ``"out.html"``,
with ``before=`` for the diff of a rewrite.
"""

from rewrite.analysis.compare import Comparison, compare
from rewrite.analysis.measure import RULE_KEY, GraphAnalysis, GroupStats, NodeStats, Totals, analyze, module_path

__all__ = ["analyze", "compare", "Comparison", "GraphAnalysis", "GroupStats", "NodeStats", "Totals", "RULE_KEY",
           "module_path"]
