"""Before and after a rewrite: the figures a user of the fusion, AMP and int8 rule
sets wants to see side by side.

    c = compare(analyze(original, (x,)), analyze(rewritten, (x,)))
    print(c.table())
    c.to_dict()["after"]["flops"]

``RewriteResult.report()`` and ``rewrite apply --report`` print ``c.table()``.
"""

from __future__ import annotations

import collections
from typing import Any

import attrs

from rewrite.analysis.measure import GraphAnalysis

__all__ = ["Comparison", "compare", "FIELDS"]

#: the compared figures, in table order: (Totals attribute, label, unit)
FIELDS = (
    ("nodes", "nodes", ""),
    ("flops", "FLOPs", ""),
    ("elementwise", "elementwise ops", ""),
    ("bytes_read", "bytes read", "B"),
    ("bytes_written", "bytes written", "B"),
    ("param_bytes", "parameters", "B"),
    ("peak_bytes", "peak activations", "B"),
    ("casts", "casts", ""),
    ("int8_ops", "int8 ops", ""),
)


@attrs.frozen
class Comparison:
    """Two analyses of the same model: ``before`` and ``after`` a rewrite.

    Attributes:
        before, after: ``GraphAnalysis``.
        rules: rule name -> times applied (empty when unknown).
    """

    before: GraphAnalysis
    after: GraphAnalysis
    rules: dict = attrs.field(factory=dict)

    def delta(self, field: str) -> int:
        return getattr(self.after.totals, field) - getattr(self.before.totals, field)

    def op_changes(self) -> dict:
        """canonical op -> (nodes before, nodes after), for the ops whose count changed."""
        b = collections.Counter(n.op for n in self.before.nodes if n.is_compute)
        a = collections.Counter(n.op for n in self.after.nodes if n.is_compute)
        return {op: (b[op], a[op]) for op in sorted(set(a) | set(b)) if a[op] != b[op]}

    def to_dict(self) -> dict:
        return {
            "before": self.before.totals.to_dict(),
            "after": self.after.totals.to_dict(),
            "ops": {op: {"before": b, "after": a} for op, (b, a) in self.op_changes().items()},
            "rules": dict(self.rules),
        }

    def table(self) -> str:
        lines = [f"{'':<18} {'before':>14} {'after':>14} {'change':>10}"]
        for field, label, unit in FIELDS:
            b, a = getattr(self.before.totals, field), getattr(self.after.totals, field)
            lines.append(f"{label:<18} {_fmt(b, unit):>14} {_fmt(a, unit):>14} {_change(b, a):>10}")
        changes = self.op_changes()
        if changes:
            width = max(18, *(len(op) for op in changes))
            lines.append("")
            lines.append(f"{'op':<{width}} {'before':>14} {'after':>14}")
            for op, (b, a) in changes.items():
                lines.append(f"{op:<{width}} {b:>14} {a:>14}")
        if self._uncounted_attention():
            lines.append("")
            lines.append("note: attention counts 0 FLOPs on CPU, as in FlopCounterMode (its registry has no formula "
                         "for the CPU kernel): the matmuls moved into it are not counted after")
        return "\n".join(lines)

    def _uncounted_attention(self) -> bool:
        """The rewrite made attention nodes whose FLOPs were not counted (CPU)."""
        def uncounted(a: GraphAnalysis) -> int:
            return sum(1 for n in a.nodes if n.op == "scaled_dot_product_attention" and not n.flops)

        return uncounted(self.after) > uncounted(self.before)

    def __str__(self) -> str:
        return self.table()


def compare(before: GraphAnalysis, after: GraphAnalysis, rules: dict | None = None) -> Comparison:
    """Compare two analyses (``rewrite.analysis.analyze``) of one model."""
    return Comparison(before, after, dict(rules or {}))


def _fmt(v: Any, unit: str) -> str:
    if unit == "B":
        for name, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if v >= scale:
                return f"{v / scale:.2f} {name}"
        return f"{v} B"
    for name, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3f}{name}"
    return str(v)


def _change(b: int, a: int) -> str:
    if b == a:
        return "="
    if b == 0:
        return f"+{a}"
    return f"{(a - b) / b * 100:+.1f}%"
