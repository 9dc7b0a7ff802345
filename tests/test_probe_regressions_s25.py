"""Session 25: outputs that would keep a larger value alive.

A rewrite that returns a view where the original returned a fresh tensor
(``cat([h[-1]]) => h[-1]``, a dropped ``h[-1].clone()``) keeps the whole of ``h``
alive for as long as the caller holds the output, and ``torch.save(out)`` writes all
of it: the values, strides and sharing are the same, so nothing compared that
before. The engine refuses such a forward (``rewrite.engine.aliasing.new_aliasing``)
and the check compares the memory each output holds.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import rewrite
from rewrite.trust.check import check_equivalence


class LastRowCopy(nn.Module):
    """Returns a fresh copy of one row of a large intermediate."""

    def forward(self, x):
        h = torch.relu(x @ x.t())
        return torch.cat([h[-1]])


class LastRowClone(nn.Module):
    def forward(self, x):
        h = torch.relu(x @ x.t())
        return h[-1].clone()


class LastRowUsed(nn.Module):
    """The copy of the row is only read inside the graph: forwarding it holds nothing."""

    def forward(self, x):
        h = torch.relu(x @ x.t())
        return torch.cat([h[-1]]) * 2


class WholeView(nn.Module):
    """A view of a whole intermediate returned through an identity."""

    def forward(self, x):
        return torch.relu(x).t() * 1


def _capture(model: nn.Module, x: torch.Tensor, level: str) -> fx.GraphModule:
    if level == "fx":
        return fx.symbolic_trace(model)
    return torch.export.export(model, (x,), strict=False).module()


def _saved_bytes(t: torch.Tensor) -> int:
    buffer = io.BytesIO()
    torch.save(t, buffer)
    return len(buffer.getvalue())


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("level", ["fx", "export"])
def test_cat_single_does_not_return_a_view_of_a_larger_value(level, check):
    x = torch.randn(256, 8)
    model = LastRowCopy()
    result = rewrite.load("rules/cleanup.rw").apply(_capture(model, x, level), (x,), check=check)
    assert result.counts.get("cat_single", 0) == 0
    out = result.graph_module(x)
    torch.testing.assert_close(out, model(x))
    assert out.untyped_storage().nbytes() == 256 * 4
    assert _saved_bytes(out) == _saved_bytes(model(x))


@pytest.mark.parametrize("level", ["fx", "export"])
def test_a_dropped_clone_of_a_returned_row_does_not_fire(level):
    x = torch.randn(256, 8)
    rules = rewrite.parse("rule drop_clone: clone(x) => x\n")
    result = rules.apply(_capture(LastRowClone(), x, level), (x,), check=False)
    assert result.counts.get("drop_clone", 0) == 0
    assert result.graph_module(x).untyped_storage().nbytes() == 256 * 4


@pytest.mark.parametrize("level", ["fx", "export"])
def test_forwarding_a_row_read_inside_the_graph_still_fires(level):
    x = torch.randn(256, 8)
    model = LastRowUsed()
    result = rewrite.load("rules/cleanup.rw").apply(_capture(model, x, level), (x,))
    assert result.counts["cat_single"] == 1
    torch.testing.assert_close(result.graph_module(x), model(x))


@pytest.mark.parametrize("level", ["fx", "export"])
def test_forwarding_a_view_of_a_whole_value_still_fires(level):
    x = torch.randn(16, 8)
    model = WholeView()
    result = rewrite.load("rules/cleanup.rw").apply(_capture(model, x, level), (x,))
    assert result.counts["mul_one"] == 1
    out = result.graph_module(x)
    torch.testing.assert_close(out, model(x))
    assert out.untyped_storage().nbytes() == 16 * 8 * 4


def test_forwarding_a_view_without_facts_does_not_fire():
    # no example inputs on a symbolic_trace graph: the size of what the output would
    # hold is unknown, so the rule does not fire
    rules = rewrite.parse("rule drop_clone: clone(x) => x\n")
    result = rules.apply(fx.symbolic_trace(LastRowClone()), check=False)
    assert result.counts.get("drop_clone", 0) == 0


def test_the_check_compares_the_memory_an_output_holds():
    def reference(x):
        return torch.relu(x @ x.t())[-1].clone()

    def candidate(x):
        return torch.relu(x @ x.t())[-1]

    report = check_equivalence(reference, candidate, (torch.randn(128, 8),))
    assert not report and "keeps 65536 bytes of memory alive in the rewrite, 512 in the original" in str(report)
    assert check_equivalence(reference, reference, (torch.randn(128, 8),))


def test_the_check_accepts_a_compact_copy_of_an_expanded_output():
    # the copy holds only its own elements, more than the expanded original did
    def reference(x):
        return x.sum(1, keepdim=True).expand(-1, 6)

    def candidate(x):
        return x.sum(1, keepdim=True).expand(-1, 6).contiguous()

    assert check_equivalence(reference, candidate, (torch.randn(5, 3),))


def test_a_diagnostic_on_a_huge_line_shows_the_part_around_the_error():
    # 5000 `not`s used to be printed in full under the message (20 KB)
    source = "rule r: relu(x) where " + "not " * 5000 + "is_float(x) => x\n"
    with pytest.raises(rewrite.RuleError) as err:
        rewrite.parse(source)
    text = str(err.value)
    assert len(text) < 1000
    excerpt, carets = text.splitlines()[1:3]
    assert excerpt.strip().startswith("...") and excerpt.rstrip().endswith("...")
    assert carets.strip().startswith("^") and len(carets) <= len(excerpt)


def test_a_diagnostic_on_a_short_line_shows_it_whole():
    with pytest.raises(rewrite.RuleError) as err:
        rewrite.parse("rule r: reluu(x) => x\n")
    lines = str(err.value).splitlines()
    assert lines[1] == "    rule r: reluu(x) => x" and lines[2] == "            ^^^^^"
